"""Pricing the resharding matrices: for every edge group of the graph (a producer's output read
by a consumer, repeated block instances grouped) and every (producer strategy, consumer
strategy) pair, the cheapest collectives that turn the produced layout into the consumed one
(autopar/pricing/reshard.py), forward and backward, in seconds and bytes per mesh axis. Called
through ``price.price_edges``, which caches the result per (cluster, micro-batches, precision)."""
from __future__ import annotations

import operator
from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np
import torch

from autopar.cluster import Cluster
from autopar.mesh import Mesh
from autopar.pricing.conjugates import Traffic, step_traffic
from autopar.pricing.cost import exposed_comm_arrays, profile_of
from autopar.pricing.local_bytes import runtime_itemsize
from autopar.pricing.regather import consumer_keeps_shard
from autopar.pricing.reshard import _checked, reduce_problem, search_reduced
from autopar.rules.candidates import Candidates, NodeInfo
from autopar.rules.layout import Layout
from autopar.rules.strategy import Strategy
from autopar.rules.table import shape as tensor_shape
from autopar.rules.table import val as node_val

if TYPE_CHECKING:
    from autopar.pricing.price import Priced, Settings

FORBIDDEN = 1e6   # seconds: a cost no plan will pay (strategies invalid under the micro-batching)


def _source_layout(producer: NodeInfo, consumer_node, strat: Strategy) -> Layout:
    if consumer_node.target is operator.getitem and len(strat.outputs) > 1:
        return strat.outputs[consumer_node.args[1]]
    return strat.outputs[0]


def edge_groups(c: Candidates):
    """The graph's (producer, consumer, input index) edges grouped by representative: yields
    (count, producer NodeInfo, consumer NodeInfo, input index, producer name, tensor shape,
    traced dtype, batch dim or None) once per group, in a fixed order. Edges of repeated block
    instances share a group, so they are priced once and multiplied by ``count``."""
    counts: dict = defaultdict(int)
    example: dict = {}
    for name in c.order:
        info = c.nodes[name]
        if info.kind != "op":
            continue
        for i, p in enumerate(c.inputs(info.node)):
            if p.name not in c.nodes:
                continue
            k = (c.nodes[p.name].rep, info.rep, i)
            counts[k] += 1
            example.setdefault(k, (p.name, name))
    for k in sorted(counts):
        pname, cname = example[k]
        i = k[2]
        prod, info = c.nodes[pname], c.nodes[cname]
        pval = node_val(prod.node)
        if isinstance(pval, (tuple, list)):
            pval = pval[info.node.args[1]] if info.node.target is operator.getitem else None
        if not isinstance(pval, torch.Tensor):
            continue
        bdims = prod.batch_dims[0] if prod.batch_dims else frozenset()
        if info.node.target is operator.getitem and len(prod.batch_dims) > 1:
            bdims = prod.batch_dims[info.node.args[1]]
        yield counts[k], prod, info, i, pname, tensor_shape(pval), pval.dtype, (min(bdims) if bdims else None)


def edge_layouts(prod: NodeInfo, info: NodeInfo, i: int, ndim: int):
    """(source layouts per producer strategy, destination layouts per consumer strategy) of one edge."""
    srcs = [_source_layout(prod, info.node, ps) for ps in prod.strategies]
    dsts = [cs.inputs[i] if i < len(cs.inputs) and cs.inputs[i] is not None else Layout.replicated(ndim)
            for cs in info.strategies]
    return srcs, dsts


def _price_edges(c: Candidates, cluster: Cluster, s: Settings, comm, P: Priced) -> None:
    """Resharding cost matrix per (producer, consumer) representative pair, summed over the
    graph's edges; edges of repeated block instances are priced once and multiplied."""
    mesh = c.mesh
    nm = s.num_micro_batches
    cal = profile_of(cluster)
    slowdown = cal.overlap_slowdown if cal else 0.0
    cache: dict = {}
    axes = len(mesh.shape)
    none = (0.0, [0.0] * axes, 0.0, [0.0] * axes, 0.0)   # a pair with nothing to move
    for n, prod, info, i, pname, shape, dtype, bdim in edge_groups(c):
        itemsize = runtime_itemsize(dtype, s.precision)
        srcs, dsts = edge_layouts(prod, info, i, len(shape))
        regather = consumer_keeps_shard(c, info, i)
        # a value no gradient flows back to (token ids, buffers) runs no backward conjugates
        grad = pname in c.needs_grad
        # Strategies share layouts (a 2-axis mesh: 49 consumer strategies, a dozen input
        # layouts): priced once per distinct (source, destination) pair, then spread to the
        # strategy pairs by index, instead of a Python step per strategy pair.
        src_u, src_at = _distinct(srcs)
        dst_u, dst_at = _distinct(dsts)
        U, V = len(src_u), len(dst_u)
        # one Python list of the pairs' answers, made arrays at once (item assignment into numpy
        # arrays was a fifth of this function's time)
        costs = []
        for src in src_u:
            for dst in dst_u:
                if src == dst:
                    costs.append(none)
                    continue
                ck = (src, dst, shape, itemsize, bdim, grad, regather)
                got = cache.get(ck)
                if got is None:
                    got = cache[ck] = _edge_cost(src, dst, shape, itemsize, nm, bdim, mesh, comm, grad, regather)
                costs.append(got)
        if not costs:
            continue   # a producer or consumer without strategies: nothing to price
        t_u, per_axis, tf_u, per_axis_f, rg_u = (np.array(col, dtype=np.float64) for col in zip(*costs))
        t_u, tf_u, rg_u = t_u.reshape(U, V), tf_u.reshape(U, V), rg_u.reshape(U, V)
        # bytes per axis: all steps, forward steps
        ax_u = np.stack([per_axis.T.reshape(axes, U, V), per_axis_f.T.reshape(axes, U, V)])
        pick = np.ix_(src_at, dst_at)
        mat, fmat = t_u[pick], tf_u[pick]
        if regather and rg_u.any():
            # runtime/regather.py gathers again while the input gradient's GEMM (the forward's
            # FLOPs) runs: only what that does not hide is exposed (``exposed_comm``, per
            # consumer strategy). A recomputed block runs the plain gather again instead,
            # unhidden: the rest of it is the recompute's.
            rg = rg_u[pick]
            dgrad = P.fwd_compute[info.rep] / (nm * max(1, info.repeats)) if grad else np.zeros(len(dsts))
            shown = exposed_comm_arrays(rg, dgrad[None, :], slowdown)
            mat = mat + nm * shown
            fmat = fmat + nm * np.maximum(0.0, rg - shown)
        bytes_axes = [ax_u[0, a][pick] for a in range(axes)]
        fbytes_axes = [ax_u[1, a][pick] for a in range(axes)]
        if not mat.any():
            continue
        key = (prod.rep, info.rep)
        if key in P.edges:
            P.edges[key] = P.edges[key] + n * mat
            P.edge_bytes[key] = [x + n * y for x, y in zip(P.edge_bytes[key], bytes_axes)]
            P.edge_fwd[key] = P.edge_fwd[key] + n * fmat
            P.edge_fwd_bytes[key] = [x + n * y for x, y in zip(P.edge_fwd_bytes[key], fbytes_axes)]
        else:
            P.edges[key] = n * mat
            P.edge_bytes[key] = [n * y for y in bytes_axes]
            P.edge_fwd[key] = n * fmat
            P.edge_fwd_bytes[key] = [n * y for y in fbytes_axes]


def _distinct(layouts: list) -> tuple[list, np.ndarray]:
    """(the distinct layouts in first-seen order, each input's index among them)."""
    index: dict = {}
    at = np.array([index.setdefault(lay, len(index)) for lay in layouts], dtype=np.intp)
    return list(index), at


def reshard_traffic(src, dst, shape, itemsize, mesh: Mesh, comm):
    """The traffic (autopar/pricing/conjugates.py) of the cheapest reshard of a ``shape`` tensor
    from ``src`` to ``dst``, or None when a layout does not divide it. Planned on the axes it can
    need (autopar/pricing/reshard.py ``reduce_problem``) and kept, in those terms, in
    ``comm.shared`` for every mesh whose remaining axes sit alike on the nodes: a pipeline stage's
    sub-mesh at m micro-batches reuses what the whole mesh priced at m / pp (GPT 18.4B, tp=8 on
    256 A100s: two thirds of the pipelined candidates' pricing was these searches)."""
    try:
        # plan_reshard's checks without its argument conversion: these are an int tuple, an int
        # (runtime_itemsize) and a Mesh's shape tuple already
        _checked(src, shape, mesh.shape, "source")
        _checked(dst, shape, mesh.shape, "destination")
    except ValueError:
        return None
    r = reduce_problem(src, dst, shape, mesh.shape)
    shared = getattr(comm, "shared", None)
    key = None
    if shared is not None:
        # kept in the original axes' numbering: meshes alike on those axes (the whole mesh and
        # its stages' sub-meshes: the data axis first) take it as it is
        sig = comm.kept_axes.get(r.kept)
        if sig is None:
            sig = comm.kept_axes[r.kept] = (r.kept, tuple(comm.axes[a] for a in r.kept))
        key = (r.src, r.dst, r.shape, itemsize, sig)
        got = shared.get(key)
        if got is not None:
            return got
    traffic = step_traffic(search_reduced(r, itemsize, comm).steps, r.src, r.shape, itemsize, r.mesh_shape)
    if len(r.kept) < len(mesh.shape):   # back to the mesh's axes
        traffic = [Traffic(r.kept[t.axis], t.forward, t.backward, t.nbytes) for t in traffic]
    if key is not None:
        shared[key] = traffic
    return traffic


def _edge_cost(src, dst, shape, itemsize, nm, bdim, mesh: Mesh, comm, grad: bool = True, regather: bool = False):
    """(seconds, bytes per mesh axis) of resharding one tensor, forward and backward, over all
    ``nm`` micro-batches, then the same for the forward steps alone (what a recomputed block
    runs again); a batch-carrying tensor (batch dim ``bdim``) is 1/nm of its size each time.

    ``regather``: the consumer is a linear keeping the shard (autopar/pricing/regather.py). When
    the reshard is one all-gather, backward gathers again: its bytes are in the edge's, and its
    seconds per micro-batch come back as the fifth value (the caller overlaps them with the
    consumer's input-gradient GEMM); nothing more when its block is recomputed (the recomputed
    forward's gather then stands in for the regather, and the linear runs plain there)."""
    local_shape = tuple(shape)
    if bdim is not None and shape[bdim] % nm == 0:
        local_shape = tuple(x // nm if d == bdim else x for d, x in enumerate(shape))
    per_axis = [0.0] * len(mesh.shape)
    fwd_axis = [0.0] * len(mesh.shape)
    # The steps depend on the local shape, not on nm: memoised per mesh across micro-batch counts.
    memo = getattr(comm, "reshard", None)
    rk = (src, dst, local_shape, itemsize)
    if memo is not None and rk in memo:
        traffic = memo[rk]
    else:
        traffic = reshard_traffic(src, dst, local_shape, itemsize, mesh, comm)
        if memo is not None:
            memo[rk] = traffic
    if traffic is None:
        # A layout that does not divide one micro-batch: the strategy is unusable with this many
        # micro-batches. Forbid it through a prohibitive cost rather than a constraint.
        return FORBIDDEN, per_axis, 0.0, fwd_axis, 0.0
    t = tf = 0.0
    for tr in traffic:
        for kind in (tr.forward, tr.backward if grad else None):
            if kind:
                t += comm(kind, tr.nbytes, tr.axis) * nm
                per_axis[tr.axis] += tr.nbytes * nm
        if tr.forward:
            tf += comm(tr.forward, tr.nbytes, tr.axis) * nm
            fwd_axis[tr.axis] += tr.nbytes * nm
    rg = 0.0
    if regather and len(traffic) == 1 and traffic[0].forward == "all_gather":
        tr = traffic[0]
        rg = comm("all_gather", tr.nbytes, tr.axis)
        per_axis[tr.axis] += tr.nbytes * nm
        tf, fwd_axis = 0.0, [0.0] * len(mesh.shape)
    return t, per_axis, tf, fwd_axis, rg
