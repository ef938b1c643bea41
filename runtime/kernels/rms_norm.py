"""RMSNorm as Triton kernels: y = x * rsqrt(mean(x^2) + eps) * w over the last dim, optionally
on h = x + residual (returning h too, the pre-norm residual stream), with its backward.

Forward: one program per row, one block of next_power_of_2(hidden) columns, fp32 arithmetic,
y (and h) stored in x's dtype, the per-row rstd (fp32) kept for the backward. Backward: a fixed
number of programs, each over a contiguous band of rows, computing dx row by row and summing
its rows' dw in fp32 registers; the bands' partial dw are summed in torch. The autograd Function
saves only the norm's input (x, or h with a residual) and rstd.

``rms_norm_reference`` is the plain-torch formula in fp32 cast back to x's dtype (the Llama
convention, weight applied in fp32).
"""
from __future__ import annotations

import torch

from runtime.kernels import backward_programs, check_device, num_warps_for, record_launch, row_block

try:
    import triton
    import triton.language as tl
except ImportError:   # the reference still works
    triton = None



def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                       residual: torch.Tensor | None = None):
    """Plain torch: x * rsqrt(mean(x^2) + eps) * weight in fp32, cast to x's dtype; with
    ``residual``, normalises h = x + residual (in x's dtype) and returns (y, h)."""
    h = x if residual is None else x + residual
    hf = h.float()
    y = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return y if residual is None else (y, h)


if triton is not None:
    @triton.jit
    def _rms_norm_fwd(X, R, W, Y, H, RSTD, n_cols, eps,
                      HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        offs = row * n_cols + cols
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
            h = (x + r).to(H.dtype.element_ty)
            tl.store(H + offs, h, mask=mask)
            x = h.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        tl.store(RSTD + row, rstd)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + offs, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _rms_norm_bwd(DY, X, W, RSTD, DH, DX, DW_PART, n_rows, n_cols, rows_per_program, eps,
                      HAS_DH: tl.constexpr, RECOMPUTE: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        row_start = pid * rows_per_program
        for i in range(0, rows_per_program):
            row = row_start + i
            if row < n_rows:
                offs = row.to(tl.int64) * n_cols + cols
                x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
                if RECOMPUTE:   # the forward's formula on the same x: the same rstd
                    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
                else:
                    rstd = tl.load(RSTD + row)
                xhat = x * rstd
                wdy = w * dy
                c = tl.sum(xhat * wdy, axis=0) / n_cols
                dx = (wdy - xhat * c) * rstd
                if HAS_DH:
                    dx += tl.load(DH + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
                dw += dy * xhat
        tl.store(DW_PART + pid.to(tl.int64) * n_cols + cols, dw, mask=mask)




def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """The forward kernel alone: (y, h, rstd) with y, h (x + residual, or None) shaped like x and
    rstd the fp32 statistic of each row (shape ``x.shape[:-1]``)."""
    check_device(x, weight, residual)
    shape = x.shape
    n_cols = shape[-1]
    if weight.shape != (n_cols,):
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} != ({n_cols},)")
    x2 = x.contiguous().view(-1, n_cols)
    n_rows = x2.shape[0]
    has_res = residual is not None
    if has_res:
        if residual.shape != shape:
            raise ValueError(f"rms_norm: residual shape {tuple(residual.shape)} != {tuple(shape)}")
        r2 = residual.to(x.dtype).contiguous().view(-1, n_cols)
        h2 = torch.empty_like(x2)
    else:
        r2 = h2 = x2   # unused (HAS_RESIDUAL is off)
    w = weight.contiguous()
    y2 = torch.empty_like(x2)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block = row_block(n_cols, "rms_norm")
    if n_rows:
        _rms_norm_fwd[(n_rows,)](x2, r2, w, y2, h2, rstd, n_cols, eps,
                                 HAS_RESIDUAL=has_res, BLOCK=block, num_warps=num_warps_for(block))
        record_launch("rms_norm")
    return y2.view(shape), (h2.view(shape) if has_res else None), rstd.view(shape[:-1])


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor | None,
                      dh: torch.Tensor | None = None, eps: float | None = None):
    """The backward kernel alone: (dx, dw) from the norm's input ``x`` (h with a residual), its
    ``rstd`` and the output gradient ``dy`` (plus ``dh``, the gradient reaching h directly). With
    ``rstd`` None the kernel recomputes it from x and ``eps``."""
    shape = x.shape
    n_cols = shape[-1]
    x2 = x.contiguous().view(-1, n_cols)
    n_rows = x2.shape[0]
    recompute = rstd is None
    if recompute and eps is None:
        raise ValueError("rms_norm_backward: without rstd, eps is needed to recompute it")
    rstd = x2.new_empty(0, dtype=torch.float32) if recompute else rstd.contiguous().view(-1)
    if dy is None:
        dy = torch.zeros_like(x2)
    dy2 = dy.to(x2.dtype).contiguous().view(-1, n_cols)
    dh2 = dh.to(x2.dtype).contiguous().view(-1, n_cols) if dh is not None else dy2
    dx2 = torch.empty_like(x2)
    block = row_block(n_cols, "rms_norm")
    programs = backward_programs(n_rows, x2.device)
    rows_per_program = -(-n_rows // programs) if n_rows else 0
    dw_part = torch.zeros(programs, n_cols, dtype=torch.float32, device=x2.device)
    if n_rows:
        _rms_norm_bwd[(programs,)](dy2, x2, weight.contiguous(), rstd, dh2, dx2, dw_part, n_rows, n_cols,
                                   rows_per_program, float(eps or 0.0), HAS_DH=dh is not None,
                                   RECOMPUTE=recompute, BLOCK=block,
                                   num_warps=num_warps_for(block))
        record_launch("rms_norm")
    return dx2.view(shape), dw_part.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """Autograd over the kernels; saves the norm's input and the per-row rstd."""

    @staticmethod
    def forward(ctx, x, weight, eps, residual):
        y, h, rstd = rms_norm_forward(x, weight, eps, residual)
        ctx.save_for_backward(h if h is not None else x, weight, rstd)
        ctx.has_res = h is not None
        return (y, h) if ctx.has_res else y

    @staticmethod
    def backward(ctx, dy, *rest):
        x, w, rstd = ctx.saved_tensors
        dh = rest[0] if ctx.has_res else None
        dx, dw = rms_norm_backward(dy, x, w, rstd, dh)
        return dx, dw, None, (dx if ctx.has_res else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             residual: torch.Tensor | None = None):
    """RMSNorm over the last dim by the Triton kernels: returns y, or (y, x + residual) when
    ``residual`` is given (y normalises the sum). fp32 or bf16 x; weight in fp32 or x's dtype;
    any x layout (non-contiguous inputs are copied contiguous)."""
    return RMSNormFunction.apply(x, weight, float(eps), residual)
