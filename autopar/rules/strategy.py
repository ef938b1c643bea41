"""Strategies: every way to run one op on a mesh, derived from its OpSpec.

Per mesh axis we choose independently what that axis does to the op: nothing (replicated),
split one letter, or "P" (partial pass-through of the op's linear inputs). The cartesian
product over axes, filtered for divisibility and legality, gives the strategies; layouts of
inputs and outputs follow from the letters. Data axes (names starting with "dp") must split a
batch letter when the op carries one: data parallelism is not a choice per op.

Conventions: a split contracted letter makes the outputs partial on that axis (reduce "sum"),
unless it is a special letter whose algorithm brings its own collectives (then the algorithm
leaves the output whole on that axis, e.g. vocab-parallel cross-entropy); a special letter
without collectives (vocab-parallel embedding) leaves a partial sum that resharding resolves.
With reduce "ignore" (``x.new_ones``: the outputs never read the inputs' values) the outputs stay
whole.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from autopar.rules.layout import Layout
from autopar.mesh import Mesh
from autopar.rules.spec import OpSpec


@dataclass(frozen=True)
class Strategy:
    name: str
    inputs: tuple[Layout | None, ...]
    outputs: tuple[Layout, ...]
    splits: tuple[str | None, ...]       # per mesh axis: split letter, "P" or None
    work_fraction: float
    comms: tuple[tuple[str, int, float], ...]   # (kind, axis, nbytes per rank), forward
    special: tuple[str, ...] = ()
    # The backward's collectives when they are not the forward's mirrored (None: backward moves
    # what ``comms`` moves). Ring attention sends more backward (fp32 dK/dV travel too), and a
    # recomputed forward repeats only the forward's bytes, so the two must be priced apart.
    backward_comms: tuple[tuple[str, int, float], ...] | None = None


def _letters_in_order(spec: OpSpec) -> list[str]:
    seen = []
    for ls in list(spec.inputs) + list(spec.outputs):
        for ch in ls or "":
            if ch not in seen:
                seen.append(ch)
    return seen


def _input_letters(spec: OpSpec) -> set[str]:
    return {ch for ls in spec.inputs if ls for ch in ls}


def split_factor(splits, letter: str, mesh_shape) -> int:
    return math.prod(mesh_shape[a] for a, s in enumerate(splits) if s == letter)


def _layout(letters: str, splits, partial: tuple[int, ...]) -> Layout:
    dims = tuple(tuple(a for a, s in enumerate(splits) if s == ch) for ch in letters)
    return Layout(dims, tuple(sorted(partial)))


def _make(spec: OpSpec, mesh: Mesh, splits: tuple) -> Strategy | None:
    """The strategy for one per-axis choice, or None when it is not legal."""
    ins_letters = _input_letters(spec)
    for ch in set(s for s in splits if s not in (None, "P")):
        if spec.sizes.get(ch, 1) % split_factor(splits, ch, mesh.shape):
            return None
    comm_axes = {}     # axis -> special letter whose algorithm resolves it
    for a, ch in enumerate(splits):
        if ch in (None, "P"):
            continue
        contracted = ch in ins_letters and any(ch not in o for o in spec.outputs)
        if ch in spec.special:
            if spec.special[ch][1]:
                comm_axes[a] = ch
        elif contracted and spec.reduce == "none":
            return None
    p_axes = tuple(a for a, s in enumerate(splits) if s == "P")
    # axes on which some output becomes partial because a contracted letter is split there
    contracted_axes = {a for a, ch in enumerate(splits)
                       if spec.reduce == "sum" and ch not in (None, "P") and ch in ins_letters and a not in comm_axes
                       and any(ch not in o for o in spec.outputs)}
    addend_axes = tuple(a for a in contracted_axes if spec.outputs and splits[a] not in spec.outputs[0])
    inputs = []
    for i, ls in enumerate(spec.inputs):
        if ls is None:
            inputs.append(None)
            continue
        partial = (p_axes if i in spec.partial_inputs else ()) + (addend_axes if i in spec.addend_inputs else ())
        inputs.append(_layout(ls, splits, partial))
    outputs = []
    for o in spec.outputs:
        partial = p_axes + tuple(a for a in contracted_axes if splits[a] not in o)
        outputs.append(_layout(o, splits, partial))
    work = 1.0 / math.prod(mesh.shape[a] for a, s in enumerate(splits) if s not in (None, "P"))
    comms, special = [], []
    for a, ch in sorted(comm_axes.items()):
        algo, clist = spec.special[ch]
        for c in clist:
            local = math.prod(spec.sizes[x] // split_factor(splits, x, mesh.shape) for x in c.letters)
            comms += [(c.kind, a, float(local * c.itemsize))] * c.count
    for ch in dict.fromkeys(s for s in splits if s in spec.special):
        special.append(spec.special[ch][0])
    parts = []
    for a, s in enumerate(splits):
        if s == "P":
            parts.append(f"P@{mesh.names[a]}")
        elif s is not None:
            parts.append(f"S({s})@{mesh.names[a]}")
    name = " ".join(parts) or "R"
    if special:
        name += " [" + ",".join(special) + "]"
    return Strategy(name, tuple(inputs), tuple(outputs), tuple(splits), work, tuple(comms), tuple(special))


def replicated_strategy(spec: OpSpec, mesh: Mesh) -> Strategy:
    splits = tuple(None for _ in mesh.shape)
    return Strategy("R", tuple(None if ls is None else Layout.replicated(len(ls)) for ls in spec.inputs),
                    tuple(Layout.replicated(len(o)) for o in spec.outputs), splits, 1.0, ())


def enumerate_strategies(spec: OpSpec, mesh: Mesh, batch_letters: frozenset = frozenset()) -> list[Strategy]:
    """Every legal strategy of ``spec`` on ``mesh`` (deduplicated by input/output layouts)."""
    if spec.replicate_only:
        return [replicated_strategy(spec, mesh)]
    letters = [ch for ch in _letters_in_order(spec)
               if ch not in spec.unsplittable and spec.sizes.get(ch, 1) > 1]
    batch = [ch for ch in letters if ch in batch_letters]
    can_partial = bool(spec.partial_inputs)
    options = []
    for a in range(mesh.ndim):
        if mesh.shape[a] == 1:
            options.append([None])
        elif mesh.is_data_axis(a):
            options.append(batch + [None] + (["P"] if can_partial and not batch else []))
        else:
            options.append([None] + letters + (["P"] if can_partial else []))
    legal = [s for s in (_make(spec, mesh, c) for c in itertools.product(*options)) if s is not None]
    if batch:
        # Data axes must split a batch letter whenever some legal strategy can.
        data = [a for a in mesh.data_axes() if mesh.shape[a] > 1]
        full = [s for s in legal if all(s.splits[a] in batch for a in data)]
        if full:
            legal = full
        else:
            legal = [s for s in legal if all(s.splits[a] is None for a in data)]
    out, seen = [], set()
    for s in legal:
        key = (s.inputs, s.outputs)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out or [replicated_strategy(spec, mesh)]


def propagate_batch(spec: OpSpec, input_batch_dims: list[frozenset]) -> tuple[frozenset, list[frozenset]]:
    """Which letters carry the batch (from the inputs' batch dims) and the batch dims per output."""
    letters = set()
    for ls, dims in zip(spec.inputs, input_batch_dims):
        if ls is None:
            continue
        letters |= {ls[d] for d in dims if d < len(ls)}
    letters = frozenset(ch for ch in letters if ch not in spec.unsplittable)
    outs = [frozenset(d for d, ch in enumerate(o) if ch in letters) for o in spec.outputs]
    return letters, outs
