#!/usr/bin/env bash
# Decode benchmark: stoker's decode path against the PyTorch DataLoader + Pillow baseline, on the
# same cores, the same objects and the same S3 server (stoker-s3 on loopback).
#
#   scripts/bench-decode.sh            # both datasets
#   BENCH_SETS=imagenet scripts/bench-decode.sh
#
# Installs: nasm (Debian, when missing and running as root: libjpeg-turbo's SIMD), a Python venv
# at ~/.cache/stoker/bench-venv with torch, pillow, numpy, boto3, scikit-image (bench/setup.sh).
# Builds: stoker-loader and stoker-s3 in release mode. Data: ~/.cache/stoker/bench-data.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT_DIR=$(pwd)
CORES=${BENCH_CORES:-$(nproc)}
SETS=${BENCH_SETS:-"mixed imagenet"}
COUNT=${BENCH_COUNT:-1000}
EPOCHS=${BENCH_EPOCHS:-2}
DATA=${BENCH_DATA:-$HOME/.cache/stoker/bench-data}
S3_PORT=${BENCH_S3_PORT:-19000}
GRPC_PORT=${BENCH_GRPC_PORT:-19051}
HTTP_PORT=${BENCH_HTTP_PORT:-19090}
export AWS_ACCESS_KEY_ID=stoker-bench AWS_SECRET_ACCESS_KEY=stoker-bench-secret
export AWS_REGION=us-east-1 AWS_DEFAULT_REGION=us-east-1 AWS_EC2_METADATA_DISABLED=true

if ! command -v nasm >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing nasm (libjpeg-turbo SIMD)"
    apt-get install -y -qq nasm >/dev/null || { apt-get update -qq && apt-get install -y -qq nasm >/dev/null; }
    # turbojpeg-sys was built without SIMD before; rebuild only that package.
    cargo clean --release -p turbojpeg-sys >/dev/null 2>&1 || true
  else
    echo "WARNING: nasm not found: libjpeg-turbo builds without SIMD and JPEG decode is slower" >&2
  fi
fi

VENV=$(bash bench/setup.sh | tail -1)
PY="$VENV/bin/python"

cargo build --release -q -p stoker-loader --bin stoker-loader
cargo build --release -q -p stoker-testenv --bin stoker-s3
BIN="$ROOT_DIR/target/release"

for set in $SETS; do
  if [ ! -f "$DATA/$set/.done" ]; then
    rm -rf "${DATA:?}/$set"
    "$PY" bench/make_dataset.py --root "$DATA" --set "$set" --count "$COUNT"
    touch "$DATA/$set/.done"
  fi
done
# The .done markers would be listed as objects: keep them out of the served tree.
SERVE=$(mktemp -d)
for set in $SETS; do
  mkdir -p "$SERVE/$set"
  find "$DATA/$set" -maxdepth 1 -type f ! -name '.done' -exec ln {} "$SERVE/$set/" \; 2>/dev/null \
    || find "$DATA/$set" -maxdepth 1 -type f ! -name '.done' -exec cp {} "$SERVE/$set/" \;
done

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$SERVE"; }
trap cleanup EXIT

"$BIN/stoker-s3" --root "$SERVE" --port "$S3_PORT" \
  --access-key "$AWS_ACCESS_KEY_ID" --secret-key "$AWS_SECRET_ACCESS_KEY" >/dev/null 2>&1 &
PIDS+=($!)
ENDPOINT="http://127.0.0.1:$S3_PORT"
for _ in $(seq 100); do (echo >/dev/tcp/127.0.0.1/"$S3_PORT") 2>/dev/null && break; sleep 0.1; done

RESULTS=()
for set in $SETS; do
  echo "== $set: $(find "$SERVE/$set" -type f | wc -l) objects, $(du -sh "$SERVE/$set" | cut -f1), $CORES cores"
  "$BIN/stoker-loader" decode --grpc-addr "127.0.0.1:$GRPC_PORT" --http-addr "127.0.0.1:$HTTP_PORT" \
    --threads "$CORES" --endpoint "$ENDPOINT" --force-path-style >/dev/null 2>/tmp/stoker-bench-worker.log &
  WPID=$!
  PIDS+=("$WPID")
  for _ in $(seq 100); do (echo >/dev/tcp/127.0.0.1/"$GRPC_PORT") 2>/dev/null && break; sleep 0.1; done
  S=$("$BIN/stoker-loader" bench --worker "http://127.0.0.1:$GRPC_PORT" --bucket "$set" \
      --endpoint "$ENDPOINT" --force-path-style --epochs "$EPOCHS" --batch-size 32 --in-flight 4 --json)
  kill -TERM "$WPID"; wait "$WPID" || true
  B=$("$PY" bench/baseline_dataloader.py --endpoint "$ENDPOINT" --bucket "$set" \
      --workers "$CORES" --epochs "$EPOCHS" --json)
  SR=$(echo "$S" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["images_per_second"])')
  BR=$(echo "$B" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["images_per_second"])')
  LINE=$("$PY" -c "s,b,c=$SR,$BR,$CORES; print(f'$set: stoker {s:.1f} images/s ({s/c:.1f}/core), baseline {b:.1f} images/s ({b/c:.1f}/core), ratio {s/b:.2f}x')")
  echo "$LINE"
  RESULTS+=("$LINE")
done
echo
echo "== summary ($CORES cores, $(date -u +%F))"
printf '%s\n' "${RESULTS[@]}"
