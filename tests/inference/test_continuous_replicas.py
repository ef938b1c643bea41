"""The completions server under continuous batching with data-parallel replicas (dp=2, tp=1, two
gloo ranks): ``serve`` on loopback, rank 0 assigning each request to a replica and both replicas
stepping each iteration (autopar/inference/iteration_engine.py ``LeaderIterations`` /
``follow_iterations``); concurrent requests of different lengths each get Hugging Face's
``generate`` of its prompt alone, both replicas run some, and a bad request is a 400 after which
the server goes on."""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
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


def _client(url, box):
    """Rank 0's client thread: waits for the server, asks, then stops it with SIGINT."""
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

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
