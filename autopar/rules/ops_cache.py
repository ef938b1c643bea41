"""Rules for writes into a preallocated tensor: ``aten.index_copy`` (out of place), what a
functional KV-cache update traces to (``cache.index_copy(2, positions, new_kv)``,
autopar/inference/codegen_step.py). The cache and the written rows share every letter but the
indexed dim, which (like the index) stays whole, so the cache splits the way its producer splits
(kv heads under tensor parallelism) and stays on its rank between steps.
"""
from __future__ import annotations

import torch

from autopar.rules.spec import OpSpec
from autopar.rules.table import Letters, io_bytes, rule, shape

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
