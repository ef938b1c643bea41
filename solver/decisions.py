"""Checkpoint decisions solved one at a time: the ILP, its LP relaxation and its cutoff proof
over each allowed checkpoint decision with the groups pinned, instead of one model with the
decisions as binaries.

Why: with a group's decision free, every node's activation bytes enter the memory rows through
``z = x AND NOT c`` (solver/ilp.py ``_add_checkpoint_groups``), and the LP relaxation of that
product is weak where memory binds. A GPT 18.4B configuration (mesh 32 x 2 x 4, one
micro-batch, 61 nodes, 1087 strategies; a block group and its selective-recompute companion):
the LP bounds the step at 5.21 s with 44 of the 61 nodes split over several strategies, the ILP's
optimum is 6.28 s, and HiGHS needs 22-26 s to solve it. Pinned, the same problem is a plain
min-cost choice with linear memory rows: none and selective are proved infeasible in 0.04 and
0.07 s and full recomputation's LP is already 6.277 s, the ILP's optimum; each pinned ILP
solves in 0.3-0.4 s. A traced model has few free groups (a block group and its companion per
repeated block kind: 3 decisions each), so ``MAX_SPLIT_GROUPS`` free groups at most are split.

The three answers combine exactly: the ILP's optimum is the least over decisions of each pinned
optimum; the least pinned LP bound is a lower bound of it (and at least the free LP's, each
pinned LP being a restriction of the free one); the optimum reaches a cutoff when every pinned
one does. Torch-free, like the rest of solver/.
"""
from __future__ import annotations

import dataclasses
import itertools
import time

from solver.problem import Problem
from solver.problem_checks import floor_exceeds_budget, memory_floor_parts

MAX_SPLIT_GROUPS = 4   # free checkpoint groups split into pinned decisions (module doc)


def free_groups(problem: Problem) -> int:
    return sum(g.forced is None for g in problem.checkpoint_groups)


def splits(problem: Problem) -> bool:
    """Whether ``problem`` is solved decision by decision (module doc)."""
    return 0 < free_groups(problem) <= MAX_SPLIT_GROUPS


def pinned_problems(problem: Problem) -> list[Problem]:
    """``problem`` once per checkpoint decision its pins and links allow (``implied_by``: a group
    is on whenever the group it names is), every group pinned; all groups off first."""
    groups = problem.checkpoint_groups
    options = [(g.forced,) if g.forced is not None else (False, True) for g in groups]
    out = []
    for combo in itertools.product(*options):
        if any(g.implied_by is not None and combo[g.implied_by] and not combo[i] for i, g in enumerate(groups)):
            continue
        out.append(dataclasses.replace(problem, checkpoint_groups=[
            dataclasses.replace(g, forced=bool(on)) for g, on in zip(groups, combo)]))
    return out


def each_pinned(problem: Problem, time_limit: float | None, t0: float):
    """(pinned problem, seconds left of ``time_limit`` since ``t0`` or None) for each allowed
    decision some choice can fit under (``memory_floor_exceeds_budget`` proves the others out
    without a solver: GPT 18.4B's none and selective). The floors are computed once for all
    decisions (``memory_floor_parts``: the pins change only which of a group's two is taken)."""
    parts = memory_floor_parts(problem)
    for sub in pinned_problems(problem):
        if not floor_exceeds_budget(parts, sub):
            yield sub, None if time_limit is None else max(0.05, time_limit - (time.perf_counter() - t0))
