"""Continuous batching on autopar's own programs (autopar/inference/codegen_iteration.py,
``IterationEngine.from_plan(..., backend="codegen")``): requests of different prompt and output
lengths admitted at different iterations, rows retired and reused, each get the tokens of Hugging
Face's ``generate`` on its prompt alone and of the modules IterationEngine, in one process, on
tp=2 gloo ranks (SPMD, and rank 0 leading through LeaderIterations) and on pp=2 stages in flight (two virtual
engines, the stages working at once), while no decoder layer module of the model ever runs (a forward hook that must
not fire) and the generated programs do; a pp=2 tick failing after its turn admitted a newcomer hands it back on
abort."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.errors import PlanError
from autopar.inference.codegen_iteration import CodegenIterationEngine
from autopar.inference.inference_plan import InferencePlan
from autopar.inference.iteration_engine import IterationEngine
from autopar.inference.iteration_ranks import LeaderIterations, follow_iterations
from autopar.inference.planner import plan_inference
from runtime.launch import run_local
from tests.helpers.serving import fail_a_tick_after_admitting, generate_alone, spread_model
from tests.inference.test_codegen_engine import linear_qkv

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops

# (prompt, max_new_tokens, iterations stepped after adding it): 3 rows for 6 requests, so rows are
# reused; some join while others are mid-decode, one wants a single token
REQUESTS = [([5, 6, 7], 5, 0), ([9, 10, 11, 12, 13, 14], 3, 1), ([1, 2], 1, 0), ([40, 41, 42, 43], 4, 2),
            ([7, 8], 6, 0), ([60], 2, 1)]
SLOTS, PROMPT_LEN, MAX_NEW = 3, 6, 6


def _model():
    return spread_model("hf_llama")


_alone = generate_alone


def _plan(devices, dtype="fp32", **pins):
    from autopar.inference.trace import synthetic_trace
    trace = synthetic_trace(16, rate=4.0, prompt_lens=(2, 6), output_lens=(1, 6), seed=0)
    plan = plan_inference(_model(), None, autopar.Cluster.preset("cpu", devices=devices), trace=trace,
                          batching="continuous", constraints=pins, dtype=dtype)
    plan.batch_size, plan.prompt_len, plan.max_new_tokens = SLOTS, PROMPT_LEN, MAX_NEW   # small programs
    plan.predictions["kv_cache_tokens_per_replica"] = None
    return plan


def _serve(engine):
    """Add the requests a few iterations apart, stepping in between; the most rows running at once."""
    seqs, most = [], 0
    for prompt, new, gap in REQUESTS:
        seqs.append(engine.add(prompt, new))
        for _ in range(gap):
            engine.step()
            most = max(most, len(engine.running))
    while not engine.idle:
        engine.step()
        most = max(most, len(engine.running))
    return seqs, most


def _no_module_runs(model):
    """A forward hook on every decoder layer that counts its runs (must stay 0)."""
    fired = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda *a: fired.append(1))
    return fired


def test_one_process_codegen_engine_equals_generate_alone_and_the_modules_engine():
    plan = _plan(1)
    model = _model()
    engine = IterationEngine.from_plan(model, plan, backend="codegen")
    assert isinstance(engine, CodegenIterationEngine)
    fired = _no_module_runs(model)
    seqs, most = _serve(engine)
    assert not fired and engine.calls[1] > 0 and engine.calls[PROMPT_LEN] == len(REQUESTS)   # premise
    assert most >= 2   # sequences ran together
    wants = [_alone(_model(), p, n) for p, n, _ in REQUESTS]
    assert [s.tokens for s in seqs] == wants
    modules = IterationEngine.from_plan(_model(), plan)
    assert [s.tokens for s in _serve(modules)[0]] == wants


def test_backend_is_checked():
    plan = _plan(1)
    with pytest.raises(PlanError, match="not an iteration engine backend"):
        IterationEngine.from_plan(_model(), plan, backend="nope")
    dp2 = InferencePlan.from_json(plan.to_json())
    dp2.dp = 2   # replicas run (tests/inference/test_codegen_iteration_dp.py), on the plan's ranks only
    with pytest.raises(PlanError, match="runs on 2 processes.*dp=2"):
        IterationEngine.from_plan(_model(), dp2, backend="codegen")


def _serve_as(engine, lead):
    """Rank 0's requests (``_serve``): through ``LeaderIterations`` when ``lead`` (the server's path,
    the other ranks following), else on the engine itself (every rank adding them)."""
    if not lead:
        return _serve(engine)
    leader = LeaderIterations(engine)
    out = _serve(leader)
    leader.stop()
    return out


def _tp_rank(rank, world, plan_json, lead):
    plan = InferencePlan.from_json(plan_json)
    model = _model()
    engine = IterationEngine.from_plan(model, plan, backend="codegen")
    fired = _no_module_runs(model)
    if lead and rank > 0:
        return follow_iterations(engine), engine.calls, len(fired)
    seqs, most = _serve_as(engine, lead)
    return [s.tokens for s in seqs], most, engine.iterations, engine.calls, len(fired), engine.kv_cache_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("lead", [False, True])
def test_tp2_codegen_engine_equals_generate_alone(lead):
    plan = _plan(2, tp=2)
    assert (plan.tp, plan.pp, plan.dp) == (2, 1, 1)
    results = run_local(_tp_rank, 2, args=(plan.to_json(), lead), timeout=600)
    wants = [_alone(_model(), p, n) for p, n, _ in REQUESTS]
    tokens, most, iterations, calls, fired, held = results[0]
    assert tokens == wants and most >= 2
    assert fired == 0 and 0 < calls[1] <= iterations and calls[PROMPT_LEN] == len(REQUESTS)   # premise
    model = _model()
    whole = 2 * model.config.num_hidden_layers * SLOTS * model.config.num_key_value_heads \
        * (PROMPT_LEN + MAX_NEW) * (model.config.hidden_size // model.config.num_attention_heads) * 4
    assert held == whole // 2   # each rank holds its kv heads of the cache
    if lead:
        assert results[1][1:] == (calls, 0)   # the follower ran every program rank 0 ran
    else:
        assert results[1] == results[0]


SAMPLING = [{"temperature": 0.8, "top_k": 20, "seed": i} for i in range(len(REQUESTS))]


def test_sampled_tokens_equal_the_modules_engine_with_the_same_seeds():
    """Each sequence samples from its own seeded generator after the same warpers, as the modules
    engine's sequences do: the same tokens."""
    plan = _plan(1)
    sampling = SAMPLING
    got = []
    for backend in ("codegen", "modules"):
        engine = IterationEngine.from_plan(_model(), plan, backend=backend)
        seqs = [engine.add(p, n, sampling[i]) for i, (p, n, _) in enumerate(REQUESTS)]
        engine.run_until_idle()
        got.append([s.tokens for s in seqs])
    assert got[0] == got[1] and got[0] != [_alone(_model(), p, n) for p, n, _ in REQUESTS]


def watched_stage_engine(plan_json):
    """A rank's codegen engine of a pp plan, the hooks that record any decoder layer running, and
    what its stages in flight did: ``flights()`` = (overlaps, each virtual engine's turns, iterations)."""
    model = _model()
    engine = IterationEngine.from_plan(model, InferencePlan.from_json(plan_json), backend="codegen")
    fired = _no_module_runs(model)
    return engine, fired, lambda: (engine.overlaps, [ve.turns for ve in engine.flights], engine.iterations)


def _pp_rank(rank, world, plan_json, lead):
    engine, fired, flights = watched_stage_engine(plan_json)
    if lead and rank > 0:
        follow_iterations(engine)
        return None, None, engine.calls, len(fired), engine.stage, *flights()
    seqs, most = _serve_as(engine, lead)
    if not lead:
        sampled = [engine.add(p, n, s) for (p, n, _), s in zip(REQUESTS, SAMPLING)]
        engine.run_until_idle()
        seqs += sampled
    return [s.tokens for s in seqs], most, engine.calls, len(fired), engine.stage, *flights()


@pytest.mark.slow
@pytest.mark.parametrize("lead", [False, True])
def test_pp2_codegen_engine_equals_generate_alone(lead):
    """Two pipeline stages in flight, each rank running its stage's layers of the row programs for
    two virtual engines (each its own cache rows); the last stage's tokens of each turn broadcast,
    so every rank has every sequence's tokens (``lead``: rank 0 leading, as the server runs it;
    without, sampled requests after the greedy ones draw one process's tokens). Premise: both
    virtual engines had turns and the stages worked at once."""
    plan = _plan(2, pp=2)
    assert (plan.tp, plan.pp, plan.dp) == (1, 2, 1) and len(plan.stages) == 2
    results = run_local(_pp_rank, 2, args=(plan.to_json(), lead), timeout=600)
    wants = [_alone(_model(), p, n) for p, n, _ in REQUESTS]
    if not lead:
        one = IterationEngine.from_plan(_model(), _plan(1), backend="codegen")
        sampled = [one.add(p, n, s) for (p, n, _), s in zip(REQUESTS, SAMPLING)]
        one.run_until_idle()
        wants += [s.tokens for s in sampled]
    for rank, (tokens, most, calls, fired, stage, overlaps, turns, iterations) in enumerate(results):
        assert (tokens == wants and most >= 2) if rank == 0 or not lead else tokens is None
        assert stage == rank
        assert fired == 0 and calls[1] > 0 and calls[PROMPT_LEN] == len(REQUESTS) * (1 if lead else 2)   # premise
        assert len(turns) == 2 and min(turns) > 0 and 0 < overlaps < iterations   # premise: stages in flight
    assert results[1][5:] == results[0][5:]   # every rank ran the same ticks


def _abort_rank(rank, world, plan_json):
    """Both stages run two ticks of one request, then a second request is added and the next tick
    fails on every rank in its stage's work, after its turn admitted the newcomer; returns the
    prompts the abort hands back, and the tokens of a request served after it."""
    plan = InferencePlan.from_json(plan_json)
    engine = IterationEngine.from_plan(_model(), plan, backend="codegen")
    admitted, dropped, first, second, idle = fail_a_tick_after_admitting(engine)
    after = engine.add([1, 2], 3)
    engine.run_until_idle()
    return admitted, dropped, first, second, idle, after.tokens


@pytest.mark.slow
def test_a_pp2_tick_failing_after_its_turn_admitted_a_newcomer_hands_it_back_on_abort():
    """A server answers every request an abort hands back: one admitted in the failing tick (in a
    virtual engine's turn, not yet ``running``) too; the engine serves on after the abort."""
    plan = _plan(2, pp=2)
    want = _alone(_model(), [1, 2], 3)
    for admitted, dropped, first, second, idle, after in run_local(_abort_rank, 2, args=(plan.to_json(),),
                                                                   timeout=300):
        assert second in admitted                      # the premise: the failing tick admitted it
        assert sorted(dropped) == sorted([first, second]) and idle
        assert after == want


def _iteration_error(rank, world, plan_json):
    try:
        IterationEngine.from_plan(linear_qkv(spread_model("hf_gpt2")), InferencePlan.from_json(plan_json),
                                  backend="codegen")
    except PlanError as e:
        return str(e)


@pytest.mark.slow
def test_a_row_cache_the_steps_plan_keeps_whole_is_refused():
    """A fused qkv projection the steps do not split (GPT-2 whose ``c_attn`` is an ``nn.Linear``,
    ``linear_qkv``) at tp=2 leaves the row steps' cache unsplit on the kv heads
    (the decode step's plan holds it in another layout than the prefill's, or whole): refused on
    every rank with a PlanError naming the modules backend, not a ValueError from the runner."""
    from autopar.inference.trace import synthetic_trace
    trace = synthetic_trace(16, rate=4.0, prompt_lens=(2, 6), output_lens=(1, 6), seed=0)
    plan = plan_inference(spread_model("hf_gpt2"), None, autopar.Cluster.preset("cpu", devices=2), trace=trace,
                          batching="continuous", constraints={"tp": 2, "pp": 1, "dp": 1}, dtype="fp32")
    plan.batch_size, plan.prompt_len, plan.max_new_tokens = SLOTS, PROMPT_LEN, MAX_NEW
    plan.predictions["kv_cache_tokens_per_replica"] = None
    for msg in run_local(_iteration_error, 2, args=(plan.to_json(),), timeout=600):
        assert msg is not None and ("do not split" in msg or "another layout" in msg) and 'backend="modules"' in msg
