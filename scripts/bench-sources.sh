#!/usr/bin/env bash
# Source benchmark: the same images as one object each, as WebDataset shards and as Parquet
# files, through the same S3 server (stoker-s3 on loopback) and the same cores, decoded by a
# stoker decode worker (crop 448x448), with PyTorch DataLoader + `webdataset` over the shards as
# the baseline (best of 2, 4 and 8 workers). Reports images/s, GET requests per image and bytes
# read per image (from the worker's own counters).
#
#   scripts/bench-sources.sh                 # 1,000 ImageNet-sized JPEGs, 100 per shard
#   BENCH_PER_SHARD=250 BENCH_PAGE_SIZE=1048576 scripts/bench-sources.sh
#
# Installs what scripts/bench-decode.sh does (bench/setup.sh), plus webdataset and pyarrow in
# the bench venv. Builds stoker-loader and stoker-s3 in release mode.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT_DIR=$(pwd)
CORES=${BENCH_CORES:-$(nproc)}
COUNT=${BENCH_COUNT:-1000}
EPOCHS=${BENCH_EPOCHS:-2}
PER_SHARD=${BENCH_PER_SHARD:-100}
PAGE_SIZE=${BENCH_PAGE_SIZE:-262144}
DATA=${BENCH_DATA:-$HOME/.cache/stoker/bench-data}
S3_PORT=${BENCH_S3_PORT:-27200}
GRPC_PORT=${BENCH_GRPC_PORT:-27251}
HTTP_PORT=${BENCH_HTTP_PORT:-27290}
export BASELINE_WORKERS=${BENCH_BASELINE_WORKERS:-"2 4 8"}
export AWS_ACCESS_KEY_ID=stoker-bench AWS_SECRET_ACCESS_KEY=stoker-bench-secret
export AWS_REGION=us-east-1 AWS_DEFAULT_REGION=us-east-1 AWS_EC2_METADATA_DISABLED=true

VENV=$(bash bench/setup.sh | tail -1)
PY="$VENV/bin/python"
"$PY" -c 'import webdataset, pyarrow' 2>/dev/null || "$VENV/bin/pip" install --quiet webdataset pyarrow

if [ -z "${BENCH_NO_BUILD:-}" ]; then
  cargo build --release -q -p stoker-loader --bin stoker-loader
  cargo build --release -q -p stoker-testenv --bin stoker-s3
fi
# Where cargo put them: CARGO_TARGET_DIR when set, as cargo itself does.
BIN="${CARGO_TARGET_DIR:-$ROOT_DIR/target}/release"

if [ ! -f "$DATA/imagenet/.done" ]; then
  rm -rf "${DATA:?}/imagenet"
  "$PY" bench/make_dataset.py --root "$DATA" --set imagenet --count "$COUNT"
  touch "$DATA/imagenet/.done"
fi
SERVE=$(mktemp -d)
STAGE=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$SERVE" "$STAGE"; }
trap cleanup EXIT
mkdir -p "$STAGE/src"
find "$DATA/imagenet" -maxdepth 1 -type f ! -name '.done' -exec ln {} "$STAGE/src/" \; 2>/dev/null \
  || find "$DATA/imagenet" -maxdepth 1 -type f ! -name '.done' -exec cp {} "$STAGE/src/" \;
"$PY" bench/make_sources.py --src "$STAGE/src" --out "$STAGE/data" --per-shard "$PER_SHARD" \
  --page-size "$PAGE_SIZE"

"$BIN/stoker-s3" --root "$SERVE" --port "$S3_PORT" \
  --access-key "$AWS_ACCESS_KEY_ID" --secret-key "$AWS_SECRET_ACCESS_KEY" >/dev/null 2>&1 &
PIDS+=("$!")
ENDPOINT="http://127.0.0.1:$S3_PORT"
for _ in $(seq 100); do (echo >/dev/tcp/127.0.0.1/"$S3_PORT") 2>/dev/null && break; sleep 0.1; done
S3=(--endpoint "$ENDPOINT" --force-path-style)
# Uploaded, not copied into the server's root: see bench/upload.py.
"$PY" bench/upload.py --endpoint "$ENDPOINT" --bucket data --dir "$STAGE/data"
mkdir -p "$STAGE/none"
"$PY" bench/upload.py --endpoint "$ENDPOINT" --bucket index --dir "$STAGE/none" >/dev/null

N=$(find "$STAGE/data/objects" -type f | wc -l)
echo "== $N images ($(du -sh "$STAGE/data/objects" | cut -f1)), $PER_SHARD per shard, Parquet pages of $PAGE_SIZE bytes, $CORES cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
for kind in shards parquet; do
  flag=--shards; [ "$kind" = parquet ] && flag=--parquet
  extra=(); [ "$kind" = parquet ] && extra=(--columns caption,label)
  echo "   index of $kind: $("$BIN/stoker-loader" index "$flag" "s3://data/$kind/" "${extra[@]}" \
      --out "s3://index/$kind/" "${S3[@]}" 2>/dev/null)"
done

# A worker's counter from its /metrics.
counter() { curl -s "http://127.0.0.1:$HTTP_PORT/metrics" | awk -v m="$1" '$1 == m {print $2}'; }
RESULTS=()
for kind in objects shards parquet; do
  "$BIN/stoker-loader" decode --grpc-addr "127.0.0.1:$GRPC_PORT" --http-addr "127.0.0.1:$HTTP_PORT" \
    --threads "$CORES" "${S3[@]}" >/dev/null 2>/tmp/stoker-bench-sources-worker.log &
  WPID=$!
  PIDS+=("$WPID")
  for _ in $(seq 100); do (echo >/dev/tcp/127.0.0.1/"$GRPC_PORT") 2>/dev/null && break; sleep 0.1; done
  plan=(--prefix "$kind/"); [ "$kind" != objects ] && plan=(--index "s3://index/$kind/")
  OUT=$("$BIN/stoker-loader" bench --worker "http://127.0.0.1:$GRPC_PORT" --bucket data "${plan[@]}" \
      "${S3[@]}" --epochs "$EPOCHS" --batch-size 32 --in-flight 4 --json)
  GETS=$(counter 'stoker_loader_s3_requests_total{op="get_object"}')
  BYTES=$(counter stoker_loader_bytes_in_total)
  kill -TERM "$WPID"; wait "$WPID" || true
  LINE=$(OUT="$OUT" "$PY" -c 'import json, os, sys
rate = json.loads(os.environ["OUT"])["images_per_second"]
n = int(sys.argv[2]) * int(sys.argv[3])
gets, read = float(sys.argv[4]) / n, float(sys.argv[5]) / n / 1024
print(f"{sys.argv[1]:8s} stoker {rate:7.1f} images/s | {gets:.3f} GETs/image | {read:.1f} KiB read/image")' \
      "$kind" "$N" "$EPOCHS" "$GETS" "$BYTES")
  echo "$LINE"
  RESULTS+=("$LINE")
done

BEST=""
for workers in $BASELINE_WORKERS; do
  OUT=$(cd bench && "$PY" baseline_webdataset.py --endpoint "$ENDPOINT" --bucket data \
      --prefix shards/ --workers "$workers" --epochs "$EPOCHS" --json)
  echo "   DataLoader + webdataset, $workers workers: $OUT"
  if [ -z "$BEST" ] || B="$BEST" OUT="$OUT" "$PY" -c 'import json, os, sys
sys.exit(0 if json.loads(os.environ["OUT"])["images_per_second"] > json.loads(os.environ["B"])["images_per_second"] else 1)'; then
    BEST=$OUT
  fi
done
SHARDS_RATE=$(printf '%s\n' "${RESULTS[@]}" | awk '$1 == "shards" {print $3}')
RESULTS+=("$(B="$BEST" "$PY" -c 'import json, os, sys
b = json.loads(os.environ["B"]); s = float(sys.argv[1])
rate, workers = b["images_per_second"], b["workers"]
print(f"baseline DataLoader + webdataset over the shards: {rate:.1f} images/s "
      f"(best: {workers} workers); stoker on shards {s / rate:.2f}x")' "$SHARDS_RATE")")
echo
echo "== summary ($N images, $CORES cores, $(date -u '+%F %H:%M'), load $(cut -d' ' -f1-3 /proc/loadavg))"
printf '%s\n' "${RESULTS[@]}"
