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
simulated 1F1B step 6% under it). Zero-bubble runs weight gradients after the last input gradient:
factor 1.

**Fill and drain over blocks** (``least_pipelined_step``). Interleaved stages (v chunks per rank,
chunk k of the p v on rank k mod p) can put little work in the first chunk of each rank, so the
factor above is 1 for them; but a chunk holds whole blocks, each taking at least b seconds per
micro-batch (forward + backward). Rank k's first action is a forward of its first chunk (any other
action of a micro-batch on rank k follows that one), which micro-batch reaches only after its
forwards through the first chunks of ranks 1..k-1; its last action is a backward of its first
chunk, after which that micro-batch's backward still goes through the first chunks of ranks
k-1..1. So with W_k rank k's work per step, for any order of each rank's actions,

    step >= t_1 + ... + t_{k-1} + W_k >= (k - 1) b + W_k      (t_i: the first chunk of rank i)

and rank p's v chunks of >= 1 block each give W_p >= m v b. Over the ranks, with sum W_k = T:

    step >= max(T / p + (p - 1) b / 2,  (p - 1 + m v) b)

the first term the mean of the (k - 1) b + W_k, the second rank p's. This is the least max over
the W_k and first chunks alone: first chunks of one block each and W_k = C - (k - 1) b reach it
(one block per chunk: the simulated step equals it). Chains through later chunks (rank k's first
forward of its chunk j waits for a micro-batch's forwards through all chunks before) add little:
the partition that minimises them also starts light and ends heavy (a linear program over chunk
times: at most 1.05 times the mean work on 8 ranks x 2 chunks, 16 micro-batches, against the
equal-stage 1.22). It holds under 1F1B and GPipe as well (v = 1), beside the factor above (their
maximum); not under zero-bubble (its last action may be a weight gradient). The
callers have T / p >= the compute floor below, and b >= ``device_block_floor`` x p / m (the
block's ops unsplit on one device with the whole batch, over the devices; on a stage's N / p
devices and per micro-batch, by the same argument as the floor). With uniform blocks the term
(p - 1) b / 2 is a fraction (p - 1) p / (2 m n) of T / p (n blocks): small beside the equal-stage
(p - 1) / (m v), which unequal chunks can beat.

**Order LP** (``order_lp_unit``, ``order_lp_step``; the planner's ``proven_step`` is its maximum with
the closed forms above). The closed forms use only the dependencies between chunks; the simulated
step (stage_plan.simulate_stages) also follows each rank's real order of actions
(stage_plan.orders_for): every action ends at its start plus its chunk's forward f_c or backward
g_c, and starts after the previous action of its rank and after its micro-batch's forward through
the chunk before (a forward) or its forward here and backward through the chunk after (a
backward). So the step is a longest path over that event graph, and the least step over every
vector of chunk times a partition may give is a linear program: variables f_c, g_c >= 0 per chunk
(per micro-batch), a completion time C_e per action with C_e >= C_pred + duration for each
predecessor, S >= each rank's last C_e; constraints f_c + g_c >= b (a chunk holds >= 1 block) and
m sum_c (f_c + g_c) >= p w (the ranks' work, w their mean); minimise S. Any real partition's
times with its simulated completion times are feasible, so the optimum is below its step. It
scales with (w, b) together: S(w, b) = w S(1, b / w), and grows with b / w, so a cached value at
b / w rounded down (a geometric grid) stays a bound; the planner uses b = 0 (one LP per schedule,
p and m; the closed forms carry the block terms). To keep it small, each rank's first and last
``KEEP_PER_STAGE`` V + ``KEEP_PER_RANK`` p actions are kept and the middle is lumped into one
event lasting its actions' total time after the head, with its dependencies on other ranks
dropped: the real completion times still satisfy every kept constraint (the lump ends when its
last action does), and dropping constraints only lowers the optimum. Larger orders than
``ORDER_LP_EVENTS`` events are not solved (0: the closed forms alone). The solver's optimum is
scaled down by ``_LP_SAFETY`` against its tolerances. At b = 0 the optima of the
free search's usual (schedule, pp, m) are stored (autopar/search/order_lp_stored.py, ``STORED_ORDER_LP``),
not solved in each run. Under 1F1B and GPipe it reaches the
equal-stage fill and drain at small m; under interleaving it sits between the closed form and the
equal-stage estimate (8 ranks x 2 chunks, 16 micro-batches: 1.14 of the mean work, against 1.01
and 1.22). Zero-bubble orders (I / W actions) are not covered. It needs ``highspy`` (without it:
the closed forms alone).

**Compute floor** (``device_compute_floor``). Every op priced unsplit on one device with the
whole global batch (each node at its cheapest strategy), divided by the cluster's devices: no
plan's average compute per device goes below it, because the cost model's compute of a kernel
(``pricing/cost.compute_time``) is a roofline whose efficiency grows with the kernel's FLOPs,
so k pieces of an op take at least as long in all as the op whole, and replication, micro-batches
and recomputation only add. It replaces the pp=1 plan's compute, which a pipelined plan can beat
(less recomputation, other tensor-parallel degrees).

**Recompute floor** (``device_recompute_floor``). With every block checkpointed (the pipelined
search's retry of a candidate that does not fit: checkpoint="full"), each block's backward reruns
its forward (autopar/search/stage_costs.py counts its forward compute and collectives in the
stage's backward time), so the ranks' work is at least the compute floor plus the blocks' forward
compute priced the same way (unsplit on one device with the whole batch, over the devices; k
pieces of a forward kernel take at least as long as it whole). About a third of the compute: a
checkpointed retry whose bound with it reaches the plan to beat is not searched.
"""
from __future__ import annotations

import dataclasses
import math

from autopar.mesh import Mesh
from autopar.pricing.price import price
from autopar.rules.candidates import candidates
from autopar.search.order_lp_stored import stored_unit
from autopar.search.pipeline_pins import virtual_stages

FILL_DRAIN_SCHEDULES = ("1f1b", "gpipe")   # the schedules whose fill and drain the factor proves
# the schedules whose fill and drain over blocks (``least_pipelined_step``) is proven
BLOCK_FILL_DRAIN_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")


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


def least_pipelined_step(schedule: str, pp: int, m: int, work: float, block: float) -> float:
    """A lower bound on the step of any partition into chunks of >= 1 block (module doc): ``work``
    a lower bound on the ranks' mean work per step (T / pp), ``block`` on one block's seconds per
    micro-batch (forward + backward, b) on a stage."""
    bound = work * fill_drain_factor(schedule, pp, m)
    if schedule not in BLOCK_FILL_DRAIN_SCHEDULES or pp < 2 or m < 1:
        return bound
    return max(bound, work + (pp - 1) * block / 2, (pp - 1 + m * virtual_stages(schedule)) * block)


def block_time_floor(block_floor: float, pp: int, m: int) -> float:
    """b: the least seconds per micro-batch of a block on a stage of pp stages with m micro-batches,
    from ``device_block_floor`` (its ops unsplit on one device with the whole batch, over the
    devices): a stage has 1 / pp of the devices and does 1 / m of the batch at a time."""
    return block_floor * pp / m if m >= 1 else 0.0


def cutoff_factor(schedules, pp: int, m: int, beat: float, block: float, order: bool = False) -> float:
    """F for an inner search that ``schedules`` share (outer.search's ``cutoff_fill_drain``): the
    least over them of beat / w*, w* the least mean work per rank whose ``least_pipelined_step``
    (with ``order``, ``proven_step``) reaches ``beat``, so that cutting where w F >= beat cuts only
    what cannot beat it (inf: all). The order LP scales with the work (``order_lp_unit`` at b = 0):
    w x unit >= beat from w = beat / unit on."""
    out = float("inf")
    for s in schedules:
        if least_pipelined_step(s, pp, m, 0.0, block) >= beat:
            continue   # no work w beats it
        w = beat / fill_drain_factor(s, pp, m)
        if s in BLOCK_FILL_DRAIN_SCHEDULES and pp >= 2 and m >= 1:
            w = min(w, beat - (pp - 1) * block / 2)
        if order:
            unit = order_lp_unit(s, pp, m, 0.0)
            if unit > 0.0:
                w = min(w, beat / unit)
        out = min(out, beat / w)
    return out


def equal_stage_factor(schedule: str, pp: int, m: int) -> float:
    """1 + (pp - 1) / (m v): the fill and drain with equal stages. An estimate (candidates are
    visited in its order), not a bound (module doc)."""
    return 1.0 + (pp - 1) / (m * virtual_stages(schedule))


def _one_device(graph, cluster, base):
    """Every op of ``graph`` priced unsplit on one device with the whole global batch."""
    one = candidates(graph, Mesh((1,), ("dp",), cluster.devices_per_node))
    settings = dataclasses.replace(base, zero=0, num_micro_batches=1, checkpoint="none", offload="none",
                                   offload_all=False)
    return one, price(one, cluster, settings, edges=False)


def device_floors(graph, cluster, base, recompute: bool = False) -> tuple:
    """(``device_compute_floor``, ``device_block_floor``) from one pricing; with ``recompute`` also
    ``device_recompute_floor`` (a third entry)."""
    one, P = _one_device(graph, cluster, base)
    least = {n: float(P.compute[n].min()) for n in one.reps if n in P.compute and len(P.compute[n])}
    groups: dict = {}
    forward = 0.0
    for n, t in least.items():   # as stage_costs counts a block: its representatives over their repeats
        if n in graph.block_of and one.nodes[n].kind == "op":
            g = graph.block_of[n][0]
            groups[g] = groups.get(g, 0.0) + t / max(1, one.nodes[n].repeats)
            if n in P.fwd_compute and len(P.fwd_compute[n]):
                forward += float(P.fwd_compute[n].min())
    floors = (sum(least.values()) / cluster.num_devices, min(groups.values(), default=0.0) / cluster.num_devices)
    return (*floors, forward / cluster.num_devices) if recompute else floors


def device_recompute_floor(graph, cluster, base) -> float:
    """Seconds per device that recomputing every block adds at least (module doc, "Recompute
    floor"): the blocks' forward compute, each op unsplit on one device with the whole batch, over
    the devices."""
    return device_floors(graph, cluster, base, recompute=True)[2]


def device_compute_floor(graph, cluster, base) -> float:
    """Seconds of compute per device no plan of ``graph`` on ``cluster`` goes below (module doc)."""
    return device_floors(graph, cluster, base)[0]


def device_block_floor(graph, cluster, base) -> float:
    """The least block's compute in ``device_compute_floor``'s terms: the least over the repeated
    block groups of one instance's ops, each unsplit on one device at its cheapest with the whole
    batch, over the devices (module doc; ``block_time_floor`` makes it b)."""
    return device_floors(graph, cluster, base)[1]




# --- the schedule's own order: a linear program over chunk times (module doc, "Order LP") ---

ORDER_LP_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")   # orders of F and B actions only
ORDER_LP_EVENTS = 600   # the most actions kept in full; larger orders get the closed forms only
_RATIO_STEPS = 32   # b / w rounded down to 2^(k / _RATIO_STEPS): the cache's grid
_LP_SAFETY = 1e-4   # the solver's tolerances (1e-7 per row, summed along a path): its optimum x (1 - this)
KEEP_PER_STAGE, KEEP_PER_RANK = 1, 0   # a rank's first and last KEEP_PER_STAGE V + KEEP_PER_RANK pp actions kept
_order_lp_cache: dict = {}
STORED_ORDER_LP = True   # b = 0: the optima stored in autopar/search/order_lp_stored.py (module doc)


def _ratio_down(r: float) -> float:
    """r rounded down to the cache's geometric grid (0 for r <= 0): the bound grows with b / w, so
    rounding down keeps it a bound."""
    if not r > 0.0:
        return 0.0
    if r == float("inf"):
        return r
    k = math.floor(math.log2(r) * _RATIO_STEPS)
    g = 2.0 ** (k / _RATIO_STEPS)
    while g > r:
        k -= 1
        g = 2.0 ** (k / _RATIO_STEPS)
    return g


def _kept_actions(n: int, keep: int) -> tuple[int, int]:
    """(head, tail): a rank's first ``head`` and last ``tail`` actions kept in full, the middle lumped."""
    if n <= 2 * keep:
        return n, 0
    return keep, keep


def order_lp_unit(schedule: str, pp: int, m: int, ratio: float) -> float:
    """The least simulated step of ``schedule``'s order (stage_plan.orders_for) over chunk times with
    mean work per rank 1 and every chunk's forward + backward per micro-batch >= ``ratio`` (module
    doc, "Order LP"); 0.0 where it is not computed (schedule not covered, order too large)."""
    key = (schedule, pp, m, ratio)
    if key in _order_lp_cache:
        return _order_lp_cache[key]
    out = 0.0
    if schedule in ORDER_LP_SCHEDULES and pp >= 2 and m >= 1:
        stored = stored_unit(schedule, pp, m, (KEEP_PER_STAGE, KEEP_PER_RANK, ORDER_LP_EVENTS)) \
            if ratio == 0.0 and STORED_ORDER_LP else None
        out = solve_order_lp(schedule, pp, m, ratio) if stored is None else stored
    _order_lp_cache[key] = out
    return out


def solve_order_lp(schedule: str, pp: int, m: int, ratio: float) -> float:
    """The order LP (module doc) solved now: ``order_lp_unit`` without its cache or stored optima."""
    import numpy as np
    try:
        import highspy
    except ImportError:   # the optional solver (pyproject's "highs" extra): the closed forms only
        return 0.0
    from autopar.errors import ConstraintError
    from autopar.search.stage_plan import orders_for
    V = pp * virtual_stages(schedule)
    keep = KEEP_PER_STAGE * V + KEEP_PER_RANK * pp
    if pp * (sum(_kept_actions(2 * m * V // pp, keep)) + 1) > ORDER_LP_EVENTS:
        return 0.0   # too large (each rank runs a forward and a backward per micro-batch and chunk)
    try:
        orders = orders_for(schedule, pp, m)
    except ConstraintError:   # torch's schedule rejects (pp, m): no order, the closed forms only
        return 0.0
    spans = {r: _kept_actions(len(acts), keep) for r, acts in orders.items()}
    if sum(h + t for h, t in spans.values()) + len(spans) > ORDER_LP_EVENTS:
        return 0.0
    # columns: f_c (0..V-1), g_c (V..2V-1), then one completion time per kept action / lump, then S
    col: dict = {}
    lumps: dict = {}
    n_col = 2 * V
    for r, acts in orders.items():
        h, t = spans[r]
        for i, a in enumerate(acts):
            if i < h or i >= len(acts) - t:
                col[tuple(a)] = n_col
                n_col += 1
        if t:
            lumps[r] = n_col
            n_col += 1
    S = n_col
    n_col += 1
    starts, idx, val, lower = [], [], [], []

    def row(entries, lo):
        starts.append(len(idx))
        for c, v in entries:
            idx.append(c)
            val.append(v)
        lower.append(lo)

    def dur(a):   # the chunk time column of an action
        return a[1] if a[0] == "F" else V + a[1]

    for r, acts in orders.items():
        h, t = spans[r]
        prev = None
        for i, a in enumerate(acts):
            a = tuple(a)
            if h <= i < len(acts) - t:   # lumped: the middle's work after the head, cross edges dropped
                if i == h:
                    counts: dict = {}
                    for b in acts[h:len(acts) - t]:
                        counts[dur(tuple(b))] = counts.get(dur(tuple(b)), 0) + 1
                    e = lumps[r]
                    row([(e, 1.0), (prev, -1.0), *[(c, -float(k)) for c, k in counts.items()]], 0.0)
                    prev = e
                continue
            kind, s, mb = a
            e, d = col[a], dur(a)
            preds = [] if prev is None else [prev]
            if kind == "F" and s > 0:
                preds.append(col.get(("F", s - 1, mb)))
            elif kind == "B":
                preds.append(col.get(("F", s, mb)))
                if s < V - 1:
                    preds.append(col.get(("B", s + 1, mb)))
            preds = [q for q in preds if q is not None]   # dependencies on lumped actions dropped
            if not preds:
                row([(e, 1.0), (d, -1.0)], 0.0)
            for q in preds:
                row([(e, 1.0), (q, -1.0), (d, -1.0)], 0.0)
            prev = e
        row([(S, 1.0), (prev, -1.0)], 0.0)
    for c in range(V):
        row([(c, 1.0), (V + c, 1.0)], ratio)
    row([(c, float(m)) for c in range(2 * V)], float(pp))
    hs = highspy.Highs()
    hs.setOptionValue("output_flag", False)
    inf = highspy.kHighsInf
    hs.addVars(n_col, np.zeros(n_col), np.full(n_col, inf))
    hs.changeColCost(S, 1.0)
    hs.addRows(len(lower), np.array(lower), np.full(len(lower), inf), len(idx), np.array(starts, dtype=np.int32),
               np.array(idx, dtype=np.int32), np.array(val))
    hs.run()
    if hs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return 0.0
    return max(0.0, hs.getInfo().objective_function_value * (1.0 - _LP_SAFETY))


def order_lp_step(schedule: str, pp: int, m: int, work: float, block: float) -> float:
    """The order LP's least step (module doc) for mean work per rank ``work`` and block time ``block``:
    work x ``order_lp_unit`` at block / work rounded down (the LP scales with both)."""
    if not work > 0.0:
        return 0.0
    return work * order_lp_unit(schedule, pp, m, _ratio_down(block / work))


def proven_step(schedule: str, pp: int, m: int, work: float, block: float) -> float:
    """The planner's proven bound: the greater of ``least_pipelined_step`` and the order LP at
    b = 0 (one LP per schedule, pp and m; the block terms come from the closed forms)."""
    return max(least_pipelined_step(schedule, pp, m, work, block), order_lp_step(schedule, pp, m, work, 0.0))


__all__ = ["BLOCK_FILL_DRAIN_SCHEDULES", "FILL_DRAIN_SCHEDULES", "ORDER_LP_SCHEDULES", "block_time_floor",
           "cutoff_factor", "device_block_floor", "device_compute_floor", "device_floors", "device_recompute_floor",
           "equal_stage_factor",
           "fill_drain_factor", "least_pipelined_step", "order_lp_step", "order_lp_unit", "proven_step",
           "shared_fill_drain_factor", "solve_order_lp"]
