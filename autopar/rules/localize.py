"""Local execution of one op under one strategy: the call each rank makes on its blocks.

Arguments that carry global sizes (view/reshape/expand shapes) are rewritten to the local
block sizes; tensor arguments stay fx Nodes (the codegen maps them to local values).

Means over a split batch. ``scale`` makes partial sums exact where the local op normalises by a
FIXED local count: an ``aten.mean`` over split letters is multiplied by local_count /
global_count, i.e. 1 / (the split factor), and by 1 / num_micro_batches more when it averages
over the batch and the step runs several micro-batches (each micro-batch program then returns
its exact share and ``step`` sums them). A mean-reduced loss over targets (cross-entropy / NLL)
has a DATA-DEPENDENT count (ignore_index, class weights): when its targets are split over some
mesh axis or over micro-batches it runs as a local SUM (``global_mean``) and the codegen divides
it by the global denominator (runtime/loss.py). Special algorithms are only named
(``needs_algorithm``); the codegen implements them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autopar.rules.microbatch import FIXED_MEAN_LOSSES, TARGET_ARGS, TARGET_MEAN_LOSSES
from autopar.rules.spec import OpSpec
from autopar.rules.strategy import Strategy, split_factor

aten = torch.ops.aten

_SHAPE_ARG_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default}
_MEAN_OPS = {aten.mean.dim, aten.mean.default}


@dataclass
class LocalCall:
    target: object
    args: tuple
    kwargs: dict
    needs_algorithm: str | None = None
    scale: float | None = None
    global_mean: bool = False      # a mean loss run as a local sum: divide by the global denominator


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


def _arg(args, kwargs, i: int, name: str, default):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _split_letters(spec: OpSpec, strategy: Strategy, mesh_shape, letters) -> bool:
    return any(split_factor(strategy.splits, ch, mesh_shape) > 1 for ch in letters)


def local_call(node: fx.Node, spec: OpSpec, strategy: Strategy, mesh_shape, micro_batches: int = 1) -> LocalCall:
    """``micro_batches``: for an op that reduces the batch away (autopar/rules/microbatch.py), how many
    micro-batches the step runs (a mean over one is 1/micro_batches of the step's mean); else 1."""
    args, kwargs = tuple(node.args), dict(node.kwargs)
    target = node.target
    if target in _SHAPE_ARG_OPS:
        args = (args[0], local_out_shape(node, spec, strategy, mesh_shape)) + args[2:]
    scale = None
    global_mean = False
    if target in _MEAN_OPS:
        f = _contracted_factor(spec, strategy, mesh_shape) * micro_batches
        scale = 1.0 / f if f > 1 else None
    elif target in FIXED_MEAN_LOSSES:
        # replicated (no rule): only the micro-batch share; reduction 2 (sum) needs nothing
        if _arg(args, kwargs, FIXED_MEAN_LOSSES[target], "reduction", 1) == 1:
            f = _contracted_factor(spec, strategy, mesh_shape) * micro_batches
            scale = 1.0 / f if f > 1 else None
    elif target in TARGET_MEAN_LOSSES:   # op -> reduction arg index
        i = TARGET_MEAN_LOSSES[target]
        reduction = _arg(args, kwargs, i, "reduction", 1)
        target_letters = spec.inputs[TARGET_ARGS.get(target, (1,))[0]] or ""
        if reduction == 1 and (micro_batches > 1 or _split_letters(spec, strategy, mesh_shape, target_letters)):
            # local sum / global denominator (module doc); 2 is Reduction::Sum
            if len(args) > i:
                args = args[:i] + (2,) + args[i + 1:]
            else:
                kwargs["reduction"] = 2
            global_mean = True
    algo = ",".join(strategy.special) if strategy.special else None
    return LocalCall(target, args, kwargs, algo, scale, global_mean)
