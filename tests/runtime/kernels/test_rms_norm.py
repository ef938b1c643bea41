"""RMSNorm kernels against rms_norm_reference: outputs and gradients, fp32 and bf16, with and
without the fused residual, odd sizes, a non-contiguous input.

Tolerances: fp32 1e-5 (abs and rel); bf16 outputs 2 bf16 ulps (rtol 2e-2, atol 2e-2: the
interpreter rounds fp32 -> bf16 by truncation, CUDA to nearest), bf16 weight gradients (a sum
over the rows of bf16-rounded terms) rtol 5e-2, atol 5e-2."""
from __future__ import annotations

import pytest
import torch

from runtime.kernels import kernel_stats, reset_kernel_stats
from runtime.kernels.rms_norm import rms_norm, rms_norm_reference

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
TOL_DW = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}


def _check(x, w, residual, eps=1e-6):
    inputs = [x, w] + ([residual] if residual is not None else [])
    out = rms_norm(x, w, eps, residual)
    ref = rms_norm_reference(x, w, eps, residual)
    out = out if isinstance(out, tuple) else (out,)
    ref = ref if isinstance(ref, tuple) else (ref,)
    for o, r in zip(out, ref):
        assert o.dtype == r.dtype and o.shape == r.shape
        torch.testing.assert_close(o, r, **TOL[x.dtype])
    g = [torch.randn_like(r) for r in ref]
    got = torch.autograd.grad(out, inputs, g)
    want = torch.autograd.grad(ref, inputs, g)
    names = ["dx", "dw", "dresidual"]
    for name, a, b in zip(names, got, want):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, **(TOL_DW if name == "dw" else TOL)[x.dtype], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("weight_fp32", [False, True])
def test_rms_norm_matches_reference(device, dtype, residual, weight_fp32):
    torch.manual_seed(0)
    reset_kernel_stats()
    x = torch.randn(100, 67, device=device, dtype=dtype, requires_grad=True)   # 67: not a power of 2
    w = (1 + 0.1 * torch.randn(67, device=device)).to(torch.float32 if weight_fp32 else dtype).requires_grad_()
    r = torch.randn(100, 67, device=device, dtype=dtype, requires_grad=True) if residual else None
    _check(x, w, r)
    assert kernel_stats()["rms_norm"] == 2   # forward and backward ran the kernels


def test_rms_norm_non_contiguous_3d_input(device):
    torch.manual_seed(1)
    base = torch.randn(67, 5, 20, device=device)
    x = base.permute(1, 2, 0).requires_grad_()   # [5, 20, 67], hidden dim strided
    assert not x.is_contiguous()
    w = torch.randn(67, device=device, requires_grad=True)
    reset_kernel_stats()
    _check(x, w, None)
    assert kernel_stats()["rms_norm"] == 2


def test_rms_norm_rejects_a_wrong_weight(device):
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(torch.randn(4, 8, device=device), torch.ones(7, device=device))
