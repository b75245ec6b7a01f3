#!/usr/bin/env bash
# A local Kubernetes control plane with 4 simulated GPU nodes and 8 CPU nodes.
#   scripts/cluster.sh up [--background]    start it (foreground until Ctrl-C, or detached)
#   scripts/cluster.sh down                 stop a detached one
# Then: export KUBECONFIG=~/.cache/stoker/dev-cluster/kubeconfig; kubectl get nodes
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/tools.sh" >/dev/null
cargo build --quiet --manifest-path "$root/Cargo.toml" -p stoker-testenv --bin stoker-cluster
exec "${CARGO_TARGET_DIR:-$root/target}/debug/stoker-cluster" "$@"
