"""The continuous codegen engine (autopar/inference/codegen_iteration.py) on a tp=2 x pp=2 grid of 4
gloo ranks: each rank runs its tp share of its stage's layers of the row programs for two virtual
engines in flight, and the staggered requests of tests/inference/test_codegen_iteration.py (rows
reused, some joining mid-decode) each get the tokens of Hugging Face's ``generate`` on its prompt
alone, on every rank, while no decoder layer module runs; premise: both virtual engines had
turns, the stages worked at once, and each rank holds its kv heads of its layers' cache."""
from __future__ import annotations

import pytest
import torch

from autopar.inference.inference_plan import InferencePlan
from autopar.inference.iteration_engine import IterationEngine
from runtime.launch import run_local
from tests.helpers.serving import generate_alone
from tests.inference.test_codegen_iteration import (MAX_NEW, PROMPT_LEN, REQUESTS, SLOTS, _model, _no_module_runs,
                                                    _plan, _serve)

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops


def _grid_rank(rank, world, plan_json):
    plan = InferencePlan.from_json(plan_json)
    model = _model()
    engine = IterationEngine.from_plan(model, plan, backend="codegen")
    fired = _no_module_runs(model)
    seqs, most = _serve(engine)
    return ([s.tokens for s in seqs], most, engine.calls, len(fired), (engine.stage, engine.tp_rank),
            engine.overlaps, [ve.turns for ve in engine.flights], engine.iterations, engine.runner.cache_bytes())


@pytest.mark.slow
def test_tp2_pp2_codegen_engine_equals_generate_alone():
    plan = _plan(4, tp=2, pp=2)
    assert (plan.tp, plan.pp, plan.dp) == (2, 2, 1) and len(plan.stages) == 2
    results = run_local(_grid_rank, 4, args=(plan.to_json(),), timeout=900)
    wants = [generate_alone(_model(), p, n) for p, n, _ in REQUESTS]
    cfg = _model().config
    layers = [b - a for a, b in plan.stages]
    per_layer = 2 * SLOTS * cfg.num_key_value_heads * (PROMPT_LEN + MAX_NEW) \
        * (cfg.hidden_size // cfg.num_attention_heads) * 4
    for rank, (tokens, most, calls, fired, place, overlaps, turns, iterations, held) in enumerate(results):
        assert tokens == wants and most >= 2
        assert place == divmod(rank, 2)
        assert fired == 0 and calls[1] > 0 and calls[PROMPT_LEN] == len(REQUESTS)   # premise: the programs ran
        assert len(turns) == 2 and min(turns) > 0 and 0 < overlaps < iterations   # premise: stages in flight
        assert held == per_layer * layers[place[0]] // 2   # its kv heads of its stage's layers, one virtual engine
    assert all(r[5:8] == results[0][5:8] for r in results)   # every rank ran the same ticks
