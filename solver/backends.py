"""Running a built ILP/LP model (solver/ilp.py ``build``) on a backend: HiGHS through highspy's
arrays, or CBC through PuLP; reading back the choice, the bound, and releasing HiGHS's threads.
Torch-free, like the rest of solver/."""
from __future__ import annotations

import math
import os
import sys
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pulp

from solver.errors import PlanError, SolverTimeout

if TYPE_CHECKING:   # annotations only
    from solver.lp_arrays import _LP, _Model

_LIVE: "weakref.WeakSet" = weakref.WeakSet()   # Highs instances not yet freed (release_threads)
_GAP_ABS = 1e-9        # in scaled objective units (largest coefficient = solver/ilp.py's _OBJ_TARGET)
# HiGHS's MIP presolve on large sharding ILPs costs more than it saves: a GPT 18.4B configuration
# on a (32, 4, 2) mesh (61 nodes, 1087 strategies, 31k edge columns) solves in 10.8 s with it and
# 6.1 s without (0.96 s against 2.7 s with the memory rows dropped); the edge columns' coupling
# rows leave presolve little to remove, and its probing on the one-hot rows is what takes long.
# Off above this many columns only: on tiny problems it costs nothing, and without it HiGHS picks
# other tied optima (a frozen backbone's tp=2 plan, 102 columns, replicated the weight at the same
# step time and 37% more memory, where presolve's tie split it). Not higher: GPT-3 175B's inner
# pipelined ILPs (a few thousand columns) took 64 s of planning with it off, 69.5 s at 5,000 and
# 83 s at 20,000.
MIP_PRESOLVE_MAX_COLUMNS = 1_000


def _input_error(message: str) -> Exception:
    return PlanError(message)


def _use_highs(backend: str) -> bool:
    if backend not in ("auto", "highs", "cbc"):
        raise _input_error(f"unknown solver backend {backend!r}; use 'auto', 'highs' or 'cbc'")
    if backend == "cbc":
        return False
    try:
        import highspy  # noqa: F401
        return True
    except ImportError:
        if backend == "highs":
            raise _input_error("backend='highs' needs the highspy package: pip install highspy, or use backend='cbc'")
        return False


@dataclass(frozen=True)
class _HighsFigures:
    """What the search reads back from a HiGHS run after it returns."""
    mip_dual_bound: float
    objective_function_value: float


_BANNER_SHOWN = False


def _new_highs(highspy):
    """A HiGHS instance. HiGHS (1.16) prints its banner on the process's stdout when its first
    instance is built, before any option can be set: that one is built with file descriptor 1
    pointed at /dev/null, so `autopar plan`'s output starts with the plan."""
    global _BANNER_SHOWN
    if _BANNER_SHOWN:
        return highspy.Highs()
    _BANNER_SHOWN = True
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            return highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _run_highs(model: _Model, time_limit, threads, mip_gap, mip: bool = True, cutoff: float | None = None,
               first_solution: bool = False) -> str:
    import highspy

    lp = model.lp
    h = _new_highs(highspy)
    _LIVE.add(h)
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", int(threads))
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("mip_rel_gap", float(mip_gap))
    h.setOptionValue("mip_abs_gap", _GAP_ABS)
    if time_limit is not None:
        h.setOptionValue("time_limit", float(time_limit))
    if not mip or model.lp.num_cols > MIP_PRESOLVE_MAX_COLUMNS:
        # The relaxations are bounds for pruning: HiGHS's LP presolve took longer than it saved
        # on them (hf_llama's largest: 0.87 s with, 0.36 s without), and the dual simplex's
        # objective bound (``cutoff``) is honoured only without it. Large MIPs too
        # (MIP_PRESOLVE_MAX_COLUMNS).
        h.setOptionValue("presolve", "off")
    if cutoff is not None:   # scaled units; see relaxation_bound (an LP) and mip_reaches (a MIP)
        h.setOptionValue("objective_bound", float(cutoff))
    if first_solution:   # stop at the first integer solution found (below the cutoff: mip_reaches)
        h.setOptionValue("mip_max_improving_sols", 1)
    n = lp.num_cols
    start, index, value, row_lo, row_up = lp.matrix()
    hl = highspy.HighsLp()
    hl.num_col_, hl.num_row_ = n, len(row_lo)
    hl.col_cost_ = lp.cost()
    hl.col_lower_ = np.asarray(lp.lower, dtype=float)
    hl.col_upper_ = np.asarray(lp.upper, dtype=float)
    hl.row_lower_ = row_lo
    hl.row_upper_ = row_up
    hl.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    hl.a_matrix_.num_col_, hl.a_matrix_.num_row_ = n, len(row_lo)
    hl.a_matrix_.start_ = start.astype(np.int32)
    hl.a_matrix_.index_ = index.astype(np.int32)
    hl.a_matrix_.value_ = value
    if mip and any(lp.integer):
        hl.integrality_ = [highspy.HighsVarType.kInteger if b else highspy.HighsVarType.kContinuous
                           for b in lp.integer]
    h.passModel(hl)
    if model.start is not None:
        # A warm start (a neighbouring configuration's choice): the x columns only; HiGHS
        # completes the edge/checkpoint columns itself, and ignores a start that is infeasible.
        cols = np.array([int(model.x[n][s]) for n, s in enumerate(model.start) if s is not None], dtype=np.int32)
        if cols.size:
            h.setSolution(int(cols.size), cols, np.ones(cols.size))
    h.run()
    status = h.getModelStatus()
    MS = highspy.HighsModelStatus
    info = h.getInfo()
    # Keep the figures, not the Highs object: an instance alive when the process exits (torchrun
    # ranks) can hold the solver's thread pool past release_threads() and abort the exit.
    lp.solver_model = _HighsFigures(float(info.mip_dual_bound), float(info.objective_function_value))
    has_solution = info.primal_solution_status == 2   # kSolutionStatusFeasible
    if has_solution:
        lp.values = np.asarray(h.getSolution().col_value, dtype=float)
    if status == MS.kOptimal:
        return "optimal"
    if status in (MS.kInfeasible,):
        return "infeasible"
    if status == MS.kObjectiveBound and not mip:
        return "above cutoff"
    if has_solution and status in (MS.kTimeLimit, MS.kIterationLimit, MS.kSolutionLimit, MS.kInterrupt,
                                   MS.kObjectiveBound, MS.kObjectiveTarget):
        return "feasible"
    if status == MS.kUnboundedOrInfeasible:
        return "infeasible"
    described = h.modelStatusToString(status)
    del h   # the traceback of the error keeps this frame: not the solver with it (release_threads)
    if time_limit is not None and status == MS.kTimeLimit:
        raise SolverTimeout(f"the HiGHS solver found no feasible plan within time_limit={time_limit} s; "
                            "raise time_limit or shrink the problem (merge followers, solve repeated blocks once)")
    raise _input_error(f"the HiGHS solver returned status {described!r}")


def _to_pulp(lp: _LP, mip: bool = True):
    """The same model as a PuLP problem (for CBC); returns (problem, PuLP variable per column)."""
    prob = pulp.LpProblem(lp.name, pulp.LpMinimize)
    # PuLP >= 3.3 wants variables created through the problem (the 4.0 API); older PuLP lacks it.
    make = prob.add_variable if hasattr(prob, "add_variable") else pulp.LpVariable
    pv = [make(lp.name_of(i), None if math.isinf(lo) else lo, None if math.isinf(up) else up,
               cat=pulp.LpBinary if (b and mip) else pulp.LpContinuous)
          for i, (lo, up, b) in enumerate(zip(lp.lower, lp.upper, lp.integer))]
    start, index, value, row_lo, row_up = lp.matrix()
    for r in range(len(row_lo)):
        a, b = start[r], start[r + 1]
        expr = pulp.LpAffineExpression([(pv[i], float(w)) for i, w in zip(index[a:b], value[a:b])])
        lo, up = float(row_lo[r]), float(row_up[r])
        if lo == up:
            prob.addConstraint(pulp.LpConstraint(expr, pulp.LpConstraintEQ, rhs=lo), f"r{r}")
        elif math.isinf(lo):
            prob.addConstraint(pulp.LpConstraint(expr, pulp.LpConstraintLE, rhs=up), f"r{r}")
        else:
            prob.addConstraint(pulp.LpConstraint(expr, pulp.LpConstraintGE, rhs=lo), f"r{r}")
    cost = lp.cost()
    prob.setObjective(pulp.LpAffineExpression([(pv[i], float(cost[i])) for i in np.flatnonzero(cost)]))
    return prob, pv


def _run_cbc(model: _Model, time_limit, threads, mip_gap, mip: bool = True) -> str:
    prob, pv = _to_pulp(model.lp, mip)
    with warnings.catch_warnings():
        # PULP_CBC_CMD is the bundled CBC (facts.md: no system cbc); PuLP 3.3 flags it for 4.0.
        warnings.simplefilter("ignore", DeprecationWarning)
        solver = pulp.PULP_CBC_CMD(mip=mip, msg=False, timeLimit=time_limit, threads=threads,
                                   gapRel=mip_gap, gapAbs=_GAP_ABS)
    prob.solve(solver)
    model.lp.values = np.array([p.varValue if p.varValue is not None else 0.0 for p in pv], dtype=float)
    model.cbc_objective = float(pulp.value(prob.objective) or 0.0) if prob.status == pulp.LpStatusOptimal else None
    if not mip:
        return "optimal" if prob.status == pulp.LpStatusOptimal else "unknown"
    if prob.sol_status == pulp.LpSolutionOptimal:
        return "optimal"
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:
        return "feasible"
    if prob.status == pulp.LpStatusInfeasible or prob.sol_status == pulp.LpSolutionInfeasible:
        return "infeasible"
    if time_limit is not None:   # PuLP does not tell a stop at the time limit from other stops
        raise SolverTimeout(f"the {solver.name} solver found no feasible plan within time_limit={time_limit} s; "
                            "raise time_limit or shrink the problem (merge followers, solve repeated blocks once)")
    raise _input_error(f"the {solver.name} solver returned status {pulp.LpStatus[prob.status]!r}")


def _run(model: _Model, backend, time_limit, threads, mip_gap) -> str:
    """Solve the model; returns 'optimal' | 'feasible' | 'infeasible'."""
    if _use_highs(backend):
        if LP_FIRST and model.lp.num_cols > MIP_PRESOLVE_MAX_COLUMNS and model.start is None:
            t0 = time.perf_counter()
            relaxed = _lp_first(model, time_limit, threads)
            if relaxed is not None:
                return relaxed
            if time_limit is not None:   # the MIP gets what the LP left; a time-out names the whole limit
                left = max(1e-9, time_limit - (time.perf_counter() - t0))
                try:
                    return _run_highs(model, left, threads, mip_gap)
                except SolverTimeout:
                    raise SolverTimeout(f"the HiGHS solver found no feasible plan within time_limit={time_limit} s "
                                        f"(LP relaxation first, then the MIP); raise time_limit or shrink the "
                                        f"problem (merge followers, solve repeated blocks once)") from None
        return _run_highs(model, time_limit, threads, mip_gap)
    return _run_cbc(model, time_limit, threads, mip_gap)


# Large sharding ILPs are often integral at their LP optimum: GPT 18.4B's 2-axis configurations
# (31k columns) all solved at HiGHS's root node, 0.19 s a MIP of which ~0.1 s was the MIP's own
# set-up (clique table, symmetry detection) before the root LP. Their LP alone takes 0.02-0.05 s:
# when its optimum is integral it is the MIP's optimum (a relaxation's optimum that is feasible),
# and the MIP is not run. Small models keep the MIP (MIP_PRESOLVE_MAX_COLUMNS: their presolve
# picks among tied optima, and they solve in milliseconds either way).
LP_FIRST = True
_INTEGRAL_TOL = 1e-6


def _lp_first(model: _Model, time_limit, threads) -> str | None:
    """Solve the LP relaxation: "optimal" (its values left on the model) when its optimum has
    every integer column at 0 or 1, i.e. is the MIP's optimum; "infeasible" when it is (so is
    the MIP); None when the MIP must run."""
    try:
        status = _run_highs(model, time_limit, threads, 1e-7, mip=False)
    except PlanError:   # out of time, or no answer: the MIP gets what is left (and says what fails)
        return None
    if status == "infeasible":
        return status
    if status != "optimal" or model.lp.values is None:
        return None
    v = model.lp.values[np.flatnonzero(np.asarray(model.lp.integer, dtype=bool))]
    return "optimal" if bool(np.all(np.minimum(np.abs(v), np.abs(1.0 - v)) <= _INTEGRAL_TOL)) else None


def _extract(model: _Model) -> tuple[list[int], list[bool]]:
    vals = model.lp.values
    choice = [int(np.argmax(vals[np.asarray(xs)])) for xs in model.x]
    ckpt = [c if isinstance(c, bool) else float(vals[c]) > 0.5 for c in model.c]
    return choice, ckpt


def _bound(model: _Model, backend, time_limit, threads) -> float:
    """Lower bound (scaled units) after a time-limited stop; see the module docstring."""
    h = model.lp.solver_model
    if h is not None:  # HiGHS
        return h.mip_dual_bound
    if _run_cbc(model, time_limit, threads, 1e-7, mip=False) != "optimal" or model.cbc_objective is None:
        return -math.inf
    return model.cbc_objective


def release_threads() -> None:
    """Stop HiGHS's worker threads (they outlive a solve). Call after a batch of solves: a
    process that then forks (test launchers) or exits (torchrun ranks: a joinable thread at exit
    aborts the process with "terminate called without an active exception") is left clean; the
    next solve starts the pool again."""
    try:
        import highspy
    except ImportError:
        return
    import gc

    if _LIVE:
        # Highs instances still referenced from cycles would outlive the reset below. Only then
        # a full collection: after a large search it walks millions of cached objects (GPT-3
        # 175B: 1.3-3 s), and normally every instance died with its _run_highs frame.
        gc.collect()
    reset = getattr(highspy.Highs, "resetGlobalScheduler", None)
    if reset is not None:
        reset(True)


def _release_before_fork() -> None:
    """Before any ``os.fork`` (multiprocessing's fork start method: runtime.launch.run_local's
    ranks, the planner's workers): a fork copies HiGHS's global scheduler without its worker
    threads, and the child's first parallel solve then waits on them forever (measured: a solve
    in the parent, then a plan in a forked rank, hung past 100 s). Only once highspy is loaded."""
    if "highspy" in sys.modules:
        release_threads()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_release_before_fork)
