"""Pipeline-parallel planning (first slice): pinned ``pp`` stages over the traced graph's blocks.

``constraints={"pp": p, "pp_schedule": "1f1b" | "gpipe", "num_micro_batches": m}`` plans as follows
(``pp`` pinned without ``num_micro_batches``: autopar/search/pipeline_search.py runs this for each
micro-batch count and schedule the free search tries with p stages and keeps the fastest).

1. Every stage runs on a sub-mesh of ``cluster.num_devices / p`` devices (whole nodes when ``p``
   divides the node count, else a slice of the one node): the global mesh is (pp, *sub-mesh) with
   stage s on ranks [s * S, (s + 1) * S). The model is planned ONCE on the sub-mesh as today
   (``search`` with pp=1: mesh shape, ZeRO, strategies; the same strategies on every stage), with
   ``m`` micro-batches (each stage sees every micro-batch) and the memory budget lifted (the
   whole model does not have to fit one stage: step 3 checks each stage).
2. The stage partition: solver/pipeline.py's dynamic program over contiguous ranges of the block
   instances (``codegen.stages.pipeline_units``), the prologue (embeddings) joining the first
   stage and the epilogue (final norm, head, loss) the last. A range's time per micro-batch is the
   sum of its nodes' predicted compute and in-op communication in the inner plan (a repeated
   block's representative divided by its repeats; under ZeRO-3 its parameters' all-gathers, one
   for forward and one for backward per micro-batch, as each stage runs them), plus the
   point-to-point sends of each boundary it has (activations forward, their gradients backward,
   priced on the link the boundary crosses: inside a node or between nodes).
3. The chosen split is simulated on the action order torch's schedule really runs
   (runtime/pipeline_orders.py -> solver/pipeline_schedule.py ``simulate``): per-stage forward and
   backward seconds per micro-batch from the inner plan (each op's forward share of its compute;
   under zero-bubble ``WEIGHT_GRAD_SHARE`` of the backward is the separate weight pass), and each
   boundary's transfer priced on the link it crosses (autopar/pricing/pipeline_cost.py: NVLink inside a
   node, InfiniBand across). The simulation gives every stage's peak count of micro-batches alive
   (1F1B: min(p - k, m); GPipe: m; interleaving and m not a multiple of p: whatever torch's order
   does, e.g. all m on rank 0) and every rank's peak activation bytes over time (its virtual stages
   together). A rank's memory is its stages' static bytes (parameters, gradients, optimizer state;
   a tied parameter on both of its stages) plus that peak; every rank must fit the budget, or the
   plan is a ``MemoryBudgetError`` naming the stage. The DP itself prices a range with the alive
   count of the equal-stage simulation (it does not know the range's final neighbours).
4. Step time = the simulated pipeline time plus the inner plan's exposed gradient communication
   and optimizer step scaled to the largest rank's share of the parameters. The bubble reported
   is the busiest rank's idle time in the simulation (its work + bubble = the pipeline time).

Interleaved schedules (``interleaved-1f1b``, ``zero-bubble``: PyTorch's ScheduleInterleaved1F1B and
ScheduleInterleavedZeroBubble) give every rank v = 2 virtual stages (k and k + pp): pp x v ranges.

Activation checkpointing is pinned, not searched, under pipelining (``checkpoint="full"`` or per
group true/false): the inner plan checkpoints those groups, and ``stage_costs`` prices each checkpointed
block instance per micro-batch as build.py does for the ILP — it keeps its input (the output of
the group's last node), its recomputation (forward compute, forward collectives, reshards into its
nodes) is added to its stage's backward time, and the largest of its stage's blocks' recompute
working sets (what recomputing one block saves again) is added once to the rank's memory. Not with
selective recompute, ZeRO-3 or zero-bubble (``checkpoint_pinned``, ``max_zero``).

Sequence parallelism composes: ``sp`` / ``sp_mode`` pins go to the inner search, so the
stage sub-mesh is (dp, sp[, tp]) and every stage runs its attention ops as the inner plan chose
(Ulysses / ring on the sequence axis, Megatron-SP on the tensor axis). Nothing else changes: the
per-instance figures of step 2 include the sequence axis' collectives, a boundary's transfer is
the output of a block as the inner plan lays it out (each rank's local sequence shard: 1/sp of
the tokens, zig-zag under load-balanced ring attention, the same on both sides of the boundary
since both stages are cut from one per-rank program), and values that depend on no parameter
(positions, RoPE tables, masks, sliced like the tokens) are recomputed on every stage.

Impossible pins are ``ConstraintError``: more stages than blocks, fewer micro-batches than
stages, a batch that does not divide, unknown schedules, per-stage axes (dp x sp x tp) that do
not fit a stage's devices (``check_stage_axes``).

Modules: autopar/search/pipeline_pins.py (the pins and their checks), autopar/search/stage_costs.py
(step 2's per-instance prices), autopar/search/stage_plan.py (the partition and the simulation,
steps 2-4); this module runs them in order (``search_pipelined``) and writes a pipelined plan's
fields (``apply_pipeline``).
"""
from __future__ import annotations

import dataclasses
import math

from autopar.errors import ConstraintError
from autopar.pricing.offload import OFFLOAD_BYTES
from autopar.search.pipeline_pins import (check_pins, check_stage_axes, checkpoint_pinned, max_zero, pipeline_pins,
                                          stage_cluster, unpipelined_pin)
from autopar.search.stage_plan import plan_stages


def search_pipelined(graph, cluster, base, constraints: dict, search_fn, **kw):
    """The inner search on one stage's sub-mesh, then the stage partition (module doc). Returns
    (inner Result, stats, pipeline figures)."""
    pp, schedule = pipeline_pins(constraints)
    m = check_pins(graph, cluster, constraints, pp)
    sub = stage_cluster(cluster, pp)
    inner = {k: v for k, v in constraints.items() if k not in ("pp", "pp_schedule")}
    check_stage_axes(cluster, sub, inner, pp)
    ck = inner.get("checkpoint")
    inner["checkpoint"] = "none" if ck is None else ck   # not searched under pipelining: only pinned
    # Offload likewise: a pipelined plan offloads only when offload is pinned (searched, its stages
    # lost the best plan without offload to the micro-batch and checkpoint retries: 40B on one
    # DGX-A100, pp=2 pinned, 13.64 s against 12.92 s with offload="none" also pinned)
    inner.setdefault("offload", "none")
    checkpointing = checkpoint_pinned(ck, pp, schedule)
    why = unpipelined_pin(inner)
    if why:
        raise ConstraintError(f"constraint pp={pp} cannot be met together with {why}: drop one of the two pins")
    top = max_zero(graph, schedule, checkpointing)
    if inner.get("zero", 0) > top:
        raise ConstraintError(f"constraint zero={inner['zero']} cannot be met with pp={pp}, pp_schedule={schedule}: "
                              f"pipelined stages run ZeRO <= {top} under that schedule; pin a lower zero or "
                              f"another schedule")
    budget = base.budget
    # The whole model need not fit one stage: the budget is checked per stage (plan_stages).
    # Offloaded, every chunk: the stages' memory (plan_stages) counts the optimizer on the host.
    lifted = dataclasses.replace(base, budget=budget * pp, offload_all=True)
    result, stats = search_fn(graph, sub, lifted, inner, max_zero=top, **kw)
    # the incumbent to beat (pipeline_candidates: ``cutoff`` is its step time times pp)
    beat = None if kw.get("cutoff") is None else kw["cutoff"] / pp
    info = plan_stages(result, graph, cluster, pp, schedule, budget, beat)
    info.update(pp=pp, schedule=schedule, num_micro_batches=m)
    return result, stats, info


def apply_pipeline(data: dict, info: dict) -> dict:
    """Plan fields of a pipelined plan: degrees, per-stage entries, step time with the bubble."""
    data["degrees"].update(pp=info["pp"], pp_schedule=info["schedule"])
    ckpt = data["stages"][0].get("checkpoint", {})
    nodes = data["stages"][0].get("nodes")
    data["stages"] = [dict(s, nodes=nodes, checkpoint=ckpt) for s in info["stages"]]
    pred = data["predictions"]
    pred["inner_step_time"] = pred["step_time"]   # the whole model on one stage's sub-mesh, no pipeline
    pred["step_time"] = info["step_time"]
    tb, share = pred["time_breakdown"], info["static_share"]
    # The busiest rank: its stages' compute, in-op and resharding communication and point-to-point
    # sends (all in "compute"), the bubble, and its share of gradient communication and optimizer.
    recompute = info.get("recompute", 0.0)   # the busiest rank's recomputation (activation checkpointing)
    pred["time_breakdown"] = {"compute": info["pipeline"] - info["bubble"] - recompute, "recompute": recompute,
                              "op_comm": 0.0,
                              "reshard_comm": 0.0, "grad_comm": tb["grad_comm"] * share,
                              "grad_comm_exposed": tb["grad_comm_exposed"] * share,
                              "optimizer": tb["optimizer"] * share, "bubble": info["bubble"],
                              "bubble_fraction": info.get("bubble_fraction", 0.0),
                              "pipeline": info["pipeline"]}
    pred["peak_memory"] = info["peak_memory"]
    mb, f = pred["memory_breakdown"], info["peak_static_share"]
    static = {k: int(round(mb[k] * f)) for k in ("params", "grads", "optimizer", "gathered") if k in mb}
    pred["memory_breakdown"] = {**static, "activations": max(0, info["peak_memory"] - sum(static.values())),
                                "other": 0}
    if "offload" in pred:
        # the rank with the most parameters: host bytes and copies go with the device's static
        # bytes (per element alike; a tied parameter held by two stages counts on both)
        flat = sum(v for k, v in mb.items() if k in ("params", "grads", "optimizer", "gathered"))
        per = info["max_static"] / flat if flat > 0 else f
        pred["offload"] = {**pred["offload"], **{k: int(round(pred["offload"][k] * per))
                                                 for k in OFFLOAD_BYTES if k in pred["offload"]}}
    # per rank: what its (virtual) stages send
    per_rank = {}
    for s in info["stages"]:
        per_rank[s["ranks"][0]] = per_rank.get(s["ranks"][0], 0) + s["p2p_bytes"]
    rank_axis = {}
    for s in info["stages"]:
        for a, x in s["comm_bytes"].items():
            rank_axis.setdefault(a, {}).setdefault(s["ranks"][0], 0)
            rank_axis[a][s["ranks"][0]] += x
    # per rank (the busiest): its stages' collectives on each mesh axis, and what they send point-to-point
    pred["comm_bytes"] = dict({a: max(v.values()) for a, v in rank_axis.items()}, pp=max(per_rank.values()))
    world = info["pp"] * math.prod(data["mesh"]["shape"])
    if pred.get("model_flops") and info["step_time"] > 0 and pred.get("mfu"):
        # the same FLOPs over pp times the devices, in the pipelined step time
        pred["mfu"] = pred["mfu"] * pred["inner_step_time"] / info["step_time"] / info["pp"]
    pred["devices"] = world
    return data


__all__ = ["search_pipelined", "apply_pipeline"]
