"""The intra-stage sharding ILP: Problem -> Solution (HiGHS or CBC: solver/backends.py runs the
built model). Torch-free.

How the model is built -- its variables and every constraint family, each with the function
that adds it -- is solver/ilp_build.py's docstring; validation and evaluation in numpy are
solver/problem_checks.py.

Optimality gap when a time limit stops the search with an incumbent (status "feasible"):
HiGHS reports its MIP dual bound (``Highs.getInfo().mip_dual_bound``), which we use; PuLP does
not expose CBC's bound, so for CBC we re-solve the LP relaxation (``mip=False``) and use its
optimum as the bound (``inf`` gap if that LP does not finish). Either way
``gap = (objective - bound) / |objective|`` in true seconds.
"""
from __future__ import annotations

import dataclasses
import math
import time

from solver import decisions
from solver.backends import _bound, _extract, _run, _run_highs, _use_highs, release_threads  # noqa: F401 (re-exported)
from solver.errors import PlanError, SolverTimeout
from solver.ilp_build import build  # noqa: F401 (re-exported)
from solver.presolve import fix_needless_checkpointing
from solver.problem import Problem, Solution
from solver.problem_checks import (_input_error, evaluate, fits, memory_floor_exceeds_budget,  # noqa: F401
                                   validate)
from solver.tie_break import prefer_less_memory

_MAX_TIME_LIMIT_GAP = math.inf


# ----------------------------------------------------------------------------- solving

def _is_trivial(problem: Problem) -> bool:
    return not problem.checkpoint_groups and all(len(c) == 1 for c in problem.costs)


def solve(problem: Problem, time_limit: float | None = None, backend: str = "auto", threads: int = 2,
          mip_gap: float = 1e-7, start: list | None = None) -> Solution:
    """Cheapest strategy per node and checkpoint decision per group within every memory budget.

    ``mip_gap`` is the relative gap at which the solver may stop and call the result optimal
    (1e-7 by default so results match brute force; 1e-4, HiGHS's own default, is much faster
    on large problems). ``start``: per node a strategy index (or None) to warm-start from
    (HiGHS; an incumbent to prune with from the first node). ``backend``: "auto" (HiGHS if
    available, else CBC), "highs", "cbc".
    """
    t0 = time.perf_counter()
    validate(problem)
    problem = fix_needless_checkpointing(problem)   # solver/presolve.py: same optimum, smaller ILP
    if _is_trivial(problem):
        choice = [0] * problem.num_nodes
        obj, mem = evaluate(problem, choice, [])
        if not fits(problem, mem):
            return Solution([], [], math.inf, "infeasible", solve_seconds=time.perf_counter() - t0)
        return Solution(choice, [], obj, "optimal", solve_seconds=time.perf_counter() - t0, peak_memory=mem)
    if decisions.splits(problem):   # one ILP per checkpoint decision (solver/decisions.py)
        return _solve_each_decision(problem, time_limit, backend, threads, mip_gap, start, t0)
    model = build(problem)
    if start is not None and len(start) == problem.num_nodes:
        model.start = [s if s is None or 0 <= s < len(problem.costs[n]) else None for n, s in enumerate(start)]
    if model.infeasible:
        return Solution([], [], math.inf, "infeasible", solve_seconds=time.perf_counter() - t0)
    status = _run(model, backend, time_limit, threads, mip_gap)
    if status == "infeasible":
        return Solution([], [], math.inf, "infeasible", solve_seconds=time.perf_counter() - t0)
    choice, ckpt = _extract(model)
    choice = prefer_less_memory(problem, choice)   # equal time, less memory (solver/tie_break.py)
    obj, mem = evaluate(problem, choice, ckpt)
    gap = 0.0
    if status == "feasible":
        bound = model.offset + _bound(model, backend, time_limit, threads) / model.scale
        gap = max(0.0, obj - bound) / max(abs(obj), 1e-300) if math.isfinite(bound) else _MAX_TIME_LIMIT_GAP
    return Solution(choice, ckpt, obj, status, gap=gap, solve_seconds=time.perf_counter() - t0, peak_memory=mem)


def _solve_each_decision(problem: Problem, time_limit, backend, threads, mip_gap, start, t0) -> Solution:
    """``solve`` over each checkpoint decision with the groups pinned (solver/decisions.py): the
    cheapest pinned solution (the first on ties, all groups off first). Its gap covers every
    decision: a decision stopped by ``time_limit`` contributes its own bound, one stopped without
    a solution an unknown one. With no solution at all: infeasible, or the time-limit error when
    some decision ran out of time."""
    best, bounds, timed_out, all_optimal = None, [], None, True
    for sub, left in decisions.each_pinned(problem, time_limit, t0):
        try:
            sol = solve(sub, left, backend, threads, mip_gap, start)
        except SolverTimeout as e:
            timed_out, all_optimal = e, False
            bounds.append(-math.inf)
            continue
        if sol.status == "infeasible":
            continue
        all_optimal = all_optimal and sol.status == "optimal"
        bounds.append(sol.objective - sol.gap * abs(sol.objective))
        if best is None or sol.objective < best.objective:
            best = sol
    seconds = time.perf_counter() - t0
    if best is None:
        if timed_out is not None:   # named by the caller's limit, not the share the last decision had
            raise SolverTimeout(f"no feasible plan within time_limit={time_limit} s over the checkpoint "
                                f"decisions ({timed_out}); raise time_limit or shrink the problem") from None
        return Solution([], [], math.inf, "infeasible", solve_seconds=seconds)
    if all_optimal:   # each decision within its gap, so the least of them too
        return dataclasses.replace(best, solve_seconds=seconds)
    low = min(bounds)
    gap = max(0.0, best.objective - low) / max(abs(best.objective), 1e-300) if math.isfinite(low) \
        else _MAX_TIME_LIMIT_GAP
    return dataclasses.replace(best, status="feasible", gap=gap, solve_seconds=seconds)


def relaxation_bound(problem: Problem, time_limit: float | None = None, threads: int = 2,
                     cutoff: float | None = None) -> float:
    """The optimum of the LP relaxation (seconds): a lower bound of the ILP's optimum, or -inf
    when HiGHS is unavailable or the LP does not finish. With ``cutoff`` (seconds; pruning only
    needs to know whether the bound reaches it) HiGHS's dual simplex stops as soon as its dual
    objective, itself a lower bound of the LP optimum, passes the cutoff: then ``cutoff`` is
    returned, often after a fraction of the iterations."""
    validate(problem)
    return _relaxation_bound(problem, time_limit, threads, cutoff)


def _relaxation_bound(problem: Problem, time_limit, threads, cutoff) -> float:
    """``relaxation_bound`` of a validated problem. Its pinned decisions (solver/decisions.py)
    differ from it in their groups' ``forced`` only, and each is one ``implied_by`` allows, so
    they are not validated again (on Gemma 2, 205 of the 368 LP bounds were such decisions)."""
    problem = fix_needless_checkpointing(problem)
    if _is_trivial(problem):
        return evaluate(problem, [0] * problem.num_nodes, [])[0]
    if not _use_highs("auto"):
        return -math.inf
    if decisions.splits(problem):
        # the least of the pinned decisions' LPs (solver/decisions.py): far tighter than the LP
        # with the decisions free, and each stops at ``cutoff`` on its own
        t0 = time.perf_counter()
        low = math.inf
        for sub, left in decisions.each_pinned(problem, time_limit, t0):
            low = min(low, _relaxation_bound(sub, left, threads, cutoff))
        return low
    model = build(problem)
    if model.infeasible:
        return math.inf
    scaled = None if cutoff is None else (cutoff - model.offset) * model.scale
    status = _run_highs(model, time_limit, threads, 1e-7, mip=False, cutoff=scaled)
    if status == "infeasible":
        return math.inf
    if status == "above cutoff":
        return cutoff
    h = model.lp.solver_model
    if status != "optimal":
        return -math.inf
    return model.offset + h.objective_function_value / model.scale


def mip_reaches(problem: Problem, cutoff: float, time_limit: float | None = None, threads: int = 2) -> bool:
    """Whether the ILP's optimum is at least ``cutoff`` (seconds), proved by HiGHS's branch and
    bound with ``cutoff`` as its objective bound: every node whose bound reaches it is pruned, so
    the search ends "infeasible" when no integer solution lies below it (True), and stops at the
    first one it finds below it (False). Far cheaper than solving when the optimum is well above
    the cutoff (GPT-3 175B's 2-axis meshes: 1.2-1.6 s of CPU where solving takes 6-10 s), and a
    stronger bound than the LP relaxation (their LPs are 15-19% below their optima). False when
    HiGHS is unavailable or runs out of time: only a proof prunes."""
    validate(problem)
    return _mip_reaches(problem, cutoff, time_limit, threads)


def _mip_reaches(problem: Problem, cutoff: float, time_limit, threads) -> bool:
    """``mip_reaches`` of a validated problem (its pinned decisions not validated again, as in
    ``_relaxation_bound``)."""
    problem = fix_needless_checkpointing(problem)
    if _is_trivial(problem):
        return evaluate(problem, [0] * problem.num_nodes, [])[0] >= cutoff
    if not _use_highs("auto"):
        return False
    if decisions.splits(problem):   # every pinned decision must reach it (solver/decisions.py)
        t0 = time.perf_counter()
        for sub, left in decisions.each_pinned(problem, time_limit, t0):
            if not _mip_reaches(sub, cutoff, left, threads):
                return False
        return True
    model = build(problem)
    if model.infeasible:
        return True
    scaled = (cutoff - model.offset) * model.scale
    try:
        status = _run_highs(model, time_limit, threads, 1e-7, mip=True, cutoff=scaled, first_solution=True)
    except PlanError:   # out of time (or no answer) before any solution: only a proof prunes
        return False
    if status == "optimal":   # HiGHS may solve it outright (e.g. in presolve) without the bound
        return model.lp.solver_model.objective_function_value >= scaled
    return status == "infeasible"


def min_peak_memory(problem: Problem, time_limit: float | None = None, backend: str = "auto",
                    threads: int = 2, mip_gap: float = 1e-7) -> float:
    """Smallest achievable max over memory constraints (bytes), budgets ignored; 0 with none."""
    sol = min_peak_solution(problem, time_limit, backend, threads, mip_gap)
    return max(sol.peak_memory.values()) if sol.peak_memory else 0.0


def min_peak_solution(problem: Problem, time_limit: float | None = None, backend: str = "auto",
                      threads: int = 2, mip_gap: float = 1e-7) -> Solution:
    """The decision with the smallest max over memory constraints, budgets ignored (its objective
    and bytes per constraint computed exactly by ``evaluate``)."""
    validate(problem)
    t0 = time.perf_counter()
    if not problem.memory or _is_trivial(problem):
        choice, ckpt = [0] * problem.num_nodes, [False] * len(problem.checkpoint_groups)
    else:
        model = build(problem, peak=True)
        if _run(model, backend, time_limit, threads, mip_gap) == "infeasible":
            raise _input_error("min_peak_memory: the peak model is infeasible, which should not happen")
        choice, ckpt = _extract(model)
    obj, mem = evaluate(problem, choice, ckpt)
    return Solution(choice, ckpt, obj, "optimal", solve_seconds=time.perf_counter() - t0, peak_memory=mem)
