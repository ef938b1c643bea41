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
  checkpointing is pinned off. Which representatives are charged, and to which block group,
  prologue or epilogue, depends on the graph and the mesh's candidates only: read once per mesh
  (``_layout``, kept in ``Candidates.edge_cache``) and shared by its ZeRO / micro-batch variants.
* Per rank. Rank r's peak is its stages' static bytes plus its activation peak over time plus a
  recompute working set (>= 0). Stage k's count of micro-batches alive moves at F(k) starts and
  B(k) ends, actions of rank r, which runs its actions one at a time in the schedule's fixed order
  (positive durations: every chunk holds a block), so the vector of its stages' counts after each
  action depends on the order only, not on the stage durations: ``rank_alive_vectors`` reads those
  vectors off the equal-stage simulation (as ``stage_plan.alive`` reads their per-stage peaks), and
  for each one the rank's activation peak is at least sum_k vec_k x saved_k.
* Over partitions. ``plan_stages`` cuts the blocks into V = pp x v contiguous chunks (the prologue
  on chunk 0, the epilogue on chunk V - 1, chunk k on rank k % pp). The least over all splits into
  V contiguous, possibly empty, chunks (a superset of the splits ``plan_stages`` chooses) of:
  (1) max over chunks k of static_k + alive_k saved_k (one chunk of a rank kept: exact for v = 1),
  found by ``_fits``: with non-negative block figures a chunk's cost only grows as it takes more
  blocks, so giving each chunk in turn as many blocks as fit under a threshold decides whether any
  split fits under it; (2) with v > 1, for weights lambda >= 0 summing to 1 over the pairs (rank
  r, alive vector vec of r), sum lambda (static_r + vec . saved_r) <= max_r peak_r: a sum over
  chunks, whose least split a dynamic program over (block, chunk) finds exactly
  (``_weighted_least``); any weights give a bound, a few multiplicative-weight steps look for a
  high one (``_rank_bound``).

What pruning changes: the inner search returns its fastest configuration not proven to fail, where
it returned its fastest one. They differ only when that one fails ``plan_stages``' memory check
(which before sent the candidate to its checkpointed retry): then the next fastest, which may fit
without recomputation, or the same MemoryBudgetError when every configuration is pruned.
"""
from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass

import numpy as np

from autopar.pricing.price import device_static
from autopar.search.pipeline_pins import virtual_stages
from autopar.search.stage_costs import shared_roots
from autopar.search.stage_plan import alive, orders_for
from solver.pipeline_schedule import rank_alive_changes
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


def _layout(graph, cands) -> tuple:
    """What ``block_floors`` reads off the graph and the mesh's candidates, not the pricing: the
    representatives it charges, in ``cands.reps`` order, each (name, kind, repeats, place) with
    place the block groups of a parameter used only inside blocks or its (prologue?, epilogue?)
    users outside them, an op's block group or ``"pro"`` / ``"epi"``. Kept in ``cands.edge_cache``
    (one per mesh, shared by its ZeRO and micro-batch variants)."""
    key = ("stage memory layout", id(graph))
    got = cands.edge_cache.get(key)
    if got is not None and got[0] is graph:
        return got[1]
    units = pipeline_units(graph)
    order = {n.name: k for k, n in enumerate(graph.gm.graph.nodes)}
    first_block = min(order[graph.blocks[g].instances[i][0]] for g, i in units)
    users: dict = {}
    for n in graph.gm.graph.nodes:
        for a in n.all_input_nodes:
            users.setdefault(a.name, []).append(n.name)
    rows = []
    for name in cands.reps:
        info = cands.nodes[name]
        if info.repeats == 0:
            continue
        r = max(1, info.repeats)
        if info.kind == "param":
            gs = {graph.block_of[u][0] for u in users.get(name, []) if u in graph.block_of}
            if gs and all(u in graph.block_of for u in users.get(name, [])):
                place = ("blocks", tuple(gs))
            else:
                where = {order[u] < first_block for u in users.get(name, []) if u not in graph.block_of}
                place = ("outside", True in where, False in where)
            rows.append((name, "param", r, place))
        elif info.kind == "op":
            place = graph.block_of[name][0] if name in graph.block_of else \
                ("pro" if order[name] < first_block else "epi")
            rows.append((name, "op", r, place))
    out = (units, tuple(rows), {})
    cands.edge_cache[key] = (graph, out)
    return out


def block_floors(graph, cands, P, checkpoint=None) -> BlockFloors:
    """Each node at its smallest bytes, attributed as ``stage_costs`` attributes them (module doc).
    ``checkpoint``: the configuration's ``Settings.checkpoint`` ("none": blocks keep what they save)."""
    units, rows, roots_memo = _layout(graph, cands)
    groups = {g for g, _ in units}
    st = {g: 0.0 for g in groups}
    sv = {g: 0.0 for g in groups}
    pro, epi = [0.0, 0.0], [0.0, 0.0]
    for name, kind, r, place in rows:
        if kind == "param":
            arr = device_static(P.static[name]) if name in P.static else None
            s = float(np.min(arr)) if arr is not None and np.size(arr) else 0.0
            if place[0] == "blocks":
                for g in place[1]:
                    st[g] += s / r
            else:
                if place[1]:
                    pro[0] += s
                if place[2]:
                    epi[0] += s
            continue
        if name not in P.saved or not np.size(P.saved[name]):
            continue
        saved = np.asarray(P.saved[name], dtype=float)
        if place != "pro" and place != "epi":
            own = saved
            charged = P.saved_by_root.get(name, {})
            rkey = (name, tuple(charged))
            if rkey not in roots_memo:
                roots_memo[rkey] = shared_roots(cands, graph, name, charged)
            for root in roots_memo[rkey]:
                own = own - charged[root]
            sv[place] += float(np.min(own)) / r
        else:
            (pro if place == "pro" else epi)[1] += float(np.min(saved))
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


@functools.lru_cache(maxsize=128)
def rank_alive_vectors(schedule: str, pp: int, m: int) -> tuple:
    """Per rank, the maximal vectors of its stages' (r, r + pp, ...) micro-batch counts alive after
    one of its actions, read off the equal-stage simulation (module doc: they depend on the order
    only)."""
    V = pp * virtual_stages(schedule)
    orders = orders_for(schedule, pp, m)
    changes, _ = rank_alive_changes(orders)   # in the rank's order: its order in time
    rank_of = {k: r for r, acts in orders.items() for _a, k, _m in acts}
    out = []
    for r in range(pp):
        ks = list(range(r, V, pp))
        slot = {k: j for j, k in enumerate(ks)}
        cur, seen = [0] * len(ks), set()
        assert all(rank_of[k] == rank_of[ks[0]] for k in ks), "stages r, r + pp, ... on one rank"
        for k, d in changes[rank_of[ks[0]]]:
            cur[slot[k]] += d
            if d > 0:
                seen.add(tuple(cur))
        out.append(tuple(sorted(v for v in seen if not any(w != v and all(x >= y for x, y in zip(w, v))
                                                           for w in seen))))
    return tuple(out)


def _chunk_sums(f: BlockFloors, V: int):
    """Per block (static, saved) arrays and the prologue / epilogue as chunk 0's / V - 1's extras."""
    a, b = np.asarray(f.static, dtype=float), np.asarray(f.saved, dtype=float)
    xs, xv = np.zeros(V), np.zeros(V)
    xs[0] += f.pro[0]
    xv[0] += f.pro[1]
    xs[V - 1] += f.epi[0]
    xv[V - 1] += f.epi[1]
    return a, b, xs, xv


def _weighted_least(a, b, xs, xv, mu, mw):
    """The least over splits of the blocks into len(mu) contiguous, possibly empty, chunks of
    sum_k (mu_k static_k + mw_k saved_k), and that split's chunk of each block (exact DP)."""
    V = len(mu)
    cost = np.outer(a, mu) + np.outer(b, mw)   # block i in chunk k
    ks = np.arange(V)
    g = cost[0].copy()
    back = []
    for i in range(1, len(a)):
        best = np.minimum.accumulate(g)
        back.append(np.maximum.accumulate(np.where(g == best, ks, 0)))   # where each running least is
        g = best + cost[i]
    k = int(np.argmin(g))
    value = float(g[k]) + float(np.dot(mu, xs) + np.dot(mw, xv))
    chunk = [k]
    for arr in reversed(back):
        k = int(arr[k])
        chunk.append(k)
    return value, chunk[::-1]


def _rank_bound(f: BlockFloors, pp: int, schedule: str, m: int, target: float = math.inf, steps: int = 40) -> float:
    """Bound (2) of the module doc: weights over (rank, alive vector) pairs, each pair's term
    static_r + vec . saved_r; the best of a few multiplicative-weight steps (each a valid bound)
    towards the weights that make it highest; stops once above ``target``, or once a split's
    floors fit under it (then no weighting proves more)."""
    V = pp * virtual_stages(schedule)
    if not f.static:
        return -math.inf
    a, b, xs, xv = _chunk_sums(f, V)
    vecs = rank_alive_vectors(schedule, pp, m)
    pairs = [(r, vec) for r in range(pp) for vec in vecs[r]]
    lam = np.full(len(pairs), 1.0 / len(pairs))
    best = -math.inf
    for t in range(steps):
        mu, mw = np.zeros(V), np.zeros(V)
        for (r, vec), x in zip(pairs, lam):
            for j, n in enumerate(vec):
                mu[r + j * pp] += x
                mw[r + j * pp] += x * n
        value, chunk = _weighted_least(a, b, xs, xv, mu, mw)
        best = max(best, value)
        if best > target:
            break
        cs, cv = xs.copy(), xv.copy()   # that split's chunks' (static, saved)
        np.add.at(cs, chunk, a)
        np.add.at(cv, chunk, b)
        load = np.array([sum(cs[r + j * pp] + n * cv[r + j * pp] for j, n in enumerate(vec)) for r, vec in pairs])
        top = load.max()
        if top <= 0 or top <= target < math.inf:   # a split whose floors fit: no weighting proves more
            break
        lam = lam * np.exp((load / top - 1.0) / math.sqrt(t + 1))
        lam /= lam.sum()
    return best


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
    hi = total_static + max(counts) * total_saved   # everything in one chunk: every split of it fits
    lo = 0.0
    if not _fits(f, counts, lo):
        for _ in range(60):   # invariant: no split fits under lo, every split fits under hi
            mid = (lo + hi) / 2
            if mid <= lo or mid >= hi:
                break
            if _fits(f, counts, mid):
                hi = mid
            else:
                lo = mid
    return max(lo, _rank_bound(f, pp, schedule, m)) if v > 1 else lo


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
        counts = tuple(alive(schedule, k, spec.pp, spec.num_micro_batches)
                       for k in range(spec.pp * virtual_stages(schedule)))
        if _fits(f, counts, limit) and (virtual_stages(schedule) == 1 or
                                        _rank_bound(f, spec.pp, schedule, spec.num_micro_batches, limit) <= limit):
            return False
    return True


__all__ = ["StageMemory", "BlockFloors", "SCHEDULES", "block_floors", "rank_alive_vectors", "least_peak",
           "exceeds_budget"]
