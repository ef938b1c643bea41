"""The least mean work per rank of a pipelined candidate (pp stages, m micro-batches, optionally a
sequence axis): a floor that knows the candidate's stage sub-mesh, used by the pipelined search's
proven pruning (autopar/search/pipeline_candidates.py, ``PROVEN_BOUNDS``) beside the
one-device compute floor (autopar/search/pipeline_bounds.py's ``device_compute_floor``).

A pipelined plan's stages split one inner plan: the whole model on one stage's sub-mesh of
N / pp devices with m micro-batches (autopar/search/pipeline.py). Its stage times
(autopar/search/stage_costs.py) add, per op node, the chosen strategy's compute plus in-op
communication less gradient communication, plus recomputation, resharding and point-to-point
transfers (all >= 0); so the ranks' work per step T is at least the sum over nodes of each node's
cheapest compute + in-op communication on that mesh, and its mean per rank is T / pp. The inner
search visits the meshes ``configurations.allowed_meshes`` gives for the sub-cluster and the inner
pins (and grid modes, whose compute ``grid_bound.grid_compute_floor`` bounds), each priced with m
micro-batches: the least over them, over pp, is a floor on the mean work per rank of any plan
the candidate's inner search could return. ZeRO stages only add communication (parameter
gathers) and the optimizer step is left out (the step adds it apart: ``rest``), so each mesh is
priced once at ZeRO-0 without checkpointing or offload.

It is higher than the one-device floor where the candidate's per-device shapes are small (a
micro-batch's slice of the batch over a stage's devices: GEMMs of lower intensity, kernel
launches per micro-batch) or a model axis forces in-op collectives: 18.4B of Narayanan et al.'s
Table 1 on pp = 4 stages, m = 16: 1.017-1.023 times it (benchmarks/RESULTS.md section 12).
"""
from __future__ import annotations

import dataclasses
import math

from autopar.errors import ConstraintError
from autopar.frontend.batching import global_batch
from autopar.pricing.price import price
from autopar.rules.candidates import candidates
from autopar.search.configurations import allowed_meshes
from autopar.search.grid_bound import grid_compute_floor
from autopar.search.pipeline_pins import stage_cluster


def inner_pins(flat: dict, m: int, sp: int | None = None) -> dict:
    """The pins of a candidate's inner search (as autopar/search/pipeline.py makes them): the
    search's pins less the pipeline's, with the micro-batch count (and sequence axis)."""
    inner = {k: v for k, v in flat.items() if k not in ("pp", "pp_schedule")}
    inner["num_micro_batches"] = m
    if sp:
        inner["sp"] = sp
    return inner


def node_work(cands, P) -> float:
    """Seconds per step of a priced configuration's nodes, each at its cheapest compute + in-op
    communication (gradient communication and optimizer left out): no plan's stage work goes below."""
    out = 0.0
    for n in cands.reps:
        if n in P.compute and len(P.compute[n]):
            t = P.compute[n]
            if n in P.comm:
                t = t + P.comm[n] - P.grad_comm[n]
            out += float(t.min())
    return out


def stage_work_floor(graph, cluster, base, pp: int, m: int, flat: dict, sp: int | None = None,
                     memo: dict | None = None) -> float:
    """The least mean work per rank (seconds per step) of any plan of the pipelined candidate
    (``pp`` stages, ``m`` micro-batches, sequence axis ``sp``) under pins ``flat`` (module doc);
    0.0 where its stage sub-mesh or pins admit no configuration (the candidate fails anyway)."""
    try:
        sub = stage_cluster(cluster, pp)
    except ConstraintError:
        return 0.0
    inner = inner_pins(flat, m, sp)
    batch = global_batch(graph)
    settings = dataclasses.replace(base, zero=0, num_micro_batches=m, checkpoint="none", offload="none",
                                   offload_all=True)
    best = math.inf
    try:
        for mesh in allowed_meshes(sub, inner):
            dp = mesh.degree("dp")
            if batch % dp or (batch // dp) % m:
                continue
            cands = candidates(graph, mesh)
            best = min(best, node_work(cands, price(cands, sub, settings, edges=False)))
        best = min(best, grid_compute_floor(graph, sub, base, inner, memo))
    except (ConstraintError, ValueError):
        return 0.0
    return 0.0 if best == math.inf else best / pp


__all__ = ["inner_pins", "node_work", "stage_work_floor"]
