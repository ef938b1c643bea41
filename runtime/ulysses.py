"""Ulysses (DeepSpeed) sequence-parallel attention: re-split by heads with all-to-alls.

``ulysses_attention(q, k, v, group)``: q [B, H, S/sp, D] and k, v [B, Hkv, S/sp, D] arrive split
on the sequence. One all-to-all turns q, another the stacked k/v, into head-split tensors over the
full sequence ([B, H/sp, S, D]); attention runs locally (``F.scaled_dot_product_attention`` by
default, or any ``attn_fn(q, k, v) -> out``, e.g. a model's explicit matmul/softmax attention); a
last all-to-all brings the output back to [B, H, S/sp, D]. The autograd conjugate of an all-to-all
is the reverse all-to-all (runtime/collectives.py ``all_to_all``), so the backward moves the same
bytes with no code here.

Heads: H % sp == 0. Grouped-query attention with Hkv % sp != 0 repeats every kv head
lcm(Hkv, sp)/Hkv times before the all-to-all (seq_layout.kv_repeat_factor), so each rank receives
exactly the kv heads its query heads read; sp > Hkv is the common case.

Sequence layout: the all-to-all concatenates the ranks' pieces in rank order. Under a causal mask
with ``layout="zigzag"`` (the layout ring attention balances with) the head-split tensors are
permuted into natural order for the attention and back afterwards (local index_select).

Bytes per rank in the COMM_STATS convention (an all-to-all counts its local tensor): closed form
``ulysses_bytes``; every all-to-all is counted under ``label``, kind "all_to_all".
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime import seq_layout as L
from runtime.collectives import all_to_all
from runtime.seq_layout import Traffic


def ulysses_bytes(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, sp: int,
                  dtype_bytes: int) -> Traffic:
    """Per-rank bytes of one Ulysses attention: forward all-to-alls of q, stacked k/v (after any
    GQA repeat) and the output; backward the three reverse all-to-alls of their gradients, same
    sizes. Convention of runtime/collectives.py: an all-to-all counts its local tensor (the wire
    carries (sp-1)/sp of it)."""
    if sp == 1:
        return Traffic(0, 0, 0, 0)
    kvh = kv_heads * L.kv_repeat_factor(heads, kv_heads, sp)
    one = batch * (seq // sp) * head_dim * dtype_bytes
    fwd = (2 * heads + 2 * kvh) * one
    return Traffic(fwd, fwd, 3, 3)


def _sdpa(is_causal, scale, mask=None):
    def attn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=k.shape[1] != q.shape[1])
    return attn


def _local_heads_mask(mask: torch.Tensor, heads: int, sp: int, rank: int, op: str) -> torch.Tensor:
    """This rank's part of a general ``attn_mask`` (broadcastable to [B, H, S, S], whole on the
    sequence): after the all-to-all a rank holds heads [rank·H/sp, (rank+1)·H/sp) over the whole
    sequence, so a per-head mask (head dim H) gives those rows and a shared one (head dim 1 or
    none) is used as it is."""
    if mask.dim() >= 3 and mask.shape[-3] == heads and heads > 1:
        per = heads // sp
        return mask.narrow(mask.dim() - 3, rank * per, per)
    if mask.dim() >= 3 and mask.shape[-3] != 1:
        raise L.SequenceParallelError(f"{op}: attn_mask of shape {tuple(mask.shape)}: its head dim must be 1 or "
                                      f"the {heads} local heads")
    return mask


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, is_causal: bool = False,
                      layout: str = "contiguous", scale: float | None = None, attn_mask=None,
                      attn_fn: Callable | None = None, label: str = "sp") -> torch.Tensor:
    """Attention over the full sequence for sequence-split q/k/v, run head-split between two
    all-to-alls. ``attn_fn(q, k, v)`` (default SDPA with ``is_causal`` and ``scale``) sees
    [B, H/sp, S, D] queries and [B, Hkv'/sp, S, D] keys/values in natural sequence order and must
    apply the causal mask itself when given. ``attn_mask``: None, "none"/"causal", or a tensor
    broadcastable to [B, H, S, S] over the WHOLE sequence (a padding or sliding-window mask, not
    split: every rank attends all positions of its heads), with ``attn_fn`` unset, not causal and
    the contiguous layout; a per-head mask's rows are taken for this rank's heads."""
    op = "ulysses_attention"
    sp = dist.get_world_size(group) if dist.is_initialized() else 1
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise L.SequenceParallelError(f"{op}: {name} must be [batch, heads, seq/sp, head_dim], "
                                          f"got shape {tuple(t.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise L.SequenceParallelError(
            f"{op}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree (need the same batch and "
            f"local sequence, and k.shape == v.shape)")
    H, Hkv = q.shape[1], k.shape[1]
    L.check_heads(H, Hkv, sp, op)
    mask = attn_mask if isinstance(attn_mask, torch.Tensor) else None
    if mask is None:
        L.check_mask(attn_mask, is_causal, op)
    elif is_causal or attn_fn is not None or layout != "contiguous":
        raise L.SequenceParallelError(f"{op}: a tensor attn_mask runs with is_causal=False, no attn_fn and the "
                                      f"contiguous layout only")
    elif mask.shape[-2:] != (q.shape[2] * sp, q.shape[2] * sp):
        raise L.SequenceParallelError(f"{op}: attn_mask of shape {tuple(mask.shape)} must span the whole sequence "
                                      f"({q.shape[2] * sp} x {q.shape[2] * sp}): Ulysses attends every position")
    L.check_layout(layout)
    if is_causal:
        L.check_seq(q.shape[2] * sp, sp, layout, "the sequence length (local length × sp)")
    if mask is not None and sp > 1:
        mask = _local_heads_mask(mask, H, sp, dist.get_rank(group), op)
    attn = attn_fn if attn_fn is not None else _sdpa(bool(is_causal), scale, mask)
    if sp == 1:
        return attn(q, k, v)
    rep = L.kv_repeat_factor(H, Hkv, sp)
    kv = torch.stack([L.repeat_kv(k, rep), L.repeat_kv(v, rep)])
    qh = all_to_all(q, 1, 2, group, label)            # [B, H/sp, S, D], sequence in rank order
    kvh = all_to_all(kv, 2, 3, group, label)          # [2, B, Hkv'/sp, S, D]
    S = qh.shape[2]
    reorder = is_causal and layout == "zigzag"
    if reorder:
        inv = L.inverse_order(S, sp, layout).to(q.device)
        qh, kvh = qh.index_select(2, inv), kvh.index_select(3, inv)
    out = attn(qh, kvh[0], kvh[1])
    if reorder:
        out = out.index_select(2, L.order(S, sp, layout).to(q.device))
    return all_to_all(out, 2, 1, group, label)        # [B, H, S/sp, D]
