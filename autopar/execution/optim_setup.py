"""The optimizer options of ``autopar.compile``: parameter groups, learning-rate schedule and
scaling, checked up front and turned into the runtime's flat optimizer at set-up.

``check_options`` validates them in ``compile`` (every rank alike, before any set-up), and
``build(cm)`` makes the ``FlatOptimizer`` (runtime/optim.py) with its base learning rate scaled
for the global batch (runtime/lr_schedule.py ``scaled_lr``) and its schedule, plus the per-tensor
settings of the parameter groups (runtime/optim_groups.py), decided from each parameter's FULL
name and shape (the model's tensor, not this rank's block), keyed by id of this rank's parameter.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from autopar.errors import ExecutionError
from runtime.lr_schedule import make_schedule, scaled_lr
from runtime.optim import FlatOptimizer, make_optimizer
from runtime.optim_groups import check_spec, default_spec, is_uniform, resolve_groups


@dataclass
class OptimOptions:
    """What ``compile`` was given for the optimizer beyond its name, lr and hyperparameters."""

    param_groups: object = None
    lr_schedule: object = None
    warmup_steps: int = 0
    total_steps: Optional[int] = None
    power: float = 1.0
    lr_scaling: Optional[str] = None
    base_batch: Optional[int] = None
    extra: dict = field(default_factory=dict)


def check_options(optimizer: str, lr: float, opts: OptimOptions, optimizer_kwargs: dict) -> None:
    """Raise ExecutionError (collective: every rank raises alike) on a bad option."""
    try:
        check_spec(opts.param_groups)
        make_schedule(opts.lr_schedule, opts.warmup_steps, opts.total_steps, opts.power)
        if opts.lr_scaling is not None:
            scaled_lr(lr, 1, opts.base_batch, opts.lr_scaling)
        make_optimizer(optimizer, lr, **optimizer_kwargs)   # unknown name or hyperparameter
    except (ValueError, TypeError) as e:
        raise ExecutionError(f"compile(): {e}", collective=True) from None


def full_shapes(cm) -> dict:
    """FQN -> the whole parameter's shape for every trainable parameter of the model (every rank
    alike, whatever blocks or stage it holds), from the traced graph's placeholders."""
    traced = cm.traced
    out = {}
    for node in traced.gm.graph.nodes:
        fqn = traced.param_fqn.get(node.name)
        val = node.meta.get("val")
        if node.op == "placeholder" and fqn is not None and node.name not in traced.buffers:
            out[fqn] = tuple(val.shape) if val is not None else tuple(cm.model.get_parameter(fqn).shape)
    return out


def apply_groups(cm, settings: dict) -> None:
    """Set the groups' per-tensor settings (FQN -> (weight_decay, lr_scale, adapt)) on ``cm``'s
    optimizer (also what ``load`` restores)."""
    cm.group_settings = dict(settings)
    wd = getattr(cm.opt.opt, "weight_decay", 0.0)
    uniform = is_uniform({f: settings[f] for f in cm.params if f in settings}, wd)
    cm.opt.set_tensor_hparams(None if uniform else {id(p): settings[f] for f, p in cm.params.items() if f in settings})


def build(cm) -> tuple[FlatOptimizer, Optional[dict]]:
    """The flat optimizer for ``cm`` (its scaled base lr and schedule), and id(param) ->
    (weight_decay, lr_scale, adapt) for the ShardedOptimizer, or None when every tensor takes the
    optimizer's own settings."""
    o: OptimOptions = cm.optim_options
    lr = scaled_lr(cm.base_lr, cm.global_batch, o.base_batch, o.lr_scaling)
    opt = make_optimizer(cm.optimizer_name, lr, fused=cm.plan.kernels == "triton", **cm.optimizer_kwargs)
    opt.schedule = make_schedule(o.lr_schedule, o.warmup_steps, o.total_steps, o.power)
    spec = o.param_groups if o.param_groups is not None else default_spec(cm.optimizer_name)
    wd = getattr(opt, "weight_decay", 0.0)
    cm.group_settings = resolve_groups(full_shapes(cm), spec, wd)   # FQN -> (wd, lr_scale, adapt)
    mine = {fqn: cm.group_settings[fqn] for fqn in cm.params}
    if is_uniform(mine, wd):
        return opt, None
    return opt, {id(p): mine[fqn] for fqn, p in cm.params.items()}


__all__ = ["OptimOptions", "check_options", "build", "full_shapes", "apply_groups"]
