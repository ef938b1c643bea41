"""The storages a rank really saves, for a chosen plan: what node pricing cannot see, because it
depends on two ops' strategies.

Node pricing (autopar/pricing/saved_roots.py) charges each storage an op saves once, to its first
saver, under that saver's layout, with the storages of the trace (global shapes, no reshards).
On a rank two things differ:

- an op that reads its input through a reshard (codegen/reshard_calls.py, one per consumer
  input) saves the reshard's result. An all-gather, all-to-all, reduce-scatter or all-reduce
  makes a new tensor; a slice is a view when the block it keeps is contiguous in the value's
  memory order and a copy otherwise (``runtime.collectives._blocks``); a zig-zag slice is always
  a copy. Under Megatron-SP a norm saves its sequence-split input and the multiply after it the
  all-gathered copy; two linears reading one tensor through an all-gather each save their own.
- a view op can be a view on a rank where the trace copied (Hugging Face ``repeat_kv``'s reshape
  of an expanded key with one local key/value head), or the reverse (a reshape of a sliced block).

``copy_bytes(c, P, pick)`` replays, for every activation input an op saves, the chain from the
nearest non-view node through the view ops and the reshards of the plan on meta tensors of the
local shapes, and names the storage the rank ends up saving. Every distinct storage counts once,
to its first saver; the result is the difference from node pricing, per node. ``row_extra`` turns
it into bytes per memory constraint of a solved Problem (nodes of a checkpointed group save
nothing), which autopar/search/outer.py adds to the solution's memory and checks against the
budget; ``with_copy_terms`` gives the ILP the copies of a plan's neighbourhood for a re-solve.
A repeated block's instances are replayed per group whose producers are alike (the first block
reads the prologue, the others the block before): ``copy_bytes_by_instance`` gives each graph
node its share, which autopar/search/stage_costs.py puts on that instance's pipeline stage.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from collections import defaultdict

import numpy as np
import torch

from autopar.pricing.edge_price import _source_layout
from autopar.pricing.local_bytes import block_fraction
from autopar.pricing.regather import consumer_keeps_shard, single_gather
from autopar.pricing.saved_roots import _VIEWISH
from autopar.rules.candidates import Candidates
from autopar.rules.layout import Layout, memory_order
from autopar.rules.localize import local_call
from autopar.rules.sequence_attention import RING

# ops returning a tuple of views of their input (read through getitem)
_TUPLE_VIEWS = {"split", "split_with_sizes", "chunk", "unbind", "tensor_split"}


def _op_name(node) -> str:
    return getattr(getattr(node.target, "overloadpacket", None), "__name__", "")


def zigzag_axes(c: Candidates, pick: dict[str, int]) -> set[int]:
    """Mesh axes whose splits the plan makes zig-zag (load-balanced ring attention runs on them)."""

    axes = set()
    for n, k in pick.items():
        info = c.nodes.get(n)
        st = info.strategies[k] if info is not None and k < len(info.strategies) else None
        if st is not None and RING in (st.special or ()):
            axes |= {a for a, s in enumerate(st.splits) if s == "s"}
    return axes


def _read_as(c: Candidates, v: str, i: int, pick: dict[str, int]) -> tuple[Layout, Layout] | None:
    """(the producer's layout, the layout consumer ``v``'s strategy reads its input ``i`` in), or
    None when the producer is not part of the plan."""
    info = c.nodes[v]
    ins = c.inputs(info.node)
    if i >= len(ins) or ins[i].name not in c.nodes:
        return None
    prod = c.nodes[ins[i].name]
    if prod.rep not in pick or info.rep not in pick:
        return None
    st = info.strategies[pick[info.rep]]
    src = _source_layout(prod, info.node, prod.strategies[pick[prod.rep]])
    dst = st.inputs[i] if i < len(st.inputs) and st.inputs[i] is not None else src
    return src, dst


def _slices_only(src: Layout, dst: Layout) -> bool:
    """Whether going from ``src`` to ``dst`` only keeps blocks (more splits, nothing gathered,
    moved or summed): each dim's axes in ``src`` lead its axes in ``dst``."""
    return src.partial == dst.partial and all(d[:len(s)] == s for s, d in zip(src.dims, dst.dims))


def _reshard(t: torch.Tensor, val, src: Layout, dst: Layout, mesh_shape, zz: set[int]) -> torch.Tensor:
    """``t`` (a rank's block under ``src``) after the reshard to ``dst``, on meta: kept blocks
    sliced as ``runtime.collectives._blocks`` slices them (in ``val``'s memory order, made
    contiguous), anything else a new tensor laid out in that order."""
    order = memory_order(val)
    new_axes = [a for s, d in zip(src.dims, dst.dims) for a in d[len(s):]]
    if _slices_only(src, dst) and not zz.intersection(new_axes):
        p = t.permute(order) if order else t
        for dim, (s, d) in enumerate(zip(src.dims, dst.dims)):
            f = math.prod(mesh_shape[a] for a in d[len(s):])
            if f > 1:
                pd = order.index(dim) if order else dim
                p = torch.chunk(p, f, dim=pd)[0].contiguous()
        return p.permute([order.index(d) for d in range(len(order))]) if order else p
    shape = dst.local_shape(tuple(val.shape), mesh_shape)
    if order:
        return torch.empty([shape[d] for d in order], dtype=t.dtype, device="meta").permute(
            [order.index(d) for d in range(len(order))])
    return torch.empty(shape, dtype=t.dtype, device="meta")


def _local_value(c: Candidates, name: str, pick: dict[str, int], order: str | None = None) -> torch.Tensor | None:
    """A meta tensor of node ``name``'s local output, contiguous or laid out in ``order`` (its
    output letters, outermost first), or None."""
    info = c.nodes.get(name)
    val = info.node.meta.get("val") if info is not None else None
    if info is None or info.rep not in pick or not isinstance(val, torch.Tensor) or not info.strategies:
        return None
    lay = info.strategies[pick[info.rep]].outputs[0]
    if lay is None or lay.ndim != val.ndim:
        return None
    shape = lay.normalized(c.mesh.shape).local_shape(tuple(val.shape), c.mesh.shape)
    letters = info.spec.outputs[0] if info.spec is not None and info.spec.outputs else ""
    if order and len(letters) == len(shape) and sorted(order) == sorted(letters):
        size = dict(zip(letters, shape))
        return torch.empty([size[ch] for ch in order], dtype=val.dtype, device="meta").permute(
            [order.index(ch) for ch in letters])
    return torch.empty(shape, dtype=val.dtype, device="meta")


def saved_storage(c: Candidates, v: str, i: int, pick: dict[str, int], zz: set[int], orders: dict | None = None):
    """(storage key, its local bytes in the traced dtype, kept) of what consumer ``v`` saves as its
    input ``i`` on a rank, or None when the chain cannot be replayed; ``kept``: a linear keeping
    the shard of its all-gathered input (autopar/pricing/regather.py), which is what it saves.
    Keys: a node name for a storage that node's kernel (or view op) made, ("copy", m, j) for the
    result of the reshard into node
    m's input j. ``orders``: op -> the memory order its kernel lays its output out in on the
    device (``Priced.storage_order``: flash attention's output is laid out like q)."""
    mesh = c.mesh.shape
    chain, n = [], c.inputs(c.nodes[v].node)[i].name
    while n in c.nodes and len(chain) < 64:
        node = c.nodes[n].node
        ins = c.inputs(node)
        view = _op_name(node) in _VIEWISH or _op_name(node) in _TUPLE_VIEWS or (
            node.target is operator.getitem and ins and _op_name(ins[0]) in _TUPLE_VIEWS)
        if not view or len(ins) != 1 or ins[0].name not in c.nodes:
            break
        chain.append(n)
        n = ins[0].name
    t = _local_value(c, n, pick, (orders or {}).get(n))
    if t is None:
        return None
    key, st = c.storage_root.get(n, n), t.untyped_storage()
    kept = False
    try:
        for m, j in [(m, 0) for m in reversed(chain)] + [(v, i)]:
            node = c.nodes[m].node
            if node.target is operator.getitem:
                t = t[node.args[1]]
            lays = _read_as(c, m, j, pick)
            if lays is None:
                return None
            src, dst = (x.normalized(mesh) for x in lays)
            if m == v and src != dst and _keeps_shard(c, v, i) and single_gather(src, dst):
                kept = True    # the linear saves the shard it gathers again in backward (regather.py)
                break
            if src != dst:
                val = node.meta["val"] if node.target is operator.getitem else c.inputs(node)[j].meta["val"]
                t = _reshard(t, val, src, dst, mesh, zz)
                if t.untyped_storage() is not st:
                    key, st = ("copy", m, j), t.untyped_storage()
            if m == v or node.target is operator.getitem:
                continue
            info = c.nodes[m]
            call = local_call(node, info.spec, info.strategies[pick[info.rep]], mesh)
            arg = node.all_input_nodes[0].name
            t = call.target(*[t if getattr(a, "name", None) == arg else a for a in call.args], **call.kwargs)
            if isinstance(t, torch.Tensor) and t.untyped_storage() is not st:
                key, st = m, t.untyped_storage()
    except Exception:      # a shape the replay cannot reproduce: keep node pricing's storage
        return None
    return key, st.nbytes(), kept


def _keeps_shard(c: Candidates, v: str, i: int) -> bool:
    return consumer_keeps_shard(c, c.nodes[v], i)


def copy_bytes(c: Candidates, P, pick: dict[str, int]) -> dict[str, float]:
    """Node -> saved bytes (per micro-batch, all repeats, as ``P.saved``) that the chosen plan
    ``pick`` (node -> strategy index) saves beyond ``P.saved``, negative where it saves less.

    A root node pricing charged for an op's own output is saved as charged. Each saved input is
    replayed (``saved_storage``): when it ends in a storage node pricing charged, it shares it;
    else it is one more storage, of its replayed bytes. A root charged to an input saver that no
    saver ends in is not saved at all."""
    return per_representative(c, copy_bytes_by_instance(c, P, pick))


def per_representative(c: Candidates, by_node: dict[str, float]) -> dict[str, float]:
    """``copy_bytes_by_instance`` summed per representative (the ILP's and node pricing's rows)."""
    out: dict[str, float] = defaultdict(float)
    for u, b in by_node.items():
        out[c.nodes[u].rep] += b
    return {n: b for n, b in out.items() if abs(b) > NOISE}


NOISE = 1e-6   # bytes: below a micro-byte a difference is float summing noise


ALL = "all"   # a storage key's instance mark: every instance of the saver's repeated block


def copy_bytes_by_instance(c: Candidates, P, pick: dict[str, int]) -> dict[str, float]:
    """``copy_bytes`` per graph node: a repeated block's representative stands for its
    instances, and their inputs need not be alike. The first instance reads the prologue (an
    embedding) where the others read the previous instance, so a reshard that copies into the
    first instance only is one copy, not one per repeat (a Llama under Megatron-SP with a
    replicated embedding: 4 KB a stage counted twice). Each saved input is
    replayed once per group of instances whose producer is alike (same representative) and
    charged to those instances; storages are told apart by (representative name, the instances
    that save them)."""
    input_charge = {(v, root) for v, entries in P.saved_inputs.items() for _, root, here, _ in entries if here}
    saved: dict = {}                  # (storage key, instances) -> (first saver's nodes, bytes)
    charged_by: dict[str, float] = defaultdict(float)
    by_input: dict[str, float] = {}   # input-charged root -> its charged bytes
    for n, roots in P.saved_by_root.items():
        if n in pick:
            for root, arr in roots.items():
                b = float(arr[pick[n]])
                charged_by[n] += b
                if (n, root) in input_charge:
                    by_input.setdefault(root, b)
                else:
                    saved.setdefault((root, ALL), (c.instances(n), b))
    zz = zigzag_axes(c, pick)

    def canon(key):
        if isinstance(key, tuple):   # ("copy", m, j): the reshard into node m's input j
            return ("copy", c.nodes[key[1]].rep if key[1] in c.nodes else key[1], key[2])
        return c.nodes[key].rep if key in c.nodes else key

    for v, entries in P.saved_inputs.items():
        if v not in pick:
            continue
        mine = c.instances(v)
        for i, root, _here, nbytes in entries:
            groups: dict = defaultdict(list)   # the producer's representative -> instances
            for k, u in enumerate(mine):
                ins = c.inputs(c.nodes[u].node)
                p = ins[i].name if i < len(ins) else None
                groups[c.nodes[p].rep if p in c.nodes else p].append(k)
            for ks in groups.values():
                u = mine[ks[0]]
                mark = ALL if len(ks) == len(mine) else frozenset(ks)
                w = len(ks) / len(mine)
                got = saved_storage(c, u, i, pick, zz, P.storage_order)
                key, local, kept = (root, None, False) if got is None else (canon(got[0]), got[1], got[2])
                if (key, mark) in saved or (key, ALL) in saved:
                    continue
                nodes = [mine[k] for k in ks]
                if key == root and root in by_input and not kept:
                    saved[(key, mark)] = (nodes, by_input[root] * w)
                elif local is not None:
                    # replayed bytes in the traced dtype of one rank, at nbytes' scale (working
                    # dtype, micro-batch, repeats)
                    x = c.inputs(c.nodes[u].node)[i]
                    numel = x.meta["val"].numel() * x.meta["val"].element_size()
                    saved[(key, mark)] = (nodes, local * nbytes * w / max(1, numel))
    out: dict[str, float] = defaultdict(float)
    for nodes, b in saved.values():
        for u in nodes:
            out[u] += b / len(nodes)
    for n, b in charged_by.items():   # node pricing's charge, spread over the instances
        mine = c.instances(n)
        for u in mine:
            out[u] -= b / len(mine)
    return {u: b for u, b in out.items() if abs(b) > NOISE}


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
    """``problem`` with memory terms for the copies the plan ``pick`` made on its edges, assuming
    each producer keeps its strategy: a consumer that reads a saved input through a reshard that
    moves data is charged, per strategy of its own, the bytes of the copy that strategy would
    save. The ILP then sees the copies of the neighbourhood of a plan and can trade them against
    the rest (the exact bytes of what it picks are still ``copy_bytes``'). Terms go to the
    consumer's checkpoint group when it has one (a recomputed block saves nothing), else to every
    memory constraint. ``seen`` holds the (consumer, input, producer strategy) added so far."""
    index = {n: i for i, n in enumerate(problem.node_names)}
    kept = getattr(problem, "kept", None)
    group_of: dict[int, int] = {}
    for gi, g in enumerate(problem.checkpoint_groups):
        for ni, _ in g.saved:
            group_of.setdefault(ni, gi)
    mesh = c.mesh.shape
    plain, grouped = [], defaultdict(list)
    for v, entries in P.saved_inputs.items():
        if v not in pick or v not in index:
            continue
        info = c.nodes[v]
        ins = c.inputs(info.node)
        for i, _root, here, nbytes in entries:
            lays = _read_as(c, v, i, pick)
            if here or lays is None or i >= len(ins):
                continue    # (a charger's copy is what node pricing charged it for)
            src = lays[0].normalized(mesh)
            if src == lays[1].normalized(mesh) or _slices_only(src, lays[1].normalized(mesh)):
                continue
            prod = c.nodes[ins[i].name]
            key = (v, i, pick[prod.rep])
            if key in seen:
                continue
            seen.add(key)
            arr = np.zeros(len(info.strategies))
            ks = _keeps_shard(c, v, i)
            for t, st in enumerate(info.strategies):
                dst = st.inputs[i] if i < len(st.inputs) and st.inputs[i] is not None else None
                if dst is None or _slices_only(src, dst.normalized(mesh)):
                    continue
                if ks and single_gather(src, dst.normalized(mesh)):
                    continue    # a linear keeping the shard: no copy saved
                arr[t] = nbytes * block_fraction(dst, c.mesh)
            ni = index[v]
            term = (ni, arr[kept[ni]] if kept is not None else arr)
            if ni in group_of:
                grouped[group_of[ni]].append(term)
            else:
                plain.append(term)
    if not plain and not grouped:
        return problem
    memory = [dataclasses.replace(m, terms=list(m.terms) + plain) for m in problem.memory]
    groups = [dataclasses.replace(g, saved=list(g.saved) + grouped.get(gi, []))
              for gi, g in enumerate(problem.checkpoint_groups)]
    return dataclasses.replace(problem, memory=memory, checkpoint_groups=groups)
