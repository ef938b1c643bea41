"""Chunked prefill in the continuous-batching engine on autopar's own programs
(autopar/inference/codegen_iteration.py, ``IterationEngine.from_plan(..., backend="codegen")`` of a
``batching="chunked"`` plan): requests of different prompt lengths (some longer than one chunk,
some shorter) added a few iterations apart are prefilled in chunks of the plan's chunk into their
cache rows, one chunk per iteration per filling sequence, beside the running rows' decode, as the
modules engine schedules them (autopar/inference/iteration_chunks.py); each gets the tokens of
Hugging Face's ``generate`` on its prompt alone and of the modules engine's chunked run, in one
process, on tp=2 gloo ranks (every rank adding, or rank 0 leading), at pp=2 and on two
data-parallel replicas (dp=2, rank 0 leading), while no decoder layer module of the model ever
runs. Premises: a long prompt ran several chunks (the chunk program ran once per chunk), sequences
were ``filling`` across iterations while others decoded."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.errors import PlanError
from autopar.inference.codegen_iteration import CodegenIterationEngine
from autopar.inference.codegen_rows import row_chunk
from autopar.inference.inference_plan import InferencePlan
from autopar.inference.iteration_engine import IterationEngine
from autopar.inference.iteration_ranks import LeaderIterations, follow_iterations
from autopar.inference.planner import plan_inference
from runtime.launch import run_local
from tests.helpers.serving import generate_alone
from tests.inference.test_codegen_iteration import SAMPLING, _model, _no_module_runs, watched_stage_engine

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops

# (prompt, max_new_tokens, iterations stepped after adding it): a chunk of 4 tokens, 3 rows; the
# 9- and 7-token prompts take several chunks (beside running rows' decodes: 2 or 3 iterations and
# more), the others one; rows are reused, one request wants a single token
REQUESTS = [([5, 6, 7], 5, 1), ([9, 10, 11, 12, 13, 14, 15, 16, 17], 3, 0), ([1, 2], 1, 1),
            ([40, 41, 42, 43, 44, 45, 46], 4, 2), ([7, 8], 6, 0), ([60], 2, 1)]
SLOTS, PROMPT_LEN, MAX_NEW, CHUNK = 3, 9, 6, 4


def _plan(devices, chunk=CHUNK, prompt_len=PROMPT_LEN, max_new=MAX_NEW, **pins):
    """A chunked plan of the spread Llama (small programs: the test's slots and lengths)."""
    from autopar.inference.trace import synthetic_trace
    trace = synthetic_trace(16, rate=4.0, prompt_lens=(2, 9), output_lens=(1, 6), seed=0)
    plan = plan_inference(_model(), None, autopar.Cluster.preset("cpu", devices=devices), trace=trace,
                          batching="chunked", prefill_chunk=chunk, constraints=pins, dtype="fp32")
    assert plan.predictions["batching"] == "chunked" and plan.predictions["prefill_chunk"] == chunk
    plan.batch_size, plan.prompt_len, plan.max_new_tokens = SLOTS, prompt_len, max_new
    plan.predictions["kv_cache_tokens_per_replica"] = None
    return plan


def _serve(engine, requests=REQUESTS):
    """Add the requests a few iterations apart, stepping in between. Returns the sequences and, per
    step, (ids of the filling sequences, how many others were running) after it (pp > 1: those of
    every virtual engine)."""
    seqs, log = [], []

    def step():
        engine.step()
        filling = engine.filling + [s for ve in getattr(engine, "flights", []) for s in ve.filling]
        ids = {id(s) for s in filling}
        log.append((sorted(ids), sum(id(s) not in ids for s in engine.running)))
    for prompt, new, gap in requests:
        seqs.append(engine.add(prompt, new))
        for _ in range(gap):
            step()
    while not engine.idle:
        step()
    return seqs, log


def _interleaved(log) -> bool:
    """A sequence was filling after two consecutive steps while rows were running (decoding)."""
    return any(set(a) & set(b) and n > 0 for (a, _), (b, n) in zip(log, log[1:]))


def _wants(requests=REQUESTS):
    return [generate_alone(_model(), p, n) for p, n, _ in requests]


def test_one_process_chunked_codegen_engine_equals_generate_alone_and_the_modules_engine():
    plan = _plan(1)
    model = _model()
    engine = IterationEngine.from_plan(model, plan, backend="codegen")
    assert isinstance(engine, CodegenIterationEngine) and engine.chunk == CHUNK and engine.prefill_len == CHUNK
    fired = _no_module_runs(model)
    seqs, log = _serve(engine)
    chunks = [s.chunks for s in seqs]
    assert not fired and engine.calls[1] > 0   # premise: no decoder layer ran, the programs did
    assert engine.calls[CHUNK] == sum(len(c) for c in chunks)   # one chunk program run per chunk
    assert len(seqs[1].chunks) >= 3 and len(seqs[3].chunks) >= 2 and max(map(max, chunks)) <= CHUNK   # premise
    assert [sum(c) for c in chunks] == [len(p) for p, _, _ in REQUESTS]
    assert _interleaved(log) and engine.most_tokens <= CHUNK   # premise: filling beside decodes, in budget
    assert engine.idle and not engine.filling
    wants = _wants()
    assert [s.tokens for s in seqs] == wants
    modules = IterationEngine.from_plan(_model(), plan)
    mseqs, mlog = _serve(modules)
    assert [s.tokens for s in mseqs] == wants
    assert [s.chunks for s in mseqs] == chunks   # the same schedule
    assert [(len(f), n) for f, n in mlog] == [(len(f), n) for f, n in log]


def test_chunked_sampled_tokens_equal_the_modules_engines_with_the_same_seeds():
    """A sequence samples once, after its last chunk, as the modules engine's does."""
    plan = _plan(1)
    got = []
    for backend in ("codegen", "modules"):
        engine = IterationEngine.from_plan(_model(), plan, backend=backend)
        seqs = [engine.add(p, n, SAMPLING[i]) for i, (p, n, _) in enumerate(REQUESTS)]
        engine.run_until_idle()
        got.append(([s.tokens for s in seqs], [s.chunks for s in seqs]))
    assert got[0] == got[1] and got[0][0] != _wants()


def test_a_late_chunk_near_the_cache_end_pads_into_its_last_slot():
    """max_new_tokens 1: a cache of prompt_len + 1 slots, so the padding of a short chunk at the
    end of a long prompt runs past the cache; it writes the cache's last slot instead."""
    ids, pos, slots = row_chunk(torch.tensor([3, 4]), 7, 4, limit=10)
    assert ids.tolist() == [0, 0, 3, 4] and pos.tolist() == [0, 0, 7, 8] and slots.tolist() == [9, 9, 7, 8]
    with pytest.raises(ValueError, match="no slot after"):
        row_chunk(torch.tensor([3, 4]), 8, 4, limit=10)
    requests = [([9, 10, 11, 12, 13, 14, 15, 16, 17], 1, 0), ([1, 2, 3, 4, 5], 1, 0)]
    plan = _plan(1, chunk=8, max_new=1)
    model = _model()
    engine = IterationEngine.from_plan(model, plan, backend="codegen")
    fired = _no_module_runs(model)
    seqs, _ = _serve(engine, requests)
    assert not fired and seqs[0].chunks[-1] < 8 and engine.prefill_len == 8   # premise: a late short chunk
    assert [s.tokens for s in seqs] == _wants(requests)


def test_a_chunk_smaller_than_the_slots_is_refused():
    plan = _plan(1)
    small = InferencePlan.from_json(plan.to_json())
    small.predictions["prefill_chunk"] = SLOTS - 1
    with pytest.raises(PlanError, match="more than the prefill chunk"):
        IterationEngine.from_plan(_model(), small, backend="codegen")


def _tp_rank(rank, world, plan_json, lead):
    plan = InferencePlan.from_json(plan_json)
    model = _model()
    engine = IterationEngine.from_plan(model, plan, backend="codegen")
    fired = _no_module_runs(model)
    if lead and rank > 0:
        return follow_iterations(engine), engine.calls, len(fired)
    leader = LeaderIterations(engine) if lead else None   # rank 0 leading, as the server runs it
    seqs, log = _serve(leader or engine)
    if leader is not None:
        leader.stop()
    return [s.tokens for s in seqs], [s.chunks for s in seqs], _interleaved(log), engine.calls, len(fired)


@pytest.mark.slow
@pytest.mark.parametrize("lead", [False, True])
def test_tp2_chunked_codegen_engine_equals_generate_alone(lead):
    plan = _plan(2, tp=2)
    assert (plan.tp, plan.pp, plan.dp) == (2, 1, 1)
    results = run_local(_tp_rank, 2, args=(plan.to_json(), lead), timeout=600)
    tokens, chunks, interleaved, calls, fired = results[0]
    assert tokens == _wants()
    assert fired == 0 and calls[1] > 0 and calls[CHUNK] == sum(len(c) for c in chunks)   # premise
    assert len(chunks[1]) >= 2 and max(map(max, chunks)) <= CHUNK
    assert interleaved   # premise: filling across iterations beside decodes
    if lead:
        assert results[1][1:] == (calls, 0)   # the follower ran every program rank 0 ran
    else:
        assert results[1] == results[0]
        modules = IterationEngine.from_plan(_model(), _plan(1))
        mseqs, _ = _serve(modules)
        assert [s.tokens for s in mseqs] == tokens and [s.chunks for s in mseqs] == chunks


def _pp_rank(rank, world, plan_json, lead):
    engine, fired, flights = watched_stage_engine(plan_json)
    if lead and rank > 0:
        follow_iterations(engine)
        return None, None, None, engine.calls, len(fired), *flights()
    leader = LeaderIterations(engine) if lead else None
    seqs, log = _serve(leader or engine)
    if leader is not None:
        leader.stop()
    return [s.tokens for s in seqs], [s.chunks for s in seqs], _interleaved(log), engine.calls, len(fired), \
        *flights()


@pytest.mark.slow
@pytest.mark.parametrize("lead", [False, True])
def test_pp2_chunked_codegen_engine_equals_generate_alone(lead):
    """Two pipeline stages in flight, each virtual engine's turn running its own chunk budget (its
    rows' decode, then its prompt chunks), as the modules engine's (iteration_stages.py); the
    tokens equal ``generate`` alone and the modules engine's pp=2 chunked run, its chunks too.
    Premise: a long prompt ran several chunks, both virtual engines had turns, the stages worked at
    once, no decoder layer ran."""
    plan = _plan(2, pp=2)
    assert (plan.tp, plan.pp, plan.dp) == (1, 2, 1) and len(plan.stages) == 2
    results = run_local(_pp_rank, 2, args=(plan.to_json(), lead), timeout=600)
    wants = _wants()
    tokens, chunks, interleaved = results[0][:3]
    assert tokens == wants and interleaved   # premise: filling across ticks beside decodes
    assert len(chunks[1]) >= 2 and max(map(max, chunks)) <= CHUNK   # premise
    for rank, (_, _, _, calls, fired, overlaps, turns, iterations) in enumerate(results):
        assert fired == 0 and calls[1] > 0 and calls[CHUNK] == sum(len(c) for c in chunks)   # premise
        assert len(turns) == 2 and min(turns) > 0 and 0 < overlaps < iterations   # premise: stages in flight
    assert results[1][5:] == results[0][5:]   # every rank ran the same ticks
    if not lead:
        assert results[1][:3] == results[0][:3]
        modules = run_local(_modules_pp_rank, 2, args=(plan.to_json(),), timeout=600)[0]
        assert modules == (tokens, chunks)


def _modules_pp_rank(rank, world, plan_json):
    engine = IterationEngine.from_plan(_model(), InferencePlan.from_json(plan_json))
    seqs, _ = _serve(engine)
    return [s.tokens for s in seqs], [s.chunks for s in seqs]


def _dp_rank(rank, world, plan_json):
    plan = InferencePlan.from_json(plan_json)
    model = _model()
    engine = IterationEngine.from_plan(model, plan, backend="codegen")
    fired = _no_module_runs(model)
    mine = []   # the sequences this rank's replica added (their chunks are its engine's)
    add = engine.add
    engine.add = lambda *a, **k: mine.append(add(*a, **k)) or mine[-1]
    tokens = None
    if rank == 0:
        leader = LeaderIterations(engine)
        seqs, _ = _serve(leader)
        leader.stop()
        tokens = [s.tokens for s in seqs]
    else:
        follow_iterations(engine)
    return tokens, engine.replica, [(list(s.prompt), s.chunks) for s in mine], engine.calls, len(fired)


@pytest.mark.slow
def test_dp2_chunked_codegen_engine_equals_generate_alone():
    """Two data-parallel replicas (dp=2 on 2 gloo ranks, rank 0 leading) of a chunked plan: each
    replica schedules the chunks of the requests assigned to it on its own rows; every request's
    tokens equal ``generate`` of its prompt alone. Premises: both replicas served some, each request
    once, each replica's chunk program ran once per chunk of its requests, a long prompt took
    several chunks of at most the plan's chunk, no decoder layer ran."""
    plan = _plan(2, dp=2)
    assert (plan.tp, plan.pp, plan.dp) == (1, 1, 2)
    results = run_local(_dp_rank, 2, args=(plan.to_json(),), timeout=600)
    assert results[0][0] == _wants()
    assert [r[1] for r in results] == [0, 1]
    shares = [r[2] for r in results]
    assert all(shares) and sorted(p for s in shares for p, _ in s) == sorted(p for p, _, _ in REQUESTS)
    for _, _, share, calls, fired in results:
        assert fired == 0 and calls[1] > 0 and calls[CHUNK] == sum(len(c) for _, c in share)   # premise
        assert all(sum(c) == len(p) and max(c) <= CHUNK for p, c in share)
    assert max(len(c) for s in shares for _, c in s) >= 3   # premise: the 9-token prompt took 3 chunks
