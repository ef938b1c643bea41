"""The completions server under continuous batching (autopar/inference/batcher.py ``IterationBatcher``
over autopar/inference/iteration_engine.py): concurrent requests arriving at different times, with
different prompt and output lengths, run in shared iterations and each get Hugging Face's
``generate`` of its prompt alone; a bad request is a clear 400 and a failed iteration a 500 for its
requests, and the server goes on; ``autopar serve`` serves a continuous plan on one process and
on tp=2 gloo ranks, and refuses a dp=2 one with the reason; it serves a chunked plan (continuous
batching with chunked prefill) with the plan's chunk, on one process and tp=2 ranks."""
from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from autopar.cli import main
from autopar.errors import PlanError
from autopar.inference.iteration_engine import IterationEngine
from autopar.inference.server import Limits, make_app
from tests.helpers.serving import assert_served_like_generate

torch.set_num_threads(1)

from test_iteration_engine import _alone, _model  # noqa: E402  (tests/inference is on the path)


class FlakyEngine(IterationEngine):
    """An iteration engine that logs the sequences running before and after each step, whose steps
    take at least ``pace`` seconds (so requests a few milliseconds apart overlap), and whose next
    step fails when asked to."""
    fail_next = False
    pace = 0.0

    def step(self):
        time.sleep(self.pace)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure")
        before = {s.id for s in self.running}
        out = super().step()
        self.log = getattr(self, "log", []) + [(before, {s.id for s in self.running})]
        return out


@pytest.fixture(scope="module")
def model():
    return _model("hf_llama")


def _limits():
    return Limits(prompt_len=9, max_new_tokens=7, max_batch=3, vocab_size=64)


async def _with_app(app, fn):
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await fn(client)


REQUESTS = [([5, 6, 7], 6, 0.0), ([9, 10, 11, 12, 13, 14, 15], 3, 0.0), ([40, 41, 42, 43], 5, 0.02),
            ([3, 30, 31, 32, 33, 34, 35, 36, 37], 4, 0.05), ([7, 8], 7, 0.05), ([60], 2, 0.1),
            ([20, 21, 22, 23, 24], 6, 0.15)]


def test_concurrent_requests_join_the_running_batch_and_equal_generate_alone(model):
    engine = FlakyEngine(model, slots=3, prompt_len=9, max_new_tokens=7)
    engine.pace = 0.03
    app = make_app(engine, _limits(), batching="continuous")

    async def one(client, prompt, new, delay):
        await asyncio.sleep(delay)
        return await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": new})

    async def run(client):
        rs = await asyncio.gather(*(one(client, *r) for r in REQUESTS))
        return [r.json() for r in rs], (await client.get("/metrics")).json()

    answers, metrics = asyncio.run(_with_app(app, run))
    for (prompt, new, _), body in zip(REQUESTS, answers):
        choice = body["choices"][0]
        want = _alone(model, prompt, new)
        assert choice["token_ids"] == want
        assert choice["finish_reason"] == ("length" if len(want) == new else "stop")
        assert body["usage"]["prompt_tokens"] == len(prompt)
    assert metrics["requests"] == len(REQUESTS)
    assert metrics["batches"] >= 7                      # iterations, not one batch per request
    assert metrics["measured"]["requests_timed"] > 0 and metrics["measured"]["tpot"] > 0
    assert engine.iterations == metrics["batches"] and engine.idle
    assert any(before & after and after - before for before, after in engine.log)   # joined a running batch
    assert any(before & after and before - after for before, after in engine.log)   # left one that runs on


def test_requests_share_iterations_whatever_their_sampling(model):
    engine = IterationEngine(model, slots=4, prompt_len=9, max_new_tokens=7)
    app = make_app(engine, _limits(), batching="continuous")
    bodies = [{"prompt": [1, 2], "max_tokens": 5}, {"prompt": [3, 4], "max_tokens": 5, "temperature": 0.8, "seed": 5},
              {"prompt": [5, 6], "max_tokens": 5}]

    async def run(client):
        return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

    answers = asyncio.run(_with_app(app, run))
    assert all(a.status_code == 200 for a in answers)
    assert answers[0].json()["choices"][0]["token_ids"] == _alone(model, [1, 2], 5)
    assert answers[2].json()["choices"][0]["token_ids"] == _alone(model, [5, 6], 5)
    torch.manual_seed(5)
    assert answers[1].json()["choices"][0]["token_ids"] == _alone(model, [3, 4], 5, temperature=0.8, top_p=1.0)


@pytest.mark.parametrize("request_body, param, words", [
    ({"prompt": list(range(1, 11)), "max_tokens": 2}, "prompt", "prompt length 9"),
    ({"prompt": [1, 2], "max_tokens": 8}, "max_tokens", "KV cache"),
    ({"prompt": [1, 99]}, "prompt", "vocabulary"),
])
def test_a_bad_request_is_400_and_the_server_goes_on(model, request_body, param, words):
    engine = IterationEngine(model, slots=2, prompt_len=9, max_new_tokens=7)
    app = make_app(engine, _limits(), batching="continuous")

    async def run(client):
        good = [client.post("/v1/completions", json={"prompt": p, "max_tokens": 4}) for p in ([1, 2], [5, 6, 7])]
        rs = await asyncio.gather(client.post("/v1/completions", json=request_body), *good)
        return rs

    bad, *good = asyncio.run(_with_app(app, run))
    assert bad.status_code == 400
    err = bad.json()["error"]
    assert err["param"] == param and words in err["message"]
    for r, p in zip(good, ([1, 2], [5, 6, 7])):
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == _alone(model, p, 4)


def test_a_failed_iteration_is_a_500_and_the_next_request_is_served(model):
    engine = FlakyEngine(model, slots=2, prompt_len=9, max_new_tokens=7)
    engine.fail_next = True
    app = make_app(engine, _limits(), batching="continuous")

    async def run(client):
        first = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        second = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        return first, second

    first, second = asyncio.run(_with_app(app, run))
    assert first.status_code == 500 and "injected failure" in first.json()["error"]["message"]
    assert second.status_code == 200 and second.json()["choices"][0]["token_ids"] == _alone(model, [1, 2, 3], 2)


def test_continuous_batching_needs_an_iteration_engine():
    with pytest.raises(PlanError, match="IterationEngine"):
        make_app(lambda *a: None, _limits(), batching="continuous")
    with pytest.raises(PlanError, match="chunked batching needs an IterationEngine"):
        make_app(lambda *a: None, _limits(), batching="chunked")
    with pytest.raises(PlanError, match="not served"):
        make_app(lambda *a: None, _limits(), batching="paged")


def _trace(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                    + "".join(f"{0.2 * i},{2 + i % 6},{1 + i % 5}\n" for i in range(16)))
    return str(path)


def test_serve_refuses_batch_wait_under_a_continuous_plan(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["plan-inference", "hf_llama", "--trace", _trace(tmp_path), "--batching", "continuous",
                 "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["serve", "hf_llama", "--plan", str(out), "--batch-wait-ms", "50"]) == 2
    assert "--batch-wait-ms 50 applies to static batching" in capsys.readouterr().err


def _ask_concurrently(url, prompts, new):
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: httpx.post(f"{url}/v1/completions", json={"prompt": p, "max_tokens": new},
                                                  timeout=60).json(), prompts))


@pytest.mark.slow
@pytest.mark.parametrize("devices, pins, tp", [(1, [], 1), (2, ["--constraint", "tp=2"], 2),
                                               (2, ["--constraint", "tp=1", "--constraint", "dp=2"], 1)])
def test_autopar_serve_runs_a_continuous_plan(tmp_path, devices, pins, tp):
    """One process; tp=2 on two gloo ranks (rank 0 leading each iteration, rank 1 following); two
    replicas (dp=2: rank 0 assigns each request to a replica and gathers the finished ones)."""
    from autopar.inference.serve_process import serve_process
    from autopar.models.hf import hf_llama
    out = tmp_path / "p.json"
    assert main(["plan-inference", "hf_llama", "--devices", str(devices), *pins, "--constraint", "batch_size=4",
                 "--trace", _trace(tmp_path), "--batching", "continuous", "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["tp"] == tp and plan["dp"] == devices // tp and plan["batch_size"] == 4
    with serve_process(["hf_llama", "--devices", str(devices), "--plan", str(out)]) as url:
        prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [1, 2], [4]]
        answers = _ask_concurrently(url, prompts, 4)
        torch.manual_seed(0)   # the zoo factory's weights: the same seed and config as the server's
        ref_model = hf_llama()[0].model.eval()
        for p, a in zip(prompts, answers):
            want = ref_model.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False, pad_token_id=0)
            assert a["choices"][0]["token_ids"] == want[0, len(p):].tolist()
        bad = httpx.post(f"{url}/v1/completions", json={"prompt": [1] * (plan["prompt_len"] + 1)}, timeout=30)
        assert bad.status_code == 400 and "prompt length" in bad.json()["error"]["message"]
        again = _ask_concurrently(url, [[3, 4], [8, 9, 10]], 2)
        for p, a in zip([[3, 4], [8, 9, 10]], again):
            want = ref_model.generate(torch.tensor([p]), max_new_tokens=2, do_sample=False, pad_token_id=0)
            assert a["choices"][0]["token_ids"] == want[0, len(p):].tolist()
        metrics = httpx.get(f"{url}/metrics", timeout=10).json()
        assert metrics["requests"] == 6 and metrics["rejected"] == 1


def test_serve_collective_timeout_is_positive(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["plan-inference", "hf_llama", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["serve", "hf_llama", "--plan", str(out), "--collective-timeout", "0"]) == 2
    assert "positive number of seconds" in capsys.readouterr().err


FAILING_FACTORY = '''
import torch.distributed as dist

from autopar.inference.model_shape import causal_lm
from autopar.inference.pp_stages import decoder_layers
from autopar.models.hf import hf_llama


def failing_llama():
    """The zoo's tiny Llama, whose rank 1 raises in its second decoder layer at its third forward."""
    module, inputs = hf_llama()
    calls = []

    def boom(layer, args, output):
        if dist.is_initialized() and dist.get_rank() == 1:
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("injected failure on rank 1")
    decoder_layers(causal_lm(module))[1].register_forward_hook(boom)
    return module, inputs
'''


def test_autopar_serve_answers_503_then_stops_when_a_rank_fails_mid_forward(tmp_path):
    """tp=2 continuous through the CLI, with a 3 s --collective-timeout: rank 1 raises mid-forward;
    the requests in flight and a later one get 503 naming the failure, then the server stops (its
    launcher stops rank 0 within the timeout plus 5 s): no hang."""
    from autopar.inference.serve_process import serve_process
    factory = tmp_path / "failing.py"
    factory.write_text(FAILING_FACTORY)
    spec = f"{factory}:failing_llama"
    out = tmp_path / "p.json"
    assert main(["plan-inference", spec, "--devices", "2", "--constraint", "tp=2", "--constraint", "batch_size=4",
                 "--trace", _trace(tmp_path), "--batching", "continuous", "-o", str(out)]) == 0
    with serve_process([spec, "--devices", "2", "--plan", str(out), "--collective-timeout", "3"]) as url:
        start = time.monotonic()
        with ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda p: httpx.post(f"{url}/v1/completions", json={"prompt": p, "max_tokens": 5},
                                                         timeout=60), [[5, 6, 7], [9, 10], [1, 2, 3, 4]]))
        assert time.monotonic() - start < 15
        failed = [a for a in answers if a.status_code == 503]
        assert failed and all(a.status_code in (200, 503) for a in answers)
        message = failed[0].json()["error"]["message"]
        assert "out of step" in message and "restart autopar serve" in message
        later = httpx.post(f"{url}/v1/completions", json={"prompt": [4, 5], "max_tokens": 2}, timeout=30)
        assert later.status_code == 503 and "out of step" in later.json()["error"]["message"]
        deadline, down = time.monotonic() + 30, False
        while time.monotonic() < deadline and not down:   # the launcher stops the server: 3 + 5 s
            try:
                httpx.get(f"{url}/health", timeout=1)
                time.sleep(0.5)
            except httpx.HTTPError:
                down = True
        assert down, "the server still answers 30 s after a rank failed"


def _chunked_plan_file(tmp_path, devices=1, pins=(), chunk=4):
    out = tmp_path / "chunked.json"
    assert main(["plan-inference", "hf_llama", "--devices", str(devices), *pins, "--constraint", "batch_size=4",
                 "--trace", _trace(tmp_path), "--batching", "chunked", "--prefill-chunk", str(chunk),
                 "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["predictions"]["batching"] == "chunked" and plan["predictions"]["prefill_chunk"] == chunk
    return out, plan


def test_serve_builds_a_chunked_plan_engine_with_its_chunk(tmp_path, capsys, monkeypatch):
    import autopar.inference.server as server
    out, _ = _chunked_plan_file(tmp_path)
    served = {}
    monkeypatch.setattr(server, "serve", lambda engine, limits, **kw: served.update(engine=engine, **kw))
    capsys.readouterr()
    assert main(["serve", "hf_llama", "--plan", str(out)]) == 0
    assert "chunked batching (4 tokens an iteration)" in capsys.readouterr().out
    assert served["batching"] == "chunked" and isinstance(served["engine"], IterationEngine)
    assert served["engine"].chunk == 4 and served["engine"].slots == 4
    assert main(["serve", "hf_llama", "--plan", str(out), "--batch-wait-ms", "50"]) == 2
    assert "under the plan's chunked batching a request joins" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("devices, pins", [(1, []), (2, ["--constraint", "tp=2"])])
def test_autopar_serve_runs_a_chunked_plan(tmp_path, devices, pins):
    """Concurrent requests with prompts longer than the chunk of 4 tokens: prefilled over several
    iterations, each answer Hugging Face's generate of its prompt alone."""
    from autopar.inference.serve_process import serve_process
    out, plan = _chunked_plan_file(tmp_path, devices, pins)
    assert plan["prompt_len"] >= 7
    with serve_process(["hf_llama", "--devices", str(devices), "--plan", str(out)]) as url:
        prompts = [[5, 6, 7, 8, 9, 10, 11], [9, 10, 11, 12, 13], [1, 2], [4, 40, 41, 42, 43, 44]]
        assert_served_like_generate(url, prompts, [4, 2, 3, 1])
        metrics = httpx.get(f"{url}/metrics", timeout=10).json()
        assert metrics["requests"] == 4 and metrics["predicted"]["batching"] == "chunked"
