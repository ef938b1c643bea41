"""Rules for writes into a preallocated tensor: ``aten.index_copy`` (out of place), what a
functional KV-cache update traces to (``cache.index_copy(2, positions, new_kv)``,
autopar/inference/codegen_step.py), and ``aten.scatter.src`` (out of place), what a per-row one
traces to (each row its own slots, autopar/inference/codegen_rows.py). The cache and the written
rows share every letter but the written dim, which (like the index) stays whole, so the cache
splits the way its producer splits (kv heads under tensor parallelism) and stays on its rank
between steps.
"""
from __future__ import annotations

import torch

from autopar.rules.spec import OpSpec
from autopar.rules.table import Letters, fallback_spec, io_bytes, rule, shape

aten = torch.ops.aten


@rule(aten.index_copy.default)
def index_copy(node):
    x, dim, index, source = node.args[:4]
    xs = shape(x)
    dim %= len(xs)
    L = Letters()
    ls = L.fresh(len(xs))
    ch = L.fresh()   # the written rows: the index's length along ``dim``
    sizes = dict(zip(ls, xs), **{ch: shape(index)[0]})
    src = ls[:dim] + ch + ls[dim + 1:]
    # Not linear in either input alone (a partial cache with whole rows is not a partial result):
    # no partial_inputs.
    return OpSpec("index_copy", (ls, ch, src), (ls,), sizes, unsplittable=frozenset({ls[dim], ch}),
                  bytes=io_bytes(node))


@rule(aten.scatter.src)
def scatter(node):
    """``x.scatter(dim, index, src)`` out of place, what a per-row KV-cache write traces to
    (``cache.scatter(2, slots.expand(B, H, S, D), new_kv)``: each row its own slots,
    autopar/inference/codegen_rows.py). ``index`` and ``src`` share every letter of ``x`` but the
    scattered dim (their written positions; that dim and ``x``'s stay whole), so the cache splits
    the way its producer splits (kv heads under tensor parallelism) and each rank writes its heads."""
    x, dim, index, src = node.args[:4]
    xs, ixs = shape(x), shape(index)
    dim %= len(xs)
    if ixs != shape(src) or any(a != b for d, (a, b) in enumerate(zip(xs, ixs)) if d != dim):
        return fallback_spec(node, "scatter")
    L = Letters()
    ls = L.fresh(len(xs))
    ch = L.fresh()
    sizes = dict(zip(ls, xs), **{ch: ixs[dim]})
    written = ls[:dim] + ch + ls[dim + 1:]
    return OpSpec("scatter", (ls, written, written), (ls,), sizes, unsplittable=frozenset({ls[dim], ch}),
                  bytes=io_bytes(node))
