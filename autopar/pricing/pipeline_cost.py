"""Price of a point-to-point activation / gradient transfer across a pipeline stage boundary.

A boundary between stage s (on rank a) and stage s+1 (on rank b) is crossed once per
micro-batch forward (activations a -> b) and once backward (gradients b -> a). The link is the
intra-node one (NVLink; shared memory for local gloo processes) when a and b share a node,
else the inter-node one (InfiniBand). Ranks are numbered node-major, as in autopar/mesh.py.

The time comes from autopar.pricing.cost's collective model, so a calibrated cluster's measured
curves and an uncalibrated cluster's alpha-beta links are both used as for every other
transfer autopar prices. A transfer of n bytes is priced as an all-gather of 2n bytes on a
two-rank axis, which is exactly "each rank sends n bytes to the other": on alpha-beta links
that is ``latency + n / bandwidth``; on a measured profile it reads the two-rank bus bandwidth
at that size. (Under 1F1B's steady state the two directions of a boundary are busy at once, so
pricing the bidirectional exchange is not pessimistic.)
"""
from __future__ import annotations

import numbers

from autopar.cluster import Cluster
from autopar.pricing.cost import Collectives
from autopar.errors import PlanError
from autopar.mesh import Mesh

# A two-rank axis inside one node, and one spanning two nodes (one rank per node).
_INTRA = Mesh(shape=(2,), names=("pp",), devices_per_node=2)
_INTER = Mesh(shape=(2,), names=("pp",), devices_per_node=1)


def p2p_time(cluster: Cluster, nbytes: float, inter_node: bool) -> float:
    """Seconds to send ``nbytes`` from one rank to another on the intra- or inter-node link."""
    if not isinstance(nbytes, numbers.Real) or isinstance(nbytes, bool) or not nbytes >= 0:
        raise PlanError(f"p2p transfer size {nbytes!r}; expected bytes >= 0")
    if nbytes == 0:
        return 0.0
    if inter_node and cluster.nodes < 2:
        raise PlanError(f"cluster {cluster.name!r} has one node; no transfer crosses nodes")
    return Collectives(cluster, _INTER if inter_node else _INTRA)("all_gather", 2.0 * nbytes, 0)


def crosses_nodes(cluster: Cluster, src_rank: int, dst_rank: int) -> bool:
    """Whether global ranks ``src_rank`` and ``dst_rank`` sit on different nodes."""
    for r in (src_rank, dst_rank):
        if not (isinstance(r, int) and 0 <= r < cluster.num_devices):
            raise PlanError(f"rank {r!r} is outside cluster {cluster.name!r} ({cluster.num_devices} devices)")
    return src_rank // cluster.devices_per_node != dst_rank // cluster.devices_per_node


def boundary_p2p_time(cluster: Cluster, nbytes: float, src_rank: int, dst_rank: int) -> float:
    """Seconds for ``nbytes`` between two ranks of adjacent stages, on the link they share.

    With tensor parallelism inside a stage each rank sends its own slice to its counterpart
    in the next stage, all at once on separate links: pass one rank pair and that slice's
    bytes. Same rank (two virtual stages on one device): free.
    """
    if src_rank == dst_rank:
        return 0.0
    return p2p_time(cluster, nbytes, crosses_nodes(cluster, src_rank, dst_rank))
