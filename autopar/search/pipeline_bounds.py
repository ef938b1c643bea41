"""Lower bounds on a pipelined step that hold for ANY stage partition, used to prune pipelined
candidates before their inner search (autopar/search/pipeline_candidates.py) and inner
configurations during it (autopar/search/outer.py's ``cutoff``).

**Fill and drain** (``fill_drain_factor``). With p stages and m micro-batches, stage k taking
t_k seconds (forward + backward) per micro-batch, the step is at least, for every k,

    L_k = t_1 + ... + t_{k-1}  +  m t_k

(micro-batch 1 reaches stage k only after its forward through stages 1..k-1; stage k then does
its m forwards and backwards one at a time; its last backward still goes back through stages
k-1..1). This holds for 1F1B and GPipe, whatever the order of a stage's actions. The partition
with the least max_k L_k makes every L_k equal (t_k = C (1 - 1/m)^(k-1) / m), so for total
T = sum t_k:

    step >= C = T / (1 - (1 - 1/m)^p) = (m T / p) * p / (m (1 - (1 - 1/m)^p))

i.e. the average work per stage times ``fill_drain_factor`` (>= 1, below the equal-stage
1 + (p - 1) / m, which unequal stages can beat: tests/search/test_pipeline_bounds.py shows a
simulated 1F1B step 6% under it). Interleaved stages (v chunks per rank) can put little work in
the first chunk of each rank, so no fill and drain is proven without the partition: the factor
is 1 (the stage partition's own bound, ``stage_plan.least_step_time``, uses the fastest block).
Zero-bubble runs weight gradients after the last input gradient: factor 1.

**Compute floor** (``device_compute_floor``). Every op priced unsplit on one device with the
whole global batch (each node at its cheapest strategy), divided by the cluster's devices: no
plan's average compute per device goes below it, because the cost model's compute of a kernel
(``pricing/cost.compute_time``) is a roofline whose efficiency grows with the kernel's FLOPs,
so k pieces of an op take at least as long in all as the op whole, and replication, micro-batches
and recomputation only add. It replaces the pp=1 plan's compute, which a pipelined plan can beat
(less recomputation, other tensor-parallel degrees).
"""
from __future__ import annotations

import dataclasses

from autopar.mesh import Mesh
from autopar.pricing.price import price
from autopar.rules.candidates import candidates
from autopar.search.pipeline_pins import virtual_stages

FILL_DRAIN_SCHEDULES = ("1f1b", "gpipe")   # the schedules whose fill and drain the factor proves


def fill_drain_factor(schedule: str, pp: int, m: int) -> float:
    """The least step over the average work per stage, m T / pp, for any partition (module doc)."""
    if schedule not in FILL_DRAIN_SCHEDULES or pp < 2 or m < 1:
        return 1.0
    if m == 1:
        return float(pp)   # one micro-batch passes every stage in turn: step >= T
    return pp / (m * (1.0 - (1.0 - 1.0 / m) ** pp))


def shared_fill_drain_factor(schedules, pp: int, m: int) -> float:
    """The factor valid for every schedule of ``schedules`` (an inner search several share)."""
    return min(fill_drain_factor(s, pp, m) for s in schedules)


def equal_stage_factor(schedule: str, pp: int, m: int) -> float:
    """1 + (pp - 1) / (m v): the fill and drain with equal stages. An estimate (candidates are
    visited in its order), not a bound (module doc)."""
    return 1.0 + (pp - 1) / (m * virtual_stages(schedule))


def device_compute_floor(graph, cluster, base, micro_batches: int = 1) -> float:
    """Seconds of compute per device no plan of ``graph`` on ``cluster`` with ``micro_batches``
    micro-batches (or more) goes below (module doc)."""
    one = candidates(graph, Mesh((1,), ("dp",), cluster.devices_per_node))
    settings = dataclasses.replace(base, zero=0, num_micro_batches=micro_batches, checkpoint="none", offload="none",
                                   offload_all=False)
    P = price(one, cluster, settings, edges=False)
    work = sum(float(P.compute[n].min()) for n in one.reps if n in P.compute and len(P.compute[n]))
    return work / cluster.num_devices


__all__ = ["FILL_DRAIN_SCHEDULES", "device_compute_floor", "equal_stage_factor", "fill_drain_factor",
           "shared_fill_drain_factor"]
