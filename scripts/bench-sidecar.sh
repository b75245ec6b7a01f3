#!/usr/bin/env bash
# Trainer data-wait benchmark: a simulated trainer (fixed step time, batches of 32 at 448²) fed
# by (a) its own synchronous GET + Pillow decode, (b) a PyTorch DataLoader with workers = cores,
# (c) stoker: decode worker + sidecar + the Python client. Same objects, same S3 server
# (stoker-s3 on loopback), same cores. Prints data wait % per step time and the hand-off latency.
#
#   scripts/bench-sidecar.sh                       # step times 200 ms and 50 ms
#   STEPS="100" BATCHES=60 scripts/bench-sidecar.sh
#
# Reuses bench/setup.sh's venv (torch, pillow, boto3) and bench/make_dataset.py's imagenet set.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT_DIR=$(pwd)
CORES=${BENCH_CORES:-$(nproc)}
STEPS=${STEPS:-"200 50"}
BATCHES=${BATCHES:-40}
SET=${BENCH_SET:-imagenet}
DATA=${BENCH_DATA:-$HOME/.cache/stoker/bench-data}
S3_PORT=${BENCH_S3_PORT:-19100}
GRPC_PORT=${BENCH_GRPC_PORT:-19151}
HTTP_PORT=${BENCH_HTTP_PORT:-19190}
SIDECAR_HTTP_PORT=${BENCH_SIDECAR_HTTP_PORT:-19191}
export AWS_ACCESS_KEY_ID=stoker-bench AWS_SECRET_ACCESS_KEY=stoker-bench-secret
export AWS_REGION=us-east-1 AWS_DEFAULT_REGION=us-east-1 AWS_EC2_METADATA_DISABLED=true

VENV=$(bash bench/setup.sh | tail -1)
PY="$VENV/bin/python"
export PYTHONPATH="$ROOT_DIR/clients/python/src${PYTHONPATH:+:$PYTHONPATH}"

cargo build --release -q -p stoker-loader --bin stoker-loader
cargo build --release -q -p stoker-testenv --bin stoker-s3
# Where cargo put them: CARGO_TARGET_DIR when set, as cargo itself does.
BIN="${CARGO_TARGET_DIR:-$ROOT_DIR/target}/release"

if [ ! -f "$DATA/$SET/.done" ]; then
  rm -rf "${DATA:?}/$SET"
  "$PY" bench/make_dataset.py --root "$DATA" --set "$SET" --count 1000
  touch "$DATA/$SET/.done"
fi
WORK=$(mktemp -d)
mkdir -p "$WORK/s3/$SET" "$WORK/shm"
find "$DATA/$SET" -maxdepth 1 -type f ! -name '.done' -exec ln {} "$WORK/s3/$SET/" \; 2>/dev/null \
  || find "$DATA/$SET" -maxdepth 1 -type f ! -name '.done' -exec cp {} "$WORK/s3/$SET/" \;

PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$WORK"; }
trap cleanup EXIT
wait_port() { for _ in $(seq 200); do (echo >/dev/tcp/127.0.0.1/"$1") 2>/dev/null && return; sleep 0.05; done; echo "port $1 never opened" >&2; exit 1; }

"$BIN/stoker-s3" --root "$WORK/s3" --port "$S3_PORT" \
  --access-key "$AWS_ACCESS_KEY_ID" --secret-key "$AWS_SECRET_ACCESS_KEY" >/dev/null 2>&1 &
PIDS+=($!)
ENDPOINT="http://127.0.0.1:$S3_PORT"
wait_port "$S3_PORT"
S3FLAGS=(--endpoint "$ENDPOINT" --region us-east-1 --force-path-style)
"$BIN/stoker-loader" decode --grpc-addr "127.0.0.1:$GRPC_PORT" --http-addr "127.0.0.1:$HTTP_PORT" \
  --threads "$CORES" "${S3FLAGS[@]}" >/dev/null 2>"$WORK/worker.log" &
PIDS+=($!)
wait_port "$GRPC_PORT"

echo "== $SET: $(find "$WORK/s3/$SET" -type f | wc -l) objects, batches of 32 at 448x448, $CORES cores, $BATCHES measured batches"
RESULTS=()
for step in $STEPS; do
  for mode in sync dataloader; do
    RESULTS+=("$("$PY" bench/sidecar_bench.py --mode "$mode" --endpoint "$ENDPOINT" --bucket "$SET" \
      --step-ms "$step" --batches "$BATCHES" --workers "$CORES")")
    echo "${RESULTS[-1]}"
  done
  # A fresh sidecar per run, so a ring filled during the other modes does not flatter stoker.
  SOCK="$WORK/shm/stoker-$step.sock"
  "$BIN/stoker-loader" sidecar --bucket "$SET" --batch-size 32 --width 448 --height 448 \
    --prefetch-batches 8 --workers "127.0.0.1:$GRPC_PORT" --shm-dir "$WORK/shm" --socket "$SOCK" \
    --http-addr "127.0.0.1:$SIDECAR_HTTP_PORT" --local-decoders 1 "${S3FLAGS[@]}" \
    >/dev/null 2>"$WORK/sidecar.log" &
  SPID=$!
  PIDS+=("$SPID")
  RESULTS+=("$("$PY" bench/sidecar_bench.py --mode stoker --socket "$SOCK" --step-ms "$step" --batches "$BATCHES")")
  echo "${RESULTS[-1]}"
  WAIT_METRIC=$(curl -s "http://127.0.0.1:$SIDECAR_HTTP_PORT/metrics" | grep '^stoker_trainer_data_wait_seconds_total' || true)
  echo "sidecar: $WAIT_METRIC"
  kill "$SPID"; wait "$SPID" 2>/dev/null || true
done

printf '%s\n' "${RESULTS[@]}" | "$PY" -c '
import json, sys
rows = [json.loads(l) for l in sys.stdin if l.strip()]
print("\n| step ms | demand img/s | sync wait % | DataLoader wait % | stoker wait % | stoker hand-off p50 / p99 µs |")
print("|---|---|---|---|---|---|")
for step in sorted({r["step_ms"] for r in rows}, reverse=True):
    by = {r["mode"]: r for r in rows if r["step_ms"] == step}
    s = by.get("stoker", {})
    print("| %g | %.0f | %.1f | %.1f | %.1f | %.0f / %.0f |" % (
        step, 32 / (step / 1000), by["sync"]["data_wait_percent"], by["dataloader"]["data_wait_percent"],
        s.get("data_wait_percent", float("nan")), s.get("handoff_us_p50", float("nan")), s.get("handoff_us_p99", float("nan"))))
'
