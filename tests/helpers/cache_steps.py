"""The one-process reference for the codegen inference steps' tests: ``CacheStep``'s own greedy
tokens over the whole (unsplit) cache, prompts padded to the runner's prefill length."""
from __future__ import annotations

import torch

from autopar.inference.codegen_step import empty_cache


def cache_step_reference(step, prompts: torch.Tensor, mask: torch.Tensor, prefill: int, max_len: int, new: int):
    """Greedy tokens [B, new] of ``step`` (a CacheStep) in one process and its final whole cache."""
    B, P = prompts.shape
    ids = torch.cat([prompts.new_zeros(B, prefill - P), prompts], 1)
    mask = torch.cat([mask.new_zeros(B, prefill - P), mask], 1)
    slots = torch.zeros(B, max_len, dtype=torch.long)
    slots[:, :prefill] = mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits, *cache = step(ids, pos, torch.arange(prefill), slots, *empty_cache(step.lm, B, max_len))
    tokens, last = [logits.argmax(-1)], pos[:, -1:]
    for t in range(new - 1):
        slots[:, prefill + t] = 1
        last = last + 1
        logits, *cache = step(tokens[-1][:, None], last, torch.tensor([prefill + t]), slots, *cache)
        tokens.append(logits.argmax(-1))
    return torch.stack(tokens, 1), cache


def reference_checked_against_hf(lm, step, prompts: torch.Tensor, mask: torch.Tensor, prefill: int, max_len: int,
                                 new: int):
    """``cache_step_reference``, after checking its tokens equal ``lm.generate``'s greedy ones (so
    the cache step itself is the model)."""
    with torch.no_grad():
        hf_tokens = lm.generate(prompts, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                pad_token_id=0)[:, prompts.shape[1]:]
        tokens, cache = cache_step_reference(step, prompts, mask, prefill, max_len, new)
    assert tokens.tolist() == hf_tokens.tolist()
    return tokens, cache
