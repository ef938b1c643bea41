"""GeGLU as Triton kernels: gelu(gate) * up, elementwise over the flattened tensors (masked
blocks, fp32 arithmetic, results in the inputs' dtype), with the exact gelu (erf) or its tanh
approximation (``approximate="tanh"``, torch's), and its backward. The autograd Function saves only
gate and up; ``geglu_reference`` is the plain-torch formula.

    exact: gelu(g) = g * Phi(g),  Phi(g) = (1 + erf(g / sqrt 2)) / 2;  gelu'(g) = Phi(g) + g * exp(-g^2/2) / sqrt(2 pi)
    tanh:  gelu(g) = g (1 + t) / 2,  t = tanh(sqrt(2/pi) (g + 0.044715 g^3));
           gelu'(g) = (1 + t) / 2 + g (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 g^2) / 2
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
APPROXIMATIONS = ("none", "tanh")


def geglu_reference(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Plain torch: gelu(gate, approximate) * up."""
    return torch.nn.functional.gelu(gate, approximate=approximate) * up


if triton is not None:
    @triton.jit
    def _gelu_and_grad(g, TANH: tl.constexpr):
        """(gelu(g), gelu'(g)) in fp32."""
        if TANH:
            k = 0.7978845608028654   # sqrt(2 / pi)
            inner = k * (g + 0.044715 * g * g * g)
            inner = tl.minimum(tl.maximum(inner, -20.0), 20.0)   # tanh is +-1 in fp32 there; exp stays finite
            t = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0   # tanh(inner)
            y = 0.5 * g * (1.0 + t)
            d = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * g * g)
        else:
            cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
            y = g * cdf
            d = cdf + g * tl.exp(-0.5 * g * g) * 0.3989422804014327   # 1 / sqrt(2 pi)
        return y, d

    @triton.jit
    def _geglu_fwd(G, U, Y, n, TANH: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        y, _ = _gelu_and_grad(g, TANH)
        tl.store(Y + offs, (y * u).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _geglu_bwd(DY, G, U, DG, DU, n, TANH: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        y, d = _gelu_and_grad(g, TANH)
        tl.store(DG + offs, (dy * u * d).to(DG.dtype.element_ty), mask=mask)
        tl.store(DU + offs, (dy * y).to(DU.dtype.element_ty), mask=mask)


def _tanh(approximate: str) -> bool:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"geglu: approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    return approximate == "tanh"


def geglu_forward(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """The forward kernel alone: gelu(gate) * up, contiguous, shaped like gate."""
    tanh = _tanh(approximate)
    g, u = gated_inputs("geglu", gate, up)
    y = torch.empty_like(g)
    n = g.numel()
    if n:
        _geglu_fwd[(triton.cdiv(n, BLOCK),)](g, u, y, n, TANH=tanh, BLOCK=BLOCK, num_warps=4)
        record_launch("geglu")
    return y


def geglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, approximate: str = "none"):
    """The backward kernel alone: (d gate, d up)."""
    tanh = _tanh(approximate)
    g, u = gate.contiguous(), up.contiguous()
    dy = dy.to(g.dtype).contiguous()
    dg = torch.empty_like(g)
    du = torch.empty_like(u)
    n = g.numel()
    if n:
        _geglu_bwd[(triton.cdiv(n, BLOCK),)](dy, g, u, dg, du, n, TANH=tanh, BLOCK=BLOCK, num_warps=4)
        record_launch("geglu")
    return dg.view(gate.shape), du.view(up.shape)


class GeGLUFunction(torch.autograd.Function):
    """Autograd over the kernels; saves gate and up."""

    @staticmethod
    def forward(ctx, gate, up, approximate):
        y = geglu_forward(gate, up, approximate)
        ctx.save_for_backward(gate.contiguous(), up.contiguous())
        ctx.approximate = approximate
        return y

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        return (*geglu_backward(dy, g, u, ctx.approximate), None)


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(gate) * up by the Triton kernels (same shape and dtype; ``approximate`` "none" or
    "tanh" as torch's gelu; any layout: non-contiguous inputs are copied contiguous). The result
    is contiguous."""
    return GeGLUFunction.apply(gate, up, approximate)
