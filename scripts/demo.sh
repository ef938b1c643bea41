#!/usr/bin/env bash
# The README's demo: set up, plan GPT-2 XL on 2 DGX-A100 nodes and print the summary,
# then train a small GPT on 4 local CPU processes under its automatic plan.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
.venv/bin/python -m autopar.demo "$@"
