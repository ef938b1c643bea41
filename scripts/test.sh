#!/usr/bin/env bash
# The README's test command (and CI's): set up, then run every test, the slow multi-process
# ones included. Pass pytest arguments to narrow it, e.g. scripts/test.sh -m "not slow".
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,hf
if [ $# -eq 0 ]; then set -- -m "slow or not slow"; fi
exec .venv/bin/python -m pytest "$@"
