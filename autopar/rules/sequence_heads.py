"""Explicit (matmul/softmax) attention run as Ulysses on a sequence axis: which letter
of each attention-core op carries the heads (``head_letters``), the head-split strategies the
core's ops get on the axis (``head_split_strategies``: the edges into and out of the core become
reshard all-to-alls, sequence dim <-> head dim), and the pinned mode's check that every core runs
head-split (``check_heads_split``). Called by autopar/rules/sequence.py's ``restrict``."""
from __future__ import annotations

import math
import operator

from autopar.errors import PlanError
from autopar.mesh import Mesh
from autopar.rules.layout import Layout
from autopar.rules.strategy import Strategy
from autopar.rules.attention_core import attention_cores, is_anchor
from autopar.rules.table import input_dim_sets, tensor_inputs

HEAD_TAG = "[ulysses-heads]"   # in the names of head-split strategies: what `autopar show` prints per op


def head_letters(graph, nodes: dict, order: list[str], seq: dict[str, frozenset]) -> dict[str, str]:
    """Per op node of an explicit (matmul/softmax) attention core: the letter of its spec that
    carries the attention heads, for the ops that have one.

    Seeded at each core's softmax (its letters that are neither batch, sequence, the softmax dim
    nor size 1: the heads), then propagated through the core's specs in both directions (a
    letter shared by an op's inputs and outputs is one dimension) until nothing changes.
    Grouped-query K/V repeated by expand + reshape (Hugging Face ``repeat_kv``) carry the letter
    back to the kv heads: the reshape's leading letter is shared with the kv-head dim, so kv heads
    that divide by sp move before the repeat. A ``repeat_interleave`` keeps its repeated dim
    whole (ops_shape.py), so there the repeated heads move. Propagation stays inside the core:
    the q/k/v and output projections keep the sequence split, so the head split begins and
    ends on the core's edges (the all-to-alls)."""
    core = []
    for cores in attention_cores(graph).values():
        for names in cores:
            core.extend(n for n in names if n in nodes and nodes[n].kind == "op")
    inside = set(core)
    core = [n for n in order if n in inside]   # graph order: one forward sweep settles most of it

    def barred(name):   # letters that are never heads at this node: batch, sequence, size 1, unsplittable
        info = nodes[name]
        spec = info.spec
        batch = {ls[d] for ls, dims in zip(spec.outputs, info.batch_dims) for d in dims if d < len(ls)}
        return batch | set(seq.get(name, ())) | set(spec.unsplittable) | {
            ch for ch, size in spec.sizes.items() if size <= 1}

    dims: dict[str, list[frozenset]] = {}   # node -> per output: its head dims
    for name in core:
        info = nodes[name]
        if is_anchor(info.node) and info.spec.rule != "sdpa" and info.spec.outputs:
            out = info.spec.outputs[0]
            bad = barred(name)
            dims[name] = [frozenset(d for d, ch in enumerate(out) if ch not in bad)] + \
                [frozenset()] * (len(info.spec.outputs) - 1)
    letters: dict[str, frozenset] = {}
    changed = bool(dims)
    while changed:
        changed = False
        for name in core:
            info = nodes[name]
            node, spec = info.node, info.spec
            ins = tensor_inputs(node)
            got = set()
            for ls, ds in zip(spec.inputs, input_dim_sets(node, dims, ins)):
                if ls is not None:
                    got |= {ls[d] for d in ds if d < len(ls)}
            for o, ds in zip(spec.outputs, dims.get(name, ())):
                got |= {o[d] for d in ds if d < len(o)}
            got = frozenset(got - barred(name))
            if got == letters.get(name, frozenset()):
                continue
            letters[name] = got
            changed = True
            dims[name] = [frozenset(d for d, ch in enumerate(o) if ch in got) for o in spec.outputs]
            for p, ls in zip(ins, spec.inputs):
                if ls is None or p.name not in inside:
                    continue
                idx = node.args[1] if node.target is operator.getitem else 0
                have = dims.setdefault(p.name, [frozenset()] * len(nodes[p.name].spec.outputs))
                if idx < len(have):
                    have[idx] = have[idx] | frozenset(d for d, ch in enumerate(ls) if ch in got)
    # one head letter per op; an op where two letters claim to be heads is left alone (ambiguous)
    return {n: next(iter(ls)) for n, ls in letters.items() if len(ls) == 1}


def head_split_strategies(spec, strategies, mesh: Mesh, a: int, head: str) -> list[Strategy]:
    """Each strategy replicated on sequence axis ``a`` made head-split there: ``a`` appended as
    the innermost split of every dim carrying the ``head`` letter. Innermost, so that with heads
    already split over a tensor axis (Megatron) each tensor rank's heads split over ``a`` -- the
    layout one reshard all-to-all reaches from a sequence split (autopar/pricing/reshard.py
    appends the axis innermost), the way DeepSpeed-Ulysses nests inside tensor parallelism."""
    sp = mesh.shape[a]
    out, seen = [], set()
    for st in strategies:
        if st.splits[a] is not None:
            continue
        factor = math.prod(mesh.shape[x] for x, s in enumerate(st.splits) if s == head)
        if spec.sizes.get(head, 1) % (factor * sp):
            continue

        def add(lay: Layout | None, letters: str | None) -> Layout | None:
            if lay is None or letters is None:
                return lay
            return Layout(tuple(axes + (a,) if ch == head else axes for axes, ch in zip(lay.dims, letters)),
                          lay.partial)

        ins = tuple(add(l, ls) for l, ls in zip(st.inputs, spec.inputs))
        outs = tuple(add(l, o) for l, o in zip(st.outputs, spec.outputs))
        if (ins, outs) in seen:
            continue
        seen.add((ins, outs))
        splits = list(st.splits)
        splits[a] = head
        name = "" if st.name == "R" else st.name
        name = (name + " " if name else "") + f"S({head})@{mesh.names[a]} {HEAD_TAG}"
        out.append(Strategy(name, ins, outs, tuple(splits), st.work_fraction / sp, st.comms, st.special,
                            st.backward_comms))
    return out


def check_heads_split(graph, nodes: dict, heads: dict[str, str], mesh: Mesh, sps) -> None:
    """Pinned Ulysses: every explicit attention's softmax must run head-split (a head letter found
    and dividing by sp on some strategy), else a PlanError naming the op."""
    a = sps[0]
    sp = mesh.shape[a]
    for cores in attention_cores(graph).values():
        for names in cores:
            for name in names:
                info = nodes.get(name)
                if info is None or info.kind != "op" or not is_anchor(info.node) or info.spec.rule == "sdpa":
                    continue
                ch = heads.get(name)
                if ch is None:
                    raise PlanError(f"{name} ({info.node.target}, explicit attention): sp_mode='ulysses' splits its "
                                    f"heads over sp={sp} ranks, but no dim of it could be told to be the heads (not "
                                    f"batch, sequence or the softmax dim); pin only sp (the attention then runs "
                                    f"sequence-split with K/V all-gathered)")
                if not any(st.splits[a] == ch for st in info.strategies):
                    raise PlanError(f"{name} ({info.node.target}, explicit attention): sp_mode='ulysses' splits its "
                                    f"{info.spec.sizes[ch]} heads over sp={sp} ranks, but the heads (on each "
                                    f"tensor-parallel rank) do not divide by {sp}; use an sp that divides the head "
                                    f"count, or pin only sp (the attention then runs sequence-split with K/V "
                                    f"all-gathered)")
