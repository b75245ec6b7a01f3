#!/usr/bin/env bash
# Every test stoker has, on a fresh machine or a warm one:
#   1. system packages (scripts/deps.sh), the Go-built control plane (scripts/tools.sh) and the
#      Python venv (scripts/python-env.sh), each cached;
#   2. cargo test for the whole workspace: unit tests, and end-to-end tests against a real
#      control plane, a real S3 server, real gRPC processes and a real Prometheus;
#   3. pytest for the Python client, against the real sidecar binary.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
start=$SECONDS
step() { printf '\n=== %s (%ds)\n' "$*" $((SECONDS - start)); }

step "system packages"
scripts/deps.sh
step "control-plane binaries"
scripts/tools.sh >/dev/null
step "python environment"
venv=$(scripts/python-env.sh)

step "build"
cargo build --workspace --all-targets --locked
step "cargo test"
cargo test --workspace --locked

if [ -d clients/python/tests ]; then
  step "pytest clients/python"
  STOKER_LOADER_BIN="${CARGO_TARGET_DIR:-$root/target}/debug/stoker-loader" \
  STOKER_S3_BIN="${CARGO_TARGET_DIR:-$root/target}/debug/stoker-s3" \
    "$venv/bin/python" -m pytest -q clients/python/tests
fi
step "all tests passed"
