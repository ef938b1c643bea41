"""The reshard calls of a per-rank program: the runtime collectives that move a value from its
producer's layout to the layout a consumer's strategy wants, plus their gradient conjugates.

``reshard(builder, x, src, dst, val, partial_grad_axes)`` emits, through ``builder.call``
(codegen/per_rank.py), one call of ``runtime.context`` per step of the cheapest reshard path
(``plan_reshard`` with the builder's ``Collectives``: the path executed is the path priced); a
step on a zig-zag axis takes its zig-zag form (codegen/sp_ops.py). An input whose gradient comes
back partial over an axis gets a conjugate: a reduce-scatter backward fused into the last
all_gather on that axis, else a ``copy`` (all-reduce backward).

Collectives return new tensors, contiguous in their dims' order; ``memory_order``
(autopar/rules/layout.py) keeps a value the trace lays out in another order (attention's q, k, v)
in that order around them, so the memory the program uses is the memory the planner counted.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx

from autopar.pricing.reshard import plan_reshard
from autopar.rules.layout import Layout, memory_order
from codegen import sp_ops as SPO
from runtime import context as RC


# reshard steps whose result is a new tensor, contiguous in its dims' order (runtime/collectives.py)
_NEW_TENSOR_STEPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "slice")


def reshard(builder, x: fx.Node, src: Layout, dst: Layout, val, partial_grad_axes) -> fx.Node:
    """Steps from src to dst on this rank's block of ``val``, plus the gradient conjugates.

    The collectives return new tensors, contiguous in the order of their dims; a value the
    trace lays out in another order (``val`` a transposed view: q, k, v of attention) is
    viewed in its traced memory order around the steps (``memory_order``: two permutes,
    no copy), so the result has the traced layout. What a consumer's kernel then does with
    it (flash attention lays its output out like q; a later ``reshape`` is a view or a copy)
    is what the trace did, which is what the memory model counts (pricing.py)."""
    steps = ()
    if src != dst:
        steps = plan_reshard(src, dst, tuple(val.shape), val.element_size(), builder.mesh_shape, builder.comm).steps
    order = memory_order(val) if any(s.kind in _NEW_TENSOR_STEPS for s in steps) else None
    if order is not None:
        at = {d: i for i, d in enumerate(order)}   # traced dim -> its position in memory order
        steps = tuple(dataclasses.replace(s, dim=None if s.dim is None else at[s.dim],
                                          dst_dim=None if s.dst_dim is None else at[s.dst_dim])
                      for s in steps)
        x = builder.call(torch.ops.aten.permute.default, (x, list(order)))
    last_on_axis = {s.axis: i for i, s in enumerate(steps)}
    fused = {a for a in partial_grad_axes if a in last_on_axis and steps[last_on_axis[a]].kind == "all_gather"}
    for i, s in enumerate(steps):
        kw = {"axis": s.axis, **({"partial_grad": True} if s.axis in fused and i == last_on_axis[s.axis] else {})}
        zz = SPO.reshard_step(builder, x, s, kw) if builder.zigzag_axes else None   # codegen/sp_ops.py
        if zz is not None:
            x = zz
        elif s.kind == "all_reduce":
            x = builder.call(RC.all_reduce, (x,), {"axis": s.axis})
        elif s.kind == "reduce_scatter":
            x = builder.call(RC.reduce_scatter, (x, s.dim), {"axis": s.axis})
        elif s.kind == "all_gather":
            kw = {"axis": s.axis}
            if s.axis in fused and i == last_on_axis[s.axis]:
                kw["partial_grad"] = True
            x = builder.call(RC.all_gather, (x, s.dim), kw)
        elif s.kind == "all_to_all":
            x = builder.call(RC.all_to_all, (x, s.dim, s.dst_dim), {"axis": s.axis})
        elif s.kind == "slice":
            x = builder.call(RC.slice_block, (x, s.dim), {"axis": s.axis})
        elif s.kind == "partial":
            x = builder.call(RC.make_partial, (x,), {"axis": s.axis})
    if order is not None:
        x = builder.call(torch.ops.aten.permute.default, (x, [order.index(d) for d in range(len(order))]))
    for a in sorted(set(partial_grad_axes) - fused):
        x = builder.call(RC.copy, (x,), {"axis": a})
    return x
