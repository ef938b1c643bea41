"""A lower bound of a grid configuration's predicted step (autopar/search/grid_price.py) before
its lowering: what ``price_grid`` would charge at least, from the traced graph's shapes alone.

Lowering the model in a grid mode (codegen/grid_ops.py ``GridProgram.analyse``) runs every op of
the traced graph on meta tensors: about a second per geometry for a 96-layer model, and the free
search walks every 2D / 2.5D / 3D geometry of the cluster (25 on 1024 GPUs). The bulk of a grid
step is its linears, and a linear's lowering is a closed form of its shapes: the GEMM kernels
(``GridProgram._grid_linear``: q kernels [my tokens, k/q] x [k/q, n/q], or one 3D kernel) and the
collectives of solver/tp_grid_cost.py ``linear_2d`` / ``linear_2p5d`` / ``linear_3d``. So:

  bound = compute of the linears (priced exactly as ``grid_compute`` prices them, from the same
          kernel shapes) + compute of the ops without a contraction (their price does not depend
          on the lowering) + the linears' collectives (priced as ``price_grid`` prices them; a 3D
          linear's axes depend on its input layout: the cheapest assignment is taken)

Everything else (contractions other than linears, e.g. attention; a classifier tied to its
embedding; norms', embeddings' and the loss's collectives; gradient synchronisation; optimizer
step) is left out: every one of those terms is >= 0. A geometry that does not divide returns 0
(its lowering reports why). tests/search/test_grid_bound.py checks bound <= priced step.
"""
from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import torch

from autopar.mesh import Mesh
from autopar.pricing.cost import Collectives
from autopar.pricing.op_base import has_contraction
from autopar.rules.candidates import candidates
from autopar.search.grid_geometry import grid_batch, grid_geometries
from autopar.search.grid_price import grid_compute
from solver import tp_grid_cost as tc

aten = torch.ops.aten


def _linears(graph, memo: dict) -> dict:
    """(m tokens, in features, out features, has bias) -> names of the linears of that shape, for
    every linear not tied to an embedding table (a tied classifier lowers differently: left out
    of the bound). A repeated block's linears share a few shapes: each is priced once."""
    if "linears" not in memo:
        out: dict = {}
        for n in graph.gm.graph.nodes:
            if n.op != "call_function" or n.target is not aten.linear.default:
                continue
            w = n.args[1]
            if any(u.target is aten.embedding.default and u.args[0] is w for u in w.users):
                continue
            out_f, in_f = tuple(w.meta["val"].shape)
            m = math.prod(tuple(n.args[0].meta["val"].shape)[:-1])
            bias = len(n.args) > 2 and n.args[2] is not None
            out.setdefault((m, in_f, out_f, bias), []).append(n.name)
        memo["linears"] = out
    return memo["linears"]


def grid_step_lower_bound(graph, cluster, base, geo, cands, memo: dict | None = None) -> float:
    """Seconds ``price_grid(graph, cluster, base, geo, cands)`` charges at least (module doc).
    ``memo``: the bound's parts of ``graph`` kept across calls (autopar/search/context.py
    ``PlanCaches.grid_bounds``)."""
    return sum(_parts(graph, cluster, base, geo, cands, {} if memo is None else memo))


def grid_compute_floor(graph, cluster, base, constraints: dict, memo: dict | None = None) -> float:
    """Compute seconds no grid plan the pins allow goes below (inf: no grid geometry): the compute
    part of the bound, least over the geometries (more micro-batches only add compute: the
    grid pass's premise). autopar/search/outer.py's ``before_large`` needs it."""
    geos = grid_geometries(cluster.num_devices, constraints, grid_batch(graph))
    if not geos:
        return math.inf
    cands = candidates(graph, Mesh((1,), ("dp",), cluster.devices_per_node))
    memo = {} if memo is None else memo
    return min(_parts(graph, cluster, base, geo, cands, memo)[0] for geo in geos)


def _parts(graph, cluster, base, geo, cands, memo: dict) -> tuple[float, float]:
    """(compute, collectives) of the bound, kept in ``memo`` (the grid pass and
    ``grid_compute_floor`` ask for the same geometries)."""
    key = (cluster, base.precision, geo)
    if key not in memo:
        memo[key] = _bound_parts(graph, cluster, base, geo, cands, memo)
    return memo[key]


def _bound_parts(graph, cluster, base, geo, cands, memo: dict) -> tuple[float, float]:
    q = geo.q
    gemms, colls = {}, []
    try:
        for (m, k, nf, bias), names in _linears(graph, memo).items():
            if k % q or nf % (q * q if geo.mode == "3d" else q) or m % geo.tok_parts:
                return 0.0, 0.0
            if geo.mode == "3d":
                kernel = (1, m // (geo.batch_parts * q), k // q, nf // q)
                options = [tc.linear_3d(m // geo.batch_parts, k, nf, q, bias=bias, axes=axes)
                           for axes in itertools.permutations(geo.names)]
            elif geo.mode == "2d":
                kernel = (q, m // geo.tok_parts, k // q, nf // q)
                options = [tc.linear_2d(m // geo.batch_parts, k, nf, q, bias=bias)]
            else:
                kernel = (q, m // geo.tok_parts, k // q, nf // q)
                options = [tc.linear_2p5d(m // geo.batch_parts, k, nf, q, geo.d, bias=bias)]
            gemms.update(dict.fromkeys(names, kernel))
            colls.append((len(names), options))
    except ValueError:   # a size that does not divide (tp_grid_cost._div): the lowering says which
        return 0.0, 0.0
    # compute: the linears at the kernel shapes the lowering records; ops without a contraction
    # (priced from their FLOPs and bytes alone); other contractions left out (their local shapes
    # come from the lowering)
    # every op split over the world (none replicated): a lower bound
    per_op = grid_compute(cands, SimpleNamespace(gemms=gemms, local_shapes={}, replicated=set()), cluster,
                          base.precision, geo)
    compute = sum(t for name, (_, t) in per_op.items()
                  if name in gemms or not has_contraction(cands.nodes[name].spec))
    mesh = Mesh(geo.mesh_shape, geo.mesh_names, cluster.devices_per_node)
    comm = Collectives(cluster, mesh)
    scale = 0.5 if base.precision == "bf16" else 1.0    # the lowering counts fp32 bytes

    def cost(cs) -> float:
        return sum(c.count * comm("broadcast" if c.kind == "reduce" else c.kind, c.nbytes * scale,
                                  geo.mesh_names.index(c.group)) for c in cs)
    op_comm = geo.nm * sum(count * min(cost(cs) for cs in options) for count, options in colls)
    return compute, op_comm


__all__ = ["grid_step_lower_bound", "grid_compute_floor"]
