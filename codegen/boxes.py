"""Boxes of a flat range: the elements ``[a, b)`` of a row-major tensor as rectangles of it, which
is how a rank's contiguous piece of a flat buffer (a ZeRO shard, a grid block's rows) maps onto
the tensor's dims (autopar/execution/checkpoint_io.py, codegen/grid_rank_program.py).
"""
from __future__ import annotations

import math


def flat_boxes(shape, a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The elements ``[a, b)`` of a row-major tensor of ``shape`` as boxes: (offsets, sizes,
    start), ``start`` the box's first element's flat index; boxes in flat order, each one
    contiguous in row-major order."""
    shape = tuple(int(s) for s in shape)
    if a >= b:
        return []
    if not shape:
        return [((), (), 0)]
    if len(shape) == 1:
        return [((a,), (b - a,), a)]
    inner = math.prod(shape[1:])
    r0, ra = divmod(a, inner)
    r1, rb = divmod(b, inner)
    out = []

    def row(r, lo, hi):
        for off, size, s in flat_boxes(shape[1:], lo, hi):
            out.append(((r, *off), (1, *size), r * inner + s))

    if r0 == r1:
        row(r0, ra, rb)
        return out
    if ra:
        row(r0, ra, inner)
        r0 += 1
    if r1 > r0:
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:]), r0 * inner))
    if rb:
        row(r1, 0, rb)
    return out
