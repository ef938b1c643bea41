"""Saved copies made by resharding: the activation bytes of a chosen plan that node pricing cannot
see, because they depend on two ops' strategies.

Node pricing (autopar/pricing/saved_roots.py) charges each storage an op saves once, to its first
saver, under that saver's layout. But an op that reads its input through a reshard (an
all-gather, a slice, an all-to-all, an all-reduce: codegen/per_rank.py emits one per consumer
input) saves the reshard's new tensor, not the producer's storage. Under Megatron-SP a norm saves
its sequence-split input while the multiply after it saves the all-gathered copy; a row-parallel
linear saves the column slice of a replicated attention output while the attention saves the
whole. Whether an input is resharded depends on the producer's strategy as well as the
consumer's, so the ILP's memory rows (node terms only) leave it out.

``copy_bytes(c, P, pick)`` evaluates it exactly for a chosen plan, per consumer node: every saved
input read through a reshard that another op already charged is one more storage (its bytes under
the consumer's layout); when the charging op itself read a copy, the producer's storage, still
saved by a direct reader, is one more too. ``row_extra`` turns that into bytes per memory
constraint of a solved Problem (nodes of a checkpointed group save nothing), which
autopar/search/outer.py adds to the solution's memory and checks against the budget.
"""
from __future__ import annotations

from collections import defaultdict

from autopar.pricing.edge_price import _source_layout
from autopar.pricing.local_bytes import block_fraction
from autopar.rules.candidates import Candidates
from autopar.rules.layout import Layout


def _normal(lay: Layout, mesh_shape) -> tuple:
    """The layout with size-1 mesh axes dropped (as codegen compares them): (dims, partial)."""
    keep = [s > 1 for s in mesh_shape]
    return (tuple(tuple(a for a in axes if keep[a]) for axes in lay.dims),
            frozenset(a for a in lay.partial if keep[a]))


def _read_as(c: Candidates, v: str, i: int, pick: dict[str, int]) -> tuple[bool, Layout] | None:
    """(whether consumer ``v`` reads its input ``i`` through a reshard that makes a new tensor,
    the layout it reads it in), or None when the producer is not part of the plan."""
    info = c.nodes[v]
    ins = c.inputs(info.node)
    if i >= len(ins) or ins[i].name not in c.nodes:
        return None
    prod = c.nodes[ins[i].name]
    if prod.rep not in pick or v not in pick:
        return None
    st = info.strategies[pick[v]]
    src = _source_layout(prod, info.node, prod.strategies[pick[prod.rep]])
    dst = st.inputs[i] if i < len(st.inputs) and st.inputs[i] is not None else src
    (sd, sp), (dd, dp) = _normal(src, c.mesh.shape), _normal(dst, c.mesh.shape)
    # moving data (gather, slice, all-to-all) or summing partials makes a new tensor; only
    # turning a whole tensor partial (no data moves on the rank that keeps it) does not
    return (sd != dd or bool(sp - dp)), dst


def _copied_upstream(c: Candidates, name: str, pick: dict[str, int]) -> bool:
    """Whether the chain of views from a storage root down to node ``name`` (nodes of the same
    ``storage_root``, through a tuple-returning op such as ``split``) has a reshard that makes a
    new tensor: then ``name`` is a view of that copy, not of the root (a row-parallel linear
    reading a column slice, taken before the reshape, of a replicated attention output)."""
    root = c.storage_root.get(name, name)
    seen = set()
    while name != root and name not in seen and name in c.nodes:
        seen.add(name)
        ins = c.inputs(c.nodes[name].node)
        if not ins:
            return False
        got = _read_as(c, name, 0, pick)
        if got is not None and got[0]:
            return True
        up = ins[0]
        if c.storage_root.get(up.name, up.name) != root and not isinstance(up.meta.get("val"), (tuple, list)):
            return False
        name = up.name
    return False


def _local_alias(c: Candidates, name: str, pick: dict[str, int]) -> str | None:
    """The node whose storage node ``name``'s local block aliases, when ``name`` is a view-like op
    (reshape, flatten, ...) that makes a new storage in the trace but only a view on a rank: the
    chain of view ops back to a non-view base is replayed on meta tensors of the local shapes.
    Hugging Face's ``repeat_kv`` (expand, then reshape) copies the key and value heads, but with
    one local key/value head (tensor parallelism over them) the reshape is a view. None otherwise."""
    import torch

    from autopar.pricing.saved_roots import _VIEWISH
    from autopar.rules.localize import local_call, local_out_shape

    chain = []
    n = name
    while True:
        info = c.nodes.get(n)
        op = getattr(getattr(info, "node", None), "target", None)
        if info is None or info.kind != "op" or getattr(getattr(op, "overloadpacket", None), "__name__", "") not in _VIEWISH:
            break
        ins = c.inputs(info.node)
        if len(ins) != 1 or len(info.node.all_input_nodes) != 1 or ins[0].name not in c.nodes:
            return None
        chain.append(n)
        n = ins[0].name
    base = c.nodes.get(n)
    if not chain or base is None or base.kind != "op" or base.rep not in pick or base.spec is None:
        return None
    try:
        val = base.node.meta["val"]
        x = torch.empty(local_out_shape(base.node, base.spec, base.strategies[pick[base.rep]], c.mesh.shape),
                        dtype=val.dtype, device="meta")
        st = x.untyped_storage()
        for m in reversed(chain):
            info = c.nodes[m]
            if info.rep not in pick:
                return None
            call = local_call(info.node, info.spec, info.strategies[pick[info.rep]], c.mesh.shape)
            args = [x if getattr(a, "name", None) == info.node.all_input_nodes[0].name else a for a in call.args]
            x = call.target(*args, **call.kwargs)
    except Exception:   # a shape the replay cannot reproduce: keep the traced storage
        return None
    return n if x.untyped_storage() is st else None


def copy_bytes(c: Candidates, P, pick: dict[str, int]) -> dict[str, float]:
    """Node -> saved bytes (per micro-batch, all repeats, as ``P.saved``) that the chosen plan
    ``pick`` (node -> strategy index) saves beyond ``P.saved``, negative where it saves less.

    Each distinct storage a rank saves counts once, to the first node that saves it: a root
    charged by node pricing (``P.saved_by_root``) under its charger's bytes; a saved input read
    through a reshard, as a copy of its own under the reader's layout; a saved input whose root
    is, on a rank, a view of another node's output (``_local_alias``), as that node's storage. A
    root whose charger read a copy is still saved by its direct readers. The result is those
    bytes minus what node pricing charged, node by node."""
    charge: dict = {}                 # storage key -> (first saver, bytes)
    charged_by: dict[str, float] = defaultdict(float)
    for n, roots in P.saved_by_root.items():
        if n in pick:
            for root, arr in roots.items():
                b = float(arr[pick[n]])
                charged_by[n] += b
                charge.setdefault(root, (n, b))
    alias: dict[str, str | None] = {}
    moved: set[str] = set()           # charged roots that are not what the rank saves
    direct, exact = [], defaultdict(float)
    for v, entries in P.saved_inputs.items():
        if v not in pick:
            continue
        x = c.inputs(c.nodes[v].node)
        for i, root, here, nbytes in entries:
            got = _read_as(c, v, i, pick)
            if got is None:
                continue
            copied, lay = got
            if copied or _copied_upstream(c, x[i].name, pick):
                exact[v] += nbytes * block_fraction(lay, c.mesh)     # the reshard's own tensor
                if here:
                    moved.add(root)
                continue
            if root not in alias:
                alias[root] = _local_alias(c, root, pick)
            base = alias[root]
            if base is None:
                direct.append((v, root, nbytes * block_fraction(lay, c.mesh)))
                continue
            moved.add(root)
            b = c.nodes[base]
            numel = b.node.meta["val"].numel() / max(1, x[i].meta["val"].numel())
            charge.setdefault(c.storage_root.get(base, base),
                              (v, nbytes * numel * block_fraction(b.strategies[pick[b.rep]].outputs[0], c.mesh)))
    for v, root, size in direct:
        if root in moved:             # its charger read a copy (or a view of another): saved here
            charge.setdefault(("direct", root), (v, size))
    for key, (n, b) in charge.items():
        if key not in moved:
            exact[n] += b
    return {n: exact[n] - charged_by[n] for n in set(exact) | set(charged_by) if exact[n] != charged_by[n]}


def row_extra(problem, sol, extra: dict[str, float]) -> dict[str, float]:
    """Bytes to add to each memory constraint of a solved Problem for ``extra`` (``copy_bytes``):
    every constraint holds all saved activations (autopar/search/build.py), except those of
    nodes in a checkpoint group the solution recomputes."""
    if not extra:
        return {m.name: 0.0 for m in problem.memory}
    dropped = set()
    for g, on in zip(problem.checkpoint_groups, sol.checkpoint):
        if on:
            dropped.update(problem.node_names[i] for i, _ in g.saved)
    total = sum(b for n, b in extra.items() if n not in dropped)
    return {m.name: total for m in problem.memory}


def with_copy_terms(problem, c: Candidates, P, pick: dict[str, int], seen: set):
    """``problem`` with memory terms for the copies the plan ``pick`` made, assuming each
    producer keeps its strategy: a consumer whose input reaches it through a reshard is charged,
    per strategy of its own, the bytes of the copy that strategy would save. The ILP then sees
    the copies of the neighbourhood of a plan and can trade them against the rest (the exact
    bytes of what it picks are still ``copy_bytes``'). Terms go to the consumer's checkpoint group
    when it has one (a recomputed block saves nothing), else to every memory constraint. ``seen``
    holds the (consumer, input, producer strategy) already added across calls."""
    import dataclasses

    import numpy as np

    index = {n: i for i, n in enumerate(problem.node_names)}
    kept = getattr(problem, "kept", None)
    group_of = {}
    for gi, g in enumerate(problem.checkpoint_groups):
        for ni, _ in g.saved:
            group_of.setdefault(ni, gi)
    plain, grouped = [], {}
    for v, entries in P.saved_inputs.items():
        if v not in pick or v not in index:
            continue
        info = c.nodes[v]
        ins = c.inputs(info.node)
        for i, _root, here, nbytes in entries:
            got = _read_as(c, v, i, pick)
            if here or got is None or not got[0] or i >= len(ins):
                continue    # (a charger's copy is what node pricing charged it for)
            prod = c.nodes[ins[i].name]
            key = (v, i, pick[prod.rep])
            if key in seen:
                continue
            seen.add(key)
            src = _normal(_source_layout(prod, info.node, prod.strategies[pick[prod.rep]]), c.mesh.shape)
            arr = np.zeros(len(info.strategies))
            for t, st in enumerate(info.strategies):
                dst = st.inputs[i] if i < len(st.inputs) and st.inputs[i] is not None else None
                if dst is not None and _normal(dst, c.mesh.shape) != src:
                    arr[t] = nbytes * block_fraction(dst, c.mesh)
            ni = index[v]
            term = (ni, arr[kept[ni]] if kept is not None else arr)
            if ni in group_of:
                grouped.setdefault(group_of[ni], []).append(term)
            else:
                plain.append(term)
    if not plain and not grouped:
        return problem
    memory = [dataclasses.replace(m, terms=list(m.terms) + plain) for m in problem.memory]
    groups = [dataclasses.replace(g, saved=list(g.saved) + grouped.get(gi, []))
              for gi, g in enumerate(problem.checkpoint_groups)]
    out = dataclasses.replace(problem, memory=memory, checkpoint_groups=groups)
    out.kept = kept
    return out
