"""The fused AdamW step against torch.optim.AdamW (single tensor, foreach=False) on the same
tensors, over several steps: parameter and both moments. An odd size (not a multiple of the
block). Tolerance: rel 1e-5, abs 1e-6 (fp32; the kernel takes its scalars in fp32)."""
from __future__ import annotations

import pytest
import torch

from runtime.kernels import kernel_stats, reset_kernel_stats
from runtime.kernels.adamw import BLOCK, adamw_reference, adamw_step


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_matches_torch_optim(device, weight_decay):
    torch.manual_seed(0)
    n = 3001
    assert n % BLOCK != 0
    start = [torch.randn(n, device=device), torch.zeros(n, device=device), torch.zeros(n, device=device)]
    ours = [t.clone() for t in start]
    theirs = [t.clone() for t in start]
    reset_kernel_stats()
    kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    for step in (1, 2, 3):
        grad = torch.randn(n, device=device)
        p, m, v = ours
        adamw_step(p, grad.clone(), m, v, step=step, **kw)
        p, m, v = theirs
        adamw_reference(p, grad.clone(), m, v, step=step, **kw)
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert not torch.equal(ours[0], start[0])   # the step moved the parameter
    assert kernel_stats()["adamw"] == 3


def test_adamw_rejects_non_contiguous_or_bf16(device):
    p = torch.zeros(8, device=device)
    with pytest.raises(ValueError, match="contiguous fp32"):
        adamw_step(p, torch.zeros(16, device=device)[::2], p.clone(), p.clone(), lr=1e-3, step=1)
    with pytest.raises(ValueError, match="contiguous fp32"):
        adamw_step(p, p.bfloat16(), p.clone(), p.clone(), lr=1e-3, step=1)
