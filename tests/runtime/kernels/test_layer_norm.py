"""LayerNorm kernels against layer_norm_reference: output and gradients (dx, dweight, dbias),
fp32 and bf16, weight and bias in fp32 or x's dtype, an odd hidden size (not a power of 2, so
the block is masked), a non-contiguous input.

Tolerances: fp32 1e-5 (abs and rel), dweight / dbias 1e-4 (sums over rows); bf16 outputs and dx
2 bf16 ulps (rtol 2e-2, atol 2e-2: the interpreter rounds fp32 -> bf16 by truncation, CUDA to
nearest), bf16 dweight / dbias (sums over the rows of bf16-rounded terms) rtol 5e-2, atol 5e-2."""
from __future__ import annotations

import pytest
import torch

from runtime.kernels import kernel_stats, reset_kernel_stats
from runtime.kernels.layer_norm import layer_norm, layer_norm_reference

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
TOL_DW = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}


def _check(x, w, b, eps=1e-5):
    y = layer_norm(x, w, b, eps)
    r = layer_norm_reference(x, w, b, eps)
    assert y.dtype == r.dtype == x.dtype and y.shape == r.shape
    torch.testing.assert_close(y, r, **TOL[x.dtype])
    dy = torch.randn_like(r)
    got = torch.autograd.grad(y, [x, w, b], dy)
    want = torch.autograd.grad(r, [x, w, b], dy)
    for name, a, c in zip(("dx", "dweight", "dbias"), got, want):
        assert a.dtype == c.dtype, name
        torch.testing.assert_close(a, c, **(TOL if name == "dx" else TOL_DW)[x.dtype], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_fp32", [False, True])
def test_layer_norm_matches_reference(device, dtype, weight_fp32):
    torch.manual_seed(0)
    reset_kernel_stats()
    x = (2 + 3 * torch.randn(100, 67, device=device)).to(dtype).requires_grad_()   # 67: masked block; mean != 0
    wd = torch.float32 if weight_fp32 else dtype
    w = (1 + 0.1 * torch.randn(67, device=device)).to(wd).requires_grad_()
    b = (0.1 * torch.randn(67, device=device)).to(wd).requires_grad_()
    _check(x, w, b)
    assert kernel_stats()["layer_norm"] == 2   # forward and backward ran the kernels


def test_layer_norm_non_contiguous_3d_input(device):
    torch.manual_seed(1)
    x = torch.randn(67, 5, 20, device=device).permute(1, 2, 0).requires_grad_()   # [5, 20, 67], hidden strided
    assert not x.is_contiguous()
    w = torch.randn(67, device=device, requires_grad=True)
    b = torch.randn(67, device=device, requires_grad=True)
    reset_kernel_stats()
    _check(x, w, b)
    assert kernel_stats()["layer_norm"] == 2


def test_layer_norm_rejects_a_wrong_weight(device):
    with pytest.raises(ValueError, match="weight"):
        layer_norm(torch.randn(4, 8, device=device), torch.ones(7, device=device), torch.zeros(8, device=device))
