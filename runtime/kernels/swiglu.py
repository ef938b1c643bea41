"""SwiGLU as Triton kernels: silu(gate) * up, elementwise over the flattened tensors (masked
blocks, fp32 arithmetic, results in the inputs' dtype), and its backward. The autograd Function
saves only gate and up; ``swiglu_reference`` is the plain-torch formula.
"""
from __future__ import annotations

import torch

from runtime.kernels import gated_inputs, record_launch

try:
    import triton
    import triton.language as tl
except ImportError:   # the reference still works
    triton = None

BLOCK = 1024


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain torch: silu(gate) * up."""
    return torch.nn.functional.silu(gate) * up


if triton is not None:
    @triton.jit
    def _swiglu_fwd(G, U, Y, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-g))
        tl.store(Y + offs, (g * sig * u).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-g))
        silu = g * sig
        tl.store(DG + offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)
        tl.store(DU + offs, (dy * silu).to(DU.dtype.element_ty), mask=mask)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The forward kernel alone: silu(gate) * up, contiguous, shaped like gate."""
    g, u = gated_inputs("swiglu", gate, up)
    y = torch.empty_like(g)
    n = g.numel()
    if n:
        _swiglu_fwd[(triton.cdiv(n, BLOCK),)](g, u, y, n, BLOCK=BLOCK, num_warps=4)
        record_launch("swiglu")
    return y


def swiglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """The backward kernel alone: (d gate, d up)."""
    g, u = gate.contiguous(), up.contiguous()
    dy = dy.to(g.dtype).contiguous()
    dg = torch.empty_like(g)
    du = torch.empty_like(u)
    n = g.numel()
    if n:
        _swiglu_bwd[(triton.cdiv(n, BLOCK),)](dy, g, u, dg, du, n, BLOCK=BLOCK, num_warps=4)
        record_launch("swiglu")
    return dg.view(gate.shape), du.view(up.shape)


class SwiGLUFunction(torch.autograd.Function):
    """Autograd over the kernels; saves gate and up."""

    @staticmethod
    def forward(ctx, gate, up):
        y = swiglu_forward(gate, up)
        ctx.save_for_backward(gate.contiguous(), up.contiguous())
        return y

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        return swiglu_backward(dy, g, u)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up by the Triton kernels (same shape and dtype; any layout: non-contiguous
    inputs are copied contiguous). The result is contiguous."""
    return SwiGLUFunction.apply(gate, up)
