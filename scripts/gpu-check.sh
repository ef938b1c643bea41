#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py): one command on a CUDA machine, one markdown table.
#
#   bash scripts/gpu-check.sh --download     # on a machine with network: fetch the wheels the GPU
#                                            # machine lacks (PuLP, highspy) into .whl/
#   bash scripts/gpu-check.sh [--quick] [--out FILE]   # on the GPU machine (no network needed)
#
# On the GPU machine it uses the python3 that has torch (and triton), installs .whl/*.whl into
# /tmp/autopar-site without touching that environment, and runs the check from this checkout.
# On a machine without CUDA it sets up .venv (scripts/setup.sh) and runs the sections that need no
# GPU, then says which ones it skipped. Finishes in under 8 minutes on one H100.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(PuLP==3.3.2 highspy==1.16.0)
if [ "${1:-}" = "--download" ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"
  ls .whl
  exit 0
fi
PY=python3
if python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/autopar-site .whl/*.whl
    export PYTHONPATH=/tmp/autopar-site:${PYTHONPATH:-}
  fi
else
  bash scripts/setup.sh test,hf
  PY=.venv/bin/python
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
exec "$PY" -m benchmarks.gpu_check "$@"
