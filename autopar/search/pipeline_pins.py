"""Pipeline pins and their checks (autopar/search/pipeline.py plans with them): ``pp`` /
``pp_schedule`` / ``num_micro_batches`` (each valid on its own: autopar/constraints.py) checked
against the model and the cluster, the stage sub-mesh (``stage_cluster``), the per-stage axes
that must fit it, the pins that rule pipelining out, the checkpoint pins pipelining accepts and
the highest ZeRO stage a pipelined plan executes (``max_zero``). Every impossible pin is a
``ConstraintError`` naming it.
"""
from __future__ import annotations

import dataclasses
import math

from autopar.constraints import SCHEDULE_ALIASES
from autopar.errors import ConstraintError
from autopar.frontend.batching import global_batch
from autopar.plans.plan_schema import checkpoint_mode_of
from codegen.grid_layout import GRID_MODES
from codegen.stages import pipeline_units

# v stages per rank (PyTorch's Interleaved1F1B, InterleavedZeroBubble)
MULTI_STAGE = ("interleaved-1f1b", "zero-bubble")


def canonical_schedules(constraints: dict) -> dict:
    """``constraints`` (a copy) with ``pp_schedule`` spelled as plans record it (the pins
    autopar.plan passes on already are: autopar/constraints.py)."""
    sched = constraints.get("pp_schedule")
    if isinstance(sched, str) and sched.lower() in SCHEDULE_ALIASES:
        constraints = dict(constraints, pp_schedule=SCHEDULE_ALIASES[sched.lower()])
    return constraints


def pipeline_pins(constraints: dict | None) -> tuple[int, str | None]:
    """(pp, pp_schedule) of validated pins (autopar/constraints.py); pp=1 means no pipeline."""
    constraints = constraints or {}
    pp = constraints.get("pp", 1)
    return pp, (constraints.get("pp_schedule") or "1f1b") if pp > 1 else None


def unpipelined_pin(constraints: dict) -> str | None:
    """The pin (as text) that rules pipelining out, or None. The grid modes (2D/2.5D/3D) run one
    micro-batch of the whole model. (Sequence parallelism does not: its axis is part of each
    stage's sub-mesh, module doc.)"""
    if constraints.get("tp_mode") in GRID_MODES:
        return f"tp_mode={constraints['tp_mode']!r} (the grid modes run without pipeline stages)"
    return None


def check_stage_axes(cluster, sub, constraints: dict, pp: int) -> None:
    """The pinned per-stage axes (dp, tp, and a Ulysses/ring sequence axis sp) must fit one stage's
    sub-mesh ``sub``: their product divides its devices, and equals them when all are pinned
    (pp x dp x sp x tp = devices; Megatron-SP's sequence split is the tensor axis, no factor).
    Otherwise a ConstraintError naming the product."""
    n = sub.num_devices
    seq_axis = constraints.get("sp_mode") != "megatron" and constraints.get("sp", 1) > 1
    pinned = {k: constraints[k] for k in ("dp", "sp", "tp") if k in constraints and (k != "sp" or seq_axis)}
    prod = math.prod(pinned.values())
    every = "dp" in pinned and "tp" in pinned and ("sp" in pinned or "sp" in constraints
                                                   or constraints.get("sp_mode") == "megatron")
    if n % prod == 0 and not (every and prod != n):
        return
    what = " x ".join(f"{k}={v}" for k, v in pinned.items())
    raise ConstraintError(
        f"constraints pp={pp} and {what} cannot be met on {cluster.num_devices} devices: each of the {pp} pipeline "
        f"stages runs on a sub-mesh of {n} devices that holds the {'/'.join(pinned)} "
        f"ax{'es' if len(pinned) > 1 else 'is'}, and {prod if len(pinned) > 1 else what} "
        f"{'does not divide' if n % prod else 'is not'} {n} (pp x dp x sp x tp must equal the devices)")


def stage_cluster(cluster, pp: int):
    """The cluster one stage plans on: whole nodes when pp divides the nodes, else part of a node."""
    if cluster.nodes % pp == 0:
        return dataclasses.replace(cluster, nodes=cluster.nodes // pp)
    if cluster.nodes == 1 and cluster.devices_per_node % pp == 0:
        return dataclasses.replace(cluster, devices_per_node=cluster.devices_per_node // pp)
    raise ConstraintError(f"constraint pp={pp} cannot be met on {cluster.nodes} node(s) x {cluster.devices_per_node} "
                          f"devices: stages must get equal whole nodes or equal parts of a single node")


def check_pins(graph, cluster, constraints: dict, pp: int) -> int:
    """Validate the pins against the model and cluster; returns the number of micro-batches."""
    units = len(pipeline_units(graph))
    sched = constraints.get("pp_schedule") or "1f1b"
    v = virtual_stages(sched)
    if units == 0:
        raise ConstraintError(f"constraint pp={pp} cannot be met: the traced model has no repeated blocks to split "
                              f"into stages (pipelining at a finer granularity is not implemented yet)")
    if pp * v > units:
        extra = f" ({v} virtual stages per rank under {sched})" if v > 1 else ""
        raise ConstraintError(f"constraint pp={pp} cannot be met: the model has {units} blocks, so at most "
                              f"{units // v} pipeline stages{extra}")
    if cluster.num_devices % pp:
        raise ConstraintError(f"constraint pp={pp} cannot be met: {cluster.num_devices} devices do not split into "
                              f"{pp} equal stages")
    m = constraints.get("num_micro_batches")
    batch = global_batch(graph)
    if m is None:   # autopar/search/pipeline_search.py chose none: no count it tries divides the batch
        fits = [k for k in range(pp, batch + 1) if batch % k == 0]
        raise ConstraintError(f"constraint pp={pp} cannot be met without num_micro_batches pinned: no micro-batch "
                              f"count the search tries with {pp} stages divides the global batch of {batch} rows"
                              + (f"; pin one of {', '.join(map(str, fits))}" if fits else
                                 f", and {pp} stages need at least {pp} micro-batches"))
    if m < pp:
        raise ConstraintError(f"constraint num_micro_batches={m} cannot be met with pp={pp}: a pipeline of {pp} "
                              f"stages needs at least {pp} micro-batches to keep every stage busy "
                              f"(torch.distributed.pipelining's 1F1B refuses fewer)")
    if batch % m:
        raise ConstraintError(f"constraint num_micro_batches={m} cannot be met: the global batch of {batch} rows "
                              f"does not split into {m} equal micro-batches")
    return m


def virtual_stages(schedule: str) -> int:
    """Stages per rank: 2 for the interleaved schedules (v is not searched or pinned yet), else 1."""
    return 2 if schedule in MULTI_STAGE else 1


def checkpoint_pinned(ck, pp: int, schedule: str) -> bool:
    """Whether a pipelined plan's checkpoint pin recomputes any block (full recompute only)."""
    if ck is None or ck == "none":
        return False
    modes = {ck} if isinstance(ck, str) else {checkpoint_mode_of(v) for v in dict(ck).values()} - {"none"}
    if "selective" in modes:
        raise ConstraintError(f"constraint checkpoint={ck!r} cannot be met with pp={pp}: selective recompute is not "
                              f"implemented under pipeline parallelism yet; pin 'full' (or per group true/false)")
    if modes and schedule == "zero-bubble":
        raise ConstraintError(f"constraint checkpoint={ck!r} cannot be met with pp_schedule=zero-bubble: its separate "
                              f"weight-gradient pass is not run through checkpoint regions; use another schedule")
    return bool(modes)


def max_zero(graph, schedule: str | None = None, checkpointing: bool = False) -> int:
    """The highest ZeRO stage a pipelined plan of ``graph`` under ``schedule`` executes
    (autopar/execution/pipeline_run.py). ZeRO-3 gathers each chunk inside each stage per
    micro-batch, for forward and for backward (codegen/stages.py), as priced; a parameter shared
    by two stages (a tied embedding and head) is a chunk of its own on both, its gradient (shard)
    summed between them. Not under zero-bubble: its weight-gradient pass of a micro-batch runs
    after later micro-batches' forwards, which free the chunk (that pass would need a third
    gather per micro-batch, not priced), so that schedule runs ZeRO <= 2. Nor with activation
    checkpointing: a stage's ZeRO-3 calls are placed outside its checkpoint regions, so a
    recomputed block would not re-gather its chunk."""
    return 2 if schedule == "zero-bubble" or checkpointing else 3


__all__ = ["MULTI_STAGE", "canonical_schedules", "pipeline_pins", "unpipelined_pin", "check_stage_axes",
           "stage_cluster", "check_pins", "virtual_stages", "max_zero"]
