"""GeGLU kernels against geglu_reference: output and gradients, exact (erf) and tanh gelu, fp32
and bf16, an odd size (not a multiple of the block), non-contiguous inputs.

Tolerances: fp32 1e-5 (abs and rel); bf16 2 bf16 ulps (rtol 2e-2, atol 2e-2: torch rounds
gelu(gate) to bf16 before the product, the kernel does not; the interpreter rounds fp32 -> bf16
by truncation, CUDA to nearest)."""
from __future__ import annotations

import pytest
import torch

from runtime.kernels import kernel_stats, reset_kernel_stats
from runtime.kernels.geglu import BLOCK, geglu, geglu_reference

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _check(gate, up, approximate):
    y = geglu(gate, up, approximate)
    r = geglu_reference(gate, up, approximate)
    assert y.dtype == r.dtype and y.shape == r.shape
    torch.testing.assert_close(y, r, **TOL[gate.dtype])
    dy = torch.randn_like(r)
    got = torch.autograd.grad(y, [gate, up], dy)
    want = torch.autograd.grad(r, [gate, up], dy)
    for name, a, b in zip(("dgate", "dup"), got, want):
        torch.testing.assert_close(a, b, **TOL[gate.dtype], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_geglu_matches_reference(device, dtype, approximate):
    torch.manual_seed(0)
    reset_kernel_stats()
    gate = (3 * torch.randn(100, 67, device=device)).to(dtype).requires_grad_()   # tails of gelu included
    up = torch.randn(100, 67, device=device, dtype=dtype, requires_grad=True)
    assert gate.numel() % BLOCK != 0
    _check(gate, up, approximate)
    assert kernel_stats()["geglu"] == 2


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_geglu_non_contiguous_inputs(device, approximate):
    torch.manual_seed(1)
    gate = torch.randn(67, 100, device=device).t().requires_grad_()       # transposed view
    up = torch.randn(100, 134, device=device)[:, ::2].requires_grad_()   # strided view
    assert not gate.is_contiguous() and not up.is_contiguous()
    reset_kernel_stats()
    _check(gate, up, approximate)
    assert kernel_stats()["geglu"] == 2


def test_geglu_rejects_mismatched_shapes_and_bad_approximations(device):
    with pytest.raises(ValueError, match="differ"):
        geglu(torch.randn(4, 8, device=device), torch.randn(4, 7, device=device))
    with pytest.raises(ValueError, match="approximate"):
        geglu(torch.randn(4, 8, device=device), torch.randn(4, 8, device=device), "sigmoid")
