"""Rotary position embedding (RoPE, the Hugging Face / GPT-NeoX "rotate half" form) as one Triton
kernel: ``y = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])``
over the last dim (the head dim, even), x of any strides (typically [batch, heads, seq, head_dim]
transposed from the projection's [batch, seq, heads, head_dim]), cos and sin broadcastable to x
(Hugging Face's [batch or 1, 1, seq, head_dim]) and read through their strides (no expanded copy);
fp32 arithmetic, y in ``promote(x, cos, sin)`` laid out as x (as eager's elementwise ops: the
attention after it sees the same query layout).

The rotation is linear in x and orthogonal per (i, i + d/2) pair, so the backward is the same
kernel with the rotation transposed: ``dx_lo = dy_lo * cos_lo + dy_hi * sin_hi``,
``dx_hi = dy_hi * cos_hi - dy_lo * sin_lo`` (``BACKWARD``: the sin halves swapped and negated;
this holds for any cos/sin, not only tables whose two halves are equal). Autograd keeps cos and
sin only - not x - unless cos or sin needs a gradient (then x too: their gradients are plain-torch
reductions of ``dy * x`` and ``dy * rotate_half(x)``). ``rotary_reference`` is the plain-torch
formula.
"""
from __future__ import annotations

import torch

from runtime.kernels import check_device, record_launch

try:
    import triton
    import triton.language as tl
except ImportError:   # the reference still works
    triton = None

ELEMENTS = 2048   # elements of x one program rotates (rows x head dim, about)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """cat(-x[..., d/2:], x[..., :d/2])."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Plain torch: x * cos + rotate_half(x) * sin."""
    return x * cos + rotate_half(x) * sin


if triton is not None:
    @triton.jit
    def _rotary(X, C, S, Y, n_rows, n1, n2, half,
                sx0, sx1, sx2, sx3, sc0, sc1, sc2, sc3, ss0, ss1, ss2, ss3, sy0, sy1, sy2, sy3,
                BACKWARD: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_H)
        i2 = rows % n2
        t = rows // n2
        i1 = t % n1
        i0 = t // n1
        mask = (rows < n_rows)[:, None] & (cols < half)[None, :]
        if INTERLEAVED:   # pairs (2i, 2i + 1), tables of width d/2
            lo = (2 * cols)[None, :]
            hi = (2 * cols + 1)[None, :]
            tlo = cols[None, :]
            thi = cols[None, :]
        else:             # pairs (i, i + d/2), tables of width d
            lo = cols[None, :]
            hi = (cols + half)[None, :]
            tlo = lo
            thi = hi
        xr = (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None]
        cr = (i0 * sc0 + i1 * sc1 + i2 * sc2)[:, None]
        sr = (i0 * ss0 + i1 * ss1 + i2 * ss2)[:, None]
        x_lo = tl.load(X + xr + lo * sx3, mask=mask, other=0.0).to(tl.float32)
        x_hi = tl.load(X + xr + hi * sx3, mask=mask, other=0.0).to(tl.float32)
        c_lo = tl.load(C + cr + tlo * sc3, mask=mask, other=0.0).to(tl.float32)
        c_hi = tl.load(C + cr + thi * sc3, mask=mask, other=0.0).to(tl.float32)
        s_lo = tl.load(S + sr + tlo * ss3, mask=mask, other=0.0).to(tl.float32)
        s_hi = tl.load(S + sr + thi * ss3, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:   # the transposed rotation: sin halves swapped and negated
            a_lo = -s_hi
            a_hi = -s_lo
        else:
            a_lo = s_lo
            a_hi = s_hi
        y_lo = x_lo * c_lo - x_hi * a_lo
        y_hi = x_hi * c_hi + x_lo * a_hi
        yr = (i0 * sy0 + i1 * sy1 + i2 * sy2)[:, None]
        tl.store(Y + yr + lo * sy3, y_lo.to(Y.dtype.element_ty), mask=mask)
        tl.store(Y + yr + hi * sy3, y_hi.to(Y.dtype.element_ty), mask=mask)


def _four_dims(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype, interleaved: bool = False):
    """(x, cos, sin, y) as 4-d views of x's shape (cos / sin expanded: stride 0 where they
    broadcast), y the result, laid out as x where x is dense (as eager's elementwise ops do), and y
    itself (contiguous for the interleaved form). More than 3 leading dims are merged (copies; y
    contiguous)."""
    if x.ndim < 1 or x.shape[-1] % 2:
        raise ValueError(f"rotary: the last dim of x {tuple(x.shape)} must be even")
    tshape = (*x.shape[:-1], x.shape[-1] // 2) if interleaved else x.shape
    c, s = cos.expand(tshape), sin.expand(tshape)   # raises where they do not broadcast to x
    if x.ndim > 4:
        d, w = x.shape[-1], tshape[-1]
        y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        return x.reshape(-1, 1, 1, d), c.reshape(-1, 1, 1, w), s.reshape(-1, 1, 1, w), y.view(-1, 1, 1, d), y
    # the interleaved form's y contiguous, as the stack + flatten it replaces
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device) if interleaved else torch.empty_like(x, dtype=out_dtype)
    x4, y4 = x, y
    while x4.ndim < 4:
        x4, c, s, y4 = x4.unsqueeze(0), c.unsqueeze(0), s.unsqueeze(0), y4.unsqueeze(0)
    return x4, c, s, y4, y


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype, backward: bool,
            interleaved: bool = False) -> torch.Tensor:
    check_device(x, cos, sin)
    x4, c4, s4, y4, y = _four_dims(x, cos, sin, out_dtype, interleaved)
    n0, n1, n2, d = x4.shape
    n_rows, half = n0 * n1 * n2, d // 2
    if n_rows and half:
        block_h = 1 << (half - 1).bit_length() if half > 1 else 1
        block_r = max(1, ELEMENTS // (2 * block_h))
        _rotary[(triton.cdiv(n_rows, block_r),)](
            x4, c4, s4, y4, n_rows, n1, n2, half, *x4.stride(), *c4.stride(), *s4.stride(), *y4.stride(),
            BACKWARD=backward, INTERLEAVED=interleaved, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=4)
        record_launch("rotary")
    return y


def rotary_forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """The forward kernel alone: x * cos + rotate_half(x) * sin (``interleaved``: the pairs (2i, 2i + 1)
    rotated by tables of width d/2), laid out as x, in promote(x, cos, sin)."""
    return _launch(x, cos, sin, torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype), False,
                   interleaved)


def rotary_backward(dy: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, x_dtype=None,
                    interleaved: bool = False) -> torch.Tensor:
    """The backward kernel alone: d x (in ``x_dtype``, default dy's) from d y."""
    return _launch(dy, cos, sin, x_dtype or dy.dtype, True, interleaved)


def rotary_interleaved_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Plain torch, GPT-J / Meta Llama's form (the zoo's Llama): each pair (x[2i], x[2i + 1]) rotated
    by the angle of cos[..., i], sin[..., i] (tables of width d/2)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def interleaved_table_grads(dy, x, cos, sin, need_cos: bool, need_sin: bool):
    """The gradients of the interleaved form's tables (plain torch; None where not needed)."""
    d, xf = dy.float(), x.float()
    d1, d2, x1, x2 = d[..., 0::2], d[..., 1::2], xf[..., 0::2], xf[..., 1::2]
    dc = sum_to(d1 * x1 + d2 * x2, cos.shape).to(cos.dtype) if need_cos else None
    ds = sum_to(d2 * x1 - d1 * x2, sin.shape).to(sin.dtype) if need_sin else None
    return dc, ds


def sum_to(t: torch.Tensor, shape) -> torch.Tensor:
    """``t`` summed over the dims a tensor of ``shape`` was broadcast along."""
    shape = tuple(shape)
    lead = t.ndim - len(shape)
    if lead:
        t = t.sum(tuple(range(lead)))
    dims = tuple(i for i, s in enumerate(shape) if s == 1 and t.shape[i] != 1)
    return t.sum(dims, keepdim=True) if dims else t


def table_grads(dy: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, need_cos: bool,
                need_sin: bool):
    """The gradients of cos and sin (plain torch; None where not needed)."""
    d = dy.float()
    dc = sum_to(d * x.float(), cos.shape).to(cos.dtype) if need_cos else None
    ds = sum_to(d * rotate_half(x.float()), sin.shape).to(sin.dtype) if need_sin else None
    return dc, ds


class RotaryFunction(torch.autograd.Function):
    """Autograd over the kernel; saves cos and sin (and x only where they need a gradient)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        y = rotary_forward(x, cos, sin)
        ctx.x_dtype = x.dtype
        ctx.save_for_backward(x if (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]) else None, cos, sin)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, cos, sin = ctx.saved_tensors
        dx = rotary_backward(dy, cos, sin, ctx.x_dtype) if ctx.needs_input_grad[0] else None
        dc, ds = (table_grads(dy, x, cos, sin, ctx.needs_input_grad[1], ctx.needs_input_grad[2])
                  if x is not None else (None, None))
        return dx, dc, ds


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin by the Triton kernel (x any layout; cos, sin broadcastable
    to x). The result is laid out as x where x is dense, else contiguous."""
    return RotaryFunction.apply(x, cos, sin)
