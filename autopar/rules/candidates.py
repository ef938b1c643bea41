"""Per-mesh candidate strategies of every node of a traced graph (step 1 of building a Problem).

``candidates(graph, mesh, policy=None) -> Candidates``: for call_function nodes the op rules'
strategies on the mesh (optionally filtered by the Megatron policy), for parameters and inputs
their layout choices (an input's batch dim, autopar/frontend/batching.py, is split over the data axes);
which dims carry the batch; which nodes alias which storage (saved tensors
are counted once); and the representative of every repeated-block node (the ILP gets one variable
set per representative). Depends only on (graph, mesh): the outer search reuses it for every ZeRO
stage, micro-batch count and precision on that mesh; pricing is autopar/pricing/price.py.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from autopar.rules import sequence
from autopar.frontend.batching import global_batch as graph_global_batch, graph_batch_dims
from autopar.rules.layout import Layout
from autopar.mesh import Mesh
from autopar.rules import spec_for, tensor_inputs
from autopar.rules.table import input_dim_sets
from autopar.rules.table import shape as tensor_shape
from autopar.rules.table import val as node_val
from autopar.rules.strategy import Strategy, enumerate_strategies, propagate_batch
from autopar.frontend.trace import TracedGraph

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


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
class PricingMemo:
    """What autopar/pricing/price.py computes once per mesh's candidates and asks for again."""
    device_roots: dict = field(default_factory=dict)   # (runs CUDA, precision) -> node -> storage root
    split_sizes: dict = field(default_factory=dict)   # (node, strategy index) -> its local letter sizes
    batched_tensors: dict = field(default_factory=dict)   # node -> its tensors a micro-batch count cuts
    batch_free: dict = field(default_factory=dict)   # storage root -> carries no batch
    grad_numel: int | None = None   # elements of the trained parameters (gradient buckets)
    global_batch: int | None = None
    # graph node name -> fx node, and block group -> the storage roots its first instance reads
    # from outside (autopar/search/build.py): built once, not per problem built
    graph_nodes: dict | None = None
    block_inputs: dict = field(default_factory=dict)

    def nodes_by_name(self, graph) -> dict:
        """``{name: fx node}`` of ``graph`` (this memo's candidates' graph)."""
        if self.graph_nodes is None:
            self.graph_nodes = {n.name: n for n in graph.gm.graph.nodes}
        return self.graph_nodes


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
    edge_cache: dict = field(default_factory=dict)      # pricing caches per cluster: collectives, ops, edges
    memo: PricingMemo = field(default_factory=lambda: PricingMemo())   # pricing's per-mesh memos
    # link family -> reshard traffic (autopar/pricing/mesh_comm.py ``shared_reshards``): one dict for
    # every mesh the searches of one plan price (autopar/search/context.py ``PlanCaches``)
    reshards: dict = field(default_factory=dict)
    instances_memo: dict | None = None   # rep -> the nodes it stands for (``instances``)
    inputs_cache: dict = field(default_factory=dict)    # node name -> tensor_inputs (pricing asks often)

    def inputs(self, node) -> list:
        """``rules.tensor_inputs(node)``, memoised per node (a pytree walk each time otherwise)."""
        got = self.inputs_cache.get(node.name)
        if got is None:
            got = self.inputs_cache[node.name] = tensor_inputs(node)
        return got

    def instances(self, rep: str) -> list[str]:
        """The graph nodes representative ``rep`` stands for (itself first, graph order): one per
        repeated-block instance; ``[rep]`` for a node outside the repeated blocks."""
        got = self.instances_memo
        if got is None:
            got = self.instances_memo = {}
            for n in self.order:
                got.setdefault(self.nodes[n].rep, []).append(n)
        return got.get(rep) or [rep]


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
    if spec.rule != "linear" or not sequence.param_axes(mesh):
        return strategies
    keep = [st for st in strategies
            if all(any(a in axes for axes in st.inputs[1].dims) for a in sequence.param_axes(mesh)
                   if mesh.shape[a] > 1)]
    return keep or strategies


def candidates(graph: TracedGraph, mesh: Mesh, policy: str | None = None, reshards: dict | None = None) -> Candidates:
    """Every node's strategies on ``mesh``. ``reshards``: the reshard traffic memos shared with other
    meshes' candidates (``Candidates.reshards``; default: this mesh's own)."""
    gm = graph.gm
    nodes: dict[str, NodeInfo] = {}
    order: list[str] = []
    batch_of: dict[str, tuple] = {}
    model_axes = sequence.param_axes(mesh)   # weights are replicated on sequence axes
    # Block instances after the first reuse the first instance's spec and strategies (same ops,
    # same shapes): enumeration is the expensive part of this function.
    first_of = {}
    for group in graph.blocks:
        for inst in group.instances[1:]:
            for a, b in zip(group.instances[0], inst):
                first_of[b] = a
    memo: dict = {}
    param_strategies: dict = {}   # shape -> a parameter's strategies
    same_spec: dict = {}   # _enumeration_key -> strategies: ops with equal specs enumerate once per mesh
    specs = _graph_specs(graph)
    input_batch = dict(zip(graph.input_names, graph_batch_dims(graph)))
    global_batch = graph_global_batch(graph, default=1)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            val = node_val(node)
            if not isinstance(val, torch.Tensor):
                continue
            shape = tensor_shape(val)
            if node.name in graph.param_fqn:
                # parameters of one shape have the same layouts (each block's weights: one list)
                if shape not in param_strategies:
                    param_strategies[shape] = [_leaf_strategy(l.describe(mesh.names), l, mesh)
                                               for l in _layout_choices(shape, mesh, model_axes)]
                strategies = list(param_strategies[shape])
                nodes[node.name] = NodeInfo(node.name, "param", node, strategies, batch_dims=(frozenset(),))
                batch_of[node.name] = (frozenset(),)
            else:
                # The data axes split the input's batch dim (autopar/frontend/batching.py), not blindly dim 0.
                bd = input_batch.get(node.name)
                splits = {}
                if bd is not None and all(shape[bd] % mesh.shape[a] == 0 for a in mesh.data_axes()):
                    splits = {bd: tuple(a for a in mesh.data_axes() if mesh.shape[a] > 1)}
                lay = Layout.shard(len(shape), splits)
                nodes[node.name] = NodeInfo(node.name, "input", node,
                                            [_leaf_strategy(lay.describe(mesh.names), lay, mesh)],
                                            batch_dims=(frozenset({bd}) if bd is not None else frozenset(),))
                batch_of[node.name] = nodes[node.name].batch_dims
            order.append(node.name)
        elif node.op == "call_function":
            spec = specs.get(node.name)
            if spec is None:
                spec = specs[node.name] = spec_for(node)
            in_batch = input_dim_sets(node, batch_of)
            first = first_of.get(node.name)
            if first is not None and (first, tuple(in_batch)) in memo:
                spec, letters, out_batch, strategies = memo[(first, tuple(in_batch))]
            else:
                letters, out_batch = propagate_batch(spec, in_batch)
                if global_batch > 1 and not any(in_batch):
                    letters, out_batch = _expanded_to_batch(node, spec, letters, out_batch, global_batch)
                key = _enumeration_key(spec, letters)
                strategies = same_spec.get(key)
                if strategies is None:
                    strategies = same_spec[key] = enumerate_strategies(spec, mesh, letters)
                if sequence.split_policy(policy)[0] == "megatron":
                    strategies = megatron_filter(spec, strategies, mesh)
                memo[(node.name, tuple(in_batch))] = (spec, letters, out_batch, strategies)
            batch_of[node.name] = tuple(out_batch)
            nodes[node.name] = NodeInfo(node.name, "op", node, strategies, spec=spec, batch_dims=tuple(out_batch))
            order.append(node.name)
    needs_grad = _graph_needs_grad(graph, nodes)
    # sequence-parallel modes (autopar/rules/sequence.py)
    sequence.restrict(graph, mesh, nodes, order, policy, needs_grad)
    if graph.step:
        _returned_values(graph, nodes)
    roots, root_bytes = storage_roots(gm, lambda n: _returns_input(nodes.get(n.name)))
    cands = Candidates(graph, mesh, nodes, order, [], roots, root_bytes, needs_grad=needs_grad,
                       reshards={} if reshards is None else reshards)
    _assign_representatives(cands)
    return cands


def _returned_values(graph: TracedGraph, nodes: dict) -> None:
    """An inference step's outputs (``trace_step``) are the values it returns, in any layout but
    never partial sums: a strategy leaving one partial would have its reduction run after the
    step, unpriced (a row-parallel LM head's all-reduce, cheaper-looking than the column-parallel
    head that needs none). Only the strategies without a partial output stay, so the reduction a
    partial producer needs is priced as the reshard into the output's op. Deterministic per spec:
    every block instance keeps the same list."""
    for name in graph.outputs:
        info = nodes.get(name)
        if info is not None and info.kind == "op":
            info.strategies = [st for st in info.strategies if not any(o.partial for o in st.outputs)] \
                or info.strategies


def _expanded_to_batch(node, spec, letters: frozenset, out_batch: list, batch: int):
    """A batch-free value expanded to the batch's size along one dim carries the batch there
    (Hugging Face BERT's token-type ids: a buffer ``expand``-ed to (batch, seq)): the letters,
    which only follow inputs, miss it, and pricing then took that dim for whole in every
    micro-batch (the reshard after its embedding priced 2x at two micro-batches). Execution
    finds batch-carrying values from the traced shapes (autopar/rules/microbatch.py)."""
    if node.target is not torch.ops.aten.expand.default or not spec.outputs or not spec.outputs[0]:
        return letters, out_batch
    xs, os_ = tensor_shape(node_val(node.args[0])), tensor_shape(node_val(node))
    off = len(os_) - len(xs)
    dims = [d for d, s in enumerate(os_) if s == batch and (d < off or xs[d - off] == 1)]
    if len(dims) != 1 or dims[0] >= len(spec.outputs[0]):
        return letters, out_batch
    d = dims[0]
    return letters | {spec.outputs[0][d]}, [out_batch[0] | {d}] + list(out_batch[1:])


def _graph_specs(graph: TracedGraph) -> dict:
    """node name -> ``spec_for(node)``, kept on the graph: a spec depends on the node alone (its
    target and traced values), not on the mesh, and every mesh's candidates ask for all of them
    (hf_llama: 7 meshes per plan, a tenth of its planning time). Specs are frozen dataclasses."""
    return graph.op_specs


def _enumeration_key(spec, letters: frozenset):
    """Everything ``strategy.enumerate_strategies(spec, mesh, letters)`` reads of ``spec`` (and
    the batch letters): two ops with equal keys get equal strategies on a mesh (Strategy refers to
    no node: only to letters, layouts, sizes and the mesh), so their list is enumerated once."""
    return (spec.inputs, spec.outputs, tuple(sorted(spec.sizes.items())), spec.unsplittable, spec.reduce,
            tuple(sorted(spec.special.items())), spec.partial_inputs, spec.addend_inputs, spec.replicate_only,
            letters)


def _graph_needs_grad(graph: TracedGraph, nodes) -> set[str]:
    """``_needs_grad``, kept on the graph per (parameters, buffers): it does not depend on the mesh."""
    params = frozenset(n for n, info in nodes.items() if info.kind == "param")
    key = (params, frozenset(graph.buffers))
    cache = graph.needs_grad_memo
    if key not in cache:
        cache[key] = frozenset(_needs_grad(graph.gm, nodes, graph.buffers))
    return set(cache[key])


def _needs_grad(gm, nodes, buffers) -> set[str]:
    out = {n for n, info in nodes.items() if info.kind == "param" and n not in buffers}
    for node in gm.graph.nodes:
        if node.op == "call_function" and any(p.name in out for p in tensor_inputs(node)):
            val = node_val(node)
            vals = val if isinstance(val, (tuple, list)) else (val,)
            if any(isinstance(v, torch.Tensor) and v.dtype in FLOAT_DTYPES for v in vals):
                out.add(node.name)
    return out


def _returns_input(info) -> int | None:
    return info.spec.returns_input if info is not None and info.spec is not None else None


def storage_roots(gm, returns_input) -> tuple[dict[str, str], dict[str, int]]:
    """Group values by the storage their fake tensor uses (views share it), first producer wins:
    (node -> the node whose storage it aliases, root -> its bytes). An op that returns its input
    itself at run time (``returns_input(node)``: ``OpSpec.returns_input``, the input's index or
    None) shares the input's root whatever storage its fake value has (and so do the views of
    it). Also what codegen/per_rank.py reads a ZeRO-3 chunk's weight views from."""
    first: dict[int, str] = {}
    roots, sizes = {}, {}
    for node in gm.graph.nodes:
        val = node_val(node)
        if not isinstance(val, torch.Tensor):
            continue
        try:
            storage = val.untyped_storage()
            key, nbytes = id(storage), int(storage.nbytes())
        except Exception:   # some fake values carry no storage: treat as their own root
            key, nbytes = id(val), int(val.numel() * val.element_size())
        k = returns_input(node)
        src = tensor_inputs(node)[k] if k is not None else None
        if src is not None and src.name in roots:
            first.setdefault(key, roots[src.name])
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
