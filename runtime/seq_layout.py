"""Where each rank's piece of a sequence-split tensor sits in the full sequence, and the input
checks shared by the sequence-parallel attention ops (runtime/ring_attention.py, runtime/ulysses.py).

Two layouts of a sequence dim split over ``sp`` ranks:

- ``"contiguous"``: rank r holds positions [r·S/sp, (r+1)·S/sp).
- ``"zigzag"`` (head-tail): the sequence is cut into 2·sp chunks; rank r holds chunk r followed by
  chunk 2·sp-1-r. Under a causal mask every rank then owns one early and one late chunk, so the
  ranks do equal work (needs S % (2·sp) == 0).

``shard`` / ``unshard`` convert between a full tensor and the per-rank pieces (plain indexing,
so autograd flows through them); ``positions`` gives the global positions of a rank's rows, which
is all a mask needs. ``order`` is the sequence as the concatenation of the ranks' pieces in rank
order (what an all-gather or an all-to-all produces), and ``inverse_order`` undoes it.

``SequenceParallelError`` (a ValueError) is what these ops raise on bad input; the planner can
re-raise it as a PlanError naming the op (runtime/ imports nothing from autopar/).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

LAYOUTS = ("contiguous", "zigzag")
MASKS = ("none", "causal")


class SequenceParallelError(ValueError):
    """Bad input to a sequence-parallel op (shapes that do not divide, an unsupported mask)."""


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise SequenceParallelError(f"unknown sequence layout {layout!r}; supported: {', '.join(LAYOUTS)}")


def check_seq(seq: int, sp: int, layout: str, what: str = "sequence length") -> None:
    """The full sequence length must split into the layout's chunks."""
    check_layout(layout)
    chunks = 2 * sp if layout == "zigzag" else sp
    if seq % chunks:
        extra = " (zig-zag load balancing cuts it into 2·sp chunks)" if layout == "zigzag" else ""
        raise SequenceParallelError(
            f"{what} {seq} does not divide into {chunks} chunks for sp={sp}, layout {layout!r}{extra}; "
            f"use a length that is a multiple of {chunks}")


def check_mask(attn_mask, is_causal: bool, op: str) -> None:
    """Only no mask and the causal mask are supported by the sequence-parallel attention ops."""
    if attn_mask is None:
        return
    if isinstance(attn_mask, str) and attn_mask in MASKS:
        if attn_mask == "causal" and not is_causal:
            raise SequenceParallelError(f"{op}: attn_mask='causal' given with is_causal=False; pass is_causal=True")
        return
    kind = f"a tensor of shape {tuple(attn_mask.shape)}" if isinstance(attn_mask, torch.Tensor) else repr(attn_mask)
    raise SequenceParallelError(
        f"{op} supports only no mask or the causal mask (is_causal=True), got attn_mask={kind}: a general "
        f"mask would have to be split over the ring's blocks; use allgather_kv_attention, which all-gathers "
        f"K/V and accepts an explicit mask")


def positions(seq: int, sp: int, rank: int, layout: str) -> torch.Tensor:
    """Global positions (int64) of the rows rank ``rank`` holds, in its local order."""
    check_seq(seq, sp, layout)
    if layout == "contiguous":
        n = seq // sp
        return torch.arange(rank * n, (rank + 1) * n)
    c = seq // (2 * sp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange((2 * sp - 1 - rank) * c, (2 * sp - rank) * c)])


def order(seq: int, sp: int, layout: str) -> torch.Tensor:
    """Global positions of the ranks' pieces concatenated in rank order."""
    return torch.cat([positions(seq, sp, r, layout) for r in range(sp)])


def inverse_order(seq: int, sp: int, layout: str) -> torch.Tensor:
    """Index that puts a rank-order concatenation back into natural order."""
    return torch.argsort(order(seq, sp, layout))


def shard(x: torch.Tensor, dim: int, sp: int, rank: int, layout: str = "zigzag") -> torch.Tensor:
    """Rank ``rank``'s piece of the full tensor ``x`` along ``dim``."""
    return x.index_select(dim, positions(x.shape[dim], sp, rank, layout).to(x.device))


def unshard(pieces: list[torch.Tensor], dim: int, layout: str = "zigzag") -> torch.Tensor:
    """The full tensor from the ranks' pieces (rank order)."""
    sp = len(pieces)
    cat = torch.cat(pieces, dim=dim)
    return cat.index_select(dim, inverse_order(cat.shape[dim], sp, layout).to(cat.device))


def kv_repeat_factor(heads: int, kv_heads: int, sp: int) -> int:
    """How many times each K/V head is repeated so the kv heads split over ``sp`` ranks in step with
    the query heads (Ulysses). 1 when kv_heads % sp == 0; otherwise lcm(kv_heads, sp) / kv_heads, which
    divides heads / kv_heads whenever heads % sp == 0 (the checks in check_heads)."""
    return math.lcm(kv_heads, sp) // kv_heads


def check_heads(heads: int, kv_heads: int, sp: int | None, op: str) -> None:
    if kv_heads < 1 or heads % kv_heads:
        raise SequenceParallelError(
            f"{op}: {heads} query heads are not a multiple of {kv_heads} key/value heads (grouped-query "
            f"attention needs query heads = k · kv heads)")
    if sp is not None and heads % sp:
        raise SequenceParallelError(
            f"{op}: Ulysses splits heads over sp={sp} ranks, but {heads} heads do not divide by {sp}; "
            f"use an sp that divides the head count, or ring attention (sequence-split, any head count)")


def repeat_kv(x: torch.Tensor, times: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv·times, S, D], kv head j serving query heads j·g .. (j+1)·g-1 (the
    grouping of HF's repeat_kv and of SDPA's enable_gqa)."""
    return x if times == 1 else x.repeat_interleave(times, dim=1)


class Traffic(NamedTuple):
    """Per-rank bytes and messages sent in one forward and one backward."""
    forward_bytes: int
    backward_bytes: int
    forward_messages: int
    backward_messages: int

    @property
    def total_bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes
