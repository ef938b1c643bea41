"""The memoised collectives of one (cluster, mesh) for pricing (``MemoComm``, ``mesh_comm``) and the
reshard traffic memo every mesh of clusters with the same links shares (``shared_reshards``)."""
from __future__ import annotations

import dataclasses

from autopar.cluster import Cluster
from autopar.pricing.cost import Collectives
from autopar.rules.candidates import Candidates


class MemoComm:
    """``Collectives`` with its answers memoised: the same (kind, bytes, axis) is asked
    thousands of times while pricing one mesh (resharding searches, every micro-batch count).
    Hashes by identity, so ``plan_reshard``'s cache keys on this one object per (cluster, mesh)."""

    def __init__(self, comm: Collectives, shared: dict):
        self.comm = comm
        self.memo: dict = {}
        self.reshard: dict = {}   # (src, dst, local shape, itemsize) -> traffic list or None
        # how each mesh axis sits on the nodes (all a collective's price depends on besides the
        # cluster's links), and the reshard traffic shared by every mesh of clusters with these
        # links (autopar/pricing/edge_price.py ``reshard_traffic``)
        mesh = comm.mesh
        self.axes = tuple((p.size, p.intra, p.inter) for p in map(mesh.placement, range(mesh.ndim)))
        self.shared = shared
        self.kept_axes: dict = {}   # kept axes -> (them, their placements): part of a shared key

    def __call__(self, kind: str, nbytes: float, axis: int) -> float:
        k = (kind, nbytes, axis)
        t = self.memo.get(k)
        if t is None:
            t = self.memo[k] = self.comm(kind, nbytes, axis)
        return t

    __hash__ = object.__hash__


SHARED_MAX = 1 << 20   # entries per family before it starts over (a long-lived process planning many models)


def shared_reshards(families: dict, cluster: Cluster) -> dict:
    """The reshard traffic memo in ``families`` (link family -> memo: ``Candidates.reshards``) of
    every cluster with ``cluster``'s device, links and calibration (the node count aside: a
    pipeline stage's cluster shares the whole cluster's)."""
    family = dataclasses.replace(cluster, nodes=1)
    memo = families.setdefault(family, {})
    if len(memo) > SHARED_MAX:
        memo.clear()
    return memo


def mesh_comm(c: Candidates, cluster: Cluster) -> MemoComm:
    """The memoised collectives of ``c``'s mesh on ``cluster`` (one per pair, kept on ``c``)."""
    key = ("comm", cluster)
    if key not in c.edge_cache:
        c.edge_cache[key] = (cluster, MemoComm(Collectives(cluster, c.mesh), shared_reshards(c.reshards, cluster)))
    return c.edge_cache[key][1]
