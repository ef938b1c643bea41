"""Softmax over the last dim as Triton kernels (explicit, eager attention's scores [.., S_q, S_k],
after the model's own mask: masked_fill with -inf or an additive mask), and its backward.

Forward: one program per row, one block of next_power_of_2(n_cols) columns, fp32 arithmetic
(max-subtracted exp), y stored in x's dtype. A row that is all -inf gives NaN, as torch's softmax.
Backward: one program per row, dx = y * (dy - sum(dy * y)), from y alone: the autograd Function
saves only y. ``softmax_reference`` is torch's softmax in fp32 cast back to x's dtype.
"""
from __future__ import annotations

import torch

from runtime.kernels import check_device, num_warps_for, record_launch, row_block

try:
    import triton
    import triton.language as tl
except ImportError:   # the reference still works
    triton = None


def softmax_reference(x: torch.Tensor) -> torch.Tensor:
    """Plain torch: softmax over the last dim in fp32, cast to x's dtype."""
    return torch.softmax(x.float(), dim=-1).to(x.dtype)


def softmax_backward_reference(dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Plain torch: y * (dy - sum(dy * y, -1)) in fp32, cast to y's dtype."""
    yf, df = y.float(), dy.float()
    return (yf * (df - (df * yf).sum(-1, keepdim=True))).to(y.dtype)


if triton is not None:
    @triton.jit
    def _softmax_fwd(X, Y, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        offs = row * n_cols + cols
        x = tl.load(X + offs, mask=mask, other=float("-inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, axis=0))
        e = tl.where(mask, e, 0.0)
        tl.store(Y + offs, (e / tl.sum(e, axis=0)).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _softmax_bwd(DY, Y, DX, n_cols, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        offs = row * n_cols + cols
        y = tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        c = tl.sum(dy * y, axis=0)
        tl.store(DX + offs, (y * (dy - c)).to(DX.dtype.element_ty), mask=mask)


def softmax_forward(x: torch.Tensor) -> torch.Tensor:
    """The forward kernel alone: softmax of x over its last dim, contiguous, in x's dtype."""
    check_device(x)
    shape = x.shape
    n_cols = shape[-1] if x.dim() else 1
    x2 = x.contiguous().view(-1, n_cols)
    y2 = torch.empty_like(x2)
    block = row_block(n_cols, "softmax")
    if x2.shape[0] and n_cols:
        _softmax_fwd[(x2.shape[0],)](x2, y2, n_cols, BLOCK=block, num_warps=num_warps_for(block))
        record_launch("softmax")
    return y2.view(shape)


def softmax_backward(dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The backward kernel alone: dx from the output gradient and the forward's output y."""
    shape = y.shape
    n_cols = shape[-1] if y.dim() else 1
    y2 = y.contiguous().view(-1, n_cols)
    dy2 = dy.to(y.dtype).contiguous().view(-1, n_cols)
    dx2 = torch.empty_like(y2)
    block = row_block(n_cols, "softmax")
    if y2.shape[0] and n_cols:
        _softmax_bwd[(y2.shape[0],)](dy2, y2, dx2, n_cols, BLOCK=block, num_warps=num_warps_for(block))
        record_launch("softmax")
    return dx2.view(shape)


class SoftmaxFunction(torch.autograd.Function):
    """Autograd over the kernels; saves y only."""

    @staticmethod
    def forward(ctx, x):
        y = softmax_forward(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return softmax_backward(dy, y)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim by the Triton kernels (fp32 or bf16; any layout: non-contiguous
    inputs are copied contiguous). The result is contiguous, in x's dtype."""
    return SoftmaxFunction.apply(x)
