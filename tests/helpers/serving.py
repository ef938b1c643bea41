"""Requests sent at once to a running ``autopar serve`` and checked against Hugging Face's
``generate`` of each prompt alone (the zoo's ``hf_llama`` weights, seed 0, as the server builds them);
``spread_model`` and ``generate_alone``, the engines' tests' model and reference."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import torch


def assert_served_like_generate(url: str, prompts: list[list[int]], news: list[int]) -> None:
    """POST every (prompt, max_tokens) to ``url``'s completions endpoint concurrently; each answer
    is 200 and its tokens are ``generate``'s greedy continuation of that prompt alone."""
    from autopar.models.hf import hf_llama
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda a: httpx.post(f"{url}/v1/completions",
                                                      json={"prompt": a[0], "max_tokens": a[1]}, timeout=120),
                                zip(prompts, news)))
    torch.manual_seed(0)   # the zoo factory's weights: the same seed and config as the server's
    ref = hf_llama()[0].model.eval()
    for p, n, a in zip(prompts, news, answers):
        assert a.status_code == 200, a.text
        want = ref.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0)
        assert a.json()["choices"][0]["token_ids"] == want[0, len(p):].tolist()


def spread_model(name: str = "hf_llama", vocab: int = 64):
    """A tiny zoo model (seed 0) whose weights are spread enough (std 0.2) that greedy tokens vary."""
    from autopar.models import hf
    torch.manual_seed(0)
    m = getattr(hf, name)(vocab=vocab)[0].model.eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    return m


def generate_alone(model, prompt: list[int], new: int, **sampling) -> list[int]:
    """Hugging Face's ``generate`` of ``prompt`` alone: its ``new`` tokens (greedy unless ``sampling``)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=new, do_sample=bool(sampling), pad_token_id=0, **sampling)
    return out[0, len(prompt):].tolist()


def fail_a_tick_after_admitting(engine) -> tuple:
    """On a pp > 1 iteration engine (either backend): two ticks of one request, then a second
    request added and the next tick failing in this rank's stage work after its turn admitted it.
    Returns (prompts the failing tick admitted, prompts the abort handed back, the two requests'
    prompts, whether the engine is idle after the abort); the engine's work is restored."""
    first = engine.add([5, 6, 7], 6)
    engine.step()
    engine.step()
    second = engine.add([9, 10, 11], 4)

    def boom(ve):
        raise RuntimeError("a stage failed mid-tick")
    engine._work = boom
    try:
        engine.step()
    except RuntimeError:
        pass
    admitted = [s.prompt for ve in engine.flights for s in (ve.admitted or [])]
    dropped = engine.abort()
    del engine._work
    return admitted, [s.prompt for s in dropped], first.prompt, second.prompt, engine.idle
