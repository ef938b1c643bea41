"""Which traced ops draw random numbers, and the block key their generator is seeded with.

torch tags every ATen op that reads the global generator ``nondeterministic_seeded`` (dropout,
native_dropout, bernoulli, rand_like, scaled_dot_product_attention, ...). Some of them only draw
when a probability argument says so: an inactive dropout (``train=False`` or ``p == 0``) and SDPA
without ``dropout_p`` are deterministic and are emitted as they are (no seeding overhead, and the
program matches eager bit for bit).
"""
from __future__ import annotations

import torch
from torch.fx import Node

_aten = torch.ops.aten
# op -> (index, keyword) of its drop probability, and of its ``train`` flag (None: none)
_DROPOUTS = {
    _aten.dropout.default: ((1, "p"), (2, "train")),
    _aten.native_dropout.default: ((1, "p"), (2, "train")),
    _aten.feature_dropout.default: ((1, "p"), (2, "train")),
    _aten.alpha_dropout.default: ((1, "p"), (2, "train")),
    _aten.feature_alpha_dropout.default: ((1, "p"), (2, "train")),
    _aten.scaled_dot_product_attention.default: ((4, "dropout_p"), None),
}


def _fused_dropouts():
    """The fused dropout_add of runtime/kernels/ops.py: active only with p > 0 and train."""
    from runtime.kernels.ops import DROPOUT_ADD
    return {DROPOUT_ADD: ((2, "p"), (3, "train"))}


def _arg(node: Node, where, default):
    i, name = where
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def is_random(node: Node) -> bool:
    """Does this call_function node draw from a random generator when it runs?"""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    if target in _DROPOUTS or target in _fused_dropouts():
        p_at, train_at = _DROPOUTS.get(target) or _fused_dropouts()[target]
        p = _arg(node, p_at, 0.0)
        train = True if train_at is None else _arg(node, train_at, True)
        return train is not False and bool(p)
    return True


def random_block(layout, coords) -> tuple:
    """((mesh axis, my coordinate), ...) over the axes ``layout`` splits a dimension over: ranks
    that differ only on other axes hold replicas and get the same key."""
    axes = sorted({a for dims in layout.dims for a in dims})
    return tuple((a, int(coords[a])) for a in axes)


__all__ = ["is_random", "random_block"]
