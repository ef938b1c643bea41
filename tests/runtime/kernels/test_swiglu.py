"""SwiGLU kernels against swiglu_reference: output and gradients, fp32 and bf16, an odd size
(not a multiple of the block), non-contiguous inputs.

Tolerances: fp32 1e-5 (abs and rel); bf16 2 bf16 ulps (rtol 2e-2, atol 2e-2: the interpreter
rounds fp32 -> bf16 by truncation, CUDA to nearest)."""
from __future__ import annotations

import pytest
import torch

from runtime.kernels import kernel_stats, reset_kernel_stats
from runtime.kernels.swiglu import BLOCK, swiglu, swiglu_reference

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _check(gate, up):
    y = swiglu(gate, up)
    r = swiglu_reference(gate, up)
    assert y.dtype == r.dtype and y.shape == r.shape
    torch.testing.assert_close(y, r, **TOL[gate.dtype])
    dy = torch.randn_like(r)
    got = torch.autograd.grad(y, [gate, up], dy)
    want = torch.autograd.grad(r, [gate, up], dy)
    for name, a, b in zip(("dgate", "dup"), got, want):
        torch.testing.assert_close(a, b, **TOL[gate.dtype], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_reference(device, dtype):
    torch.manual_seed(0)
    reset_kernel_stats()
    gate = (3 * torch.randn(100, 67, device=device, dtype=dtype)).requires_grad_()
    up = torch.randn(100, 67, device=device, dtype=dtype, requires_grad=True)
    assert gate.numel() % BLOCK != 0
    _check(gate, up)
    assert kernel_stats()["swiglu"] == 2


def test_swiglu_non_contiguous_inputs(device):
    torch.manual_seed(1)
    gate = torch.randn(67, 100, device=device).t().requires_grad_()       # transposed view
    up = torch.randn(100, 134, device=device)[:, ::2].requires_grad_()   # strided view
    assert not gate.is_contiguous() and not up.is_contiguous()
    reset_kernel_stats()
    _check(gate, up)
    assert kernel_stats()["swiglu"] == 2


def test_swiglu_rejects_mismatched_shapes(device):
    with pytest.raises(ValueError, match="differ"):
        swiglu(torch.randn(4, 8, device=device), torch.randn(4, 7, device=device))
