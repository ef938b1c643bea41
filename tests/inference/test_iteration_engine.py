"""Continuous batching on a real model (autopar/inference/iteration_engine.py): requests arriving at
different iterations, with different prompt and output lengths, each get the tokens of Hugging
Face's ``generate`` on its prompt alone (tiny GPT-2 and Llama, fixed seeds); slots and the KV-token
pool bound admission; a continuous plan builds the engine, tp=2 ranks run the same iterations (on
their own, or rank 0 leading and rank 1 following); with dp=2 replicas each
runs its own iterations on the requests rank 0 assigns it, and every request still gets ``generate``
alone. With chunked prefill (a chunk budget smaller than the prompts, one process, tp=2 and pp=2)
prompts are prefilled over several iterations, no iteration runs more tokens than the budget, and
the tokens are still ``generate``'s alone."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.errors import PlanError
from autopar.inference.inference_plan import InferencePlan
from autopar.inference.iteration_engine import IterationEngine
from autopar.inference.iteration_ranks import LeaderIterations, follow_iterations
from autopar.inference.planner import plan_inference
from runtime.launch import run_local
from tests.helpers.serving import generate_alone, spread_model

torch.set_num_threads(1)

# (prompt, max_new_tokens): prompts of 1 to 9 tokens, outputs of 1 to 7
REQUESTS = [([5, 6, 7], 6), ([9, 10, 11, 12, 13, 14, 15], 3), ([1, 2], 1), ([40, 41, 42, 43], 5),
            ([3, 30, 31, 32, 33, 34, 35, 36, 37], 4), ([7, 8], 7), ([60], 2), ([20, 21, 22, 23, 24], 6)]


def _model(name):
    return spread_model(name)


def _alone(model, prompt, new, **sampling):
    return generate_alone(model, prompt, new, **sampling)


def _serve_staggered(engine, requests, arrive_every=(0, 0, 1, 0, 2, 0, 1, 1)):
    """Add the requests a few iterations apart (some together), stepping in between."""
    seqs, log = [], []
    for (prompt, new), gap in zip(requests, arrive_every):
        seqs.append(engine.add(prompt, new))
        for _ in range(gap):
            engine.step()
            log.append((len(engine.running), len(engine.waiting)))
    engine.run_until_idle()
    return seqs, log


@pytest.mark.parametrize("name", ["hf_llama", "hf_gpt2"])
def test_staggered_requests_equal_generate_alone(name):
    model = _model(name)
    engine = IterationEngine(model, slots=3, prompt_len=9, max_new_tokens=7)
    seqs, log = _serve_staggered(engine, REQUESTS)
    wants = [_alone(model, p, n) for p, n in REQUESTS]
    assert len({len(w) for w in wants}) > 3 and len({t for w in wants for t in w}) > 8   # not degenerate
    for seq, want in zip(seqs, wants):
        assert seq.tokens == want
        assert seq.done >= seq.first >= seq.admitted >= seq.added
    assert engine.idle and engine.cache is None
    assert max(r for r, _ in log) == 3                   # the slots filled: requests really ran together
    assert any(w > 0 for _, w in log)                    # and some waited for a slot


def test_a_long_request_keeps_running_while_others_join_and_leave():
    model = _model("hf_llama")
    engine = IterationEngine(model, slots=2, prompt_len=9, max_new_tokens=12)
    long = engine.add([3, 30, 31, 32, 33, 34, 35, 36, 37], 12)
    engine.step()
    shorts = []
    for prompt in ([5], [9, 10], [40, 41, 42]):   # shorter prompts join a row with a longer context
        shorts.append(engine.add(prompt, 2))
        engine.step()
        engine.step()
    engine.run_until_idle()
    assert long.tokens == _alone(model, long.prompt, 12)
    for s in shorts:
        assert s.tokens == _alone(model, s.prompt, 2)


def test_sampled_requests_draw_what_generate_alone_draws_with_their_seed():
    model = _model("hf_llama")
    engine = IterationEngine(model, slots=4, prompt_len=9, max_new_tokens=7)
    sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 3}
    a = engine.add([5, 6, 7], 6, sampled)
    b = engine.add([9, 10, 11, 12], 5)                       # greedy next to it
    engine.step()
    c = engine.add([1, 2], 6, dict(sampled, seed=4, top_k=10))
    engine.run_until_idle()
    torch.manual_seed(3)
    want_a = _alone(model, [5, 6, 7], 6, temperature=0.9, top_p=0.95)
    torch.manual_seed(4)
    want_c = _alone(model, [1, 2], 6, temperature=0.9, top_p=0.95, top_k=10)
    assert a.tokens == want_a and c.tokens == want_c
    assert b.tokens == _alone(model, [9, 10, 11, 12], 5)
    assert a.tokens != _alone(model, [5, 6, 7], 6)             # it really sampled


def test_the_kv_token_pool_bounds_admission_in_order():
    model = _model("hf_gpt2")
    engine = IterationEngine(model, slots=4, prompt_len=9, max_new_tokens=7, kv_tokens=12)
    a = engine.add([5, 6, 7], 6)          # holds 9 tokens
    b = engine.add([1, 2], 3)             # 5 more: over 12, waits (and blocks c)
    c = engine.add([4], 1)
    engine.step()
    assert engine.running == [a] and engine.waiting == [b, c]
    engine.run_until_idle()
    assert a.tokens == _alone(model, [5, 6, 7], 6) and b.tokens == _alone(model, [1, 2], 3)
    assert c.tokens == _alone(model, [4], 1)
    with pytest.raises(PlanError, match="pool of 12"):
        engine.add([1] * 9, 5)


def test_what_the_engine_cannot_run_is_a_clear_error():
    engine = IterationEngine(_model("hf_llama"), slots=2, prompt_len=4, max_new_tokens=3)
    with pytest.raises(PlanError, match="prompt length 4"):
        engine.add([1] * 5, 2)
    with pytest.raises(PlanError, match="KV cache holds no more"):
        engine.add([1], 4)
    with pytest.raises(PlanError, match="empty"):
        engine.add([], 1)
    with pytest.raises(PlanError, match="not known"):
        engine.add([1], 1, {"temp": 1})
    assert engine.idle


def _continuous_plan(devices, name="hf_llama", **pins):
    from autopar.inference.trace import synthetic_trace
    trace = synthetic_trace(16, rate=4.0, prompt_lens=(2, 8), output_lens=(1, 6), seed=0)
    return plan_inference(_model(name), None, autopar.Cluster.preset("cpu", devices=devices), trace=trace,
                          batching="continuous", constraints=pins, dtype="fp32")


def test_a_one_process_continuous_plan_builds_the_engine():
    plan = _continuous_plan(1)
    assert plan.predictions["batching"] == "continuous" and plan.world_size == 1
    engine = IterationEngine.from_plan(_model("hf_llama"), plan)
    assert engine.slots == plan.batch_size
    assert engine.kv_tokens == plan.predictions.get("kv_cache_tokens_per_replica")
    seq = engine.add([5, 6, 7], 2)
    engine.run_until_idle()
    assert seq.tokens == _alone(_model("hf_llama"), [5, 6, 7], 2)
    pp2 = InferencePlan.from_json(plan.to_json())
    pp2.pp = 2   # pp > 1 runs (tests/inference/test_continuous_pipeline.py), on the plan's ranks only
    with pytest.raises(PlanError, match="runs on 2 processes"):
        IterationEngine.from_plan(_model("hf_llama"), pp2)


def _tp_rank(rank, world, plan_json, lead, name):
    """One rank of a tp=2 continuous engine: SPMD (every rank adds the same requests) or, with
    ``lead``, rank 0 leading through LeaderIterations and rank 1 following its broadcasts."""
    plan = InferencePlan.from_json(plan_json)
    engine = IterationEngine.from_plan(_model(name), plan)
    engine.slots, engine.prompt_len, engine.max_new_tokens, engine.kv_tokens = 3, 9, 7, None
    if lead and rank > 0:
        return follow_iterations(engine)
    if lead:
        leader = LeaderIterations(engine)
        seqs, log = _serve_staggered(leader, REQUESTS)
        leader.stop()
    else:
        seqs, log = _serve_staggered(engine, REQUESTS)
    return [s.tokens for s in seqs], engine.iterations, max(r for r, _ in log)


@pytest.mark.slow
@pytest.mark.parametrize("lead, name", [(False, "hf_llama"), (True, "hf_llama"), (True, "hf_gpt2")])
def test_tp2_ranks_run_the_same_iterations_and_equal_generate_alone(lead, name):
    plan = _continuous_plan(2, name, tp=2)
    assert (plan.tp, plan.pp, plan.dp) == (2, 1, 1)
    results = run_local(_tp_rank, 2, args=(plan.to_json(), lead, name), timeout=300)
    model = _model(name)
    wants = [_alone(model, p, n) for p, n in REQUESTS]
    tokens, iterations, most = results[0]
    assert tokens == wants and most == 3
    if lead:
        assert results[1] == iterations          # the follower ran every iteration rank 0 ran
    else:
        assert results[1] == results[0]


def _dp_rank(rank, world, plan_json, name):
    """One rank of a continuous plan with replicas: rank 0 leads (assigns each request a replica),
    the others follow; rank 0 returns the tokens and how many sequences each replica finished."""
    plan = InferencePlan.from_json(plan_json)
    engine = IterationEngine.from_plan(_model(name), plan)
    engine.slots, engine.prompt_len, engine.max_new_tokens, engine.kv_tokens = 2, 9, 7, None
    if rank > 0:
        return follow_iterations(engine), engine.replica
    leader = LeaderIterations(engine)
    seqs, _ = _serve_staggered(leader, REQUESTS)
    steps = engine.iterations
    leader.stop()
    return [s.tokens for s in seqs], leader.served, [s.done >= s.first >= s.admitted >= s.added for s in seqs], steps


def _dp_plan(devices, name, **pins):
    plan = _continuous_plan(devices, name, **pins)
    assert (plan.tp, plan.pp, plan.dp) == (pins["tp"], 1, pins["dp"])
    return plan


def test_dp2_replicas_each_run_requests_and_equal_generate_alone():
    plan = _dp_plan(2, "hf_llama", tp=1, dp=2)
    results = run_local(_dp_rank, 2, args=(plan.to_json(), "hf_llama"), timeout=300)
    tokens, served, ordered, _ = results[0]
    model = _model("hf_llama")
    assert tokens == [_alone(model, p, n) for p, n in REQUESTS]
    assert all(ordered)
    assert sum(served) == len(REQUESTS) and min(served) > 0   # both replicas really ran requests
    assert results[1][1] == 1 and results[1][0] > 0


@pytest.mark.slow
def test_tp2_dp2_replicas_equal_generate_alone():
    plan = _dp_plan(4, "hf_gpt2", tp=2, dp=2)
    results = run_local(_dp_rank, 4, args=(plan.to_json(), "hf_gpt2"), timeout=600)
    tokens, served, _, _ = results[0]
    model = _model("hf_gpt2")
    assert tokens == [_alone(model, p, n) for p, n in REQUESTS]
    assert sum(served) == len(REQUESTS) and min(served) > 0
    assert [r[1] for r in results[1:]] == [0, 1, 1]           # ranks 1 | 2, 3: replica 0 | replica 1
    assert results[2][0] == results[3][0]                     # a replica's tp ranks ran the same iterations


class _FailingOnce(IterationEngine):
    """Fails its second step that has something to do, once."""
    busy_steps = 0

    def step(self):
        if not self.idle:
            self.busy_steps += 1
            if self.busy_steps == 2:
                raise RuntimeError("injected failure")
        return super().step()


def _dp_failing_rank(rank, world, plan_json):
    plan = InferencePlan.from_json(plan_json)
    engine = (_FailingOnce if rank == 1 else IterationEngine).from_plan(_model("hf_llama"), plan)
    engine.slots, engine.prompt_len, engine.max_new_tokens, engine.kv_tokens = 2, 9, 7, None
    if rank > 0:
        return follow_iterations(engine)
    leader = LeaderIterations(engine)
    first = [leader.add(p, n) for p, n in REQUESTS[:4]]
    error, answered = None, []
    try:
        while not leader.idle:
            answered += leader.step()
    except RuntimeError as e:
        error = str(e)
    dropped = leader.abort()
    assert leader.idle
    again = [leader.add(p, n) for p, n in REQUESTS[4:]]
    leader.run_until_idle()
    leader.stop()
    handed_back = sorted(id(s) for s in answered + dropped) == sorted(id(s) for s in first)
    return error, handed_back, len(dropped), [s.tokens for s in again], leader.served


def test_a_failed_step_on_one_replica_fails_the_iteration_and_the_replicas_go_on():
    plan = _dp_plan(2, "hf_llama", tp=1, dp=2)
    error, handed_back, dropped, tokens, served = run_local(_dp_failing_rank, 2, args=(plan.to_json(),),
                                                            timeout=300)[0]
    assert "replica 1 failed its step" in error and "injected failure" in error
    # each request was answered before the failure or handed back by the abort (finished in the
    # failed iteration or not), once
    assert handed_back and dropped >= 2
    model = _model("hf_llama")
    assert tokens == [_alone(model, p, n) for p, n in REQUESTS[4:]]
    assert min(served) > 0


# chunked prefill: prompts of 1 to 12 tokens (most longer than the chunk of 5), outputs of 1 to 7
CHUNK = 5
CHUNKED = [([5, 6, 7, 8, 9, 10, 11], 6), ([9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], 3), ([1, 2], 1),
           ([40, 41, 42, 43, 44, 45], 5), ([3, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 50], 4), ([7, 8], 7), ([60], 2),
           ([20, 21, 22, 23, 24, 25, 26, 27, 28], 6)]


def _count_tokens(engine):
    """Record the tokens each iteration's (pp > 1: each tick's) forwards of this rank ran:
    {iteration: tokens}, a decode step's rows and a chunk's prompt tokens."""
    spent, forward = {}, engine._forward

    def counted(cache, **inputs):
        spent[engine.iterations] = spent.get(engine.iterations, 0) + inputs["input_ids"].numel()
        return forward(cache, **inputs)
    engine._forward = counted
    return spent


def _check_chunked(seqs_chunks, spent, chunk=CHUNK):
    assert all(sum(c) == len(p) for c, (p, _) in zip(seqs_chunks, CHUNKED))   # each prompt prefilled once, whole
    assert max(len(c) for c in seqs_chunks) >= 3                              # prompts were split over iterations
    assert max(spent.values()) == chunk                                        # budgets filled, never passed


@pytest.mark.parametrize("name", ["hf_llama", "hf_gpt2"])
def test_chunked_prefill_splits_prompts_within_the_budget_and_equals_generate_alone(name):
    model = _model(name)
    engine = IterationEngine(model, slots=3, prompt_len=12, max_new_tokens=7, prefill_chunk=CHUNK)
    spent = _count_tokens(engine)
    seqs, log = _serve_staggered(engine, CHUNKED)
    for seq, (prompt, new) in zip(seqs, CHUNKED):
        assert seq.tokens == _alone(model, prompt, new)
        assert seq.done >= seq.first >= seq.admitted >= seq.added
    _check_chunked([s.chunks for s in seqs], spent)
    assert engine.most_tokens == CHUNK and engine.idle and engine.cache is None
    assert max(r for r, _ in log) >= 2 and any(w > 0 for _, w in log)   # they ran together, some waited


def test_chunked_prefill_samples_as_generate_and_abort_hands_back_a_prompt_part_way():
    model = _model("hf_llama")
    engine = IterationEngine(model, slots=2, prompt_len=12, max_new_tokens=7, prefill_chunk=4)
    sampled = engine.add(CHUNKED[0][0], 6, {"temperature": 0.9, "top_p": 0.95, "seed": 3})
    engine.run_until_idle()
    torch.manual_seed(3)
    assert sampled.chunks == [4, 3] and sampled.tokens == _alone(model, CHUNKED[0][0], 6, temperature=0.9, top_p=0.95)
    long = engine.add(CHUNKED[4][0], 2)
    engine.step()
    assert engine.filling == [long] and long.chunks == [4] and not engine.running
    assert engine.abort() == [long] and engine.idle


def test_a_chunked_engine_needs_a_chunk_of_at_least_its_slots():
    with pytest.raises(PlanError, match="more than the prefill chunk of 2 tokens"):
        IterationEngine(_model("hf_llama"), slots=3, prompt_len=9, max_new_tokens=3, prefill_chunk=2)
    with pytest.raises(PlanError, match="positive integer"):
        IterationEngine(_model("hf_llama"), slots=1, prompt_len=9, max_new_tokens=3, prefill_chunk=0)


def _chunked_plan(devices, name="hf_llama", **pins):
    from autopar.inference.trace import synthetic_trace
    trace = synthetic_trace(16, rate=4.0, prompt_lens=(2, 8), output_lens=(1, 6), seed=0)
    return plan_inference(_model(name), None, autopar.Cluster.preset("cpu", devices=devices), trace=trace,
                          batching="chunked", prefill_chunk=8, constraints=pins, dtype="fp32")


def test_a_chunked_plan_builds_the_engine_with_its_chunk():
    plan = _chunked_plan(1)
    assert plan.predictions["batching"] == "chunked" and plan.predictions["prefill_chunk"] == 8
    engine = IterationEngine.from_plan(_model("hf_llama"), plan)
    assert engine.chunk == 8 and engine.slots == plan.batch_size
    assert IterationEngine.from_plan(_model("hf_llama"), _continuous_plan(1)).chunk is None


def _chunked_rank(rank, world, plan_json, name):
    """One rank of a chunked plan, rank 0 leading and the others following: rank 0 returns the
    tokens and chunks of each request; every rank the most tokens one of its iterations ran."""
    plan = InferencePlan.from_json(plan_json)
    engine = IterationEngine.from_plan(_model(name), plan)
    assert engine.chunk == plan.predictions["prefill_chunk"]
    engine.slots, engine.prompt_len, engine.max_new_tokens, engine.kv_tokens, engine.chunk = 3, 12, 7, None, CHUNK
    spent = _count_tokens(engine)
    if rank > 0:
        return follow_iterations(engine), spent
    leader = LeaderIterations(engine)
    seqs, log = _serve_staggered(leader, CHUNKED)
    leader.stop()
    return [s.tokens for s in seqs], [s.chunks for s in seqs], spent, engine.iterations, max(r for r, _ in log)


@pytest.mark.slow
@pytest.mark.parametrize("name, pins", [("hf_llama", {"tp": 2}), ("hf_gpt2", {"tp": 2}),
                                        ("hf_llama", {"tp": 1, "pp": 2})])
def test_chunked_prefill_on_ranks_equals_generate_alone(name, pins):
    """tp=2: both ranks run the same chunks; pp=2: each virtual engine's turn has its own budget."""
    plan = _chunked_plan(2, name, **pins)
    assert (plan.tp, plan.pp) == (pins["tp"], pins.get("pp", 1))
    results = run_local(_chunked_rank, 2, args=(plan.to_json(), name), timeout=300)
    tokens, chunks, spent, iterations, most = results[0]
    model = _model(name)
    assert tokens == [_alone(model, p, n) for p, n in CHUNKED]
    _check_chunked(chunks, spent)
    assert results[1][0] == iterations and max(results[1][1].values()) == CHUNK
    assert most >= (4 if plan.pp > 1 else 2)   # pp=2: more running than one virtual engine's 3 slots
