#!/usr/bin/env bash
# Every test stoker has, on a fresh machine or a warm one:
#   1. system packages (scripts/deps.sh), the Go-built control plane (scripts/tools.sh) and the
#      Python venv (scripts/python-env.sh), each cached;
#   2. the build, and stoker's container image from it (scripts/image.sh --debug);
#   3. cargo test for the whole workspace (scripts/cargo-tests.py): unit tests, and end-to-end
#      tests against a real control plane, a real S3 server, real gRPC processes and a real
#      Prometheus (the Helm e2e test installs the chart with that image);
#   4. pytest for the Python client, against the real sidecar binary.
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
# stoker's image from these binaries: the node runtime runs every stoker pod from it, and the
# Helm e2e test installs the chart with it (cached; a release image takes a ~15 min build).
step "image"
scripts/image.sh --debug --check >/dev/null
step "cargo test"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# STOKER_PYTHON: the demo's simulated trainer and dataset generator run in the venv.
# scripts/cargo-tests.py is `cargo test --workspace` with the test binaries run one per CPU at
# a time, those that measure CPU or bandwidth alone; the doc tests are the only ones it leaves out.
export STOKER_PYTHON="$venv/bin/python"
{ cargo test --workspace --locked --doc && scripts/cargo-tests.py --locked; } 2>&1 | tee "$log"
# test result: ok. 6 passed; 0 failed; 0 ignored; ...
read -r passed failed < <(awk '/^test result:/ {p += $4; f += $6} END {print p+0, f+0}' "$log")

if [ -d clients/python/tests ]; then
  step "pytest clients/python"
  STOKER_LOADER_BIN="${CARGO_TARGET_DIR:-$root/target}/debug/stoker-loader" \
  STOKER_S3_BIN="${CARGO_TARGET_DIR:-$root/target}/debug/stoker-s3" \
    "$venv/bin/python" -m pytest -q clients/python/tests -p no:cacheprovider 2>&1 | tee "$log"
  read -r py_passed < <(grep -oE '[0-9]+ passed' "$log" | tail -1 | cut -d' ' -f1; echo 0)
  passed=$((passed + ${py_passed:-0}))
fi
step "done"
echo "stoker: $passed passed, $failed failed"
