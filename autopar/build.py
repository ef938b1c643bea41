"""From a traced graph, a mesh and the training settings to a torch-free ``Problem``.

This is where the op rules, the layouts, the cost model and the memory model meet:

1. ``candidates``: per node, its candidate strategies on the mesh (op rules for call_function
   nodes, layout choices for parameters and inputs), and which dims carry the batch.
   Depends only on (graph, mesh), so the outer search reuses it for every ZeRO stage and
   micro-batch count on that mesh.
2. ``build_problem``: prices every strategy (compute, special-algorithm communication,
   gradient synchronisation, optimizer step), every edge (resharding, forward + backward),
   and the memory of every liveness set, under one ``Settings``; repeated blocks collapse onto
   their first instance (costs multiplied by the number of repeats).

Units: seconds and bytes only.
"""
from __future__ import annotations

import math
import operator
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from autopar.cluster import Cluster
from autopar.conjugates import region_inputs, step_traffic
from autopar.cost import Collectives, fwd_bwd_compute, optimizer_step_time
from autopar.layout import Layout
from autopar.memory import state_bytes, zero_shard
from autopar.mesh import Mesh
from autopar.reshard import plan_reshard
from autopar.rules import spec_for, tensor_inputs
from autopar.strategy import Strategy, enumerate_strategies, propagate_batch
from autopar.trace import TracedGraph
from solver.problem import CheckpointGroup, Edge, MemoryConstraint, Problem

FORBIDDEN = 1e6   # seconds: a cost no plan will pay (strategies invalid under the micro-batching)

# Ops whose output shares storage with their first input (used to count saved tensors once).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class Settings:
    optimizer: str = "adamw"
    precision: str = "bf16"
    zero: int = 0
    num_micro_batches: int = 1
    budget: float = float("inf")
    overlap_grad_comm: bool = True
    checkpoint: str | None = None   # None: the ILP decides per block group; "none" | "full": pinned


@dataclass
class NodeInfo:
    name: str
    kind: str                       # "param" | "input" | "op"
    node: object                    # the fx node
    strategies: list[Strategy]
    spec: object = None             # OpSpec for ops
    batch_dims: tuple = ()          # per output: frozenset of batch dims
    rep: str = ""                   # representative (first block instance) node name
    repeats: int = 1                # how many nodes this representative stands for


@dataclass
class Candidates:
    """Per-mesh candidate strategies of every node (independent of ZeRO and micro-batching)."""
    graph: TracedGraph
    mesh: Mesh
    nodes: dict[str, NodeInfo]
    order: list[str]                # node names in graph order (params, inputs, ops)
    reps: list[str]                 # representative nodes: one ILP variable set each
    storage_root: dict[str, str]    # node -> the node whose storage it aliases
    root_bytes: dict[str, int]      # root -> storage bytes (global, as traced)
    block_of_rep: dict[str, int] = field(default_factory=dict)   # rep op node -> block group index
    needs_grad: set[str] = field(default_factory=set)
    edge_cache: dict = field(default_factory=dict)      # (micro-batches, precision) -> priced edges   # values autograd differentiates (params and what they reach)


def _val(node):
    return node.meta.get("val")


def _tensor_shape(val) -> tuple[int, ...]:
    return tuple(int(s) for s in val.shape)


def _itemsize(dtype, precision: str) -> int:
    """Bytes per element at run time: floating tensors are bf16 under bf16 mixed precision."""
    if dtype in FLOAT_DTYPES and precision == "bf16":
        return 2
    return torch.empty((), dtype=dtype, device="meta").element_size()


def _layout_choices(shape: tuple[int, ...], mesh: Mesh, axes: tuple[int, ...]) -> list[Layout]:
    """Every layout splitting at most one dim per given mesh axis (evenly), others replicated."""
    layouts = [{}]
    for a in axes:
        nxt = []
        for splits in layouts:
            nxt.append(splits)
            for d, size in enumerate(shape):
                used = math.prod(mesh.shape[x] for x in splits.get(d, ()))
                if size % (used * mesh.shape[a]) == 0 and mesh.shape[a] > 1:
                    s = dict(splits)
                    s[d] = s.get(d, ()) + (a,)
                    nxt.append(s)
        layouts = nxt
    out = sorted({Layout.shard(len(shape), s) for s in layouts})
    return out


def _leaf_strategy(name: str, layout: Layout, mesh: Mesh) -> Strategy:
    return Strategy(name=name, inputs=(), outputs=(layout,), splits=tuple(None for _ in mesh.shape),
                    work_fraction=layout.shard_fraction(mesh.shape), comms=())


def megatron_filter(spec, strategies: list[Strategy], mesh: Mesh) -> list[Strategy]:
    """Megatron-style policy: every linear splits its weight over every model axis (column- or
    row-parallel); other ops stay free. Used to price hand-written Megatron configurations."""
    if spec.rule != "linear" or not mesh.model_axes():
        return strategies
    keep = [st for st in strategies
            if all(any(a in axes for axes in st.inputs[1].dims) for a in mesh.model_axes()
                   if mesh.shape[a] > 1)]
    return keep or strategies


def candidates(graph: TracedGraph, mesh: Mesh, policy: str | None = None) -> Candidates:
    gm = graph.gm
    nodes: dict[str, NodeInfo] = {}
    order: list[str] = []
    batch_of: dict[str, tuple] = {}
    model_axes = mesh.model_axes()
    # Block instances after the first reuse the first instance's spec and strategies (same ops,
    # same shapes): enumeration is the expensive part of this function.
    first_of = {}
    for group in graph.blocks:
        for inst in group.instances[1:]:
            for a, b in zip(group.instances[0], inst):
                first_of[b] = a
    memo: dict = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = _val(node)
            if not isinstance(val, torch.Tensor):
                continue
            shape = _tensor_shape(val)
            if node.name in graph.param_fqn:
                layouts = _layout_choices(shape, mesh, model_axes)
                strategies = [_leaf_strategy(l.describe(mesh.names), l, mesh) for l in layouts]
                nodes[node.name] = NodeInfo(node.name, "param", node, strategies, batch_dims=(frozenset(),))
                batch_of[node.name] = (frozenset(),)
            else:
                splits = {}
                if shape and all(shape[0] % mesh.shape[a] == 0 for a in mesh.data_axes()):
                    splits = {0: tuple(a for a in mesh.data_axes() if mesh.shape[a] > 1)}
                lay = Layout.shard(len(shape), splits)
                nodes[node.name] = NodeInfo(node.name, "input", node, [_leaf_strategy(lay.describe(mesh.names), lay, mesh)],
                                            batch_dims=(frozenset({0}) if shape else frozenset(),))
                batch_of[node.name] = nodes[node.name].batch_dims
            order.append(node.name)
        elif node.op == "call_function":
            spec = spec_for(node)
            ins = tensor_inputs(node)
            in_batch = []
            for i, p in enumerate(ins):
                outs = batch_of.get(p.name, (frozenset(),))
                if node.target is operator.getitem:
                    idx = node.args[1]
                    in_batch.append(outs[idx] if idx < len(outs) else frozenset())
                else:
                    in_batch.append(outs[0] if outs else frozenset())
            first = first_of.get(node.name)
            if first is not None and (first, tuple(in_batch)) in memo:
                spec, letters, out_batch, strategies = memo[(first, tuple(in_batch))]
            else:
                letters, out_batch = propagate_batch(spec, in_batch)
                strategies = enumerate_strategies(spec, mesh, letters)
                if policy == "megatron":
                    strategies = megatron_filter(spec, strategies, mesh)
                memo[(node.name, tuple(in_batch))] = (spec, letters, out_batch, strategies)
            batch_of[node.name] = tuple(out_batch)
            nodes[node.name] = NodeInfo(node.name, "op", node, strategies, spec=spec, batch_dims=tuple(out_batch))
            order.append(node.name)
    roots, root_bytes = _storage_roots(gm, nodes)
    cands = Candidates(graph, mesh, nodes, order, [], roots, root_bytes, needs_grad=_needs_grad(gm, nodes, graph.buffers))
    _assign_representatives(cands)
    return cands


def _needs_grad(gm, nodes, buffers) -> set[str]:
    out = {n for n, info in nodes.items() if info.kind == "param" and n not in buffers}
    for node in gm.graph.nodes:
        if node.op == "call_function" and any(p.name in out for p in tensor_inputs(node)):
            val = _val(node)
            vals = val if isinstance(val, (tuple, list)) else (val,)
            if any(isinstance(v, torch.Tensor) and v.dtype in FLOAT_DTYPES for v in vals):
                out.add(node.name)
    return out


def _storage_roots(gm, nodes) -> tuple[dict[str, str], dict[str, int]]:
    """Group values by the storage their fake tensor uses (views share it), first producer wins."""
    first: dict[int, str] = {}
    roots, sizes = {}, {}
    for node in gm.graph.nodes:
        val = _val(node)
        if not isinstance(val, torch.Tensor):
            continue
        try:
            storage = val.untyped_storage()
            key, nbytes = id(storage), int(storage.nbytes())
        except Exception:   # some fake values carry no storage: treat as their own root
            key, nbytes = id(val), int(val.numel() * val.element_size())
        root = first.setdefault(key, node.name)
        roots[node.name] = root
        sizes.setdefault(root, nbytes)
    return roots, sizes


def _assign_representatives(c: Candidates) -> None:
    """Nodes of block instances > 0 (and the parameters only they use) follow instance 0."""
    graph = c.graph
    for name in c.order:
        c.nodes[name].rep = name
    for gi, group in enumerate(graph.blocks):
        first = group.instances[0]
        for inst in group.instances[1:]:
            if len(inst) != len(first):
                continue
            for a, b in zip(first, inst):
                if a in c.nodes and b in c.nodes and len(c.nodes[a].strategies) == len(c.nodes[b].strategies):
                    c.nodes[b].rep = a
        for a in first:
            if a in c.nodes:
                c.block_of_rep[a] = gi
    # Parameters: a parameter used only inside one instance maps to the parameter instance 0 uses
    # at the same (position, argument) place.
    uses: dict[str, list[tuple[str, int]]] = defaultdict(list)
    gm = graph.gm
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        for i, p in enumerate(tensor_inputs(node)):
            if p.name in c.nodes and c.nodes[p.name].kind == "param":
                uses[p.name].append((node.name, i))
    by_place = {}
    for pname, places in uses.items():
        for (user, i) in places:
            by_place[(user, i)] = pname
    for pname, places in uses.items():
        reps = {(c.nodes[u].rep, i) for (u, i) in places}
        if all(c.nodes[u].rep != u for (u, _) in places):
            targets = {by_place.get(r) for r in reps}
            if len(targets) == 1 and None not in targets:
                tgt = targets.pop()
                if len(c.nodes[tgt].strategies) == len(c.nodes[pname].strategies) and tgt != pname:
                    c.nodes[pname].rep = tgt
    counts = defaultdict(int)
    for name in c.order:
        counts[c.nodes[name].rep] += 1
    for name in c.order:
        c.nodes[name].repeats = counts[name] if c.nodes[name].rep == name else 0
    c.reps = [n for n in c.order if c.nodes[n].rep == n]


# ---------------------------------------------------------------- pricing


@dataclass
class Priced:
    """Per-representative cost and memory arrays under one Settings (also used by predictions)."""
    compute: dict[str, np.ndarray]          # fwd+bwd compute, all repeats
    fwd_compute: dict[str, np.ndarray]      # forward only (recompute cost), all repeats
    comm: dict[str, np.ndarray]             # in-op algorithm comm + gradient sync, all repeats
    optimizer: dict[str, np.ndarray]
    grad_comm: dict[str, np.ndarray]        # the overlappable part of comm
    static: dict[str, dict[str, np.ndarray]]   # param -> {params, grads, optimizer} bytes, all repeats
    saved: dict[str, np.ndarray]            # activation bytes per micro-batch, all repeats
    transient: dict[str, np.ndarray]        # output bytes per micro-batch (one instance)
    edges: dict[tuple[str, str], np.ndarray]
    comm_bytes: dict[str, list[np.ndarray]]  # per node: per mesh axis bytes per strategy (all repeats)
    edge_bytes: dict[tuple[str, str], list[np.ndarray]]
    valid: dict[str, np.ndarray] = field(default_factory=dict)   # strategies whose layouts divide a micro-batch


def _fraction(layout: Layout | None, mesh: Mesh) -> float:
    return 1.0 if layout is None else layout.shard_fraction(mesh.shape)


def _letter_fraction(letters: str, strat: Strategy, mesh: Mesh) -> float:
    f = 1.0
    for a, split in enumerate(strat.splits):
        if split is not None and split != "P" and split in letters:
            f /= mesh.shape[a]
    return f


def _has_contraction(spec) -> bool:
    out = set("".join(spec.outputs))
    return any(ch not in out for ins in spec.inputs if ins for ch in ins)


def price(c: Candidates, cluster: Cluster, s: Settings, edges: bool = True) -> Priced:
    """Price every node under ``s``; with ``edges`` also the resharding matrices (the costly
    part: the outer search prices them only for configurations its lower bound keeps)."""
    P = price_nodes(c, cluster, s)
    if edges:
        price_edges(c, cluster, s, P)
    return P


def price_edges(c: Candidates, cluster: Cluster, s: Settings, P: Priced) -> None:
    key = (s.num_micro_batches, s.precision)
    if key not in c.edge_cache:   # edges depend on micro-batching and precision only, not on ZeRO
        _price_edges(c, cluster, s, Collectives(cluster, c.mesh), P)
        c.edge_cache[key] = (P.edges, P.edge_bytes)
    P.edges, P.edge_bytes = c.edge_cache[key]


def price_nodes(c: Candidates, cluster: Cluster, s: Settings) -> Priced:
    mesh = c.mesh
    comm = Collectives(cluster, mesh)
    device = cluster.device
    nm = s.num_micro_batches
    dtype = "bf16" if s.precision == "bf16" else "fp32"
    dp = math.prod(mesh.shape[a] for a in mesh.data_axes())
    P = Priced({}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {})
    charged_roots: set[str] = set()
    for name in c.order:
        info = c.nodes[name]
        if info.rep != name:
            continue
        k = info.repeats
        S = len(info.strategies)
        compute = np.zeros(S)
        fwd = np.zeros(S)
        comm_t = np.zeros(S)
        grad_t = np.zeros(S)
        opt_t = np.zeros(S)
        saved = np.zeros(S)
        transient = np.zeros(S)
        axis_bytes = [np.zeros(S) for _ in mesh.shape]
        static = {"params": np.zeros(S), "grads": np.zeros(S), "optimizer": np.zeros(S)}
        val = _val(info.node)
        if info.kind == "param":
            numel = val.numel()
            for j, st in enumerate(info.strategies):
                local = numel * st.outputs[0].shard_fraction(mesh.shape)
                sb = zero_shard(state_bytes(local, s.optimizer, s.precision), s.zero, dp)
                if name not in c.needs_grad:   # a buffer: stored, never trained
                    sb = {"params": local * _itemsize(val.dtype, s.precision), "grads": 0, "optimizer": 0}
                for key in static:
                    static[key][j] = sb[key] * k
                if name not in c.needs_grad:
                    continue
                opt_local = local / (dp if s.zero >= 1 else 1)
                opt_t[j] = optimizer_step_time(opt_local, s.optimizer, s.precision, device) * k
                gbytes = local * (2 if s.precision == "bf16" else 4)
                pbytes = local * (2 if s.precision == "bf16" else 4)
                for a in mesh.data_axes():
                    if mesh.shape[a] == 1:
                        continue
                    if s.zero == 0:
                        t = comm("all_reduce", gbytes, a)
                        axis_bytes[a][j] += gbytes * k
                        grad_t[j] += t * k
                    else:
                        # As runtime/zero.py runs it (checked by tests/test_predictions_measured.py):
                        # stages 2/3 reduce-scatter each micro-batch's gradient as soon as backward
                        # produced it (the full gradient is not kept across micro-batches), stage 1
                        # once per step; stages 1/2 all-gather the updated shards after the step,
                        # stage 3 does not (it keeps only the shard: the next forward's gather,
                        # priced below, is that all-gather). ZeRO-3 total: 3x params (ZeRO paper).
                        n_rs = nm if s.zero >= 2 else 1
                        n_ag = 0 if s.zero == 3 else 1
                        t = n_rs * comm("reduce_scatter", gbytes, a) + n_ag * comm("all_gather", pbytes, a)
                        axis_bytes[a][j] += (n_rs * gbytes + n_ag * pbytes) * k
                        grad_t[j] += t * k
                        if s.zero == 3:   # parameters gathered for forward and again for backward, per micro-batch
                            comm_t[j] += 2 * nm * comm("all_gather", pbytes, a) * k
                            axis_bytes[a][j] += 2 * nm * pbytes * k
        elif info.kind == "op":
            spec = info.spec
            wgrad = _has_contraction(spec)
            for j, st in enumerate(info.strategies):
                f, b = fwd_bwd_compute(spec.flops * st.work_fraction / nm, spec.bytes * st.work_fraction / nm,
                                       dtype, device, wgrad)
                compute[j] = (f + b) * nm * k
                fwd[j] = f * nm * k
                for (kind, a, nbytes) in st.comms:
                    nb = nbytes / nm
                    # forward collective and its backward conjugate move the same bytes
                    comm_t[j] += 2 * nm * comm(kind, nb, a) * k
                    axis_bytes[a][j] += 2 * nbytes * k
                t, per_axis = _region_cost(c, info, st, s.precision, nm, comm)
                comm_t[j] += t * k
                for a, nb in per_axis.items():
                    axis_bytes[a][j] += nb * k
            saved_roots = _saved_roots(c, info, s.precision, charged_roots)
            for j, st in enumerate(info.strategies):
                saved[j] = sum(fn(st) for fn in saved_roots) / nm * k
                outs = val if isinstance(val, (tuple, list)) else (val,)
                tb = 0.0
                for o, lay in zip(outs, st.outputs):
                    if isinstance(o, torch.Tensor):
                        tb += o.numel() * _itemsize(o.dtype, s.precision) * _fraction(lay, mesh)
                transient[j] = tb / nm
        P.compute[name], P.fwd_compute[name], P.comm[name] = compute, fwd, comm_t + grad_t
        P.grad_comm[name], P.optimizer[name], P.saved[name] = grad_t, opt_t, saved
        P.transient[name], P.comm_bytes[name] = transient, axis_bytes
        P.valid[name] = np.array([_divides_micro_batch(c, info, st, nm) for st in info.strategies], dtype=bool)
        if info.kind == "param":
            P.static[name] = static
    return P


def _micro_shape(shape, batch_dims, nm: int):
    if nm == 1 or not batch_dims:
        return tuple(shape)
    d = min(batch_dims)
    return tuple(x // nm if i == d else x for i, x in enumerate(shape))


def _divides_micro_batch(c: Candidates, info: NodeInfo, st: Strategy, nm: int) -> bool:
    """Every layout of the strategy splits one micro-batch's tensors evenly."""
    if nm == 1:
        return True
    mesh = c.mesh
    tensors = []
    val = _val(info.node)
    outs = val if isinstance(val, (tuple, list)) else (val,)
    for k, (o, lay) in enumerate(zip(outs, st.outputs)):
        bd = info.batch_dims[k] if k < len(info.batch_dims) else frozenset()
        tensors.append((o, bd, lay))
    if info.kind == "op":
        for p, lay in zip(tensor_inputs(info.node), st.inputs):
            prod = c.nodes.get(p.name)
            pv = _val(p)
            if prod is None or lay is None or not isinstance(pv, torch.Tensor):
                continue
            tensors.append((pv, prod.batch_dims[0] if prod.batch_dims else frozenset(), lay))
    for t, bd, lay in tensors:
        if not isinstance(t, torch.Tensor) or lay is None or lay.ndim != t.ndim:
            continue
        shape = _micro_shape(_tensor_shape(t), bd, nm)
        if any(x % lay.split_factor(d, mesh.shape) for d, x in enumerate(shape)):
            return False
    return True


def _region_cost(c: Candidates, info: NodeInfo, st: Strategy, precision: str, nm: int, comm):
    """Backward all-reduces of inputs replicated on an axis the op splits its work on (see
    autopar/conjugates.py). A parameter's data-axis reduction is its gradient sync, priced with
    the parameter (once per step, not per micro-batch)."""
    mesh = c.mesh
    ins = tensor_inputs(info.node)
    t, per_axis = 0.0, {}
    for i, a in region_inputs(st, info.spec.inputs):
        p = ins[i]
        if p.name not in c.needs_grad:
            continue
        if mesh.is_data_axis(a) and c.nodes[p.name].kind == "param":
            continue
        pv = _val(p)
        if isinstance(pv, (tuple, list)):
            continue
        nb = pv.numel() * _itemsize(pv.dtype, precision) * _fraction(st.inputs[i], mesh)
        # backward runs once per micro-batch; a batch-carrying tensor is 1/nm of its size each time
        batchy = bool(c.nodes[p.name].batch_dims and c.nodes[p.name].batch_dims[0])
        size = nb / nm if batchy else nb
        t += comm("all_reduce", size, a) * nm
        per_axis[a] = per_axis.get(a, 0.0) + size * nm
    return t, per_axis


def _saved_roots(c: Candidates, info: NodeInfo, precision: str, charged: set[str]):
    """Functions strategy -> bytes for each tensor this op saves, each storage counted once."""
    mesh = c.mesh
    fns = []
    ins = tensor_inputs(info.node)
    val = _val(info.node)
    outs = val if isinstance(val, (tuple, list)) else (val,)
    if info.name not in c.needs_grad:
        return fns          # autograd records nothing for an op none of whose inputs needs a gradient
    for sv in info.spec.saved:
        if sv.for_grad_of and not any(j < len(ins) and ins[j].name in c.needs_grad for j in sv.for_grad_of):
            continue
        if sv.kind in ("input", "output"):
            if sv.kind == "input":
                if sv.index >= len(ins):
                    continue
                src = ins[sv.index]
                root = c.storage_root.get(src.name)
                t = _val(src)
            else:
                if sv.index >= len(outs):
                    continue
                root = c.storage_root.get(info.name) if sv.index == 0 else f"{info.name}#{sv.index}"
                t = outs[sv.index]
            if root is None or not isinstance(t, torch.Tensor):
                continue
            if root in c.nodes and c.nodes[root].kind == "param":
                continue    # parameters are counted as parameters, not activations
            if root in charged:
                continue
            charged.add(root)
            nbytes = c.root_bytes.get(root, t.numel() * t.element_size())
            nbytes = nbytes // t.element_size() * _itemsize(t.dtype, precision)
            idx = sv.index

            def fn(st, nbytes=nbytes, idx=idx, kind=sv.kind):
                lay = (st.inputs[idx] if idx < len(st.inputs) else None) if kind == "input" else \
                    (st.outputs[idx] if idx < len(st.outputs) else None)
                return nbytes * _fraction(lay, mesh)
            fns.append(fn)
        else:
            size = math.prod(info.spec.sizes[ch] for ch in sv.letters) if sv.letters else 1
            nbytes = size * (sv.itemsize if sv.itemsize != 4 or precision != "bf16" else sv.itemsize)
            fns.append(lambda st, nbytes=nbytes, letters=sv.letters: nbytes * _letter_fraction(letters, st, mesh))
    return fns


def _source_layout(producer: NodeInfo, consumer_node, strat: Strategy) -> Layout:
    if consumer_node.target is operator.getitem and len(strat.outputs) > 1:
        return strat.outputs[consumer_node.args[1]]
    return strat.outputs[0]


def _price_edges(c: Candidates, cluster: Cluster, s: Settings, comm, P: Priced) -> None:
    """Resharding cost matrix per (producer, consumer) representative pair, summed over the
    graph's edges; edges of repeated block instances are priced once and multiplied."""
    mesh = c.mesh
    nm = s.num_micro_batches
    counts: dict = defaultdict(int)
    example: dict = {}
    for name in c.order:
        info = c.nodes[name]
        if info.kind != "op":
            continue
        for i, p in enumerate(tensor_inputs(info.node)):
            if p.name not in c.nodes:
                continue
            k = (c.nodes[p.name].rep, info.rep, i)
            counts[k] += 1
            example.setdefault(k, (p.name, name))
    cache: dict = {}
    for k in sorted(counts):
        pname, cname = example[k]
        i = k[2]
        prod, info = c.nodes[pname], c.nodes[cname]
        pval = _val(prod.node)
        if isinstance(pval, (tuple, list)):
            pval = pval[info.node.args[1]] if info.node.target is operator.getitem else None
        if not isinstance(pval, torch.Tensor):
            continue
        shape = _tensor_shape(pval)
        itemsize = _itemsize(pval.dtype, s.precision)
        bdims = prod.batch_dims[0] if prod.batch_dims else frozenset()
        if info.node.target is operator.getitem and len(prod.batch_dims) > 1:
            bdims = prod.batch_dims[info.node.args[1]]
        bdim = min(bdims) if bdims else None
        S, T = len(prod.strategies), len(info.strategies)
        mat = np.zeros((S, T))
        bytes_axes = [np.zeros((S, T)) for _ in mesh.shape]
        srcs = [_source_layout(prod, info.node, ps) for ps in prod.strategies]
        for b_i, cs in enumerate(info.strategies):
            dst = cs.inputs[i] if i < len(cs.inputs) and cs.inputs[i] is not None else Layout.replicated(len(shape))
            for a_i, src in enumerate(srcs):
                if src == dst:
                    continue
                ck = (src, dst, shape, itemsize, bdim)
                if ck not in cache:
                    cache[ck] = _edge_cost(src, dst, shape, itemsize, nm, bdim, mesh, comm)
                t, per_axis = cache[ck]
                mat[a_i, b_i] = t
                for a in range(len(mesh.shape)):
                    bytes_axes[a][a_i, b_i] = per_axis[a]
        if not mat.any():
            continue
        n = counts[k]
        key = (prod.rep, info.rep)
        if key in P.edges:
            P.edges[key] = P.edges[key] + n * mat
            P.edge_bytes[key] = [x + n * y for x, y in zip(P.edge_bytes[key], bytes_axes)]
        else:
            P.edges[key] = n * mat
            P.edge_bytes[key] = [n * y for y in bytes_axes]


def _edge_cost(src, dst, shape, itemsize, nm, bdim, mesh: Mesh, comm):
    """(seconds, bytes per mesh axis) of resharding one tensor, forward and backward, over all
    ``nm`` micro-batches; a batch-carrying tensor (batch dim ``bdim``) is 1/nm of its size each time."""
    local_shape = tuple(shape)
    if bdim is not None and shape[bdim] % nm == 0:
        local_shape = tuple(x // nm if d == bdim else x for d, x in enumerate(shape))
    per_axis = [0.0] * len(mesh.shape)
    try:
        rp = plan_reshard(src, dst, local_shape, itemsize, mesh.shape, comm)
    except ValueError:
        # A layout that does not divide one micro-batch: the strategy is unusable with this many
        # micro-batches. Forbid it through a prohibitive cost rather than a constraint.
        return FORBIDDEN, per_axis
    t = 0.0
    for tr in step_traffic(rp.steps, src, local_shape, itemsize, mesh.shape):
        for kind in (tr.forward, tr.backward):
            if kind:
                t += comm(kind, tr.nbytes, tr.axis) * nm
                per_axis[tr.axis] += tr.nbytes * nm
    return t, per_axis


# ---------------------------------------------------------------- the Problem


def build_problem(c: Candidates, P: Priced, s: Settings, liveness_points: int = 8) -> Problem:
    """Assemble the ILP: objective terms, edges, liveness memory constraints, checkpoint groups."""
    reps = c.reps
    index = {n: i for i, n in enumerate(reps)}
    costs = []
    for n in reps:
        info = c.nodes[n]
        S = len(info.strategies)
        costs.append(P.compute.get(n, np.zeros(S)) + P.comm.get(n, np.zeros(S)) + P.optimizer.get(n, np.zeros(S)))
    edges = [Edge(index[u], index[v], m) for (u, v), m in sorted(P.edges.items()) if u in index and v in index]
    static_terms = []
    for n, st in P.static.items():
        static_terms.append((index[n], st["params"] + st["grads"] + st["optimizer"]))
    # Activation terms: block nodes go to their checkpoint group, the rest are always saved.
    groups: dict[int, CheckpointGroup] = {}
    plain_saved = []
    for n in reps:
        if c.nodes[n].kind != "op" or not P.saved[n].any():
            continue
        g = c.block_of_rep.get(n)
        if g is None or c.nodes[n].repeats < 2:
            plain_saved.append((index[n], P.saved[n]))
            continue
        grp = groups.setdefault(g, CheckpointGroup(name=c.graph.blocks[g].name))
        k = c.nodes[n].repeats
        grp.saved.append((index[n], P.saved[n]))
        grp.recompute_memory.append((index[n], P.saved[n] / k))
        grp.recompute_time.append((index[n], P.fwd_compute[n]))
    for g, grp in groups.items():
        # What a checkpointed block keeps: its input, the residual stream — priced as the output of
        # the group's last node, one per repeat.
        last = c.graph.blocks[g].instances[0][-1]
        if last in index:
            grp.kept.append((index[last], P.transient[last] * c.nodes[last].repeats))
        if s.checkpoint == "full":
            grp.forced = True
        elif s.checkpoint == "none":
            grp.forced = False
    cgroups = [groups[g] for g in sorted(groups)]
    memory = []
    base_terms = static_terms + plain_saved
    gidx = list(range(len(cgroups)))
    # Liveness: the end of forward (every saved activation alive) plus the working set of the op
    # running then; checking the biggest few ops' working sets bounds the peak of both passes.
    ops = [n for n in reps if c.nodes[n].kind == "op"]
    ops.sort(key=lambda n: (-float(P.transient[n].max()) if len(P.transient[n]) else 0.0, n))
    for n in ops[:liveness_points] or [None]:
        terms = list(base_terms)
        if n is not None:
            terms.append((index[n], 2 * P.transient[n]))
        memory.append(MemoryConstraint(name=f"backward@{n}" if n else "end-of-forward", budget=s.budget,
                                       terms=terms, groups=gidx))
    names = [[st.name for st in c.nodes[n].strategies] for n in reps]
    problem = Problem(node_names=list(reps), costs=costs, edges=edges, memory=memory,
                      checkpoint_groups=cgroups, strategy_names=names)
    keep = [np.flatnonzero(P.valid[n]) if n in P.valid and P.valid[n].size else np.arange(len(costs[i]))
            for i, n in enumerate(reps)]
    return restrict(problem, keep)


def restrict(problem: Problem, keep: list[np.ndarray]) -> Problem:
    """The same problem over a subset of each node's strategies (those valid for the micro-batch
    count); ``problem.kept[i]`` maps the solver's index back to the candidate strategy."""
    if all(len(k) == len(c) for k, c in zip(keep, problem.costs)):
        problem.kept = [np.arange(len(c)) for c in problem.costs]
        return problem
    sub = lambda terms: [(n, arr[keep[n]]) for n, arr in terms]  # noqa: E731
    out = Problem(
        node_names=problem.node_names,
        costs=[c[k] for c, k in zip(problem.costs, keep)],
        edges=[Edge(e.src, e.dst, e.cost[np.ix_(keep[e.src], keep[e.dst])]) for e in problem.edges],
        memory=[MemoryConstraint(m.name, m.budget, m.const, sub(m.terms), list(m.groups)) for m in problem.memory],
        checkpoint_groups=[CheckpointGroup(g.name, sub(g.saved), sub(g.kept), sub(g.recompute_memory),
                                           sub(g.recompute_time), g.forced) for g in problem.checkpoint_groups],
        strategy_names=[[names[j] for j in k] for names, k in zip(problem.strategy_names, keep)],
    )
    out.kept = keep
    return out


def chosen(problem: Problem, solution) -> dict[str, int]:
    """Node name -> index of the chosen candidate strategy (undoing ``restrict``)."""
    kept = getattr(problem, "kept", None)
    return {n: int(kept[i][solution.choice[i]]) if kept is not None else solution.choice[i]
            for i, n in enumerate(problem.node_names)}
