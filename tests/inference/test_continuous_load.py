"""The continuous-batching load test (benchmarks/bench_inference.py ``--part continuous``): each
answer carries its measured timing; a small trace replayed at its arrival times against ``autopar
serve`` under a continuous and a static plan of that trace is answered in full, with finite positive
TTFT / TPOT percentiles, and continuous batching's TTFT P90 is not worse than static's."""
from __future__ import annotations

import asyncio
import math

import httpx
import pytest
import torch

from autopar.inference.iteration_engine import IterationEngine
from autopar.inference.server import Limits, make_app

torch.set_num_threads(1)

from test_iteration_engine import _model  # noqa: E402  (tests/inference is on the path)


def test_each_answer_carries_its_measured_timing():
    model = _model("hf_llama")
    engine = IterationEngine(model, slots=2, prompt_len=9, max_new_tokens=7)
    app = make_app(engine, Limits(prompt_len=9, max_new_tokens=7, max_batch=2, vocab_size=64), batching="continuous")

    async def run():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
                return await asyncio.gather(*(client.post("/v1/completions", json={"prompt": p, "max_tokens": n})
                                              for p, n in (([1, 2, 3], 5), ([4, 5], 1), ([6], 4))))

    many, one, four = (r.json()["choices"][0]["timing"] for r in asyncio.run(run()))
    for t in (many, one, four):
        assert 0 <= t["queued_s"] < t["ttft_s"]
    assert many["tpot_s"] > 0 and four["tpot_s"] > 0
    assert one["tpot_s"] is None   # one token: no time between tokens


@pytest.mark.slow
def test_a_trace_replayed_against_continuous_and_static_plans(tmp_path):
    import autopar
    from benchmarks.bench_inference import measured_percentiles, plan_for_trace, serve_and_replay, serve_trace
    trace = serve_trace(requests=12, rate=6.0, seed=1)
    cluster = autopar.Cluster.preset("cpu", devices=1)
    measured = {}
    for batching in ("continuous", "static"):
        plan = plan_for_trace(trace, 1, batching, 4, cluster)
        assert plan.predictions["batching"] == batching and plan.tp == 1 and plan.batch_size == 4
        answers = serve_and_replay(plan, tmp_path / f"{batching}.json", trace, 1)
        assert len(answers) == len(trace)
        for a, want in zip(answers, trace.output_lens.tolist()):
            # the random model may stop at its end-of-sequence token, said so
            assert a["tokens"] == want or (a["finish"] == "stop" and 1 <= a["tokens"] < want)
        pct = measured_percentiles(answers)
        for q in ("ttft", "tpot"):
            for v in pct[q].values():
                assert math.isfinite(v) and v > 0
            for v in plan.predictions["served"][q].values():
                assert math.isfinite(v) and v > 0
        measured[batching] = pct
    # requests arriving while a static batch decodes wait for all of it; under continuous batching
    # they join at the next iteration
    assert measured["continuous"]["ttft"]["p90"] <= measured["static"]["ttft"]["p90"], measured
