#!/usr/bin/env bash
# Decode benchmark: stoker's decode path against the PyTorch DataLoader + Pillow baseline, on the
# same cores, the same objects and the same S3 server (stoker-s3 on loopback).
#
#   scripts/bench-decode.sh            # both datasets
#   BENCH_SETS=imagenet scripts/bench-decode.sh
#
# Per dataset: stoker (worker + bench client through the S3 server), `stoker-loader profile`
# (CPU per image by stage: get, decode, resize, pack, reply), and the DataLoader baseline at 2,
# 4 and 8 workers, keeping its best.
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
S3_PORT=${BENCH_S3_PORT:-27100}
GRPC_PORT=${BENCH_GRPC_PORT:-27151}
HTTP_PORT=${BENCH_HTTP_PORT:-27190}
# DataLoader worker counts tried; the best is reported (BENCH_BASELINE_WORKERS="2" for one).
export BASELINE_WORKERS=${BENCH_BASELINE_WORKERS:-"2 4 8"}
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

if [ -z "${BENCH_NO_BUILD:-}" ]; then
  cargo build --release -q -p stoker-loader --bin stoker-loader
  cargo build --release -q -p stoker-testenv --bin stoker-s3
fi
# Where cargo put them: CARGO_TARGET_DIR when set, as cargo itself does.
BIN="${CARGO_TARGET_DIR:-$ROOT_DIR/target}/release"

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
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$SERVE" "${TIMEF:-}"; }
trap cleanup EXIT

"$BIN/stoker-s3" --root "$SERVE" --port "$S3_PORT" \
  --access-key "$AWS_ACCESS_KEY_ID" --secret-key "$AWS_SECRET_ACCESS_KEY" >/dev/null 2>&1 &
S3PID=$!
PIDS+=("$S3PID")
ENDPOINT="http://127.0.0.1:$S3_PORT"
for _ in $(seq 100); do (echo >/dev/tcp/127.0.0.1/"$S3_PORT") 2>/dev/null && break; sleep 0.1; done

# CPU seconds of a live process (user + system), from /proc.
TCK=$(getconf CLK_TCK)
cpu_of() { awk -v t="$TCK" '{printf "%.2f", ($14 + $15) / t}' "/proc/$1/stat"; }
# CPU seconds of a finished command, from GNU time's output file.
cpu_file() { awk '{printf "%.2f", $1 + $2}' "$1"; }
TIMEF=$(mktemp)

RESULTS=()
for set in $SETS; do
  N=$(find "$SERVE/$set" -type f | wc -l)
  echo "== $set: $N objects, $(du -shL "$SERVE/$set" | cut -f1), $CORES cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
  "$BIN/stoker-loader" decode --grpc-addr "127.0.0.1:$GRPC_PORT" --http-addr "127.0.0.1:$HTTP_PORT" \
    --threads "$CORES" --endpoint "$ENDPOINT" --force-path-style >/dev/null 2>/tmp/stoker-bench-worker.log &
  WPID=$!
  PIDS+=("$WPID")
  for _ in $(seq 100); do (echo >/dev/tcp/127.0.0.1/"$GRPC_PORT") 2>/dev/null && break; sleep 0.1; done
  S3_0=$(cpu_of "$S3PID")
  S=$(/usr/bin/time -f "%U %S" -o "$TIMEF" "$BIN/stoker-loader" bench --worker "http://127.0.0.1:$GRPC_PORT" \
      --bucket "$set" --endpoint "$ENDPOINT" --force-path-style --epochs "$EPOCHS" --batch-size 32 \
      --in-flight 4 --json)
  S_S3=$(awk -v c="$(cpu_of "$S3PID")" -v d="$S3_0" 'BEGIN {printf "%.2f", c - d}')
  S_CLIENT=$(cpu_file "$TIMEF")
  S_WORKER=$(cpu_of "$WPID")
  S_CPU=$(awk -v a="$S_CLIENT" -v b="$S_WORKER" -v c="$S_S3" 'BEGIN {printf "%.2f", a + b + c}')
  kill -TERM "$WPID"; wait "$WPID" || true
  # The decode path by stage, CPU per image on one thread (get and reply included).
  P=$("$BIN/stoker-loader" profile --bucket "$set" --endpoint "$ENDPOINT" --force-path-style \
      --sample "$N" --resize crop --width 448 --height 448 --json)
  # The baseline at its best worker count: more workers than cores can win through S3, where
  # each worker waits on its GETs.
  B="" B_CPU=0 B_S3=0
  for workers in $BASELINE_WORKERS; do
    S3_0=$(cpu_of "$S3PID")
    OUT=$(/usr/bin/time -f "%U %S" -o "$TIMEF" "$PY" bench/baseline_dataloader.py --endpoint "$ENDPOINT" \
        --bucket "$set" --workers "$workers" --epochs "$EPOCHS" --json)
    OUT_S3=$(awk -v c="$(cpu_of "$S3PID")" -v d="$S3_0" 'BEGIN {printf "%.2f", c - d}')
    OUT_CPU=$(awk -v a="$(cpu_file "$TIMEF")" -v c="$OUT_S3" 'BEGIN {printf "%.2f", a + c}')
    echo "   baseline, $workers workers: $OUT"
    if [ -z "$B" ] || B="$B" OUT="$OUT" "$PY" -c 'import json, os, sys
sys.exit(0 if json.loads(os.environ["OUT"])["images_per_second"] > json.loads(os.environ["B"])["images_per_second"] else 1)'; then
      B=$OUT B_CPU=$OUT_CPU B_S3=$OUT_S3
    fi
  done
  LINE=$(S="$S" B="$B" P="$P" "$PY" - "$set" "$CORES" "$N" "$EPOCHS" "$S_CPU" "$B_CPU" "$S_S3" "$B_S3" \
      "$S_WORKER" "$S_CLIENT" <<'PYEOF'
import json, os, sys
name, cores, n, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
s_cpu, b_cpu, s_s3, b_s3, s_worker, s_client = (float(x) for x in sys.argv[5:11])
s, b, p = json.loads(os.environ["S"]), json.loads(os.environ["B"]), json.loads(os.environ["P"])
sr, br = s["images_per_second"], b["images_per_second"]
images = n * epochs
# Images per CPU-second over the whole run (every process on each side, S3 server included):
# robust to other load on the machine, which wall-clock rates are not.
se, be = images / s_cpu, images / b_cpu
# The same without the S3 server, which stands in for a remote store in production.
sx, bx = images / (s_cpu - s_s3), images / (b_cpu - b_s3)
ms = lambda secs: secs * 1000 / images
print(f"{name}: stoker {sr:.1f} images/s ({sr / cores:.1f}/core), baseline {br:.1f} images/s "
      f"({br / cores:.1f}/core, best of {os.environ.get('BASELINE_WORKERS', '2 4 8')} workers: "
      f"{b['workers']}), ratio {sr / br:.2f}x | per CPU-second: stoker {se:.1f}, "
      f"baseline {be:.1f}, ratio {se / be:.2f}x | without the S3 server: stoker {sx:.1f}, "
      f"baseline {bx:.1f}, ratio {sx / bx:.2f}x")
print(f"  stoker CPU per image through S3: worker {ms(s_worker):.2f} ms, bench client "
      f"{ms(s_client):.2f} ms, S3 server {ms(s_s3):.2f} ms; baseline {ms(b_cpu - b_s3):.2f} ms "
      f"+ S3 server {ms(b_s3):.2f} ms")
print(f"  profile, CPU per image on one thread: get {p['get_cpu_ms_per_image']:.3f} ms, "
      f"decode {p['decode_ms_per_image']:.3f}, resize {p['resize_ms_per_image']:.3f}, "
      f"pack {p['pack_ms_per_image']:.3f}, reply {p['reply_cpu_ms_per_image']:.3f} = "
      f"{p['all_cpu_ms_per_image']:.3f} ms; decode path {p['images_per_second_per_core']:.0f} "
      f"images/s per core; outside decode path {p['outside_decode_percent']:.1f} %")
PYEOF
)
  echo "$LINE"
  RESULTS+=("$LINE")
done
echo
echo "== summary ($CORES cores, $(date -u '+%F %H:%M'), load $(cut -d' ' -f1-3 /proc/loadavg))"
printf '%s\n' "${RESULTS[@]}"
