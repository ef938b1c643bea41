#!/usr/bin/env bash
# The README's test command (and CI's): set up, then run every test, the slow multi-process
# ones included. Pass pytest arguments to narrow it, e.g. scripts/test.sh -m "not slow".
#
# Tests run on AUTOPAR_TEST_WORKERS pytest-xdist workers (default 2, one per core of these
# machines; 0 runs them in this process): planning tests are single-threaded Python, so two
# at a time halve the wall time. Each test has a 15-minute limit (pytest-timeout), so a hang
# fails that test instead of eating CI's 90 minutes; the slowest tests are listed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test,hf
if [ $# -eq 0 ]; then set -- -m "slow or not slow"; fi
workers=${AUTOPAR_TEST_WORKERS:-2}
extra=(--timeout=900 --durations=25)
if [ "$workers" != "0" ]; then extra+=(-n "$workers" --dist worksteal); fi
exec .venv/bin/python -m pytest "${extra[@]}" "$@"
