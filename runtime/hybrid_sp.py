"""Hybrid sequence parallelism (the USP / double-ring idea): Ulysses inside a group of ``u`` ranks
(typically one node: fast all-to-alls), ring attention across ``r`` such groups (slow links carry
only K/V blocks, overlapped with compute). The sequence is split over r·u ranks.

Layout: ring rank ``ri`` owns a ring piece of S/r positions (``seq_layout.positions(S, r, ri,
layout)``, zig-zag for causal load balance); Ulysses rank ``ui`` holds the ui-th contiguous
S/(r·u) rows of that piece in its local order (``positions``). The Ulysses all-to-all then
concatenates exactly the ring piece, head-split by u, and ring attention runs on it unchanged.

``hybrid_attention(q, k, v, ulysses_group, ring_group, ...)`` is ``ulysses_attention`` whose local
attention is ``ring_attention`` over ``ring_group``. Bytes per rank: ``hybrid_bytes`` (Ulysses'
all-to-alls under ``ulysses_label``, the ring's p2p under ``ring_label``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from runtime import seq_layout as L
from runtime.ring_attention import ring_attention, ring_attention_bytes
from runtime.seq_layout import Traffic
from runtime.ulysses import ulysses_attention, ulysses_bytes


def positions(seq: int, r: int, u: int, ri: int, ui: int, layout: str = "zigzag") -> torch.Tensor:
    """Global positions of the rows rank (ring rank ri, Ulysses rank ui) holds, in local order."""
    piece = L.positions(seq, r, ri, layout)
    if piece.numel() % u:
        raise L.SequenceParallelError(
            f"hybrid sequence parallelism: a ring piece of {piece.numel()} positions does not split over u={u} ranks")
    n = piece.numel() // u
    return piece[ui * n:(ui + 1) * n]


def shard(x: torch.Tensor, dim: int, r: int, u: int, ri: int, ui: int, layout: str = "zigzag") -> torch.Tensor:
    return x.index_select(dim, positions(x.shape[dim], r, u, ri, ui, layout).to(x.device))


def hybrid_bytes(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, r: int, u: int,
                 dtype_bytes: int) -> tuple[Traffic, Traffic]:
    """(Ulysses traffic on the inner axis, ring traffic on the outer axis), per rank. The ring moves
    the kv heads a rank holds after the all-to-all: kv_heads·repeat/u."""
    uly = ulysses_bytes(batch, heads, kv_heads, seq // r, head_dim, u, dtype_bytes)
    kvh = kv_heads * L.kv_repeat_factor(heads, kv_heads, u) // u if u > 1 else kv_heads
    return uly, ring_attention_bytes(batch, kvh, seq, head_dim, r, dtype_bytes)


def hybrid_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ulysses_group, ring_group, *,
                     is_causal: bool = False, layout: str = "zigzag", scale: float | None = None, attn_mask=None,
                     ulysses_label: str = "sp_u", ring_label: str = "sp_r") -> torch.Tensor:
    """Attention over the full sequence for q [B, H, S/(r·u), D], k/v [B, Hkv, S/(r·u), D] laid out
    as ``positions``; needs H % u == 0 (Ulysses) and, under a causal mask, S % (2·r) == 0."""
    L.check_mask(attn_mask, is_causal, "hybrid_attention")
    r = dist.get_world_size(ring_group)
    if is_causal:
        L.check_seq(q.shape[2] * r * dist.get_world_size(ulysses_group), r, layout,
                    "the sequence length (local length × r × u)")

    def ring(qh, kh, vh):
        return ring_attention(qh, kh, vh, ring_group, is_causal=is_causal, layout=layout, scale=scale,
                              label=ring_label)

    # the Ulysses all-to-all concatenates the ring piece in its own local order: no reordering, so
    # Ulysses is told "not causal"; the ring applies the mask by global position
    return ulysses_attention(q, k, v, ulysses_group, is_causal=False, layout="contiguous", attn_fn=ring,
                             label=ulysses_label)
