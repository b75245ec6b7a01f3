#!/usr/bin/env bash
# GPU check of the trainer hand-off, for a machine with an NVIDIA GPU (under 5 minutes with the
# binaries built): stoker-s3 with a generated dataset, one decode worker and a sidecar with
# `--gpu-placement auto`, then `python -m stoker.gpu_check` (clients/python/src/stoker/gpu_check.py):
# the ring registered with cudaHostRegister, H2D GB/s, per-batch latency, pixels on the GPU
# bit-exact against the CPU path. Run twice: crop at 448x448, then qwenSmart (the Qwen vision
# input made on the device, checked against numpy). Exits non-zero on any mismatch.
#
#   scripts/gpu-check.sh                  # BATCHES=64 COUNT=512
#   STOKER_BIN_DIR=target/release scripts/gpu-check.sh
#
# Binaries: $STOKER_BIN_DIR, else target/release when built, else `cargo build --release`.
# Python: a venv with torch (CUDA wheels from PyPI) at $STOKER_GPU_VENV
# (default ~/.cache/stoker/gpu-venv), created when it cannot import torch with CUDA.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
BATCHES=${BATCHES:-64}
COUNT=${COUNT:-512}
venv=${STOKER_GPU_VENV:-${STOKER_CACHE:-$HOME/.cache/stoker}/gpu-venv}

command -v nvidia-smi >/dev/null && nvidia-smi -L || echo "[gpu-check] nvidia-smi not found" >&2

bin=${STOKER_BIN_DIR:-}
if [ -z "$bin" ]; then
  bin=${CARGO_TARGET_DIR:-$root/target}/release
  if [ ! -x "$bin/stoker-loader" ] || [ ! -x "$bin/stoker-s3" ]; then
    echo "[gpu-check] building release binaries" >&2
    cargo build --release -q -p stoker-loader --bin stoker-loader
    cargo build --release -q -p stoker-testenv --bin stoker-s3
  fi
fi

if ! "$venv/bin/python" -c 'import torch, numpy, PIL; assert torch.cuda.is_available()' 2>/dev/null; then
  echo "[gpu-check] installing torch, numpy, pillow into $venv" >&2
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet torch numpy pillow
fi
py=$venv/bin/python
export PYTHONPATH="$root/clients/python/src${PYTHONPATH:+:$PYTHONPATH}"

work=$(mktemp -d)
shm=$(mktemp -d /dev/shm/stoker-gpu-check.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work" "$shm"
}
trap cleanup EXIT

# Starts a server with its stdout in $work/$1.out and waits for its "listening" line.
start() {
  local name=$1; shift
  "$@" >"$work/$name.out" 2>"$work/$name.err" &
  pids+=($!)
  for _ in $(seq 600); do
    if grep -q listening "$work/$name.out" 2>/dev/null; then return; fi
    if ! kill -0 "${pids[-1]}" 2>/dev/null; then break; fi
    sleep 0.1
  done
  echo "[gpu-check] $name did not start:" >&2
  cat "$work/$name.err" >&2
  exit 1
}
# The value of word NAME=value on the "listening" line of $work/$1.out.
field() { grep -m1 listening "$work/$1.out" | tr ' ' '\n' | sed -n "s/^$2=//p"; }

echo "[gpu-check] $COUNT JPEGs (mixed sizes around 1 MP)" >&2
mkdir -p "$work/s3/data"
"$py" - "$work/s3/data" "$COUNT" <<'EOF'
import sys
import numpy as np
from PIL import Image
out, count = sys.argv[1], int(sys.argv[2])
rng = np.random.default_rng(0)
for i in range(count):
    w, h = [(1280, 960), (1024, 768), (960, 1280), (1600, 900)][i % 4]
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([(x * 255 // w), (y * 255 // h), (x ^ y) & 255], -1).astype(np.uint8)
    img = np.clip(img + rng.normal(0, 8, img.shape), 0, 255).astype(np.uint8)
    Image.fromarray(img).save("%s/img-%05d.jpg" % (out, i), quality=90)
EOF

export AWS_ACCESS_KEY_ID=stoker-test-access AWS_SECRET_ACCESS_KEY=stoker-test-secret
export AWS_REGION=us-east-1 AWS_EC2_METADATA_DISABLED=true RUST_LOG=${RUST_LOG:-warn}
start s3 "$bin/stoker-s3" --root "$work/s3" --port 0
endpoint=$(grep -m1 listening "$work/s3.out" | awk '{print $NF}')
s3flags=(--endpoint "$endpoint" --region us-east-1 --force-path-style)
start decoder "$bin/stoker-loader" decode --grpc-addr 127.0.0.1:0 --http-addr 127.0.0.1:0 --threads 0 "${s3flags[@]}"
worker=$(field decoder grpc)

status=0
check() {
  local name=$1; shift
  local dir="$shm/$name"
  mkdir -p "$dir"
  start "sidecar-$name" "$bin/stoker-loader" sidecar --bucket data --http-addr 127.0.0.1:0 --shm-dir "$dir" \
    --workers "$worker" --local-decoders 2 --gpu-placement auto "$@" "${s3flags[@]}"
  echo "== $name" >&2
  "$py" -m stoker.gpu_check --socket "$(field "sidecar-$name" socket)" --batches "$BATCHES" --expect-pinned \
    || status=1
}
check crop --batch-size 32 --resize crop --width 448 --height 448
# 8 samples of at most 1600x900 after smart_resize (max pixels 1003520, Qwen2-VL's default).
check qwen --batch-size 8 --resize qwenSmart --max-pixels 1003520 --slot-bytes $((8 * 1003520 * 3))
exit $status
