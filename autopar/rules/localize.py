"""Local execution of one op under one strategy: the call each rank makes on its blocks.

Arguments that carry global sizes (view/reshape/expand shapes) are rewritten to the local
block sizes; tensor arguments stay fx Nodes (the codegen maps them to local values). ``scale``
makes partial sums exact where the local op normalises by a local count (a mean, or a
mean-reduced loss, over a split batch: multiply by local_count / global_count). Special
algorithms are only named (``needs_algorithm``); the codegen implements them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.rules.spec import OpSpec
from autopar.strategy import Strategy, split_factor

aten = torch.ops.aten

_SHAPE_ARG_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
_MEAN_OPS = {aten.mean.dim, aten.mean.default}
_MEAN_LOSSES = {aten.cross_entropy_loss.default: 3, aten.nll_loss.default: 3}   # op -> reduction arg index


@dataclass
class LocalCall:
    target: object
    args: tuple
    kwargs: dict
    needs_algorithm: str | None = None
    scale: float | None = None


def local_out_shape(node: fx.Node, spec: OpSpec, strategy: Strategy, mesh_shape, index: int = 0):
    """The local block shape of output ``index`` under ``strategy``."""
    v = node.meta["val"]
    v = v[index] if isinstance(v, (tuple, list)) else v
    letters = spec.outputs[index]
    return [int(s) // split_factor(strategy.splits, ch, mesh_shape) for s, ch in zip(v.shape, letters)]


def _contracted_factor(spec: OpSpec, strategy: Strategy, mesh_shape) -> int:
    """How many ways the letters reduced away (input-only, non-special) are split."""
    out = set("".join(spec.outputs))
    ins = {ch for ls in spec.inputs if ls for ch in ls}
    f = 1
    for ch in ins - out:
        if ch not in spec.special:
            f *= split_factor(strategy.splits, ch, mesh_shape)
    return f


def local_call(node: fx.Node, spec: OpSpec, strategy: Strategy, mesh_shape) -> LocalCall:
    args, kwargs = tuple(node.args), dict(node.kwargs)
    target = node.target
    if target in _SHAPE_ARG_OPS:
        args = (args[0], local_out_shape(node, spec, strategy, mesh_shape)) + args[2:]
    scale = None
    if target in _MEAN_OPS:
        f = _contracted_factor(spec, strategy, mesh_shape)
        scale = 1.0 / f if f > 1 else None
    elif target in _MEAN_LOSSES:
        i = _MEAN_LOSSES[target]
        reduction = args[i] if len(args) > i else kwargs.get("reduction", 1)
        if reduction == 1:
            f = _contracted_factor(spec, strategy, mesh_shape)
            scale = 1.0 / f if f > 1 else None
    algo = ",".join(strategy.special) if strategy.special else None
    return LocalCall(target, args, kwargs, algo, scale)
