"""The completions server under continuous batching with data-parallel replicas (dp=2, tp=1, two
gloo ranks): ``serve`` on loopback, rank 0 assigning each request to a replica and both replicas
stepping each iteration (autopar/inference/iteration_engine.py ``LeaderIterations`` /
``follow_iterations``); concurrent requests of different lengths each get Hugging Face's
``generate`` of its prompt alone, both replicas run some, and a bad request is a 400 after which
the server goes on."""
from __future__ import annotations

import os
from datetime import timedelta
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from autopar.inference.inference_plan import InferencePlan
from autopar.inference.iteration_engine import IterationEngine
from autopar.inference.server import Limits, serve
from runtime.launch import run_local

torch.set_num_threads(1)

from test_iteration_engine import _alone, _continuous_plan, _model  # noqa: E402  (tests/inference is on the path)

PROMPTS = [([5, 6, 7], 6), ([9, 10, 11, 12, 13, 14, 15], 3), ([1, 2], 1), ([40, 41, 42, 43], 5),
           ([3, 30, 31, 32, 33, 34, 35, 36, 37], 4), ([7, 8], 7)]
AGAIN = [([20, 21, 22, 23, 24], 6), ([60], 2), ([4, 5], 3)]


class CountingEngine(IterationEngine):
    """An iteration engine that counts the sequences it finished (this rank's replica's share)."""
    finished_count = 0

    def step(self):
        out = super().step()
        self.finished_count += len(out)
        return out


def _wait_healthy(url, within: float = 120.0) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _client(url, box):
    """Rank 0's client thread: waits for the server, asks, then stops it with SIGINT."""
    try:
        _wait_healthy(url)

        def ask(request):
            (prompt, new), delay = request
            time.sleep(delay)
            r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": new}, timeout=120)
            return r.status_code, r.json()

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            box["first"] = list(pool.map(ask, [(p, 0.03 * (i % 3)) for i, p in enumerate(PROMPTS)]))
        bad = httpx.post(f"{url}/v1/completions", json={"prompt": [1] * 10, "max_tokens": 2}, timeout=30)
        box["bad"] = (bad.status_code, bad.json())
        with ThreadPoolExecutor(len(AGAIN)) as pool:
            box["again"] = list(pool.map(ask, [(p, 0.0) for p in AGAIN]))
        box["metrics"] = httpx.get(f"{url}/metrics", timeout=10).json()
    except Exception as e:  # noqa: BLE001 - reported by rank 0
        box["error"] = repr(e)
    finally:
        os.kill(os.getpid(), signal.SIGINT)


def _serve_rank(rank, world, plan_json, port):
    plan = InferencePlan.from_json(plan_json)
    engine = CountingEngine.from_plan(_model("hf_llama"), plan)
    engine.slots, engine.prompt_len, engine.max_new_tokens, engine.kv_tokens = 2, 9, 7, None
    limits = Limits(9, 7, 2 * plan.dp, vocab_size=64)
    box = {}
    if rank == 0:
        threading.Thread(target=_client, args=(f"http://127.0.0.1:{port}", box), daemon=True).start()
    try:
        serve(engine, limits, host="127.0.0.1", port=port, batching="continuous")
    except KeyboardInterrupt:   # uvicorn re-raises the SIGINT that stopped it, after leader.stop()
        pass
    return box, engine.finished_count


def test_serve_with_dp2_replicas_answers_concurrent_requests_and_goes_on_after_a_bad_one():
    from autopar.inference.serve_process import free_port
    plan = _continuous_plan(2, tp=1, dp=2)
    assert (plan.tp, plan.pp, plan.dp) == (1, 1, 2)
    results = run_local(_serve_rank, 2, args=(plan.to_json(), free_port()), timeout=300)
    box, mine = results[0]
    assert "error" not in box, box.get("error")
    model = _model("hf_llama")
    for (prompt, new), (status, body) in zip(PROMPTS + AGAIN, box["first"] + box["again"]):
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == _alone(model, prompt, new)
    status, body = box["bad"]
    assert status == 400 and "prompt length 9" in body["error"]["message"]
    assert box["metrics"]["requests"] == len(PROMPTS) + len(AGAIN) and box["metrics"]["rejected"] == 1
    theirs = results[1][1]
    assert mine > 0 and theirs > 0 and mine + theirs == len(PROMPTS) + len(AGAIN)   # both replicas served


# --- a rank that fails mid-forward: no hang, a 503 naming the failure --------------------------------

LONG = [([5, 6, 7], 6), ([20, 21, 22, 23, 24], 5), ([40, 41, 42, 43], 5)]   # none done by iteration 2
TIMEOUT_S = 4.0   # the process group's timeout here (autopar serve --collective-timeout; 120 s by default)


def _failing_client(url, box):
    """Rank 0's client: three staggered requests while rank ``fail`` raises mid-forward, then a
    later request and /health; every answer timed; then SIGINT stops the server."""
    try:
        _wait_healthy(url)

        def ask(request):
            (prompt, new), delay = request
            time.sleep(delay)
            start = time.monotonic()
            r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": new}, timeout=60)
            return r.status_code, r.json(), time.monotonic() - start

        with ThreadPoolExecutor(3) as pool:
            box["first"] = list(pool.map(ask, [(p, 0.02 * i) for i, p in enumerate(LONG)]))
        box["later"] = ask((([4, 5], 2), 0.0))
        health = httpx.get(f"{url}/health", timeout=10)
        box["health"] = (health.status_code, health.json())
    except Exception as e:  # noqa: BLE001 - reported by rank 0
        box["error"] = repr(e)
    finally:
        os.kill(os.getpid(), signal.SIGINT)


def _failing_rank(rank, world, plan_json, port, fail, batching):
    """A two-rank server (tp=2 or pp=2) whose rank ``fail`` raises at its third forward step in its
    second decoder layer (tp: between the layers' all-reduces) or its stage's first (pp); rank 0
    returns its client's answers, the other rank the error it stopped with."""
    from autopar.inference.engine import compile_inference
    from autopar.inference.iteration_ranks import RanksOutOfStep
    from autopar.inference.pp_stages import decoder_layers
    plan = InferencePlan.from_json(plan_json)
    if batching == "continuous":
        engine = IterationEngine.from_plan(_model("hf_llama"), plan, collective_timeout=timedelta(seconds=TIMEOUT_S))
        engine.slots, engine.prompt_len, engine.max_new_tokens, engine.kv_tokens = 2, 9, 7, None
    else:   # as autopar serve builds it
        engine = compile_inference(_model("hf_llama"), plan=plan, collective_timeout=timedelta(seconds=TIMEOUT_S))
    first = tuple(plan.stages[rank // plan.tp])[0] if plan.pp > 1 else 1
    if rank == fail:
        calls = []

        def boom(module, args, output):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError(f"injected failure on rank {rank}")
        decoder_layers(engine.model)[first].register_forward_hook(boom)
    box = {}
    if rank == 0:
        threading.Thread(target=_failing_client, args=(f"http://127.0.0.1:{port}", box), daemon=True).start()
    start = time.monotonic()
    try:
        serve(engine, Limits(9, 7, 2, vocab_size=64), host="127.0.0.1", port=port, batching=batching)
    except KeyboardInterrupt:
        pass
    except RanksOutOfStep as e:   # a rank other than 0: it stops (autopar serve then stops the server)
        return str(e), time.monotonic() - start
    return box


@pytest.mark.parametrize("tp, pp, fail, batching", [(2, 1, 1, "continuous"), (2, 1, 0, "continuous"),
                                                    (1, 2, 1, "continuous"), (2, 1, 1, "static")])
def test_a_rank_failing_mid_forward_is_a_503_for_in_flight_and_later_requests_not_a_hang(tp, pp, fail, batching):
    from autopar.inference.serve_process import free_port
    if batching == "continuous":
        plan = _continuous_plan(2, tp=tp, pp=pp)
    else:
        import autopar
        from autopar.inference.planner import plan_inference
        plan = plan_inference(_model("hf_llama"), torch.zeros(2, 9, dtype=torch.long),
                              autopar.Cluster.preset("cpu", devices=2), max_new_tokens=7,
                              constraints={"tp": tp, "pp": pp}, dtype="fp32")
    assert (plan.tp, plan.pp, plan.dp) == (tp, pp, 1)
    start = time.monotonic()
    results = run_local(_failing_rank, 2, args=(plan.to_json(), free_port(), fail, batching), timeout=120,
                        pg_timeout=TIMEOUT_S)
    took = time.monotonic() - start
    box, (stopped, _) = results
    assert "error" not in box, box.get("error")
    for status, body, seconds in box["first"]:   # in flight when the rank failed
        assert status == 503, [(s, b.get("choices", [{}])[0].get("token_ids"), t) for s, b, t in box["first"]]
        assert body["error"]["type"] == "service_unavailable"
        assert "out of step" in body["error"]["message"] and "restart autopar serve" in body["error"]["message"]
        assert seconds < 3 * TIMEOUT_S + 10
    if fail == 0:   # rank 0's own failure is named; rank 1 waited in the all-reduce, then timed out
        assert any("injected failure on rank 0" in body["error"]["message"] for _, body, _ in box["first"])
    status, body, seconds = box["later"]
    assert status == 503 and "out of step" in body["error"]["message"] and seconds < 2
    assert box["health"][0] == 503 and box["health"][1]["status"] == "failed"
    assert "RanksOutOfStep" not in stopped and "out of step" in stopped and "rank 1" in stopped
    if fail == 1:
        assert "injected failure on rank 1" in stopped
    assert took < 120
