"""Request traces (autopar/inference/trace.py): loading Vidur's CSV format, synthetic traces, the
serving simulation on cases computed by hand, and the planner and CLI on a trace."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import autopar
from autopar.cli import main
from autopar.errors import PlanError
from autopar.inference.inference_plan import summary
from autopar.inference.continuous import simulate_continuous
from autopar.inference.inference_plan import InferencePlan
from autopar.inference.planner import plan_inference
from autopar.inference.trace import BUCKET, RequestTrace, load_trace, simulate, synthetic_trace
from autopar.models import hf


def _csv(tmp_path, rows, header="arrived_at,num_prefill_tokens,num_decode_tokens"):
    p = tmp_path / "trace.csv"
    p.write_text(header + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows))
    return p


def test_load_trace_reads_vidurs_format_and_refuses_bad_files(tmp_path):
    t = load_trace(_csv(tmp_path, [(1.5, 100, 20), (2.0, 300, 5), (4.5, 50, 1)]))
    assert len(t) == 3 and t.arrivals.tolist() == [0.0, 0.5, 3.0]   # from the first arrival
    assert t.prompt_lens.tolist() == [100, 300, 50] and t.output_lens.tolist() == [20, 5, 1]
    assert t.stats()["rate"] == pytest.approx(2 / 3.0) and t.stats()["prompt"]["max"] == 300
    with pytest.raises(PlanError, match="num_decode_tokens"):
        load_trace(_csv(tmp_path, [(0, 1)], header="arrived_at,num_prefill_tokens"))
    with pytest.raises(PlanError, match="in order"):
        load_trace(_csv(tmp_path, [(2, 1, 1), (1, 1, 1)]))
    with pytest.raises(PlanError, match="at least one token"):
        load_trace(_csv(tmp_path, [(0, 0, 1)]))
    with pytest.raises(PlanError, match="cannot read"):
        load_trace(tmp_path / "missing.csv")


def test_synthetic_trace_has_the_rate_and_lengths_asked():
    t = synthetic_trace(4000, rate=5.0, prompt_lens=[100, 200], output_lens=[10], seed=1)
    assert t.stats()["rate"] == pytest.approx(5.0, rel=0.05)
    assert set(t.prompt_lens.tolist()) == {100, 200} and set(t.output_lens.tolist()) == {10}


def _flat(prefill_s=1.0, step_s=0.1):
    calls = []

    def prefill(batch, prompt):
        calls.append(("prefill", batch, prompt))
        return prefill_s

    def decode(batch, context):
        calls.append(("decode", batch, context))
        return step_s
    return prefill, decode, calls


def test_one_request_waits_only_for_its_prefill():
    prefill, decode, calls = _flat()
    out = simulate(RequestTrace(np.array([0.0]), np.array([100]), np.array([11])), prefill, decode, 1, 4)
    assert out["ttft"]["p50"] == pytest.approx(1.0)
    assert out["latency"]["p50"] == pytest.approx(1.0 + 10 * 0.1)   # the first token, then 10 steps
    assert out["tpot"]["p50"] == pytest.approx(0.1)
    assert ("prefill", 1, BUCKET * 2) in calls   # the prompt priced rounded up to the bucket


def test_requests_arriving_together_share_a_batch_and_later_ones_queue():
    prefill, decode, calls = _flat()
    t = RequestTrace(np.array([0.0, 0.0, 0.5]), np.array([10, 10, 10]), np.array([1, 1, 1]))
    out = simulate(t, prefill, decode, replicas=1, batch_size=2)
    ttft = out["arrays"]["ttft"]
    assert ttft.tolist() == pytest.approx([1.0, 1.0, 1.5])   # the third waits for the replica: 1.0 - 0.5 + 1.0
    assert ("prefill", 2, BUCKET) in calls
    two = simulate(t, prefill, decode, replicas=2, batch_size=1)   # two replicas: the second serves at once
    assert two["arrays"]["ttft"].tolist() == pytest.approx([1.0, 1.0, 1.5])
    assert simulate(t, prefill, decode, replicas=3, batch_size=1)["arrays"]["ttft"].tolist() == \
        pytest.approx([1.0, 1.0, 1.0])


def _model():
    return hf.hf_llama(vocab=64)[0].model


def test_plan_on_a_trace_records_its_percentiles_and_refuses_what_it_cannot_serve(tmp_path):
    cl = autopar.Cluster.preset("dgx-a100", nodes=1)
    slow = synthetic_trace(200, rate=2.0, prompt_lens=[64, 256], output_lens=[16, 64], seed=0)
    p = plan_inference(_model(), None, cl, trace=slow, slo={"ttft": "2s", "tpot": "200ms"})
    assert p.prompt_len == 256 and p.max_new_tokens == 64
    served = p.predictions["served"]
    assert p.predictions["ttft"] == served["ttft"]["p90"] <= 2.0 and p.predictions["tpot"] == served["tpot"]["p99"]
    assert p.predictions["trace"]["requests"] == 200
    with pytest.raises(PlanError, match="serves the trace"):
        plan_inference(_model(), None, cl, trace=slow, slo={"ttft": "1us"})
    with pytest.raises(PlanError, match="longest output"):
        plan_inference(_model(), None, cl, trace=slow, max_new_tokens=8)


def test_plan_inference_cli_takes_a_trace(tmp_path, capsys):
    rows = [(0.1 * i, 32 + i, 8) for i in range(20)]
    path = _csv(tmp_path, rows)
    assert main(["plan-inference", "hf_llama", "--cluster", "dgx-a100", "--trace", str(path),
                 "--slo", "ttft=2s", "-o", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "20 requests" in out and "served (simulated)" in out


def test_slo_percentile_is_configurable_and_needs_a_trace():
    cl = autopar.Cluster.preset("dgx-a100", nodes=1)
    tr = synthetic_trace(200, rate=2.0, prompt_lens=[64, 256], output_lens=[16, 64], seed=0)
    p = plan_inference(_model(), None, cl, trace=tr, slo={"ttft_p50": "2s", "tpot_p90": "200ms"})
    assert p.predictions["percentiles"] == {"ttft": "p50", "tpot": "p90"}
    assert p.predictions["ttft"] == p.predictions["served"]["ttft"]["p50"] <= 2.0
    assert "slo binds" in summary(p) and "TTFT P50" in summary(p)
    p95 = plan_inference(_model(), None, cl, trace=tr, slo={"ttft_p95": "2s"})   # not precomputed: from the arrays
    assert p95.predictions["percentiles"]["ttft"] == "p95" and p95.predictions["ttft"] <= 2.0
    with pytest.raises(PlanError, match="applies to a trace"):
        plan_inference(_model(), torch.zeros(1, 8, dtype=torch.long), cl, max_new_tokens=4, slo={"ttft_p90": "2s"})
    with pytest.raises(PlanError, match="not known"):
        plan_inference(_model(), None, cl, trace=tr, slo={"ttft_q90": "2s"})


def test_a_faster_trace_gets_bigger_batches():
    # the tiny model is served by 8 replicas of tp=1 at any rate; a thousand times the arrivals fill batches
    cl = autopar.Cluster.preset("dgx-a100", nodes=1)
    base = synthetic_trace(300, rate=1.0, prompt_lens=[512, 2048], output_lens=[64, 256], seed=1)
    slo = {"ttft": "2s", "tpot": "200ms"}
    slow = plan_inference(_model(), None, cl, trace=base, slo=slo)
    fast = plan_inference(_model(), None, cl, trace=base.scaled(1000.0), slo=slo)
    assert fast.predictions["ttft"] <= 2.0 and fast.predictions["tpot"] <= 0.2
    assert (slow.dp, slow.batch_size) == (8, 1) and fast.dp == 8 and fast.batch_size > slow.batch_size


def test_a_busy_replica_still_waits_batch_wait_like_the_batcher():
    # the batcher's deadline runs from when it takes the first request (here when the replica frees at 1.0 s)
    tr = RequestTrace(np.array([0.0, 0.5, 1.02]), np.array([8, 8, 8]), np.array([1, 1, 1]))
    sim = simulate(tr, lambda b, s: 1.0, lambda b, c: 0.1, 1, 4, batch_wait=0.05)
    # request 0 waits 50 ms then 1 s of prefill; the replica frees at 1.05 and takes request 1, waits to 1.10,
    # and request 2 (1.02) joins it
    assert sim["arrays"]["ttft"].tolist() == pytest.approx([1.05, 1.05 + 0.05 + 1.0 - 0.5, 2.10 - 1.02])


# continuous batching (autopar/inference/continuous.py): prefill 1 s per request, 0.1 s per decode step


def test_continuous_a_later_request_joins_at_the_next_iteration():
    tr = RequestTrace(np.array([0.0, 0.35]), np.array([10, 10]), np.array([11, 3]))
    sim = simulate_continuous(tr, *_flat()[:2], replicas=1, batch_size=4)
    # request 0: prefill to 1.0, one decode step to 1.1; request 1 (arrived at 0.35 during the prefill) joins
    # then: its prefill to 2.1 (request 0 paused), two steps together to 2.3; request 0's last 7 steps to 3.0
    assert sim["arrays"]["ttft"].tolist() == pytest.approx([1.0, 2.1 - 0.35])
    assert sim["arrays"]["latency"].tolist() == pytest.approx([3.0, 2.3 - 0.35])
    assert sim["arrays"]["tpot"].tolist() == pytest.approx([(3.0 - 1.0) / 10, 0.1])
    static = simulate(tr, *_flat()[:2], replicas=1, batch_size=4)   # request 1 waits for request 0's batch
    assert static["arrays"]["ttft"].tolist() == pytest.approx([1.0, 2.0 + 1.0 - 0.35])


def test_continuous_a_long_request_does_not_hold_short_ones_back():
    tr = RequestTrace(np.zeros(3), np.array([10, 10, 10]), np.array([101, 2, 2]))
    prefill, decode, calls = _flat()
    sim = simulate_continuous(tr, prefill, decode, replicas=1, batch_size=2)
    # 0 and 1 prefill one after the other (2 s), one step and 1 leaves at 2.1; 2 takes its slot: prefill to
    # 3.1, one step to 3.2; request 0's other 98 steps end at 13.0
    assert sim["arrays"]["ttft"].tolist() == pytest.approx([2.0, 2.0, 3.1])
    assert sim["arrays"]["latency"].tolist() == pytest.approx([13.0, 2.1, 3.2])
    assert ("prefill", 1, BUCKET) in calls and ("decode", 2, BUCKET) in calls   # own prompts, no padding
    static = simulate(tr, *_flat()[:2], replicas=1, batch_size=2)   # request 2 waits for the 101-token batch
    assert static["arrays"]["ttft"][2] == pytest.approx(1.0 + 100 * 0.1 + 1.0)


def test_continuous_one_request_is_served_as_static():
    tr = RequestTrace(np.array([0.0]), np.array([100]), np.array([11]))
    static = simulate(tr, *_flat()[:2], 1, 4)
    cont = simulate_continuous(tr, *_flat()[:2], 1, 4)
    for k in ("ttft", "tpot", "latency"):
        assert cont[k] == pytest.approx(static[k])
    assert cont["tokens_per_s"] == pytest.approx(static["tokens_per_s"])
    one = simulate_continuous(RequestTrace(np.array([0.0]), np.array([8]), np.array([1])), *_flat()[:2], 1, 4)
    assert one["arrays"]["latency"].tolist() == pytest.approx([1.0]) and one["tpot"]["p50"] == 0.0


def test_continuous_shares_one_queue_over_replicas_and_keeps_to_the_kv_budget():
    tr = RequestTrace(np.array([0.0, 0.0, 0.5]), np.array([10, 10, 10]), np.array([1, 1, 1]))
    two = simulate_continuous(tr, *_flat()[:2], replicas=2, batch_size=1)   # as static: the third waits to 1.0
    assert two["arrays"]["ttft"].tolist() == pytest.approx([1.0, 1.0, 1.5])
    both = RequestTrace(np.zeros(2), np.array([10, 10]), np.array([11, 11]))   # 21 KV tokens each
    sim = simulate_continuous(both, *_flat()[:2], replicas=1, batch_size=4, kv_tokens=30)
    assert sim["arrays"]["ttft"].tolist() == pytest.approx([1.0, 3.0])   # the second after the first ends at 2.0
    assert simulate_continuous(both, *_flat()[:2], 1, 4, kv_tokens=42)["arrays"]["ttft"].tolist() == \
        pytest.approx([2.0, 2.0])
    with pytest.raises(PlanError, match="KV-cache tokens"):
        simulate_continuous(both, *_flat()[:2], 1, 4, kv_tokens=20)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_continuous_ttft_p90_is_no_worse_than_static_on_long_tailed_outputs(seed):
    rng = np.random.default_rng(seed)
    outputs = np.minimum(rng.pareto(1.2, 500) * 20 + 1, 2000).astype(int)   # mostly short, a few very long
    tr = synthetic_trace(600, rate=4.0, prompt_lens=rng.integers(16, 2048, 500), output_lens=outputs, seed=seed)

    def prefill(b, s):
        return 2e-3 + 2e-6 * b * s

    def decode(b, c):
        return 8e-3 + 1e-5 * b + 1e-8 * b * c
    for replicas, batch in ((1, 8), (2, 4), (4, 16)):
        static = simulate(tr, prefill, decode, replicas, batch)
        cont = simulate_continuous(tr, prefill, decode, replicas, batch)
        assert cont["ttft"]["p90"] <= static["ttft"]["p90"]
        assert cont["latency"]["p90"] <= static["latency"]["p90"]


def test_plan_inference_takes_the_batching_policy(tmp_path, capsys):
    cl = autopar.Cluster.preset("dgx-a100", nodes=1)
    tr = synthetic_trace(200, rate=2.0, prompt_lens=[64, 256], output_lens=[16, 64], seed=0)
    slo = {"ttft": "2s", "tpot": "200ms"}
    static = plan_inference(_model(), None, cl, trace=tr, slo=slo)
    cont = plan_inference(_model(), None, cl, trace=tr, slo=slo, batching="continuous")
    assert static.predictions["batching"] == "static" and cont.predictions["batching"] == "continuous"
    assert cont.predictions["ttft"] == cont.predictions["served"]["ttft"]["p90"] <= 2.0
    assert "continuous batching" in summary(cont)
    with pytest.raises(ValueError, match="'static', 'continuous'"):
        plan_inference(_model(), None, cl, trace=tr, batching="dynamic")
    path = _csv(tmp_path, [(0.1 * i, 32 + i, 8) for i in range(20)])
    assert main(["plan-inference", "hf_llama", "--cluster", "dgx-a100", "--trace", str(path),
                 "--batching", "continuous", "-o", str(tmp_path / "p.json")]) == 0
    assert "continuous batching" in capsys.readouterr().out
    assert InferencePlan.load(tmp_path / "p.json").predictions["batching"] == "continuous"


def test_continuous_plans_pool_the_kv_cache():
    # a memory budget that holds few longest contexts: static batches are bounded by them, continuous
    # batching by the tokens the requests hold
    cl = autopar.Cluster.preset("dgx-a100", nodes=1)
    tr = synthetic_trace(300, rate=50.0, prompt_lens=[32] * 9 + [2000], output_lens=[8] * 9 + [500], seed=0)
    pins = {"tp": 1, "batch_size": 64}
    budget = "40MiB"
    with pytest.raises(autopar.errors.MemoryBudgetError):
        plan_inference(_model(), None, cl, trace=tr, constraints=pins, memory_budget=budget)
    p = plan_inference(_model(), None, cl, trace=tr, constraints=pins, memory_budget=budget, batching="continuous")
    tokens = p.predictions["kv_cache_tokens_per_replica"]
    assert 2500 <= tokens < 64 * 2500 and p.predictions["memory_per_rank"] <= 40 * 2**20
    with pytest.raises(PlanError, match="applies to serving a trace"):
        plan_inference(_model(), torch.zeros(1, 8, dtype=torch.long), cl, max_new_tokens=4, batching="continuous")


# pipeline stages in flight (simulate_continuous(stages=), Pricer.decode_in_flight)


def test_continuous_two_stages_in_flight_serve_twice_the_tokens_at_the_same_time_per_token():
    # 4 requests at 0, prompt 10, output 11, batch 1; prefill 1 s, 0.1 s a step (a micro-batch's iteration
    # with the other in flight: its pass through both stages)
    tr = RequestTrace(np.zeros(4), np.full(4, 10), np.full(4, 11))
    one = simulate_continuous(tr, *_flat()[:2], replicas=1, batch_size=1)
    # one batch at a time: each request 1 s prefill + 10 steps, one after the other
    assert one["arrays"]["ttft"].tolist() == pytest.approx([1.0, 3.0, 5.0, 7.0])
    assert one["tokens_per_s"] == pytest.approx(44 / 8.0)
    two = simulate_continuous(tr, *_flat()[:2], replicas=1, batch_size=1, stages=2)
    # two micro-batches in flight: requests 0 and 1 together to 2.0, then 2 and 3 to 4.0
    assert two["arrays"]["ttft"].tolist() == pytest.approx([1.0, 1.0, 3.0, 3.0])
    assert two["arrays"]["latency"].tolist() == pytest.approx([2.0, 2.0, 4.0, 4.0])
    assert two["tokens_per_s"] == pytest.approx(2 * one["tokens_per_s"])
    assert two["arrays"]["tpot"].tolist() == pytest.approx(one["arrays"]["tpot"].tolist())   # 0.1 s each
    # the KV pool is shared out: 21 tokens a request, 42 a replica is 21 a micro-batch
    assert simulate_continuous(tr, *_flat()[:2], 1, 4, kv_tokens=42, stages=2)["tokens_per_s"] == \
        pytest.approx(two["tokens_per_s"])
    with pytest.raises(PlanError, match="shared by its 2 micro-batches"):
        simulate_continuous(tr, *_flat()[:2], 1, 4, kv_tokens=41, stages=2)


def test_continuous_pp2_plan_keeps_stages_in_flight_and_pp1_is_unchanged():
    from autopar.inference.inference_cost import Pricer
    from autopar.inference.model_shape import ModelShape
    from autopar.models.hf_config import from_hf_config
    from tests.inference.test_inference_planner import LLAMA3_70B
    model = from_hf_config(dict(LLAMA3_70B), seq=16, batch=1)
    cl = autopar.Cluster.preset("dgx-h100", nodes=1)
    price = Pricer(cl, ModelShape.of(model), "bf16")
    busy = synthetic_trace(300, rate=40.0, prompt_lens=[128, 512], output_lens=[64, 128], seed=0)   # saturating
    for pp in (1, 2):
        pins = {"tp": 2, "pp": pp, "batch_size": 8}
        plan = plan_inference(model, None, cl, trace=busy, constraints=pins, batching="continuous")
        tokens = plan.predictions["kv_cache_tokens_per_replica"]
        at_a_time = simulate_continuous(busy, lambda b, s: price.prefill(2, pp, b, s),
                                        lambda b, c: price.decode(2, pp, b, c), plan.dp, 8, kv_tokens=tokens)
        ratio = plan.predictions["tokens_per_s"] / at_a_time["tokens_per_s"]
        tpot = plan.predictions["served"]["tpot"]["p50"] / at_a_time["tpot"]["p50"]
        if pp == 1:   # one stage: the plan is the one-batch-at-a-time simulation itself
            assert ratio == pytest.approx(1.0) and tpot == pytest.approx(1.0)
        else:   # two micro-batches in flight: twice the tokens, each request's time per token as before
            assert 1.8 < ratio < 2.05 and tpot == pytest.approx(1.0, rel=0.05)


def test_continuous_search_takes_stages_where_static_cannot_use_them():
    # a budget the 2-layer model's tp=1 rank holds only with its layers on two stages: under continuous
    # batching pp is searched (stages in flight serve), under static batching only a pin sets it
    cl = autopar.Cluster.preset("dgx-a100", nodes=1)
    tr = synthetic_trace(200, rate=2.0, prompt_lens=[64, 256], output_lens=[16, 64], seed=0)
    p = plan_inference(_model(), None, cl, trace=tr, constraints={"tp": 1}, memory_budget="650KiB",
                       batching="continuous")
    assert p.pp == 2 and p.dp == 4 and p.stages == [[0, 1], [1, 2]]
    assert "1 sequences per micro-batch, 2 in flight per replica" in summary(p)
    with pytest.raises(autopar.errors.MemoryBudgetError):
        plan_inference(_model(), None, cl, trace=tr, constraints={"tp": 1}, memory_budget="650KiB")
    # with memory to spare, one stage and more replicas serve as many tokens at a lower latency (a tie goes
    # to the fewer stages)
    assert plan_inference(_model(), None, cl, trace=tr, constraints={"tp": 1}, batching="continuous").pp == 1
