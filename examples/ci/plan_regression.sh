#!/usr/bin/env bash
# Plan regression check (examples/ci/README.md): plan the model as CI does on every change and diff
# the plan against the committed baseline; exit 1 when a predicted metric got worse beyond its limit.
#
#   bash examples/ci/plan_regression.sh            # plan -> $OUT, then autopar diff BASELINE $OUT --fail-on LIMITS
#   bash examples/ci/plan_regression.sh --update   # plan -> BASELINE (after an intended change; commit it)
#
# Environment (all optional): AUTOPAR (the command, default "autopar"), BASELINE (default
# examples/ci/baseline.json), OUT (default plan.json), LIMITS (default step_time=+2%,peak_memory=+5%).
# Plans are deterministic (the same JSON for the same inputs), so an unchanged planner diffs clean.
set -euo pipefail
AUTOPAR=${AUTOPAR:-autopar}
BASELINE=${BASELINE:-examples/ci/baseline.json}
OUT=${OUT:-plan.json}
LIMITS=${LIMITS:-step_time=+2%,peak_memory=+5%}

# What is planned: edit this line for your model (a zoo name or module:FACTORY) and cluster.
plan() { $AUTOPAR plan gpt2 --arg n_layer=4 --cluster dgx-a100 -o "$1"; }

if [ "${1:-}" = "--update" ]; then
  plan "$BASELINE"
  echo "baseline written to $BASELINE: commit it"
  exit 0
fi
plan "$OUT"
echo "--- $AUTOPAR diff $BASELINE $OUT --fail-on $LIMITS"
$AUTOPAR diff "$BASELINE" "$OUT" --fail-on "$LIMITS"
