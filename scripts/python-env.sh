#!/usr/bin/env bash
# The Python environment the tests and the demo use: a venv (never the system Python) with numpy,
# pytest, pillow and scikit-image (its sample photographs make the demo dataset), matplotlib (the
# demo's plot), boto3 (the demo's synchronous trainer), transformers (the Qwen2-VL image processor
# the client's qwenSmart tests compare against; it installs and imports without torch), webdataset
# and pyarrow (the loader's dataset tests write their shards and Parquet files with them), and the
# `stoker` client installed from clients/python. Cached: a warm machine reinstalls only when
# clients/python changes. Prints the venv's path.
#   STOKER_VENV=/path   where the venv lives (default ~/.cache/stoker/venv)
# torch is optional for the client and not installed here (the PyPI wheel brings ~3 GB of CUDA
# libraries); scripts/bench-*.sh use their own venv with torch.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${STOKER_VENV:-${STOKER_CACHE:-$HOME/.cache/stoker}/venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
if ! "$venv/bin/python" -c 'import numpy, pytest, PIL, skimage, matplotlib, boto3, transformers, webdataset, pyarrow' 2>/dev/null; then
  echo "[python] installing numpy, pytest, pillow, scikit-image, matplotlib, boto3, transformers, webdataset, pyarrow into $venv" >&2
  "$venv/bin/pip" install --quiet numpy pytest pillow scikit-image matplotlib boto3 transformers webdataset pyarrow
fi
if [ -f "$root/clients/python/pyproject.toml" ]; then
  stamp="$venv/.stoker-client-$(find "$root/clients/python" -type f \( -name '*.py' -o -name '*.toml' \) \
    -not -path '*/tests/*' -not -path '*/build/*' -not -path '*.egg-info/*' -print0 | sort -z | xargs -0 cat | sha256sum | cut -c1-16)"
  if [ ! -f "$stamp" ]; then
    echo "[python] installing clients/python into $venv" >&2
    "$venv/bin/pip" install --quiet "$root/clients/python"
    rm -f "$venv"/.stoker-client-* && touch "$stamp"
  fi
fi
echo "$venv"
