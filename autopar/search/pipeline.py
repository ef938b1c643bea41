"""Pipeline-parallel planning (first slice): pinned ``pp`` stages over the traced graph's blocks.

``constraints={"pp": p, "pp_schedule": "1f1b" | "gpipe", "num_micro_batches": m}`` plans as follows.

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
group true/false): the inner plan checkpoints those groups, and ``_costs`` prices each checkpointed
block instance per micro-batch as build.py does for the ILP — it keeps its input (the output of
the group's last node), its recomputation (forward compute, forward collectives, reshards into its
nodes) is added to its stage's backward time, and the largest of its stage's blocks' recompute
working sets (what recomputing one block saves again) is added once to the rank's memory. Not with
selective recompute, ZeRO-3 or zero-bubble (``_checkpoint_pinned``, ``max_zero``).

Sequence parallelism composes (issue 7): ``sp`` / ``sp_mode`` pins go to the inner search, so the
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
"""
from __future__ import annotations

import dataclasses
import functools
import math

from autopar.errors import ConstraintError, MemoryBudgetError

MULTI_STAGE = ("interleaved-1f1b", "zero-bubble")   # v stages per rank (PyTorch's Interleaved1F1B, InterleavedZeroBubble)
RUNNABLE_SCHEDULES = ("gpipe", "1f1b", *MULTI_STAGE)
KNOWN_SCHEDULES = RUNNABLE_SCHEDULES
# Spellings accepted for the api.md names above (plans record the api.md name).
SCHEDULE_ALIASES = {"interleaved_1f1b": "interleaved-1f1b", "interleaved": "interleaved-1f1b",
                    "zero_bubble": "zero-bubble", "zb": "zero-bubble"}


def canonical_schedules(constraints: dict) -> dict:
    """``constraints`` (a copy) with ``pp_schedule`` spelled as api.md spells it."""
    sched = constraints.get("pp_schedule")
    if isinstance(sched, str) and sched.lower() in SCHEDULE_ALIASES:
        constraints = dict(constraints, pp_schedule=SCHEDULE_ALIASES[sched.lower()])
    return constraints


def pipeline_pins(constraints: dict | None) -> tuple[int, str | None]:
    """(pp, pp_schedule) from constraints, validated; pp=1 means no pipeline."""
    constraints = canonical_schedules(constraints or {})
    pp = constraints.get("pp", 1)
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ConstraintError(f"constraint pp={pp!r}: must be a positive integer (pipeline stages)")
    sched = constraints.get("pp_schedule")
    if sched is not None:
        if sched not in KNOWN_SCHEDULES:
            raise ConstraintError(f"constraint pp_schedule={sched!r}: known schedules are {', '.join(KNOWN_SCHEDULES)}")
        if sched not in RUNNABLE_SCHEDULES:
            raise ConstraintError(f"constraint pp_schedule={sched!r} cannot be met yet: the schedules planned and "
                                  f"executed are {', '.join(RUNNABLE_SCHEDULES)}")
        if pp == 1:
            raise ConstraintError(f"constraint pp_schedule={sched!r} needs pp > 1 (pin pp as well)")
    return pp, (sched or "1f1b") if pp > 1 else None


def unpipelined_pin(constraints: dict) -> str | None:
    """The pin (as text) that rules pipelining out, or None. The grid modes (2D/2.5D/3D) run one
    micro-batch of the whole model. (Sequence parallelism does not: its axis is part of each
    stage's sub-mesh, module doc.)"""
    from codegen.grid_layout import GRID_MODES

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
    from codegen.stages import pipeline_units
    from autopar.search.outer import global_batch

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
    if m is None:
        raise ConstraintError(f"constraint pp={pp} cannot be met without num_micro_batches pinned too (at least "
                              f"{pp}; the search does not choose it under pipelining yet)")
    if m < pp:
        raise ConstraintError(f"constraint num_micro_batches={m} cannot be met with pp={pp}: a pipeline of {pp} "
                              f"stages needs at least {pp} micro-batches to keep every stage busy "
                              f"(torch.distributed.pipelining's 1F1B refuses fewer)")
    batch = global_batch(graph)
    if batch % m:
        raise ConstraintError(f"constraint num_micro_batches={m} cannot be met: the global batch of {batch} rows "
                              f"does not split into {m} equal micro-batches")
    return m


def alive_micro_batches(schedule: str, stage: int, pp: int, m: int) -> int:
    """Micro-batches whose activations a stage holds at its peak (equal stages; see ``alive``)."""
    return alive(schedule, stage, pp, m)


@dataclasses.dataclass
class _Costs:
    unit_time: list[float]       # seconds per micro-batch of each block instance
    unit_static: list[float]     # static bytes of each instance's parameters
    unit_saved: list[float]      # saved activation bytes per micro-batch
    unit_out: list[float]        # bytes of the instance's output (what a boundary after it sends)
    pro: tuple[float, float, float]   # prologue (time, static, saved)
    epi: tuple[float, float, float]
    unit_bytes: list[dict] = dataclasses.field(default_factory=list)   # per instance: mesh axis -> bytes per step
    pro_bytes: dict = dataclasses.field(default_factory=dict)
    epi_bytes: dict = dataclasses.field(default_factory=dict)
    unit_fwd: list[float] = dataclasses.field(default_factory=list)   # forward part of unit_time
    pro_fwd: float = 0.0
    epi_fwd: float = 0.0
    # activation checkpointing (the inner plan's "full" groups): per instance the seconds of its
    # recomputation per micro-batch (in unit_time, backward part) and the bytes its recomputation
    # saves again in backward beyond its kept input (one block at a time: a stage counts its largest)
    unit_recompute: list[float] = dataclasses.field(default_factory=list)
    unit_recompute_memory: list[float] = dataclasses.field(default_factory=list)


def _costs(result, graph) -> _Costs:
    """Per-instance and prologue/epilogue figures from the inner plan's priced arrays."""
    from autopar.pricing.saved_copies import copy_bytes
    from autopar.search.build import _block_input_roots, chosen
    from codegen.stages import pipeline_units

    cands, P = result.cands, result.priced
    pick = chosen(result.problem, result.solution)
    copies = copy_bytes(cands, P, pick)   # saved copies made by reshards (autopar/pricing/saved_copies.py)
    nm = result.config.settings.num_micro_batches
    units = pipeline_units(graph)
    order = {n.name: k for k, n in enumerate(graph.gm.graph.nodes)}
    first_block = min(order[graph.blocks[g].instances[i][0]] for g, i in units)
    groups = {g for g, _ in units}
    t = {g: 0.0 for g in groups}
    tf = {g: 0.0 for g in groups}   # forward seconds per micro-batch
    fwd_pe = [0.0, 0.0]             # prologue, epilogue forward seconds
    st = {g: 0.0 for g in groups}
    sv = {g: 0.0 for g in groups}
    out = {g: 0.0 for g in groups}
    last_pos = {g: -1 for g in groups}
    pro, epi = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
    names = result.config.mesh.names
    ub = {g: {a: 0.0 for a in names} for g in groups}
    pro_b, epi_b = {a: 0.0 for a in names}, {a: 0.0 for a in names}
    # Checkpointed block groups (full recompute, as build.py prices them): a checkpointed instance
    # keeps only its input (priced as the output of the group's last node, as in the ILP), and its
    # backward reruns its forward (compute, in-op forward collectives, reshards into its nodes).
    modes = result.prediction.get("checkpoint") or {}
    full = {g for g in groups if modes.get(graph.blocks[g].name) is True}
    rec_t = {g: 0.0 for g in groups}
    rec_m = {g: 0.0 for g in groups}
    inputs_of = {g: _block_input_roots(cands, g) for g in full}

    def add_bytes(name, per_axis, r):
        """A node's (or edge's) bytes per mesh axis go with the node's block, prologue or epilogue."""
        vals = {names[a]: float(x) for a, x in enumerate(per_axis)}
        if name in graph.block_of:
            for a, x in vals.items():
                ub[graph.block_of[name][0]][a] += x / r
            return
        where = {order[name] < first_block} if name in order else set()
        for dst in ([pro_b] if True in where else []) + ([epi_b] if False in where else []):
            for a, x in vals.items():
                dst[a] += x
    users = {}
    for n in graph.gm.graph.nodes:
        for a in n.all_input_nodes:
            users.setdefault(a.name, []).append(n.name)
    for name in cands.order:
        info = cands.nodes[name]
        if name not in pick or info.repeats == 0:
            continue
        k, r = pick[name], max(1, info.repeats)
        if name in P.comm_bytes:
            per = [arr[k] for arr in P.comm_bytes[name]]
            if info.kind == "param":   # gradient traffic: with the parameter's block(s)
                gs = {graph.block_of[u][0] for u in users.get(name, []) if u in graph.block_of}
                if gs and all(u in graph.block_of for u in users.get(name, [])):
                    for g in gs:
                        for a, x in enumerate(per):
                            ub[g][names[a]] += float(x) / r
                else:
                    for side, dst in ((True, pro_b), (False, epi_b)):
                        if side in {order[u] < first_block for u in users.get(name, []) if u not in graph.block_of}:
                            for a, x in enumerate(per):
                                dst[names[a]] += float(x)
            else:
                add_bytes(name, per, r)
        if info.kind == "param":
            s = sum(float(P.static[name][key][k]) for key in ("params", "grads", "optimizer")) if name in P.static else 0.0
            # ZeRO-3's gathers (one for forward, one for backward, per micro-batch): on the stage(s)
            # holding the parameter, in its time per micro-batch; gradient traffic stays in ``rest``
            gt = (float(P.comm[name][k]) - float(P.grad_comm[name][k])) / nm if name in P.comm else 0.0
            gs = {graph.block_of[u][0] for u in users.get(name, []) if u in graph.block_of}
            if gs and all(u in graph.block_of for u in users.get(name, [])):
                for g in gs:
                    st[g] += s / r
                    t[g] += gt / r
                    tf[g] += gt / 2 / r
            else:   # read outside the blocks: the prologue's, the epilogue's, or both (tied)
                where = {order[u] < first_block for u in users.get(name, []) if u not in graph.block_of}
                if True in where:
                    pro[1] += s
                    pro[0] += gt
                    fwd_pe[0] += gt / 2
                if False in where:
                    epi[1] += s
                    epi[0] += gt
                    fwd_pe[1] += gt / 2
            continue
        if info.kind != "op":
            continue
        time = float(P.compute[name][k]) + float(P.comm[name][k]) - float(P.grad_comm[name][k])
        time /= nm   # per micro-batch
        # forward share: the op's forward compute share of its compute, applied to its whole time
        comp = float(P.compute[name][k])
        fshare = float(P.fwd_compute[name][k]) / comp if comp > 0 and name in P.fwd_compute else 0.5
        saved = (float(P.saved[name][k]) if name in P.saved else 0.0) + copies.get(name, 0.0)
        if name in graph.block_of:
            g = graph.block_of[name][0]
            t[g] += time / r
            tf[g] += time * fshare / r
            sv[g] += saved / r
            if g in full:
                again = saved - sum(float(arr[k]) for root, arr in P.saved_by_root.get(name, {}).items()
                                    if root in inputs_of[g])
                rec_m[g] += again / r
                rec_t[g] += (float(P.fwd_compute[name][k]) + float(P.fwd_comm[name][k] if name in P.fwd_comm else 0.0)) \
                    / nm / r
                for a, arr in enumerate(P.fwd_comm_bytes.get(name, [])):   # its forward collectives run again
                    ub[g][names[a]] += float(arr[k]) / r
            if order[name] > last_pos[g] and name in P.transient:
                last_pos[g], out[g] = order[name], float(P.transient[name][k])
        else:
            dst = pro if order[name] < first_block else epi
            dst[0] += time
            dst[2] += saved
            fwd_pe[0 if order[name] < first_block else 1] += time * fshare
    for (u, v), per_axis in P.edge_bytes.items():   # resharding goes with its consumer
        if u in pick and v in pick:
            add_bytes(v, [arr[pick[u], pick[v]] for arr in per_axis], max(1, cands.nodes[v].repeats))
    for (u, v), per_axis in P.edge_fwd_bytes.items():   # recomputation reruns the reshards into a block
        if u in pick and v in pick and v in graph.block_of and graph.block_of[v][0] in full:
            for a, arr in enumerate(per_axis):
                ub[graph.block_of[v][0]][names[a]] += float(arr[pick[u], pick[v]]) / max(1, cands.nodes[v].repeats)
    for (u, v), mat in P.edges.items():   # and so does its time
        if u in pick and v in pick:
            secs = float(mat[pick[u], pick[v]]) / nm
            fsecs = float(P.edge_fwd[(u, v)][pick[u], pick[v]]) / nm if (u, v) in P.edge_fwd else 0.0
            if v in graph.block_of:
                t[graph.block_of[v][0]] += secs / max(1, cands.nodes[v].repeats)
                tf[graph.block_of[v][0]] += fsecs / max(1, cands.nodes[v].repeats)
                if graph.block_of[v][0] in full:   # recomputation reruns the reshards into the block
                    rec_t[graph.block_of[v][0]] += fsecs / max(1, cands.nodes[v].repeats)
            elif v in order:
                (pro if order[v] < first_block else epi)[0] += secs
                fwd_pe[0 if order[v] < first_block else 1] += fsecs
    for g in full:
        last = graph.blocks[g].instances[0][-1]
        sv[g] = float(P.transient[last][pick[last]]) if last in pick else out[g]   # what it keeps
        t[g] += rec_t[g]
    return _Costs([t[g] for g, _ in units], [st[g] for g, _ in units], [sv[g] for g, _ in units],
                  [out[g] for g, _ in units], tuple(pro), tuple(epi), [dict(ub[g]) for g, _ in units], pro_b, epi_b,
                  [tf[g] for g, _ in units], fwd_pe[0], fwd_pe[1], [rec_t[g] for g, _ in units],
                  [rec_m[g] for g, _ in units])


# Torch's schedule names (runtime/pipeline_orders.py) for the planner's pp_schedule values.
_TORCH_NAME = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved-1f1b": "interleaved-1f1b", "zero-bubble": "zero-bubble"}
# Share of a stage's backward that is the weight-gradient pass under zero-bubble (I and W scheduled
# apart): for a matmul dX and dW cost one forward each, so half; the pass the simulator prices.
WEIGHT_GRAD_SHARE = 0.5


def virtual_stages(schedule: str) -> int:
    """Stages per rank: 2 for the interleaved schedules (v is not searched or pinned yet), else 1."""
    return 2 if schedule in MULTI_STAGE else 1


def orders_for(schedule: str, pp: int, m: int) -> dict:
    """rank -> the compute actions torch's schedule runs (runtime/pipeline_orders.py)."""
    from runtime.pipeline_orders import pipeline_orders

    try:
        return pipeline_orders(_TORCH_NAME[schedule], pp, m, virtual_stages(schedule))
    except ValueError as e:
        raise ConstraintError(f"constraint pp={pp}, pp_schedule={schedule}, num_micro_batches={m}: {e}") from None


def simulate_stages(schedule: str, pp: int, m: int, fwd, bwd, p2p=(), timeline: bool = False):
    """Simulate torch's order for this schedule with per-stage forward / backward seconds per
    micro-batch and per-boundary transfer seconds (solver/pipeline_schedule.py)."""
    from solver.pipeline_schedule import StageDurations, simulate

    w = WEIGHT_GRAD_SHARE if schedule == "zero-bubble" else 0.0
    d = StageDurations(list(fwd), [b * (1 - w) for b in bwd], [b * w for b in bwd], list(p2p))
    if schedule == "zero-bubble":   # torch 2.13 runs stage 0's whole backward in its W action
        d = d.first_stage_backward_in_weight_pass()
    return simulate(orders_for(schedule, pp, m), d, timeline=timeline)


def alive(schedule: str, k: int, pp: int, m: int) -> int:
    """Micro-batches of virtual stage k's activations alive at its peak, read off the simulation
    of torch's order with equal stages (GPipe: all m; 1F1B: min(pp - k, m); interleaving: more on
    the first ranks, and all m on rank 0 when m is not a multiple of pp)."""
    V = pp * virtual_stages(schedule)
    return _uniform_alive(schedule, pp, m)[k] if k < V else 0


@functools.lru_cache(maxsize=256)
def _uniform_alive(schedule: str, pp: int, m: int) -> tuple[int, ...]:
    V = pp * virtual_stages(schedule)
    sim = simulate_stages(schedule, pp, m, [1.0] * V, [2.0] * V)
    return tuple(sim.peak_alive[k] for k in range(V))


def plan_stages(result, graph, cluster, pp: int, schedule: str, budget: float) -> dict:
    """The stage partition and the pipeline's predictions (module doc, steps 2-4). With an
    interleaved schedule there are pp x v virtual stages, stage k on rank position k % pp."""
    from solver.pipeline import partition
    from autopar.pricing.pipeline_cost import boundary_p2p_time

    c = _costs(result, graph)
    mesh = result.config.mesh
    m = result.config.settings.num_micro_batches
    n = len(c.unit_time)
    S = mesh.size
    V = pp * virtual_stages(schedule)
    est_alive = _uniform_alive(schedule, pp, m)

    def first_rank(k: int) -> int:   # first global rank of virtual stage k
        return (k % pp) * S

    def p2p_secs(bytes_: float, k: int) -> float:   # boundary between virtual stages k and k + 1
        return boundary_p2p_time(cluster, bytes_, first_rank(k), first_rank(k + 1))

    def memory_parts(i: int, j: int) -> tuple[float, float]:
        """(static bytes, saved activation bytes per micro-batch) of blocks [i, j)."""
        static = sum(c.unit_static[i:j]) + (c.pro[1] if i == 0 else 0.0) + (c.epi[1] if j == n else 0.0)
        saved = sum(c.unit_saved[i:j]) + (c.pro[2] if i == 0 else 0.0) + (c.epi[2] if j == n else 0.0)
        return static, saved

    def recompute_memory(i: int, j: int) -> float:
        """Bytes one checkpointed block of [i, j) saves again while backward recomputes it: blocks
        are recomputed one at a time, so the largest (0 without checkpointing)."""
        return max(c.unit_recompute_memory[i:j], default=0.0)

    def times(i: int, j: int) -> tuple[float, float]:
        """(forward, backward) seconds per micro-batch of blocks [i, j), without point-to-point."""
        t = sum(c.unit_time[i:j]) + (c.pro[0] if i == 0 else 0.0) + (c.epi[0] if j == n else 0.0)
        f = sum(c.unit_fwd[i:j]) + (c.pro_fwd if i == 0 else 0.0) + (c.epi_fwd if j == n else 0.0)
        return f, t - f

    # The DP's cost callback does not know a range's stage index: price it as the first stage, the
    # last or a middle one by where it starts and ends (time with its boundaries' transfers, memory
    # with the equal-stage simulation's alive count); the chosen split is then simulated exactly.
    def cost(i, j, d):
        k = min(0 if i == 0 else (V - 1 if j == n else 1), V - 1)
        f, b = times(i, j)
        t = f + b
        if i > 0:
            t += 2 * p2p_secs(c.unit_out[i - 1], max(k - 1, 0))
        if j < n:
            t += 2 * p2p_secs(c.unit_out[j - 1], k)
        static, saved = memory_parts(i, j)
        return t, static + est_alive[k] * saved + recompute_memory(i, j)

    try:
        part = partition(n, V, m, cost, device_options=(S,), total_devices=V * S)
    except Exception as e:   # a PlanError from the DP: no split at all (cannot happen with finite memory)
        raise ConstraintError(f"constraint pp={pp}: no stage partition: {e}") from None
    ranges = [(i, j) for i, j, _ in part.stages]
    fb = [times(i, j) for i, j in ranges]
    p2p = [p2p_secs(c.unit_out[j - 1], k) for k, (i, j) in enumerate(ranges[:-1])]
    sim = simulate_stages(schedule, pp, m, [f for f, _ in fb], [b for _, b in fb], p2p)
    parts = [memory_parts(i, j) for i, j in ranges]
    acts = sim.peak_rank_memory({k: parts[k][1] for k in range(V)})
    rank_static = [sum(parts[k][0] for k in range(V) if k % pp == r) for r in range(pp)]
    # a rank recomputes one block at a time, whichever of its virtual stages it belongs to
    rank_rec = [max((recompute_memory(*ranges[k]) for k in range(V) if k % pp == r), default=0.0) for r in range(pp)]
    rank_peak = [int(math.ceil(rank_static[r] + acts.get(r, 0.0) + rank_rec[r])) for r in range(pp)]
    stages = []
    for k, (i, j) in enumerate(ranges):
        static, saved = parts[k]
        r = k % pp
        p2p_bytes = (c.unit_out[i - 1] if i > 0 else 0.0) + (c.unit_out[j - 1] if j < n else 0.0)
        comm = {a: sum(c.unit_bytes[u][a] for u in range(i, j)) + (c.pro_bytes[a] if i == 0 else 0.0)
                + (c.epi_bytes[a] if j == n else 0.0) for a in mesh.names}
        nal = sim.peak_alive[k]
        rec_mem = recompute_memory(i, j)
        stages.append({"index": k, "ranks": [r * S, (r + 1) * S - 1], "virtual": k // pp, "blocks": [i, j],
                       "time": fb[k][0] + fb[k][1], "forward_time": fb[k][0], "backward_time": fb[k][1],
                       "p2p_time": p2p[k] if k < V - 1 else 0.0,
                       "comm_bytes": {a: int(round(x)) for a, x in comm.items()},
                       "peak_memory": int(math.ceil(static + nal * saved + rec_mem)),
                       "static_memory": int(round(static)),
                       "activations_per_micro_batch": int(round(saved)),
                       # activation checkpointing: seconds of recomputation per micro-batch (in
                       # backward_time) and the bytes one recomputed block saves again in backward
                       "recompute_time": sum(c.unit_recompute[i:j]), "recompute_memory": int(round(rec_mem)),
                       "alive_micro_batches": nal, "p2p_bytes": int(round(p2p_bytes * m)),
                       "rank_peak_memory": rank_peak[r]})
    worst_r = max(range(pp), key=lambda r: rank_peak[r])
    if rank_peak[worst_r] > budget:
        own = [s for s in stages if s["index"] % pp == worst_r]
        what = ", ".join(f"blocks {s['blocks'][0]}..{s['blocks'][1] - 1}" for s in own)
        alive_txt = "/".join(f"{s['alive_micro_batches']:g}" for s in own)
        raise MemoryBudgetError(f"pipeline stage {worst_r} ({what}) needs {rank_peak[worst_r]:,} bytes at its peak "
                                f"({alive_txt} micro-batches alive under {schedule}) but the budget is {int(budget):,}: "
                                f"use more stages, more micro-batches (1F1B), activation checkpointing or a larger "
                                f"budget", min_peak_bytes=rank_peak[worst_r], budget_bytes=int(budget))
    pipe = sim.step_time
    # the bubble of the busiest rank: what the step adds to its own work (compute + bubble = pipeline)
    bubble = pipe - max(sim.busy.values())
    pred = result.prediction
    tb = pred["time_breakdown"]
    total_static = sum(c.unit_static) + c.pro[1] + c.epi[1]
    share = max(rank_static) / total_static if total_static > 0 else 1.0
    rest = (tb["grad_comm_exposed"] + tb["optimizer"]) * share
    worst_static = rank_static[worst_r]
    busiest = max(sim.busy, key=lambda r: sim.busy[r])
    recompute = m * sum(s["recompute_time"] for s in stages if s["index"] % pp == busiest)
    return {"stages": stages, "step_time": pipe + rest, "bubble": bubble, "pipeline": pipe, "rest": rest,
            "recompute": recompute,
            "bubble_fraction": sim.bubble_fraction,
            "peak_memory": rank_peak[worst_r], "rank_peak_memory": rank_peak, "static_share": share,
            "peak_static_share": worst_static / total_static if total_static > 0 else 1.0,
            "peak_static": worst_static}


def _checkpoint_pinned(ck, pp: int, schedule: str) -> bool:
    """Whether a pipelined plan's checkpoint pin recomputes any block (full recompute only)."""
    from autopar.plans.plan_schema import checkpoint_mode_of

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


def simulate_plan(data: dict):
    """The predicted schedule of a saved pipelined plan, with its timeline (for ``autopar show``)."""
    deg = data["degrees"]
    st = data["stages"]
    return simulate_stages(deg["pp_schedule"], deg["pp"], deg["num_micro_batches"],
                           [s["forward_time"] for s in st], [s["backward_time"] for s in st],
                           [s["p2p_time"] for s in st[:-1]], timeline=True)


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
    checkpointing = _checkpoint_pinned(ck, pp, schedule)
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
    lifted = dataclasses.replace(base, budget=budget * pp)
    result, stats = search_fn(graph, sub, lifted, inner, max_zero=top, **kw)
    info = plan_stages(result, graph, cluster, pp, schedule, budget)
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
    static = {k: int(round(mb[k] * f)) for k in ("params", "grads", "optimizer")}
    pred["memory_breakdown"] = {**static, "activations": max(0, info["peak_memory"] - sum(static.values())),
                                "other": 0}
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


__all__ = ["search_pipelined", "apply_pipeline", "pipeline_pins", "stage_cluster", "check_pins", "alive_micro_batches", "plan_stages",
           "RUNNABLE_SCHEDULES", "KNOWN_SCHEDULES"]
