"""Pipeline stage partitioning: contiguous block ranges onto sub-meshes, by dynamic program.

Minimises the 1F1B step time ``sum(stage times) + (micro_batches - 1) * max(stage time)``
over every split of ``num_blocks`` blocks into ``num_stages`` non-empty contiguous ranges,
each stage taking a device count from ``device_options`` with the counts summing to at most
``total_devices``, and each stage's memory within ``memory_budget``.

The sum-plus-max objective is not decomposable, so the DP runs once per candidate bottleneck
``T`` (every distinct stage time, ascending): minimise the sum of stage times with every stage
``<= T``, score it ``sum + (micro_batches - 1) * T``. At the optimum's own bottleneck this is
exact and no other candidate scores below the optimum, so the minimum over candidates is
optimal. Candidates stop once ``micro_batches * T`` (a lower bound on any plan with that
bottleneck) cannot beat the best found. Costs are asked for once per (range, devices):
the callback is typically an intra-stage ILP.

The callback's memory figure must already include what the schedule keeps alive on that
stage (for 1F1B, up to ``num_stages`` micro-batches of activations on the first stage).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from solver.ilp import _input_error

StageCost = Callable[[int, int, int], "tuple[float, float]"]


@dataclass
class PipelinePlan:
    stages: list[tuple[int, int, int]]   # (first block, end block exclusive, devices) per stage
    stage_times: list[float]             # seconds per micro-batch, per stage
    objective: float                     # sum(stage_times) + (micro_batches - 1) * max(stage_times)


def pipeline_objective(stage_times: Sequence[float], micro_batches: int) -> float:
    """1F1B step time of a partition: every stage once, the slowest one micro_batches - 1 more times."""
    return float(sum(stage_times) + (micro_batches - 1) * max(stage_times))


def _table(num_blocks, device_options, cost, memory_budget):
    """(i, j, d) -> time for every range [i, j) and device count that fits in memory."""
    table = {}
    for i in range(num_blocks):
        for j in range(i + 1, num_blocks + 1):
            for d in device_options:
                t, mem = cost(i, j, d)
                if not (math.isfinite(t) and t >= 0):
                    raise _input_error(f"pipeline cost({i}, {j}, {d}) returned time {t!r}; need a finite time >= 0")
                if mem <= memory_budget:
                    table[(i, j, d)] = float(t)
    return table


def _min_sum(table, num_blocks, num_stages, total_devices, cap, items=None):
    """Min sum of stage times with every stage <= cap; returns (sum, stages) or None. ``items``:
    ``sorted(table.items())`` when the caller has it (``partition`` calls this once per candidate
    bottleneck, up to thousands of times on 96 blocks: sorting the table each time was most of it)."""
    # best[(i, k, used)] = (sum, parent state, stage) for the first i blocks in k stages using
    # `used` devices; the stages are read back through the parents at the end (copying each
    # candidate's stage list was most of the DP's time on 96 blocks). Same order and ties as
    # building the lists.
    by_start: dict[int, list] = {}
    for (i, j, d), t in (sorted(table.items()) if items is None else items):
        if t <= cap:
            by_start.setdefault(i, []).append((j, d, t))
    best = {(0, 0, 0): (0.0, None, None)}
    layers = []
    for k in range(num_stages):
        nxt = {}
        for state, (acc, _, _) in sorted(best.items()):
            i, _, used = state
            for j, d, t in by_start.get(i, ()):
                # Leave at least one block for each stage still to come.
                if used + d > total_devices or num_blocks - j < num_stages - k - 1:
                    continue
                key = (j, k + 1, used + d)
                total = acc + t
                if key not in nxt or total < nxt[key][0]:
                    nxt[key] = (total, state, (i, j, d))
        layers.append(nxt)
        best = nxt
    done = [(v[0], key) for key, v in sorted(best.items()) if key[0] == num_blocks]
    if not done:
        return None
    total, key = min(done, key=lambda v: v[0])
    stages = []
    for layer in reversed(layers):
        _, parent, stage = layer[key]
        stages.append(stage)
        key = parent
    return total, stages[::-1]


def _min_sum_one_option(times: np.ndarray, d: int, num_blocks: int, num_stages: int, cap: float):
    """``_min_sum`` where every stage takes the one device count ``d`` (and the devices suffice for
    every stage): the state is (blocks covered, stages), one array operation per stage. ``times``:
    (n + 1) x (n + 1), range [i, j)'s time, inf where it does not fit. Same sums (acc + t), same
    ties (the smallest i) as ``_min_sum``."""
    n = num_blocks
    allowed = np.where(times <= cap, times, np.inf)
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    cols = np.arange(n + 1)
    parents = []
    for k in range(num_stages):
        total = best[:, None] + allowed
        arg = np.argmin(total, axis=0)
        best = total[arg, cols]
        best[n - (num_stages - k - 1) + 1:] = np.inf   # leave at least one block for each stage to come
        parents.append(arg)
    if not math.isfinite(best[n]):
        return None
    stages, j = [], n
    for arg in reversed(parents):
        i = int(arg[j])
        stages.append((i, j, d))
        j = i
    return float(best[n]), stages[::-1]


def partition(num_blocks: int, num_stages: int, micro_batches: int, cost: StageCost,
              device_options: Sequence[int] = (1,), total_devices: int | None = None,
              memory_budget: float = math.inf) -> PipelinePlan:
    """Optimal 1F1B partition (see module docstring); raises PlanError when none fits."""
    if num_blocks < 1 or not 1 <= num_stages <= num_blocks:
        raise _input_error(f"cannot split {num_blocks} blocks into {num_stages} non-empty stages; "
                           "need 1 <= num_stages <= num_blocks")
    if micro_batches < 1:
        raise _input_error(f"micro_batches must be >= 1, got {micro_batches}")
    if not device_options or any(d < 1 for d in device_options):
        raise _input_error(f"device_options must be positive device counts, got {list(device_options)}")
    device_options = sorted(set(device_options))
    if total_devices is None:
        total_devices = num_stages * device_options[-1]
    table = _table(num_blocks, device_options, cost, memory_budget)
    best = None
    items = sorted(table.items())
    if len(device_options) == 1 and total_devices >= num_stages * device_options[0]:   # one array DP per stage
        times = np.full((num_blocks + 1, num_blocks + 1), np.inf)
        for (i, j, _d), t in items:
            times[i, j] = t

        def solve(cap):
            return _min_sum_one_option(times, device_options[0], num_blocks, num_stages, cap)
    else:
        def solve(cap):
            return _min_sum(table, num_blocks, num_stages, total_devices, cap, items)
    caps = sorted(set(table.values()))
    # Whether some split has every stage <= cap only grows with cap: the smallest such cap by
    # bisection, so the caps below it do not each cost a DP (GPT-3 175B's 29 partitions: most
    # of the 1,821 DPs were those).
    lo, hi = 0, len(caps)
    while lo < hi:
        mid = (lo + hi) // 2
        if solve(caps[mid]) is None:
            lo = mid + 1
        else:
            hi = mid
    # No cap's sum of stage times is below the unconstrained least sum (the largest cap's), so a
    # cap whose score cannot go under the best one even with that sum ends the walk.
    least = solve(caps[-1]) if caps else None
    floor = least[0] if least is not None else 0.0
    for cap in caps[lo:]:
        if best is not None and max(micro_batches * cap, floor + (micro_batches - 1) * cap) >= best[0]:
            break
        found = solve(cap)
        if found is not None:
            score = found[0] + (micro_batches - 1) * cap
            if best is None or score < best[0]:
                best = (score, found[1])
    if best is None:
        raise _input_error(f"no split of {num_blocks} blocks into {num_stages} stages fits: every candidate "
                           f"has a stage over memory_budget={memory_budget} or needs more than "
                           f"{total_devices} devices; add stages or devices, or lower the memory per stage")
    stages = best[1]
    times = [table[s] for s in stages]
    return PipelinePlan(stages=stages, stage_times=times, objective=pipeline_objective(times, micro_batches))
