"""Dropout fused with the residual add as Triton kernels: y = residual + dropout(x, p), the mask
drawn inside the kernel from Philox (``tl.randint``) keyed by a 64-bit seed and each element's
flat index, and its backward, which regenerates the mask from the same seed: the autograd
Function saves the seed alone (8 bytes), neither the mask nor x.

The seed is an int64 tensor of one element that the caller draws from the device's generator
(``draw_seed``: on a rank, inside ``runtime.rng.seeded``, the generator its random ops are seeded
with, so tensor-parallel replicas draw the same seed, data-parallel rows and split blocks their
own, and a region recomputed under activation checkpointing the same one again). The kernel reads
it from memory: no host synchronisation on CUDA.

An element is kept where the top 24 bits of its Philox word are >= round(p * 2^24), and scaled by
1 / (1 - p); arithmetic in fp32, y in ``promote(x.dtype, residual.dtype)``. ``philox_reference``
is Triton's Philox (10 rounds, the 32-bit counter path tl.randint takes) in plain torch, bit for
bit, so ``dropout_add_reference`` draws the very mask the kernel draws. It is not torch's dropout
stream: the same seed gives a different mask from ``torch.nn.functional.dropout``.
"""
from __future__ import annotations

import torch

from runtime.kernels import check_device, record_launch

try:
    import triton
    import triton.language as tl
except ImportError:   # the reference still works
    triton = None

BLOCK = 1024
_M32 = 0xFFFFFFFF
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57


def threshold(p: float) -> int:
    """The 24-bit threshold of drop probability ``p``: an element is dropped below it."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout_add: p must be in [0, 1], got {p}")
    return min(1 << 24, int(round(p * (1 << 24))))


def scale_of(p: float) -> float:
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


def draw_seed(device) -> torch.Tensor:
    """A fresh seed from ``device``'s default generator: an int64 tensor of one element on it."""
    return torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=device)


def _mul_hi_lo(a: int, b: torch.Tensor):
    """(high, low) 32-bit words of a * b, a < 2^32 a constant, b int64 values in [0, 2^32)."""
    t = a * (b & 0xFFFF)
    u = a * (b >> 16) + (t >> 16)
    return u >> 16, ((u & 0xFFFF) << 16) | (t & 0xFFFF)


def philox_reference(seed: torch.Tensor, n: int) -> torch.Tensor:
    """``tl.randint(seed, arange(n))`` (int32 offsets) in torch: the uint32 words as int64."""
    s = seed.reshape(()).to(torch.int64)
    k0, k1 = s & _M32, (s >> 32) & _M32
    c0 = torch.arange(n, dtype=torch.int64, device=seed.device)
    c1 = torch.zeros_like(c0)
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _M32, (k1 + _KEY_B) & _M32
    return c0


def keep_mask_reference(seed: torch.Tensor, shape, p: float) -> torch.Tensor:
    """The bool keep-mask the kernel draws for a tensor of ``shape`` (its flat index order)."""
    n = 1
    for s in shape:
        n *= int(s)
    return ((philox_reference(seed, n) >> 8) >= threshold(p)).view(shape)


def dropout_add_reference(x: torch.Tensor, residual: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    """Plain torch, the kernel's mask: residual + x * keep / (1 - p) in fp32, in the promoted dtype."""
    keep = keep_mask_reference(seed.to(x.device), x.shape, p)
    out = torch.promote_types(x.dtype, residual.dtype)
    return (residual.float() + torch.where(keep, x.float() * scale_of(p), 0.0)).to(out)


def dropout_add_backward_reference(dy: torch.Tensor, p: float, seed: torch.Tensor, x_dtype) -> torch.Tensor:
    """Plain torch: the gradient of x (the residual's is dy itself)."""
    keep = keep_mask_reference(seed.to(dy.device), dy.shape, p)
    return torch.where(keep, dy.float() * scale_of(p), 0.0).to(x_dtype)


if triton is not None:
    @triton.jit
    def _dropout_add_fwd(X, R, Y, SEED, n, thresh, scale, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        seed = tl.load(SEED)
        keep = (tl.randint(seed, offs) >> 8).to(tl.int32) >= thresh
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
        y = r + tl.where(keep, x * scale, 0.0)
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _dropout_add_bwd(DY, DX, SEED, n, thresh, scale, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        seed = tl.load(SEED)
        keep = (tl.randint(seed, offs) >> 8).to(tl.int32) >= thresh
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, tl.where(keep, dy * scale, 0.0).to(DX.dtype.element_ty), mask=mask)


def _check_numel(n: int) -> None:
    if n >= 2 ** 31:
        raise ValueError(f"dropout_add: {n} elements; the kernel's Philox counters are 32-bit (< 2^31)")


def dropout_add_forward(x: torch.Tensor, residual: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
    """The forward kernel alone: residual + dropout(x, p) with the mask of ``seed``."""
    check_device(x, residual, seed)
    if x.shape != residual.shape:
        raise ValueError(f"dropout_add: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    out = torch.promote_types(x.dtype, residual.dtype)
    xc, rc = x.contiguous(), residual.contiguous()
    y = torch.empty(x.shape, dtype=out, device=x.device)
    n = x.numel()
    _check_numel(n)
    if n:
        _dropout_add_fwd[(triton.cdiv(n, BLOCK),)](xc, rc, y, seed, n, threshold(p), scale_of(p), BLOCK=BLOCK,
                                                   num_warps=4)
        record_launch("dropout_add")
    return y


def dropout_add_backward(dy: torch.Tensor, p: float, seed: torch.Tensor, x_dtype) -> torch.Tensor:
    """The backward kernel alone: d x from d y and the forward's seed."""
    dy = dy.contiguous()
    dx = torch.empty(dy.shape, dtype=x_dtype, device=dy.device)
    n = dy.numel()
    _check_numel(n)
    if n:
        _dropout_add_bwd[(triton.cdiv(n, BLOCK),)](dy, dx, seed, n, threshold(p), scale_of(p), BLOCK=BLOCK,
                                                   num_warps=4)
        record_launch("dropout_add")
    return dx


class DropoutAddFunction(torch.autograd.Function):
    """Autograd over the kernels (``kernels`` True) or their plain-torch bodies, the same mask;
    saves the seed only."""

    @staticmethod
    def forward(ctx, x, residual, p, seed, kernels=True):
        y = (dropout_add_forward if kernels else dropout_add_reference)(x, residual, p, seed)
        ctx.save_for_backward(seed)
        ctx.p, ctx.x_dtype, ctx.r_dtype, ctx.kernels = p, x.dtype, residual.dtype, kernels
        return y

    @staticmethod
    def backward(ctx, dy):
        (seed,) = ctx.saved_tensors
        grad = dropout_add_backward if ctx.kernels else dropout_add_backward_reference
        return grad(dy, ctx.p, seed, ctx.x_dtype), dy.to(ctx.r_dtype), None, None, None


def dropout_add(x: torch.Tensor, residual: torch.Tensor, p: float, seed: torch.Tensor | None = None) -> torch.Tensor:
    """residual + dropout(x, p) by the Triton kernels, the mask drawn from ``seed`` (one int64
    element; drawn from x's device generator when None)."""
    if seed is None:
        seed = draw_seed(x.device)
    return DropoutAddFunction.apply(x, residual, float(p), seed)
