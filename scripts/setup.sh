#!/usr/bin/env bash
# Creates .venv (if missing) and installs autopar with what the demo and tests need.
# torch is pinned to the CPU build already on these machines (constraints.txt); the package itself
# only requires torch>=2.5. Safe to run repeatedly: pip skips what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
extras=${1:-test,hf}
stamp=".venv/.autopar-installed-$extras"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  echo "[setup] installing autopar[$extras] into .venv (first run: ~1-2 min)"
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[$extras]"
  touch "$stamp"
fi
