"""Resharding floors: a cheap lower bound of every resharding matrix, for pruning before pricing.

Pricing a configuration's resharding matrices (``price.price_edges``) runs one shortest-path
search per distinct (source layout, destination layout, shape): tens of thousands of searches
on a mesh with two model axes, most of a small model's planning time. The outer search needs
those matrices only for configurations its bounds cannot prune, so it first asks for this
floor: per (producer strategy, consumer strategy) pair,

    sum over the mesh axes a of the fewest collectives any path runs on a (``collectives_needed``)
    times the cheapest collective's latency floor on a,

times the number of micro-batches and of edge instances. It is a lower bound of the priced
entry: an axis that is used changes place only through a collective on that axis (all-reduce,
reduce-scatter, all-gather, all-to-all; the free moves, slice and partial, only take unused
axes, autopar/pricing/reshard.py; autopar/pricing/conjugates.py gives each step's backward),
every micro-batch reshards again, and a collective on any number of bytes costs at least its
latency terms (``latency_floor``). The floors depend on the mesh only, so they are computed once
per (candidates, cluster) and scaled by the micro-batch count.
"""
from __future__ import annotations

import numpy as np

from autopar.pricing.edge_price import edge_groups, edge_layouts
from autopar.pricing.price import Priced, mesh_comm
from autopar.rules.layout import Layout

COLLECTIVES = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
_UNUSED, _PARTIAL = -1, -2


def latency_floor(comm, axis: int) -> float:
    """The least seconds any collective on ``axis`` takes, whatever its size: each kind priced
    on a vanishing message, which leaves only its latency terms (alpha-beta rings and the
    measured curves alike add latency to a bandwidth term that goes to zero with the bytes)."""
    return min(float(comm(kind, 1e-9, axis)) for kind in COLLECTIVES)


def _places(layouts: list[Layout], naxes: int) -> np.ndarray:
    """[len(layouts), naxes]: the dim each mesh axis splits, _PARTIAL or _UNUSED."""
    out = np.full((len(layouts), naxes), _UNUSED, dtype=np.int64)
    for r, lay in enumerate(layouts):
        for d, axes in enumerate(lay.dims):
            for a in axes:
                out[r, a] = d
        for a in lay.partial:
            out[r, a] = _PARTIAL
    return out


def collectives_needed(src: np.ndarray, dst: np.ndarray, grad: bool) -> np.ndarray:
    """[S, T, axes]: the fewest collectives on each axis of any path from each source to each
    destination placement (``_places``), forward and, with ``grad``, backward. An axis that
    leaves its place needs one forward collective (all-gather, all-reduce, reduce-scatter or
    all-to-all); one that ends up splitting another dim than before also one backward (the
    all-to-all's own conjugate, reduce-scatter's all-gather, or the all-gather a slice runs in
    backward); an unused axis that ends up splitting a dim is a slice (free forward, all-gather
    backward) or an all-to-all. An axis that splits the same dim in both needs none (a bound)."""
    s, d = src[:, None, :], dst[None, :, :]
    leaves = (s != _UNUSED) & (s != d)
    lands = (d >= 0) & (s != d)
    return leaves.astype(np.float64) + (lands.astype(np.float64) if grad else 0.0)


def edge_floors(c, cluster) -> dict:
    """(producer rep, consumer rep) -> [S, T] floor seconds for ONE micro-batch, all edge
    instances (module doc). Cached on ``c`` per cluster."""
    return _floors_and_pairs(c, cluster)[0]


def _floors_and_pairs(c, cluster) -> tuple[dict, int]:
    """(``edge_floors``, how many strategy pairs its edges have), one cache entry per cluster."""
    key = ("floors", cluster)
    if key in c.edge_cache:
        return c.edge_cache[key][1]
    comm = mesh_comm(c, cluster)
    naxes = len(c.mesh.shape)
    floor = np.array([latency_floor(comm, a) for a in range(naxes)])
    out: dict = {}
    pairs = 0
    for n, prod, info, i, pname, shape, _, _ in edge_groups(c):
        srcs, dsts = edge_layouts(prod, info, i, len(shape))
        pairs += len(srcs) * len(dsts)
        mat = n * (collectives_needed(_places(srcs, naxes), _places(dsts, naxes), pname in c.needs_grad) @ floor)
        if not mat.any():
            continue
        k = (prod.rep, info.rep)
        out[k] = out[k] + mat if k in out else mat
    c.edge_cache[key] = (cluster, (out, pairs))
    return out, pairs


def edge_pairs(c, cluster) -> int:
    """How many (producer strategy, consumer strategy) pairs pricing ``c``'s edges visits: what
    ``price_edges`` costs, roughly (tens of microseconds a distinct pair)."""
    return _floors_and_pairs(c, cluster)[1]


def with_edge_floors(P: Priced, c, cluster, num_micro_batches: int) -> Priced:
    """A shallow copy of ``P`` whose resharding matrices are the floors (for
    ``predict.step_time_lower_bound(..., edges=True)``): a bound no priced plan beats."""
    import dataclasses
    floors = edge_floors(c, cluster)
    return dataclasses.replace(P, edges={k: num_micro_batches * m for k, m in floors.items()})
