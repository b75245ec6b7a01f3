#!/usr/bin/env bash
# Installs the Python side of the decode benchmark into its own venv (never the system Python):
# torch (PyPI wheel, used on CPU only), pillow, numpy, boto3, scikit-image (its bundled sample
# photographs are the source of the mixed dataset).
set -euo pipefail
VENV="${STOKER_BENCH_VENV:-$HOME/.cache/stoker/bench-venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c 'import torch, PIL, numpy, boto3, skimage' 2>/dev/null; then
  "$VENV/bin/pip" install --quiet torch pillow numpy boto3 scikit-image
fi
"$VENV/bin/python" -c 'import torch, PIL; print("torch", torch.__version__, "pillow", PIL.__version__)'
echo "$VENV"
