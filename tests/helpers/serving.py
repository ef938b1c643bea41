"""Requests sent at once to a running ``autopar serve`` and checked against Hugging Face's
``generate`` of each prompt alone (the zoo's ``hf_llama`` weights, seed 0, as the server builds them)."""
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
