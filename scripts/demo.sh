#!/usr/bin/env bash
# stoker's main job on a local default, the whole story on one machine:
#   a real Kubernetes control plane (etcd, kube-apiserver, controller-manager, scheduler) with 12
#   simulated nodes, each a network namespace with a tc-limited NIC; a real S3 server with a
#   generated photo dataset; real Prometheus; the operator (controller, webhook, autoscaler);
#   stoker-loader decode workers and the injected sidecar (from stoker's image, or a root
#   filesystem of the release binary) and the trainer (uid 1000), each in runc on those nodes.
#   (a) a trainer loading synchronously, (a') the same trainer on a PyTorch DataLoader with 4
#   workers on its own node, (b) a DataPipeline starting with one decoder on one NIC-limited
#   node, (c) the autoscaler scaling and spreading decoders. It prints a timeline and
#   the autoscaler's decisions, writes demo-out/story.png, and stops everything on exit or Ctrl-C.
#
#   scripts/demo.sh                  # builds what is missing (cold: ~30 min), then ~5 min
#   DEMO_IMAGES=800 scripts/demo.sh  # a bigger dataset
#   DEMO_DATALOADER=0 scripts/demo.sh  # without the DataLoader phase (no torch venv needed)
#
# Needs root (network namespaces, tc).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
images=${DEMO_IMAGES:-400}
cache=${STOKER_CACHE:-$HOME/.cache/stoker}
out=${DEMO_OUT:-$root/demo-out}

echo "== building what is missing"
scripts/deps.sh
scripts/tools.sh >/dev/null
venv=$(scripts/python-env.sh)
torch_args=()
if [ "${DEMO_DATALOADER:-1}" != 0 ]; then
  # torch in its own venv (the PyPI wheel is ~3 GB; cached), as the benchmarks use it.
  torch_venv=$(bench/setup.sh | tail -1)
  torch_args=(--torch-python "$torch_venv/bin/python")
fi
cargo build --release --quiet -p stoker-loader -p stoker-demo
target=${CARGO_TARGET_DIR:-$root/target}/release

data="$cache/demo-data-$images"
if [ ! -f "$data/.done" ]; then
  echo "== generating $images photos (mostly JPEG, some PNG and WebP) from scikit-image's samples"
  rm -rf "$data" && mkdir -p "$data"
  "$venv/bin/python" bench/make_dataset.py --root "$data" --set mixed --count "$images" >/dev/null
  mv "$data/mixed" "$data/demo"
  touch "$data/.done"
fi
# The .done marker stays outside the served bucket: the server serves one folder per bucket.
exec "$target/stoker-demo" --data "$data" --bucket demo --python "$venv/bin/python" \
  --trainer demo/trainer.py --loader "$target/stoker-loader" --out "$out" "${torch_args[@]}" "$@"
