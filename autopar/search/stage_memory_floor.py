"""The proven memory floor of a pipelined candidate's inner configuration: a lower bound on the
largest rank peak ``stage_plan.plan_stages`` can reach for ANY plan of that configuration and ANY
stage partition it may choose, so a configuration whose floor exceeds the budget is pruned before
its edges are priced and its ILP solved (autopar/search/visit.py ``_stage_memory``; the inner
search learns its pipeline through ``SearchOptions.stage_memory``, a ``StageMemory``).

Why it is a lower bound (every step only drops or lowers terms of ``plan_stages``' peak):

* Per block. ``stage_costs`` charges each block instance its group's parameters' static bytes
  and saved activations, each node at the strategy the ILP chose, divided by the group's repeats
  (the prologue / epilogue: the nodes before / after the blocks). ``block_floors`` charges each
  node its smallest bytes over all its strategies instead (as ``solver.problem_checks.
  memory_floor_exceeds_budget`` does for the whole model), with the same attribution, so every
  block's, the prologue's and the epilogue's static and saved floors are at most what any solved
  plan gives them. Left out (all >= 0): the copies reshards save, the storages a stage's blocks
  share (RoPE tables: ``unit_shared``), the recomputation working set; a checkpointed block keeps
  the smaller of its saved-floor and its kept-floor (the group's last output) unless
  checkpointing is pinned off.
* Per rank. Rank r's peak is its stages' static bytes plus its activation peak over time plus a
  recompute working set (>= 0). Its activation peak is at least alive_k x saved_k for each of its
  stages k: alive_k, stage k's peak count of micro-batches alive, counts F(k) starts and B(k) ends,
  all actions of rank r, which runs its actions one at a time in the schedule's fixed order, so it
  depends on the order only, not on the stage durations (``stage_plan.alive``: the equal-stage
  simulation; 1F1B and GPipe in closed form, as ``plan_stages`` itself uses them).
* Over partitions. ``plan_stages`` cuts the blocks into V = pp x v contiguous chunks (the prologue
  on chunk 0, the epilogue on chunk V - 1, chunk k on rank k % pp). Then max over ranks of the
  peak >= max over chunks k of static_k + alive_k saved_k (one chunk of each rank kept: exact for
  v = 1), and the least of that over all splits into V contiguous, possibly empty, chunks (a
  superset of the splits ``plan_stages`` chooses) is found by ``_fits``: with non-negative block
  figures a chunk's cost only grows as it takes more blocks, so giving each chunk in turn as many
  blocks as fit under a threshold decides whether any split fits under it. Also (interleaving)
  the average over ranks: (all static + min_k alive_k x all saved / v) / pp.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

from autopar.pricing.price import device_static
from autopar.search.pipeline_pins import virtual_stages
from autopar.search.stage_costs import _shared_roots
from autopar.search.stage_plan import alive
from codegen.stages import pipeline_units

# Schedules whose alive counts depend on the action order alone (``alive``; zero-bubble's stage 0
# runs an input-gradient pass of no duration: not covered)
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


@dataclass(frozen=True)
class StageMemory:
    """What an inner search needs to apply the floor: its pipeline degree, the micro-batch count,
    the per-device budget every rank must fit (the inner search runs with pp x that), and the
    schedules that share its inner plan (``pipeline_candidates.Pipelined.inner_cache``): a
    configuration is pruned only when it fits under none of them."""
    pp: int
    num_micro_batches: int
    budget: float
    schedules: tuple[str, ...]


@dataclass(frozen=True)
class BlockFloors:
    """Per block instance (``pipeline_units`` order) the least static and saved bytes per
    micro-batch any plan of the configuration gives it; the same for the prologue and epilogue."""
    static: tuple[float, ...]
    saved: tuple[float, ...]
    pro: tuple[float, float]   # (static, saved)
    epi: tuple[float, float]


def block_floors(graph, cands, P, checkpoint=None) -> BlockFloors:
    """Each node at its smallest bytes, attributed as ``stage_costs`` attributes them (module doc).
    ``checkpoint``: the configuration's ``Settings.checkpoint`` ("none": blocks keep what they save)."""
    units = pipeline_units(graph)
    order = {n.name: k for k, n in enumerate(graph.gm.graph.nodes)}
    first_block = min(order[graph.blocks[g].instances[i][0]] for g, i in units)
    groups = {g for g, _ in units}
    users: dict = {}
    for n in graph.gm.graph.nodes:
        for a in n.all_input_nodes:
            users.setdefault(a.name, []).append(n.name)
    st = {g: 0.0 for g in groups}
    sv = {g: 0.0 for g in groups}
    pro, epi = [0.0, 0.0], [0.0, 0.0]
    for name in cands.reps:
        info = cands.nodes[name]
        if info.repeats == 0:
            continue
        r = max(1, info.repeats)
        if info.kind == "param":
            arr = device_static(P.static[name]) if name in P.static else None
            s = float(np.min(arr)) if arr is not None and np.size(arr) else 0.0
            gs = {graph.block_of[u][0] for u in users.get(name, []) if u in graph.block_of}
            if gs and all(u in graph.block_of for u in users.get(name, [])):
                for g in gs:
                    st[g] += s / r
            else:
                where = {order[u] < first_block for u in users.get(name, []) if u not in graph.block_of}
                if True in where:
                    pro[0] += s
                if False in where:
                    epi[0] += s
            continue
        if info.kind != "op" or name not in P.saved or not np.size(P.saved[name]):
            continue
        saved = np.asarray(P.saved[name], dtype=float)
        if name in graph.block_of:
            g = graph.block_of[name][0]
            own = saved
            for root in _shared_roots(cands, graph, name, P.saved_by_root.get(name, {})):
                own = own - P.saved_by_root[name][root]
            sv[g] += float(np.min(own)) / r
        else:
            (pro if order[name] < first_block else epi)[1] += float(np.min(saved))
    if checkpoint != "none":   # a checkpointed block keeps its input: the output of its group's last node
        for g in groups:
            last = graph.blocks[g].instances[0][-1]
            kept = float(np.min(P.transient[last])) if last in P.transient and np.size(P.transient[last]) else 0.0
            sv[g] = min(sv[g], kept)
    return BlockFloors(tuple(st[g] for g, _ in units), tuple(sv[g] for g, _ in units), tuple(pro), tuple(epi))


def _fits(f: BlockFloors, counts: tuple[int, ...], limit: float) -> bool:
    """Whether some split of the blocks into len(counts) contiguous, possibly empty, chunks keeps
    every chunk's static + counts[k] x saved at most ``limit`` (module doc: greedy is exact)."""
    n, V = len(f.static), len(counts)
    i = 0
    prefix: dict = {}
    for k, a in enumerate(counts):
        x = (f.pro[0] + a * f.pro[1] if k == 0 else 0.0) + (f.epi[0] + a * f.epi[1] if k == V - 1 else 0.0)
        if a not in prefix:
            acc, ps = 0.0, [0.0]
            for s, v in zip(f.static, f.saved):
                acc += s + a * v
                ps.append(acc)
            prefix[a] = ps
        ps = prefix[a]
        if k == V - 1:
            return ps[n] - ps[i] + x <= limit
        # the furthest j with ps[j] - ps[i] + x <= limit (ps non-decreasing)
        j = bisect.bisect_right(ps, limit - x + ps[i]) - 1
        if j < i:
            return False
        i = j
    return True


def least_peak(f: BlockFloors, pp: int, schedule: str, m: int) -> float:
    """A lower bound (module doc) on the largest rank peak ``plan_stages`` reaches under
    ``schedule`` with ``pp`` ranks and ``m`` micro-batches, for any plan whose per-block figures
    are at least ``f``'s and any stage partition; -inf when a block figure is negative (the
    greedy split is exact only for non-negative figures)."""
    if min(f.static + f.saved + f.pro + f.epi, default=0.0) < 0:
        return -math.inf
    v = virtual_stages(schedule)
    V = pp * v
    counts = tuple(alive(schedule, k, pp, m) for k in range(V))
    total_static = sum(f.static) + f.pro[0] + f.epi[0]
    total_saved = sum(f.saved) + f.pro[1] + f.epi[1]
    average = (total_static + min(counts) * total_saved / v) / pp
    hi = total_static + max(counts) * total_saved   # everything in one chunk: every split of it fits
    lo = 0.0
    if _fits(f, counts, lo):
        return max(lo, average)
    for _ in range(60):   # invariant: no split fits under lo, every split fits under hi
        mid = (lo + hi) / 2
        if mid <= lo or mid >= hi:
            break
        if _fits(f, counts, mid):
            hi = mid
        else:
            lo = mid
    return max(lo, average)


def exceeds_budget(spec: StageMemory, graph, cands, P, checkpoint=None) -> bool:
    """True when the configuration (priced ``P``) has no plan and stage partition that fits
    ``spec.budget`` under any of ``spec.schedules`` (module doc). Schedules outside ``SCHEDULES``
    never prune."""
    if not spec.schedules or any(s not in SCHEDULES for s in spec.schedules):
        return False
    f = block_floors(graph, cands, P, checkpoint)
    if min(f.static + f.saved + f.pro + f.epi, default=0.0) < 0:
        return False
    limit = spec.budget * (1 + 1e-9) + 1.0   # rounding of the sums: a fit at the budget never pruned
    for schedule in spec.schedules:
        v = virtual_stages(schedule)
        counts = tuple(alive(schedule, k, spec.pp, spec.num_micro_batches) for k in range(spec.pp * v))
        total_static = sum(f.static) + f.pro[0] + f.epi[0]
        total_saved = sum(f.saved) + f.pro[1] + f.epi[1]
        if (total_static + min(counts) * total_saved / v) / spec.pp <= limit and _fits(f, counts, limit):
            return False
    return True


__all__ = ["StageMemory", "BlockFloors", "SCHEDULES", "block_floors", "least_peak", "exceeds_budget"]
