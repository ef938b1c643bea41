"""Resharding floors: a cheap lower bound of every resharding matrix, for pruning before pricing.

Pricing a configuration's resharding matrices (``price.price_edges``) runs one shortest-path
search per distinct (source layout, destination layout, shape): tens of thousands of searches
on a mesh with two model axes, most of a small model's planning time. The outer search needs
those matrices only for configurations its bounds cannot prune, so it first asks for this
floor: per (producer strategy, consumer strategy) pair,

    sum over the mesh axes a of the fewest collectives any path runs on a (``collectives_needed``)
    times the least a collective that can act on a costs on the fewest bytes it can move,

times the number of micro-batches and of edge instances (``bandwidth_floors``). It is a lower
bound of the priced entry: an axis that is used changes place only through a collective on that
axis (all-reduce, reduce-scatter, all-gather, all-to-all; the free moves, slice and partial, only
take unused axes, autopar/pricing/reshard.py; autopar/pricing/conjugates.py gives each step's
backward), every micro-batch reshards again, a block is never split over more axes than the
source or the destination splits it over (so an all-to-all moves at least that block, and an
all-gather, reduce-scatter or all-reduce, whose buffer is not split by the axis, that block times
the axis' size when a side splits over it: ``_NOT_A2A``), an axis the destination does not split over leaves by an
all-gather or all-reduce, never an all-to-all, and a collective costs at least its latency terms
(``latency_floor``) and at least the least it costs on that many bytes or more (``_least_from``).
With the bandwidth term the floors prune GPT 18.4B's
(tp=8, 256 A100s) configurations that used to be priced first (``pair_floors``; checked against
the cheapest reshard on random layout pairs, tests/codegen/test_reshard.py).
"""
from __future__ import annotations

import math

import numpy as np

from autopar.pricing.edge_price import edge_groups, edge_layouts
from autopar.pricing.mesh_comm import mesh_comm
from autopar.pricing.price import Priced
from autopar.rules.layout import Layout
from autopar.pricing.cost import profile_of
from autopar.pricing.local_bytes import runtime_itemsize

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


def _kept(c, key: tuple, cluster, make):
    """``make()``, once per ``key`` on ``c`` (its edge cache; the cluster kept with the value)."""
    if key not in c.edge_cache:
        c.edge_cache[key] = (cluster, make())
    return c.edge_cache[key][1]


def edge_pairs(c, cluster) -> int:
    """How many (producer strategy, consumer strategy) pairs pricing ``c``'s edges visits: what
    ``price_edges`` costs, roughly (tens of microseconds a distinct pair). Cached on ``c``."""
    def count() -> int:
        pairs = 0
        for _, prod, info, i, _, shape, _, _ in edge_groups(c):
            srcs, dsts = edge_layouts(prod, info, i, len(shape))
            pairs += len(srcs) * len(dsts)
        return pairs
    return _kept(c, ("edge pairs", cluster), cluster, count)


def with_edge_floors(P: Priced, c, cluster, settings) -> Priced:
    """A shallow copy of ``P`` whose resharding matrices are the floors under ``settings`` (their
    micro-batch count and precision; for ``predict.step_time_lower_bound(..., edges=True)``): a
    bound no priced plan beats."""
    import dataclasses
    return dataclasses.replace(P, edges=bandwidth_floors(c, cluster, settings.num_micro_batches, settings.precision))


def _least_from(comm, cluster, mesh):
    """``least(nbytes, axis, kinds)``: the least seconds a collective of ``kinds`` on ``axis`` takes
    on ``nbytes`` or more. Alpha-beta rings grow with the bytes: their price at ``nbytes``. A
    measured curve (autopar/pricing/cost.py ``_curve``) is log-log interpolated, so between two
    of its sizes a collective's time is a power of the bytes, monotone: the least is at ``nbytes``
    or at one of the curves' sizes above it (all of the link's sizes are tried, a superset). An
    axis whose groups span nodes adds terms of other sizes: only its latency floor (0 here)."""
    import bisect

    cal = profile_of(cluster)
    sizes = [] if cal is None else sorted({x for _, _, table in cal.intra.curves for x, _ in table})
    suffix: dict = {}
    memo: dict = {}   # the same sizes recur across edge groups and micro-batch counts

    def least(nbytes: float, axis: int, kinds=COLLECTIVES) -> float:
        got = memo.get((nbytes, axis, kinds))
        if got is None:
            got = memo[nbytes, axis, kinds] = _least(nbytes, axis, kinds)
        return got

    def _least(nbytes: float, axis: int, kinds) -> float:
        p = mesh.placement(axis)
        if p.size <= 1:
            return 0.0
        if cal is not None and p.inter > 1:
            return 0.0
        here = min(float(comm(k, nbytes, axis)) for k in kinds)
        if not sizes:
            return here
        if (axis, kinds) not in suffix:   # the least over each curve size and all larger ones
            at = [min(float(comm(k, x, axis)) for k in kinds) for x in sizes]
            suffix[axis, kinds] = list(np.minimum.accumulate(at[::-1]))[::-1]
        i = bisect.bisect_left(sizes, nbytes)
        return here if i == len(sizes) else min(here, suffix[axis, kinds][i])
    return least


# Which collectives can act on an axis, and on how many bytes at least, given the smallest block
# B a path can hold (the tensor split by the union of the axes source and destination split it
# over) and the axis' size m (autopar/pricing/reshard.py's moves; conjugates.py's byte convention,
# the larger buffer, shared by a step and its backward):
# - all_to_all moves a block split by the axis: >= B; it only puts the axis on a dim the
#   destination splits over it;
# - all_gather's output, reduce_scatter's input and an all_reduce's block are not split by the
#   axis: >= B m when the axis is among the union's (split on one side), else >= B.
_NOT_A2A = ("all_gather", "reduce_scatter", "all_reduce")


def _split_masks(layouts: list[Layout]) -> np.ndarray:
    """Each layout's split axes (not partial) as a bit mask."""
    return np.array([sum(1 << a for axes in lay.dims for a in axes) for lay in layouts], dtype=np.int64)


def bandwidth_floors(c, cluster, nm: int, precision: str) -> dict:
    """(producer rep, consumer rep) -> [S, T] floor seconds for ``nm`` micro-batches, all edge
    instances (module doc): each collective a pair needs at least what the least-cost collective
    on the smallest block a path can hold costs. Any block a path holds is the tensor (one
    micro-batch) split at most by the axes source or destination split it over (moves only put
    axes where the destination wants them), so a collective moves at least that block's bytes;
    ``_least_from`` gives the least a collective on that many bytes or more costs."""

    def make() -> dict:
        lat, least, groups = _kept(c, ("floor parts", cluster), cluster, lambda: _floor_parts(c, cluster))
        out: dict = {}
        for n, k, need, src_masks, dst_masks, shape, dtype, bdim in groups:
            numel = float(np.prod(shape))
            if bdim is not None and shape[bdim] % nm == 0:
                numel /= nm
            mat = n * nm * pair_floors(need, src_masks, dst_masks, numel * runtime_itemsize(dtype, precision),
                                       c.mesh.shape, lat, least)
            out[k] = out[k] + mat if k in out else mat
        return out
    return _kept(c, ("bandwidth floors", cluster, nm, precision), cluster, make)


def pair_floors(need, src_masks, dst_masks, tensor_bytes: float, sizes, lat, least) -> np.ndarray:
    """[S, T] floor seconds of one micro-batch's reshards of a ``tensor_bytes`` tensor between
    sources and destinations given as ``collectives_needed`` [S, T, axes] and their split axes as
    bit masks (``_split_masks``): each needed collective at its latency floor ``lat[axis]`` and at
    least the least of the collectives that can act there on their least bytes (``_NOT_A2A``)."""
    naxes = len(sizes)
    masks = range(1 << naxes)
    union = src_masks[:, None] | dst_masks[None, :]
    lands = ((dst_masks[None, :, None] >> np.arange(naxes)) & 1).astype(bool)   # [1, T, axes]
    block = [tensor_bytes / math.prod(sizes[a] for a in range(naxes) if u >> a & 1) for u in masks]
    # [axes, masks]: where the destination splits over the axis (all-to-all possible), and not
    into = np.array([[max(lat[a], min(least(block[u], a, ("all_to_all",)), least(block[u] * sizes[a], a, _NOT_A2A)))
                      for u in masks] for a in range(naxes)])
    away = np.array([[max(lat[a], least(block[u] * (sizes[a] if u >> a & 1 else 1), a, _NOT_A2A))
                      for u in masks] for a in range(naxes)])
    per = np.where(lands, into[:, union].transpose(1, 2, 0), away[:, union].transpose(1, 2, 0))   # [S, T, axes]
    return (need * per).sum(axis=2)


def _floor_parts(c, cluster):
    """What ``bandwidth_floors`` needs whatever the micro-batches and precision: each axis'
    latency floor, the least price on some bytes, and per edge group (instances, key, collectives
    needed [S, T, axes], split masks of sources and destinations, shape, dtype, batch dim)."""
    comm = mesh_comm(c, cluster)
    naxes = len(c.mesh.shape)
    lat = np.array([latency_floor(comm, a) for a in range(naxes)])
    groups = []
    for n, prod, info, i, pname, shape, dtype, bdim in edge_groups(c):
        srcs, dsts = edge_layouts(prod, info, i, len(shape))
        need = collectives_needed(_places(srcs, naxes), _places(dsts, naxes), pname in c.needs_grad)
        if need.any():
            groups.append((n, (prod.rep, info.rep), need, _split_masks(srcs), _split_masks(dsts), shape, dtype, bdim))
    return lat, _least_from(comm, cluster, c.mesh), groups
