"""Sequence-parallel functions the generated per-rank programs call (codegen/sp_ops.py emits them).

Attention on a sequence-split mesh axis, looked up from the execution context by axis index
like the reshard steps of runtime/context.py (bytes counted in ``COMM_STATS`` under the axis name):

- ``ulysses(q, k, v, axis=, is_causal=, scale=)``: runtime/ulysses.py (all-to-all to heads and back);
- ``ring(q, k, v, axis=, is_causal=, layout=, scale=)``: runtime/ring_attention.py;
- ``hybrid(q, k, v, axis=, ring_axis=, is_causal=, layout=, scale=)``: runtime/hybrid_sp.py, Ulysses
  on ``axis`` and ring attention on ``ring_axis`` (bytes under each axis' name).

Zig-zag splits. When load-balanced causal ring attention runs on an axis, EVERY split over that
axis is the zig-zag split (rank r holds chunks r and 2·sp-1-r of 2·sp): equivalently, the
contiguous split of the sequence permuted by ``seq_layout.order``. The reshard steps on that axis
are therefore the contiguous ones wrapped in that permutation (autograd differentiates the
index_select, the collective keeps its conjugate), so values, gradients and bytes are those of
the contiguous step:

- ``zz_slice``: permute the (replicated) tensor, keep my contiguous block; backward all-gather;
- ``zz_all_gather``: all-gather the blocks (rank order = permuted order), un-permute;
- ``zz_reduce_scatter``: permute the partial sum, reduce-scatter contiguous blocks.
"""
from __future__ import annotations

import torch

from runtime import collectives as C
from runtime import context
from runtime import seq_layout as L
from runtime.hybrid_sp import hybrid_attention
from runtime.ring_attention import ring_attention
from runtime.ulysses import ulysses_attention


def _group(axis: int):
    ctx = context.current()
    return ctx.groups[axis], ctx.labels[axis], ctx.mesh.shape[axis]


def ulysses(q, k, v, attn_mask=None, *, axis: int, is_causal: bool = False, scale=None) -> torch.Tensor:
    g, lab, _ = _group(axis)
    return ulysses_attention(q, k, v, g, is_causal=is_causal, layout="contiguous", scale=scale, attn_mask=attn_mask,
                             label=lab)


def ring(q, k, v, *, axis: int, is_causal: bool = False, layout: str = "zigzag", scale=None) -> torch.Tensor:
    g, lab, _ = _group(axis)
    return ring_attention(q, k, v, g, is_causal=is_causal, layout=layout, scale=scale, label=lab)


def hybrid(q, k, v, *, axis: int, ring_axis: int, is_causal: bool = False, layout: str = "zigzag",
           scale=None) -> torch.Tensor:
    gu, lu, _ = _group(axis)
    gr, lr, _ = _group(ring_axis)
    return hybrid_attention(q, k, v, gu, gr, is_causal=is_causal, layout=layout, scale=scale,
                            ulysses_label=lu, ring_label=lr)


def _perm(x: torch.Tensor, dim: int, sp: int, inverse: bool) -> torch.Tensor:
    fn = L.inverse_order if inverse else L.order
    return x.index_select(dim, fn(x.shape[dim], sp, "zigzag").to(x.device))


def unzigzag(x: torch.Tensor, dim: int, *, axis: int) -> torch.Tensor:
    """The blocks of ``dim`` as a plain all-gather over zig-zag axis ``axis`` concatenates them,
    put back in sequence order (what ``zz_all_gather`` does after its gather)."""
    return _perm(x, dim, _group(axis)[2], True)


def zz_slice(x: torch.Tensor, dim: int, *, axis: int) -> torch.Tensor:
    g, lab, sp = _group(axis)
    return C.slice_block(_perm(x, dim, sp, False), dim, g, lab)


def zz_all_gather(x: torch.Tensor, dim: int, *, axis: int, partial_grad: bool = False) -> torch.Tensor:
    g, lab, sp = _group(axis)
    return _perm(C.all_gather(x, dim, g, lab, partial_grad=partial_grad), dim, sp, True)


def zz_reduce_scatter(x: torch.Tensor, dim: int, *, axis: int) -> torch.Tensor:
    g, lab, sp = _group(axis)
    return C.reduce_scatter(_perm(x, dim, sp, False), dim, g, lab)
