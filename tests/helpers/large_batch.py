"""The model and comparison the large-batch optimizer tests share (tests/execution/
test_large_batch_optimizers.py, test_optim_recipes.py): a tiny Llama whose every weight is scaled
by a ramp along each dim, so the blocks of a split tensor have different norms, and per-tensor
errors relative to the tensor's largest magnitude."""
from __future__ import annotations

import torch

from autopar.models import ZOO


def ramped_llama():
    """The zoo's tiny Llama (RMSNorm, GQA, SwiGLU), every weight scaled by a ramp along each
    of its dims (blocks of a split tensor get different norms)."""
    model, batch = ZOO["llama"]()
    with torch.no_grad():
        for p in model.parameters():
            for d, n in enumerate(p.shape):
                shape = [1] * p.dim()
                shape[d] = n
                p.mul_(torch.linspace(0.25, 2.0, n).view(shape))
    return model, batch


def rel_errors(sd, want) -> dict:
    """Per tensor: the largest elementwise difference relative to the tensor's largest magnitude
    (elementwise relative errors blow up where LAMB's m/sqrt(v) divides fp32 noise by tiny v)."""
    return {k: float((torch.as_tensor(sd[k]) - v).abs().max() / v.abs().max()) for k, v in want.items()}
