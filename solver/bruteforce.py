"""Exhaustive reference solver for tiny Problems: the ILP's oracle in tests.

Enumerates every strategy choice and every checkpoint decision allowed by ``forced``, scores
each with ``solver.ilp.evaluate`` (numpy, no linearisation) and keeps the cheapest that fits.
Ties go to the first combination in lexicographic order.
"""
from __future__ import annotations

import itertools
import math
import time

from solver.checkpoint_links import links_hold
from solver.ilp import _input_error, evaluate, fits, validate
from solver.problem import Problem, Solution

MAX_COMBINATIONS = 1_000_000


def _decisions(problem: Problem):
    per_group = [(g.forced,) if g.forced is not None else (False, True) for g in problem.checkpoint_groups]
    return [d for d in itertools.product(*per_group) if links_hold(problem, d)]


def _count(problem: Problem) -> int:
    return math.prod(len(c) for c in problem.costs) * len(_decisions(problem))


def brute_force(problem: Problem) -> Solution:
    """Optimal Solution by enumeration (raises PlanError above MAX_COMBINATIONS combinations)."""
    t0 = time.perf_counter()
    validate(problem)
    if _count(problem) > MAX_COMBINATIONS:
        raise _input_error(f"brute_force: {_count(problem)} combinations exceed {MAX_COMBINATIONS}; "
                           "use solver.ilp.solve for problems this size")
    best = None
    for ckpt in _decisions(problem):
        for choice in itertools.product(*(range(len(c)) for c in problem.costs)):
            obj, mem = evaluate(problem, choice, ckpt)
            if fits(problem, mem) and (best is None or obj < best[0]):
                best = (obj, list(choice), [bool(c) for c in ckpt], mem)
    if best is None:
        return Solution([], [], math.inf, "infeasible", solve_seconds=time.perf_counter() - t0)
    obj, choice, ckpt, mem = best
    return Solution(choice, ckpt, obj, "optimal", solve_seconds=time.perf_counter() - t0, peak_memory=mem)


def brute_force_min_peak(problem: Problem) -> float:
    """Smallest max over memory constraints any decision reaches (budgets ignored); 0 with none."""
    validate(problem)
    if not problem.memory:
        return 0.0
    if _count(problem) > MAX_COMBINATIONS:
        raise _input_error(f"brute_force_min_peak: {_count(problem)} combinations exceed {MAX_COMBINATIONS}")
    return min(max(evaluate(problem, choice, ckpt)[1].values())
               for ckpt in _decisions(problem)
               for choice in itertools.product(*(range(len(c)) for c in problem.costs)))
