#!/usr/bin/env bash
# stoker's main job on a local default: a real Kubernetes control plane with simulated GPU and CPU
# nodes, a real S3 server holding a generated photo dataset, and stoker's data plane.
#
#   scripts/demo.sh                 # builds what is missing, runs the story, stops everything
#   DEMO_IMAGES=600 scripts/demo.sh
#
# Everything it starts runs on loopback and is stopped on exit or Ctrl-C.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
images=${DEMO_IMAGES:-400}
cache=${STOKER_CACHE:-$HOME/.cache/stoker}
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "building what is missing (cold: ~20 min for the Go-built control plane, then cached)"
scripts/deps.sh
bin=$(scripts/tools.sh)
venv=$(scripts/python-env.sh)
cargo build --release --quiet -p stoker-loader -p stoker-testenv
target=${CARGO_TARGET_DIR:-$root/target}/release

work=$(mktemp -d /tmp/stoker-demo.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() { "$venv/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 300); do (echo >"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.1; done; return 1; }

say "starting the control plane: etcd, kube-apiserver, controller-manager, scheduler, KWOK"
"$target/stoker-cluster" --dir "$work/cluster" up >"$work/cluster.log" 2>&1 &
pids+=($!)
for _ in $(seq 600); do [ -f "$work/cluster/cluster.pid" ] && break; sleep 0.2; done
[ -f "$work/cluster/cluster.pid" ] || { cat "$work/cluster.log"; exit 1; }
kubectl() { "$bin/kubectl" --kubeconfig "$work/cluster/kubeconfig" "$@"; }
kubectl get nodes -L topology.kubernetes.io/zone,stoker.dev/pool,node.kubernetes.io/instance-type

say "generating $images photos (mostly JPEG, some PNG and WebP) from scikit-image's samples"
"$venv/bin/python" bench/make_dataset.py --root "$work/s3" --set mixed --count "$images" >/dev/null
export AWS_ACCESS_KEY_ID=stoker-demo AWS_SECRET_ACCESS_KEY=stoker-demo-secret AWS_REGION=us-east-1
export AWS_EC2_METADATA_DISABLED=true
s3_port=$(free_port)
"$target/stoker-s3" --root "$work/s3" --port "$s3_port" \
  --access-key "$AWS_ACCESS_KEY_ID" --secret-key "$AWS_SECRET_ACCESS_KEY" >"$work/s3.log" 2>&1 &
pids+=($!)
wait_port "$s3_port"
endpoint="http://127.0.0.1:$s3_port"
echo "S3 at $endpoint, bucket 'mixed': $(find "$work/s3/mixed" -type f | wc -l) objects, $(du -sh "$work/s3/mixed" | cut -f1)"

say "stoker-loader profile: where the time goes, per image, on one core"
"$target/stoker-loader" profile --endpoint "$endpoint" --force-path-style --bucket mixed \
  --sample 200 --target-rate 2400

say "a decode worker serving the dataset over gRPC"
grpc_port=$(free_port); http_port=$(free_port)
"$target/stoker-loader" decode --grpc-addr "127.0.0.1:$grpc_port" --http-addr "127.0.0.1:$http_port" \
  --endpoint "$endpoint" --force-path-style >"$work/worker.log" 2>&1 &
pids+=($!)
wait_port "$grpc_port"
"$target/stoker-loader" bench --worker "http://127.0.0.1:$grpc_port" --bucket mixed \
  --endpoint "$endpoint" --force-path-style --epochs 1 --batch-size 32
echo
echo "worker metrics (excerpt):"
curl -s "http://127.0.0.1:$http_port/metrics" | grep -E '^stoker_decode_(samples|skips|busy)' | head -8 || true

say "done: everything started here is being stopped"
