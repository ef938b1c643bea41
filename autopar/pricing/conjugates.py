"""Forward and backward collectives of resharding steps and of replicated-input regions.

Gradient convention (used by the cost model, the codegen and the runtime alike): the gradient
of a tensor that is replicated on a mesh axis is held COMPLETE (identical) on every rank of
that axis. Under it each reshard step has one conjugate in backward:

    step            forward            backward
    all_reduce      all_reduce         nothing (the complete grad is every addend's grad)
    reduce_scatter  reduce_scatter     all_gather
    all_gather      all_gather         nothing (keep my block of the complete grad)
    all_to_all      all_to_all         all_to_all (reversed)
    slice           nothing            all_gather
    partial         nothing            nothing (every rank's complete grad is the grad of x)

and an op that splits its work on an axis while one of its inputs is replicated there (a
column-parallel linear's input, Megatron's "f") produces a partial gradient for that input:
it needs an all_reduce in backward (``region_inputs``).

Byte figures follow the shared convention: per rank, the larger buffer of the collective.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.rules.layout import Layout

BACKWARD = {"all_reduce": None, "reduce_scatter": "all_gather", "all_gather": None,
            "all_to_all": "all_to_all", "slice": "all_gather", "partial": None}
FORWARD = {"all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter", "all_gather": "all_gather",
           "all_to_all": "all_to_all", "slice": None, "partial": None}


@dataclass(frozen=True)
class Traffic:
    axis: int
    forward: str | None
    backward: str | None
    nbytes: int            # per rank, the larger buffer (the same for the step and its conjugate)


def apply_step(layout: Layout, step) -> Layout:
    """The layout after one reshard step (see autopar/pricing/reshard.py for the step semantics)."""
    dims = [tuple(d) for d in layout.dims]
    partial = tuple(layout.partial)
    a = step.axis
    if step.kind == "all_reduce":
        partial = tuple(p for p in partial if p != a)
    elif step.kind == "reduce_scatter":
        partial = tuple(p for p in partial if p != a)
        dims[step.dim] = dims[step.dim] + (a,)
    elif step.kind == "all_gather":
        dims[step.dim] = dims[step.dim][:-1]
    elif step.kind == "all_to_all":
        dims[step.dim] = dims[step.dim][:-1]
        dims[step.dst_dim] = dims[step.dst_dim] + (a,)
    elif step.kind == "slice":
        dims[step.dim] = dims[step.dim] + (a,)
    elif step.kind == "partial":
        partial = partial + (a,)
    return Layout(tuple(dims), tuple(sorted(partial)))


def step_traffic(steps, src: Layout, shape, itemsize: int, mesh_shape) -> list[Traffic]:
    out = []
    lay = src
    for step in steps:
        local = math.prod(lay.local_shape(tuple(shape), tuple(mesh_shape))) * itemsize
        # a slice's backward all-gathers into a buffer of the pre-slice block (``local``)
        nbytes = local * mesh_shape[step.axis] if step.kind == "all_gather" else local
        out.append(Traffic(step.axis, FORWARD[step.kind], BACKWARD[step.kind], int(nbytes)))
        lay = apply_step(lay, step)
    return out


def region_inputs(strategy, spec_inputs, skip_axes=()) -> list[tuple[int, int]]:
    """(input index, axis) pairs whose gradient is partial over the axis: the op splits work on
    the axis (a letter, or a partial pass-through) while the input is replicated there."""
    out = []
    for i, lay in enumerate(strategy.inputs):
        if lay is None or spec_inputs[i] is None:
            continue
        for a, split in enumerate(strategy.splits):
            if split is None or a in skip_axes:
                continue
            if a in lay.partial or any(a in axes for axes in lay.dims):
                continue
            out.append((i, a))
    return out
