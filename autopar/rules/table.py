"""The op-rule registry: ATen target -> function(node) -> OpSpec.

Rules register with ``@rule(*aten_ops)``. ``spec_for`` looks a node up and falls back to a
replicate-only spec (always correct, never a crash), warning once per distinct op.
``tensor_inputs`` fixes the order OpSpec.inputs aligns to: every fx Node in args then kwargs,
flattened, duplicates kept. This module also holds the small helpers every rule family uses
(shapes, byte counts, fresh letters).
"""
from __future__ import annotations

import math
import operator
import warnings
import weakref
from typing import Callable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.rules.spec import OpSpec

RULES: dict[object, Callable[[fx.Node], OpSpec]] = {}
_warned: set[str] = set()

# Letters handed out by rules that have no mnemonic letters of their own.
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def rule(*targets):
    """Register the decorated ``fn(node) -> OpSpec`` for every given ATen op / overload packet.

    An OpOverloadPacket (``aten.add``) registers all its overloads; a specific overload
    (``aten.add.Tensor``) only that one."""
    def deco(fn):
        for t in targets:
            if isinstance(t, torch._ops.OpOverloadPacket):
                for name in t.overloads():
                    RULES[getattr(t, name)] = fn
            else:
                RULES[t] = fn
        return fn
    return deco


# node -> (its args, its kwargs, their fx Nodes): a pytree walk is ~10 us and planning asks for
# the same node's inputs ~10,000 times. fx replaces a node's args/kwargs objects on every edit
# (they are immutable), so an entry is valid while both are the very objects it was made from.
_INPUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """Every fx Node among args then kwargs, flattened, in order, duplicates kept."""
    got = _INPUTS.get(node)
    if got is not None and got[0] is node.args and got[1] is node.kwargs:
        return list(got[2])
    leaves = pytree.tree_leaves((list(node.args), dict(node.kwargs)))
    out = [x for x in leaves if isinstance(x, fx.Node)]
    _INPUTS[node] = (node.args, node.kwargs, tuple(out))
    return out


def input_dim_sets(node: fx.Node, per_value: dict, inputs: list | None = None) -> list[frozenset]:
    """For each tensor input of ``node`` (``inputs``, default ``tensor_inputs(node)``), the dim set
    its producer recorded: ``per_value[name]`` holds one frozenset per output, a ``getitem``
    reads its index; empty when the producer recorded none."""
    out = []
    for p in tensor_inputs(node) if inputs is None else inputs:
        sets = per_value.get(p.name, (frozenset(),))
        if node.target is operator.getitem:
            idx = node.args[1]
            out.append(sets[idx] if idx < len(sets) else frozenset())
        else:
            out.append(sets[0] if sets else frozenset())
    return out


def val(x):
    return x.meta.get("val") if isinstance(x, fx.Node) else None


def shape(x) -> tuple[int, ...]:
    """Global shape of a tensor-valued node (or a tensor)."""
    v = val(x) if isinstance(x, fx.Node) else x
    return tuple(int(s) for s in v.shape)


def is_tensor(x) -> bool:
    return isinstance(val(x), torch.Tensor)


def out_vals(node: fx.Node) -> list:
    v = val(node)
    return list(v) if isinstance(v, (tuple, list)) else [v]


def io_bytes(node: fx.Node) -> float:
    """Bytes read + written by the op (memory-bound cost), from the traced values."""
    total = 0
    for v in [val(x) for x in tensor_inputs(node)] + out_vals(node):
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
    return float(total)


def numel(node_or_shape) -> int:
    s = node_or_shape if isinstance(node_or_shape, tuple) else shape(node_or_shape)
    return math.prod(s)


class Letters:
    """Hands out fresh letters, skipping those already used by a rule."""

    def __init__(self, used: str = ""):
        self.used = set(used)

    def fresh(self, n: int = 1) -> str:
        out = ""
        for ch in ALPHABET:
            if len(out) == n:
                break
            if ch not in self.used:
                self.used.add(ch)
                out += ch
        if len(out) < n:
            raise ValueError("op has more dims than the letter alphabet")
        return out


def fallback_spec(node: fx.Node, rule_name: str = "fallback") -> OpSpec:
    """Everything replicated: fresh unsplittable letters for every tensor input and output."""
    L = Letters()
    ins, sizes = [], {}
    for x in tensor_inputs(node):
        v = val(x)
        if isinstance(v, torch.Tensor):
            ls = L.fresh(v.dim())
            sizes.update(zip(ls, shape(v)))
            ins.append(ls)
        else:
            ins.append(None)
    outs = []
    for v in out_vals(node):
        if isinstance(v, torch.Tensor):
            ls = L.fresh(v.dim())
            sizes.update(zip(ls, shape(v)))
            outs.append(ls)
        else:
            outs.append("")
    return OpSpec(rule=rule_name, inputs=tuple(ins), outputs=tuple(outs), sizes=sizes,
                  unsplittable=frozenset(sizes), bytes=io_bytes(node), replicate_only=True)


def spec_for(node: fx.Node) -> OpSpec:
    """The OpSpec of a call_function node; replicate-only fallback (with one warning per op)."""
    fn = RULES.get(node.target)
    if fn is None and isinstance(node.target, torch._ops.OpOverload):
        fn = RULES.get(node.target.overloadpacket)
    if fn is not None:
        spec = fn(node)
        if spec is not None:
            return spec
    name = str(node.target)
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"autopar: no sharding rule for {name}; it runs replicated "
                      f"(correct but unsharded)", stacklevel=2)
    return fallback_spec(node)


def coverage(graph: fx.Graph) -> list[tuple[str, str, str]]:
    """(node name, target, rule name) of every call_function node; "fallback" when unruled."""
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for node in graph.nodes:
            if node.op == "call_function":
                rows.append((node.name, str(node.target), spec_for(node).rule))
    return rows
