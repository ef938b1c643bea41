"""The stage partition of a pipelined plan and the schedule simulation that prices it
(autopar/search/pipeline.py, steps 2-4): ``plan_stages`` runs solver/pipeline.py's DP over the
block instances priced by autopar/search/stage_costs.py, simulates the chosen split on the action
order torch's schedule runs (runtime/pipeline_orders.py -> solver/pipeline_schedule.py), checks
every rank's memory and returns the step time, bubble and per-stage entries. ``simulate_stages`` /
``alive`` / ``simulate_plan`` are that simulation for given stage times (equal stages, a saved plan).
"""
from __future__ import annotations

import functools
import math

from autopar.errors import ConstraintError, MemoryBudgetError
from autopar.pricing.pipeline_cost import boundary_p2p_time
from autopar.search.context import CutOff
from autopar.search.pipeline_pins import virtual_stages
from autopar.search.stage_costs import stage_costs
from runtime.pipeline_orders import pipeline_orders
from solver.pipeline import partition
from solver.pipeline_schedule import StageDurations, peak_alive_counts, simulate


def alive_micro_batches(schedule: str, stage: int, pp: int, m: int) -> int:
    """Micro-batches whose activations a stage holds at its peak (equal stages; see ``alive``)."""
    return alive(schedule, stage, pp, m)


# Torch's schedule names (runtime/pipeline_orders.py) for the planner's pp_schedule values.
_TORCH_NAME = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved-1f1b": "interleaved-1f1b", "zero-bubble": "zero-bubble"}
# Share of a stage's backward that is the weight-gradient pass under zero-bubble (I and W scheduled
# apart): for a matmul dX and dW cost one forward each, so half; the pass the simulator prices.
WEIGHT_GRAD_SHARE = 0.5


@functools.lru_cache(maxsize=64)
def orders_for(schedule: str, pp: int, m: int) -> dict:
    """rank -> the compute actions torch's schedule runs (runtime/pipeline_orders.py). One object
    per (schedule, pp, m), read only: the simulator reads its dependencies once per object
    (solver/pipeline_schedule.py ``_compiled``)."""
    try:
        return pipeline_orders(_TORCH_NAME[schedule], pp, m, virtual_stages(schedule))
    except ValueError as e:
        raise ConstraintError(f"constraint pp={pp}, pp_schedule={schedule}, num_micro_batches={m}: {e}") from None


def simulate_stages(schedule: str, pp: int, m: int, fwd, bwd, p2p=(), timeline: bool = False):
    """Simulate torch's order for this schedule with per-stage forward / backward seconds per
    micro-batch and per-boundary transfer seconds (solver/pipeline_schedule.py)."""
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


CLOSED_FORM_ALIVE = ("gpipe", "1f1b")   # schedules whose alive counts ``_uniform_alive`` gives without simulating


@functools.lru_cache(maxsize=256)
def _uniform_alive(schedule: str, pp: int, m: int) -> tuple[int, ...]:
    if schedule == "gpipe":   # the simulation's answer in closed form (tests/search/test_pipeline_plan.py)
        return (m,) * pp
    if schedule == "1f1b":
        return tuple(min(pp - k, m) for k in range(pp))
    return simulated_alive(schedule, pp, m)


def simulated_alive(schedule: str, pp: int, m: int) -> tuple[int, ...]:
    """``alive`` read off torch's order: what its simulation with any stage times counts
    (solver/pipeline_schedule.py ``peak_alive_counts``)."""
    V = pp * virtual_stages(schedule)
    peak = peak_alive_counts(orders_for(schedule, pp, m), V)
    return tuple(peak[k] for k in range(V))


def least_step_time(c, result, pp: int, schedule: str) -> float:
    """A lower bound on the pipelined step of ``result`` (its per-block prices ``c``) over any
    stage partition. The ranks' work per micro-batch averages (blocks + prologue + epilogue) / pp,
    and the rank holding a stage of ceil(n / V) blocks (pigeonhole) with v - 1 more stages of a
    block each does at least that many of the fastest block; rank r also waits, before its first
    action and after its last, at least r stages of a block each (fill and drain), pp (pp - 1) / 2
    of them over the ranks. Plus 1 / pp of the exposed gradient communication and optimizer step
    (the busiest rank holds at least 1 / pp of the static memory: ``rest`` in ``plan_stages``).
    Not the equal-stage bubble (pp - 1) / (m v): with unequal stages the busiest rank may wait
    less (tests/search/test_free_never_worse.py)."""
    m = result.config.settings.num_micro_batches
    v = virtual_stages(schedule)
    n = len(c.unit_time)
    fastest = min(c.unit_time, default=0.0)
    total = sum(c.unit_time) + c.pro[0] + c.epi[0]
    busiest = max(m * total / pp + fastest * (pp - 1) / 2, m * (math.ceil(n / (pp * v)) + v - 1) * fastest)
    tb = result.prediction["time_breakdown"]
    return busiest + (tb["grad_comm_exposed"] + tb["optimizer"]) / pp


def plan_stages(result, graph, cluster, pp: int, schedule: str, budget: float, beat: float | None = None) -> dict:
    """The stage partition and the pipeline's predictions (module doc, steps 2-4). With an
    interleaved schedule there are pp x v virtual stages, stage k on rank position k % pp.
    ``beat``: the step time of the plan to beat; CutOff, before the partition and the simulation,
    when ``least_step_time`` reaches it."""
    c = stage_costs(result, graph)
    mesh = result.config.mesh
    m = result.config.settings.num_micro_batches
    n = len(c.unit_time)
    if beat is not None and least_step_time(c, result, pp, schedule) >= beat:
        raise CutOff(f"pp={pp}: its least work per rank reaches the plan to beat ({beat:.4g} s)")
    S = mesh.size
    V = pp * virtual_stages(schedule)

    def first_rank(k: int) -> int:   # first global rank of virtual stage k
        return (k % pp) * S

    p2p_memo: dict = {}

    def p2p_secs(bytes_: float, k: int) -> float:   # boundary between virtual stages k and k + 1
        # memoised: the DP's cost callback asks for the same few (bytes, boundary) pairs on every
        # range it prices (thousands on 96 blocks), each a collective-model evaluation
        key = (bytes_, first_rank(k), first_rank(k + 1))
        if key not in p2p_memo:
            p2p_memo[key] = boundary_p2p_time(cluster, bytes_, key[1], key[2])
        return p2p_memo[key]

    def memory_parts(i: int, j: int) -> tuple[float, float]:
        """(static bytes, saved activation bytes per micro-batch) of blocks [i, j)."""
        static = sum(c.unit_static[i:j]) + (c.pro[1] if i == 0 else 0.0) + (c.epi[1] if j == n else 0.0)
        saved = sum(c.unit_saved[i:j]) + (c.pro[2] if i == 0 else 0.0) + (c.epi[2] if j == n else 0.0)
        shared: dict = {}   # storages made before the blocks that its blocks save: once per stage
        for u in range(i, j):
            if u < len(c.unit_shared):
                shared.update(c.unit_shared[u])
        return static, saved + sum(shared.values())

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
    # last or a middle one by where it starts and ends (time with its boundaries' transfers); the
    # DP minimises time (no memory budget: memory is 0 to it), and the chosen split is then
    # simulated exactly and its every rank's memory checked below.
    def cost(i, j, d):
        k = min(0 if i == 0 else (V - 1 if j == n else 1), V - 1)
        f, b = times(i, j)
        t = f + b
        if i > 0:
            t += 2 * p2p_secs(c.unit_out[i - 1], max(k - 1, 0))
        if j < n:
            t += 2 * p2p_secs(c.unit_out[j - 1], k)
        return t, 0.0

    try:
        part = partition(n, V, m, cost, device_options=(S,), total_devices=V * S)
    except Exception as e:   # a PlanError from the DP: no split at all (cannot happen with finite memory)
        raise ConstraintError(f"constraint pp={pp}: no stage partition: {e}") from None
    ranges = [(i, j) for i, j, _ in part.stages]
    fb = [times(i, j) for i, j in ranges]
    p2p = [p2p_secs(c.unit_out[j - 1], k) for k, (i, j) in enumerate(ranges[:-1])]
    parts = [memory_parts(i, j) for i, j in ranges]
    if schedule in CLOSED_FORM_ALIVE:
        # one stage per rank, its alive count set by the order alone (not the durations): memory
        # is checked before the simulation, which a split that does not fit then skips
        sim, peak_alive = None, dict(enumerate(_uniform_alive(schedule, pp, m)))
        acts = {k: peak_alive[k] * parts[k][1] for k in range(V)}
    else:
        sim = simulate_stages(schedule, pp, m, [f for f, _ in fb], [b for _, b in fb], p2p)
        peak_alive = sim.peak_alive
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
        # the count program runs once per step on every rank: with the rank's first stage
        comm = {a: sum(c.unit_bytes[u][a] for u in range(i, j)) + (c.pro_bytes[a] if i == 0 else 0.0)
                + (c.epi_bytes[a] if j == n else 0.0) + (c.count_bytes.get(a, 0.0) if k < pp else 0.0)
                for a in mesh.names}
        nal = peak_alive[k]
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
                                f"({alive_txt} micro-batches alive under {schedule}) but the budget is "
                                f"{int(budget):,}: "
                                f"use more stages, more micro-batches (1F1B), activation checkpointing or a larger "
                                f"budget", min_peak_bytes=rank_peak[worst_r], budget_bytes=int(budget))
    if sim is None:
        sim = simulate_stages(schedule, pp, m, [f for f, _ in fb], [b for _, b in fb], p2p)
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
            "peak_static": worst_static, "max_static": max(rank_static)}


def simulate_plan(data: dict):
    """The predicted schedule of a saved pipelined plan, with its timeline (for ``autopar show``)."""
    deg = data["degrees"]
    st = data["stages"]
    return simulate_stages(deg["pp_schedule"], deg["pp"], deg["num_micro_batches"],
                           [s["forward_time"] for s in st], [s["backward_time"] for s in st],
                           [s["p2p_time"] for s in st[:-1]], timeline=True)


__all__ = ["alive_micro_batches", "alive", "least_step_time", "orders_for", "simulate_stages", "plan_stages",
           "simulate_plan", "WEIGHT_GRAD_SHARE"]
