"""LayerNorm as Triton kernels: y = (x - mean) * rstd * w + b over the last dim, rstd =
rsqrt(var + eps) with the biased variance (torch's), and its backward (dx, dweight, dbias).

Forward: one program per row, one block of next_power_of_2(hidden) columns, fp32 arithmetic,
y stored in x's dtype. Backward: a fixed number of programs, each over a contiguous band of rows,
recomputing each row's mean and rstd from x (which it reads anyway: the same formula as the
forward, so the same values) and its dx, and summing its rows' dweight and dbias in fp32
registers; the bands' partial sums are added in torch. The autograd Function saves only x and the
weight, and the operator has one output (y), so a plan reads it as it reads ATen's layer_norm
(no getitem between the norm and its readers, where a reshard could hide from the linear that
regathers it).

``layer_norm_reference`` is ``F.layer_norm`` in fp32 cast back to x's dtype.
"""
from __future__ import annotations

import torch

from runtime.kernels import backward_programs, check_device, num_warps_for, record_launch, row_block

try:
    import triton
    import triton.language as tl
except ImportError:   # the reference still works
    triton = None



def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5):
    """Plain torch: F.layer_norm over the last dim in fp32, cast to x's dtype."""
    y = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)
    return y.to(x.dtype)


if triton is not None:
    @triton.jit
    def _row_stats(x, mask, n_cols, eps):
        """(x - mean masked to the row, rstd) of one row loaded as fp32 (0 beyond n_cols)."""
        mean = tl.sum(x, axis=0) / n_cols
        xc = tl.where(mask, x - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / n_cols + eps)
        return xc, rstd

    @triton.jit
    def _layer_norm_fwd(X, W, B, Y, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        offs = row * n_cols + cols
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        xc, rstd = _row_stats(x, mask, n_cols, eps)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + offs, (xc * rstd * w + b).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _layer_norm_bwd(DY, X, W, DX, DW_PART, DB_PART, n_rows, n_cols, rows_per_program, eps,
                        BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        db = tl.zeros([BLOCK], dtype=tl.float32)
        row_start = pid * rows_per_program
        for i in range(0, rows_per_program):
            row = row_start + i
            if row < n_rows:
                offs = row.to(tl.int64) * n_cols + cols
                x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
                xc, rstd = _row_stats(x, mask, n_cols, eps)
                xhat = xc * rstd
                wdy = w * dy
                c1 = tl.sum(xhat * wdy, axis=0) / n_cols
                c2 = tl.sum(wdy, axis=0) / n_cols
                dx = (wdy - (xhat * c1 + c2)) * rstd
                tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
                dw += dy * xhat
                db += dy
        tl.store(DW_PART + pid.to(tl.int64) * n_cols + cols, dw, mask=mask)
        tl.store(DB_PART + pid.to(tl.int64) * n_cols + cols, db, mask=mask)




def layer_norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """The forward kernel alone: y, shaped like x, in x's dtype."""
    check_device(x, weight, bias)
    shape = x.shape
    n_cols = shape[-1]
    if weight.shape != (n_cols,) or bias.shape != (n_cols,):
        raise ValueError(f"layer_norm: weight {tuple(weight.shape)} / bias {tuple(bias.shape)} != ({n_cols},)")
    x2 = x.contiguous().view(-1, n_cols)
    n_rows = x2.shape[0]
    y2 = torch.empty_like(x2)
    block = row_block(n_cols, "layer_norm")
    if n_rows:
        _layer_norm_fwd[(n_rows,)](x2, weight.contiguous(), bias.contiguous(), y2, n_cols, eps,
                                   BLOCK=block, num_warps=num_warps_for(block))
        record_launch("layer_norm")
    return y2.view(shape)


def layer_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
    """The backward kernel alone: (dx, dweight, dbias) from the norm's input ``x`` (its statistics
    recomputed) and the output gradient ``dy``; dweight and dbias in fp32."""
    shape = x.shape
    n_cols = shape[-1]
    x2 = x.contiguous().view(-1, n_cols)
    n_rows = x2.shape[0]
    dy2 = dy.to(x2.dtype).contiguous().view(-1, n_cols)
    dx2 = torch.empty_like(x2)
    block = row_block(n_cols, "layer_norm")
    programs = backward_programs(n_rows, x2.device)
    rows_per_program = -(-n_rows // programs) if n_rows else 0
    dw_part = torch.zeros(programs, n_cols, dtype=torch.float32, device=x2.device)
    db_part = torch.zeros(programs, n_cols, dtype=torch.float32, device=x2.device)
    if n_rows:
        _layer_norm_bwd[(programs,)](dy2, x2, weight.contiguous(), dx2, dw_part, db_part, n_rows, n_cols,
                                     rows_per_program, eps, BLOCK=block, num_warps=num_warps_for(block))
        record_launch("layer_norm")
    return dx2.view(shape), dw_part.sum(0), db_part.sum(0)


class LayerNormFunction(torch.autograd.Function):
    """Autograd over the kernels; saves x and the weight."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y = layer_norm_forward(x, weight, bias, eps)
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.bias_dtype = eps, bias.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx, dw, db = layer_norm_backward(dy, x, w, ctx.eps)
        return dx, dw.to(w.dtype), db.to(ctx.bias_dtype), None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5):
    """LayerNorm over the last dim by the Triton kernels: y in x's dtype. fp32 or bf16 x; weight
    and bias in fp32 or x's dtype; any x layout (non-contiguous inputs are copied contiguous)."""
    return LayerNormFunction.apply(x, weight, bias, float(eps))
