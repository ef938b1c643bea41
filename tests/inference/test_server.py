"""The completions server (autopar/inference/server.py) on loopback, in process: OpenAI's request
and answer shapes, concurrent requests batched into one generate call, the tokens equal to the
engine's own for the same prompt, clear 400s for what the plan cannot do, and serving on after a
failed batch."""
from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from autopar.inference.batcher import pad_left
from autopar.inference.server import Limits, make_app
from autopar.models.hf import hf_llama


class HFGenerate:
    """A one-process engine: Hugging Face's own greedy generate, counting its calls."""

    def __init__(self, model):
        self.model, self.calls, self.fail_next, self.sampling = model, [], False, []

    def __call__(self, input_ids, max_new_tokens, attention_mask, sampling=None):
        self.calls.append(tuple(input_ids.shape))
        self.sampling.append(sampling)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure")
        with torch.no_grad():
            return self.model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                       do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return hf_llama(vocab=64)[0].model.eval()


def _client(app):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def _with_app(app, fn):
    async with app.router.lifespan_context(app):
        async with _client(app) as client:
            return await fn(client)


def _limits():
    return Limits(prompt_len=8, max_new_tokens=6, max_batch=4, vocab_size=64)


def test_concurrent_requests_are_batched_and_equal_their_own_generate(model):
    engine = HFGenerate(model)
    app = make_app(engine, _limits(), batch_wait=0.2)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [1, 2]]

    async def run(client):
        rs = await asyncio.gather(*(client.post("/v1/completions", json={"prompt": p, "max_tokens": 4})
                                    for p in prompts))
        return [r.json() for r in rs], (await client.get("/metrics")).json()

    answers, metrics = asyncio.run(_with_app(app, run))
    assert len(engine.calls) == 1 and engine.calls[0][0] == 3        # one batch of the three
    assert metrics["batches"] == 1 and metrics["requests"] == 3 and metrics["tokens"] == 12
    for prompt, body in zip(prompts, answers):
        assert body["object"] == "text_completion"
        assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 4, "total_tokens": len(prompt) + 4}
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert body["choices"][0]["token_ids"] == alone[0, len(prompt):].tolist()


def test_one_request_with_several_prompts_gets_one_choice_each(model):
    engine = HFGenerate(model)
    app = make_app(engine, _limits(), batch_wait=0.05)

    async def run(client):
        return (await client.post("/v1/completions", json={"prompt": [[3, 4], [5, 6, 7]], "max_tokens": 2})).json()

    body = asyncio.run(_with_app(app, run))
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(len(c["token_ids"]) == 2 for c in body["choices"])
    assert len(engine.calls) == 1


@pytest.mark.parametrize("request_body, param, words", [
    ({"prompt": list(range(1, 10)), "max_tokens": 2}, "prompt", "prompt length 8"),
    ({"prompt": [1, 2], "max_tokens": 7}, "max_tokens", "KV cache"),
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens", "positive integer"),
    ({"prompt": [1, 2], "temperature": 3}, "temperature", "[0, 2]"),
    ({"prompt": [1, 2], "temperature": 1, "top_p": 0}, "top_p", "(0, 1]"),
    ({"prompt": [1, 2], "stream": True}, "stream", "not supported"),
    ({"prompt": [1, 99]}, "prompt", "vocabulary"),
    ({"prompt": "hello"}, "prompt", "tokenizer"),
    ({"max_tokens": 2}, "prompt", "required"),
    ({"prompt": []}, "prompt", "non-empty"),
])
def test_bad_requests_are_400_with_the_reason_and_the_server_goes_on(model, request_body, param, words):
    engine = HFGenerate(model)
    app = make_app(engine, _limits())

    async def run(client):
        bad = await client.post("/v1/completions", json=request_body)
        good = await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
        return bad, good

    bad, good = asyncio.run(_with_app(app, run))
    assert bad.status_code == 400
    err = bad.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and words in err["message"]
    assert good.status_code == 200 and len(good.json()["choices"][0]["token_ids"]) == 1
    assert len(engine.calls) == 1          # the bad request never reached the engine


def test_requests_sampling_differently_get_batches_of_their_own(model):
    engine = HFGenerate(model)
    app = make_app(engine, _limits(), batch_wait=0.2)
    bodies = [{"prompt": [1, 2], "max_tokens": 2}, {"prompt": [3, 4], "max_tokens": 2, "temperature": 0.8, "seed": 5},
              {"prompt": [5, 6], "max_tokens": 2}]

    async def run(client):
        return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

    answers = asyncio.run(_with_app(app, run))
    assert all(a.status_code == 200 for a in answers)
    assert sorted(engine.calls) == [(1, 2), (2, 2)]          # the two greedy requests together
    assert sorted(map(str, engine.sampling)) == sorted(map(str, [None, {"temperature": 0.8, "top_p": 1.0,
                                                                        "seed": 5}]))


def test_not_json_is_400():
    app = make_app(HFGenerate(None), _limits())

    async def run(client):
        return await client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})

    r = asyncio.run(_with_app(app, run))
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]


def test_a_failed_batch_is_a_500_and_the_next_request_is_served(model):
    engine = HFGenerate(model)
    engine.fail_next = True
    app = make_app(engine, _limits())

    async def run(client):
        first = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        second = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
        health = await client.get("/health")
        return first, second, health

    first, second, health = asyncio.run(_with_app(app, run))
    assert first.status_code == 500 and "injected failure" in first.json()["error"]["message"]
    assert second.status_code == 200 and len(second.json()["choices"][0]["token_ids"]) == 2
    assert health.json() == {"status": "ok"}


def test_pad_left_right_aligns_prompts_under_a_mask():
    ids, mask = pad_left([[1, 2, 3], [4]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
