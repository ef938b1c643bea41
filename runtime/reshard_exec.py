"""Executing a ReshardPlan's steps on one rank with the autograd collectives.

Gradient convention: see ``runtime/collectives.py``. By default the grads arriving at the
destination layout follow it (full on axes the destination leaves replicated), so an
all_gather's backward is a local slice. When the consumer computes differently across a mesh
axis the destination leaves replicated (e.g. a column-parallel linear reading a replicated
input), the grads come back partial over that axis: list it in ``partial_grad_axes``. Then the
last step on that axis, if it is an all_gather, gets a reduce_scatter backward (Megatron's
sequence-parallel pairing); otherwise a ``copy`` (all_reduce backward) is appended.
"""
from __future__ import annotations

import torch

from runtime import collectives as C


def apply_steps(tensor: torch.Tensor, steps, groups: dict, labels: dict,
                partial_grad_axes=()) -> torch.Tensor:
    """Run ``steps`` (a ReshardPlan's) on this rank's block. ``groups[axis]`` is this rank's
    process group along mesh axis ``axis`` and ``labels[axis]`` its name for COMM_STATS."""
    steps = tuple(steps)
    last_on_axis = {s.axis: i for i, s in enumerate(steps)}
    fused = {a for a in partial_grad_axes
             if a in last_on_axis and steps[last_on_axis[a]].kind == "all_gather"}
    x = tensor
    for i, s in enumerate(steps):
        g, lab = groups[s.axis], labels[s.axis]
        if s.kind == "all_reduce":
            x = C.all_reduce(x, g, lab)
        elif s.kind == "reduce_scatter":
            x = C.reduce_scatter(x, s.dim, g, lab)
        elif s.kind == "all_gather":
            partial = s.axis in fused and i == last_on_axis[s.axis]
            x = C.all_gather(x, s.dim, g, lab, partial_grad=partial)
        elif s.kind == "all_to_all":
            # Step.dim becomes gathered (the cat dim), Step.dst_dim becomes split.
            x = C.all_to_all(x, s.dst_dim, s.dim, g, lab)
        elif s.kind == "slice":
            x = C.slice_block(x, s.dim, g, lab)
        elif s.kind == "partial":
            x = C.make_partial(x, g)
        else:  # pragma: no cover - autopar.pricing.reshard.Step validates its kind
            raise ValueError(f"unknown step kind {s.kind!r}")
    for a in sorted(set(partial_grad_axes) - fused):
        x = C.copy(x, groups[a], labels[a])
    return x


__all__ = ["apply_steps"]
