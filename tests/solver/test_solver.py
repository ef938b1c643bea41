"""The ILP (solver.ilp) against the exhaustive reference (solver.bruteforce) on random problems."""
from __future__ import annotations

import copy
import math

import numpy as np
import pulp
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from autopar.errors import PlanError
from solver.bruteforce import brute_force, brute_force_min_peak
from solver.ilp import build, evaluate, fits, min_peak_memory, relaxation_bound, solve
from solver.tree_bound import tree_lower_bound
from solver.pipeline import partition, pipeline_objective
from solver.problem import Edge, MemoryConstraint, Problem
from helpers.solver_problems import (SETTINGS, assert_matches, problems,
                                    random_problem, tie_tol)


# ----------------------------------------------------------------------------- generators


# ----------------------------------------------------------------------------- checks


@settings(max_examples=200, **SETTINGS)
@given(problems())
def test_highs_matches_brute_force(problem):
    assert_matches(problem, solve(problem, backend="highs"), brute_force(problem))


@settings(max_examples=80, **SETTINGS)
@given(problems(min_groups=1), st.floats(0.0, 1.0))
def test_budget_between_min_peak_and_unconstrained_peak(problem, frac):
    # Budgets that bind but can be met: the regime where checkpointing trades time for memory.
    for m in problem.memory:
        m.budget = math.inf
    free = brute_force(problem)
    lo = brute_force_min_peak(problem)
    hi = max(free.peak_memory.values(), default=0.0)
    for m in problem.memory:
        m.budget = lo + frac * (hi - lo)
    ref = brute_force(problem)
    assert ref.status == "optimal"
    assert_matches(problem, solve(problem, backend="highs"), ref)


@settings(max_examples=60, **SETTINGS)
@given(problems())
def test_cbc_matches_brute_force_and_highs(problem):
    ref = brute_force(problem)
    cbc = solve(problem, backend="cbc")
    assert_matches(problem, cbc, ref)
    highs = solve(problem, backend="highs")
    assert highs.status == cbc.status
    if cbc.status == "optimal":
        assert math.isclose(highs.objective, cbc.objective, rel_tol=1e-6, abs_tol=tie_tol(problem))


@settings(max_examples=100, **SETTINGS)
@given(problems())
def test_min_peak_memory_matches_brute_force(problem):
    got = min_peak_memory(problem, backend="highs")
    want = brute_force_min_peak(problem)
    assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-6), (got, want)


@settings(max_examples=30, **SETTINGS)
@given(problems())
def test_min_peak_memory_cbc(problem):
    assert math.isclose(min_peak_memory(problem, backend="cbc"), brute_force_min_peak(problem),
                        rel_tol=1e-6, abs_tol=1e-6)


def test_min_peak_is_the_threshold_of_feasibility():
    # A budget exactly at the min peak is feasible, just below it is not.
    p = random_problem(8, 3, 10, seed=3)
    peak = min_peak_memory(p)
    p.memory[0].budget = peak
    assert solve(p).status == "optimal"
    p.memory[0].budget = peak * (1 - 1e-3)
    assert solve(p).status == "infeasible"


# ----------------------------------------------------------------------------- determinism, limits

@pytest.mark.parametrize("backend", ["highs", "cbc"])
def test_deterministic(backend):
    # Integer costs make many ties: a solver free to break them differently would show it.
    rng = np.random.default_rng(7)
    n, s = 30, 4
    costs = [rng.integers(0, 3, s).astype(float) for _ in range(n)]
    edges = [Edge(i, i + 1, rng.integers(0, 2, (s, s)).astype(float)) for i in range(n - 1)]
    mem = [MemoryConstraint("dev", budget=60.0, terms=[(i, rng.integers(0, 5, s).astype(float)) for i in range(n)])]
    p = Problem([f"n{i}" for i in range(n)], costs, edges, mem)
    first = solve(p, backend=backend)
    for again in (solve(p, backend=backend), solve(copy.deepcopy(p), backend=backend)):
        assert (again.choice, again.checkpoint, again.objective, again.status) == \
               (first.choice, first.checkpoint, first.objective, first.status)


@pytest.mark.parametrize("backend", ["highs", "cbc"])
def test_time_limit_returns_incumbent_with_gap(backend):
    # Sized so that on 2 quiet cores neither backend proves optimality within 1 s but both find a
    # plan. On a loaded machine (CI runs two tests at once) 1 s may not reach a first plan, which
    # is a PlanError naming the limit; the limit then doubles, up to 8 s, until one is found.
    p = random_problem(100, 6, 150, seed=1, budget_frac=0.35)
    for limit in (1.0, 2.0, 4.0, 8.0):
        try:
            sol = solve(p, time_limit=limit, backend=backend)
            break
        except PlanError as e:
            assert f"time_limit={limit}" in str(e)
    assert sol.status in ("feasible", "optimal")
    assert sol.gap >= 0.0 and math.isfinite(sol.gap)
    if sol.status == "optimal":
        assert sol.gap == 0.0
    obj, mem = evaluate(p, sol.choice, sol.checkpoint)
    assert fits(p, mem) and obj == sol.objective
    # A cheap valid lower bound (node minima; edge costs are >= 0) bounds the gap from above.
    trivial_bound = sum(float(c.min()) for c in p.costs)
    assert sol.gap <= (sol.objective - trivial_bound) / sol.objective + 1e-9


# ----------------------------------------------------------------------------- short cuts and folding

def test_trivial_problem_does_not_call_a_solver(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a MIP solver was called for a trivial problem")
    monkeypatch.setattr(pulp.LpProblem, "solve", boom)
    p = Problem(["a", "b"], [np.array([1.0]), np.array([2.0])],
                [Edge(0, 1, np.array([[0.5]])), Edge(1, 1, np.array([[0.25]]))],
                [MemoryConstraint("dev", budget=10.0, const=1.0, terms=[(0, np.array([4.0])), (1, np.array([5.0]))])])
    sol = solve(p)
    assert (sol.status, sol.choice, sol.objective, sol.peak_memory) == ("optimal", [0, 0], 3.75, {"dev": 10.0})
    assert min_peak_memory(p) == 10.0
    p.memory[0].budget = 9.0
    assert solve(p).status == "infeasible"


def test_constant_memory_row_over_budget_is_infeasible():
    p = Problem(["a", "b"], [np.array([1.0, 2.0]), np.array([1.0])], [],
                [MemoryConstraint("dev", budget=5.0, const=6.0)])
    assert solve(p).status == "infeasible" and brute_force(p).status == "infeasible"


def _edge_vars(problem):
    return [v for v in build(problem).lp.variables() if v.name.startswith("e_")]


def test_edges_are_folded_summed_and_dropped():
    costs = [np.array([1.0, 2.0, 0.5]), np.array([0.3, 0.1]), np.array([0.2, 0.4])]
    sep = np.array([1.0, 2.0, 3.0])[:, None] + np.array([0.0, 5.0])[None, :]
    p = Problem(["a", "b", "c"], costs, [
        Edge(0, 1, sep),                          # separable: folded into node costs
        Edge(1, 2, np.zeros((2, 2))),             # zero: dropped
        Edge(2, 2, np.array([[1.0, 9.0], [9.0, 0.0]])),  # self edge: diagonal only
    ])
    assert _edge_vars(p) == []
    assert math.isclose(solve(p).objective, brute_force(p).objective, rel_tol=1e-9)
    # Two edges u->v and v->u become one pair with one set of e variables.
    dense = np.array([[0.0, 3.0], [3.0, 0.0]])
    q = Problem(["b", "c"], costs[1:], [Edge(0, 1, dense), Edge(1, 0, dense.T * 2)])
    assert len(_edge_vars(q)) == 4
    assert math.isclose(solve(q).objective, brute_force(q).objective, rel_tol=1e-9)


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("mutate, match", [
    (lambda p: p.edges.append(Edge(0, 1, np.zeros((3, 3)))), "expected \\(2, 2\\)"),
    (lambda p: p.edges.append(Edge(0, 5, np.zeros((2, 2)))), "not in \\[0, 2\\)"),
    (lambda p: p.costs.__setitem__(0, np.array([])), "at least one strategy"),
    (lambda p: p.costs.__setitem__(0, np.array([np.nan, 1.0])), "NaN"),
    (lambda p: p.memory.append(MemoryConstraint("dev", 1.0)), "unique"),
    (lambda p: p.memory.append(MemoryConstraint("x", 1.0, groups=[3])), "checkpoint group index"),
    (lambda p: p.memory.append(MemoryConstraint("x", 1.0, terms=[(1, np.ones(3))])), "one value per strategy"),
])
def test_bad_input_raises_plan_error(mutate, match):
    p = Problem(["a", "b"], [np.array([1.0, 2.0]), np.array([1.0, 0.0])], [],
                [MemoryConstraint("dev", 10.0)])
    mutate(p)
    with pytest.raises(PlanError, match=match):
        solve(p)


def test_unknown_backend():
    p = Problem(["a"], [np.array([1.0, 2.0])])
    with pytest.raises(PlanError, match="unknown solver backend"):
        solve(p, backend="gurobi")


# ----------------------------------------------------------------------------- pipeline partitioning

def brute_force_partition(n, stages, mb, cost, options, total, budget):
    import itertools
    best = math.inf
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = list(zip((0,) + cuts, cuts + (n,)))
        for devs in itertools.product(options, repeat=stages):
            if sum(devs) > total:
                continue
            tm = [cost(i, j, d) for (i, j), d in zip(bounds, devs)]
            if all(m <= budget for _, m in tm):
                best = min(best, pipeline_objective([t for t, _ in tm], mb))
    return best


@settings(max_examples=150, **SETTINGS)
@given(st.integers(1, 6), st.data())
def test_pipeline_partition_matches_brute_force(n, data):
    stages = data.draw(st.integers(1, n))
    mb = data.draw(st.integers(1, 8))
    options = data.draw(st.lists(st.sampled_from([1, 2, 4]), min_size=1, max_size=3, unique=True))
    total = data.draw(st.integers(stages, stages * 4))
    block_t = data.draw(st.lists(st.floats(0.0, 10.0, width=32), min_size=n, max_size=n))
    block_m = data.draw(st.lists(st.integers(0, 10), min_size=n, max_size=n))
    budget = float(data.draw(st.integers(0, 40)))

    def cost(i, j, d):  # more devices: less time and memory, plus a per-stage overhead
        return sum(block_t[i:j]) / d + 0.1 * (d - 1), sum(block_m[i:j]) / d

    want = brute_force_partition(n, stages, mb, cost, options, total, budget)
    event(f"fits={not math.isinf(want)}")
    if math.isinf(want):
        with pytest.raises(PlanError, match="no split"):
            partition(n, stages, mb, cost, options, total, budget)
        return
    plan = partition(n, stages, mb, cost, options, total, budget)
    assert math.isclose(plan.objective, want, rel_tol=1e-9, abs_tol=1e-12)
    # The plan is a real partition that meets every constraint.
    assert [s[0] for s in plan.stages] == [0] + [s[1] for s in plan.stages[:-1]] and plan.stages[-1][1] == n
    assert len(plan.stages) == stages and sum(d for _, _, d in plan.stages) <= total
    assert all(cost(i, j, d)[1] <= budget and d in options for i, j, d in plan.stages)


def test_pipeline_calls_cost_once_per_range_and_rejects_bad_input():
    calls = []

    def cost(i, j, d):
        calls.append((i, j, d))
        return float(j - i), 0.0

    plan = partition(4, 2, 4, cost)
    assert plan.stages == [(0, 2, 1), (2, 4, 1)] and plan.objective == 2 + 2 + 3 * 2
    assert len(calls) == len(set(calls)) == 10
    with pytest.raises(PlanError, match="non-empty stages"):
        partition(2, 3, 1, cost)
    with pytest.raises(PlanError, match="finite time"):
        partition(2, 1, 1, lambda i, j, d: (math.nan, 0.0))


def test_recompute_working_set_binds_at_the_scale_of_real_models():
    """A recompute working set of 300 MB beside 17 GB of model state: the memory row's coefficient
    of the recompute variable must survive HiGHS's small-coefficient threshold (it was dropped when
    kept in bytes, so a plan 100 MB over budget was called optimal)."""
    import numpy as np

    from solver import CheckpointGroup, MemoryConstraint, Problem, solve
    from solver.ilp import evaluate

    state = 1.7e10
    problem = Problem(
        node_names=["block"], costs=[np.array([1.0, 2.0])],
        memory=[MemoryConstraint("end", budget=state + 2e8, terms=[(0, np.array([state, state]))], groups=[0])],
        checkpoint_groups=[CheckpointGroup("blocks", saved=[(0, np.array([1e9, 1e9]))],
                                           kept=[(0, np.array([1e6, 1e6]))],
                                           recompute_memory=[(0, np.array([3e8, 1e8]))],
                                           recompute_time=[(0, np.array([0.1, 0.1]))], forced=True)])
    sol = solve(problem)
    _, mem = evaluate(problem, sol.choice, sol.checkpoint)
    assert sol.choice == [1], "the cheaper strategy's recompute set (300 MB) does not fit the 200 MB left"
    assert mem["end"] <= problem.memory[0].budget


# ----------------------------------------------------------------------------- cheap bounds

@settings(max_examples=150, **SETTINGS)
@given(problems())
def test_tree_bound_is_below_the_optimum(problem):
    """solver/tree_bound.py prunes configurations: it must never exceed the true optimum."""
    ref = brute_force(problem)
    if ref.status == "infeasible":
        return
    assert tree_lower_bound(problem) <= ref.objective + tie_tol(problem)


@settings(max_examples=60, **SETTINGS)
@given(st.integers(2, 6), st.integers(0, 10_000))
def test_tree_bound_is_exact_on_a_tree(n, seed):
    """Without cycles, memory or checkpointing the dynamic program is the optimum itself."""
    rng = np.random.default_rng(seed)
    sizes = [int(rng.integers(1, 4)) for _ in range(n)]
    costs = [rng.uniform(0, 1, k) for k in sizes]
    edges = []
    for v in range(1, n):   # each node hangs off an earlier one, in either direction
        u = int(rng.integers(0, v))
        src, dst = (u, v) if rng.random() < 0.5 else (v, u)
        edges.append(Edge(src, dst, rng.uniform(0, 1, (sizes[src], sizes[dst]))))
    problem = Problem([f"n{i}" for i in range(n)], costs, edges)
    assert math.isclose(tree_lower_bound(problem), brute_force(problem).objective, rel_tol=1e-9)


def test_tree_bound_beats_the_per_node_bound_on_a_chain():
    """Two nodes that each prefer strategy 0 alone but must pay to pair it: the forest sees it."""
    problem = Problem(["a", "b"], [np.array([0.0, 1.0]), np.array([0.0, 1.0])],
                      [Edge(0, 1, np.array([[5.0, 5.0], [5.0, 0.0]]))])
    assert tree_lower_bound(problem) == 2.0 == brute_force(problem).objective


@pytest.mark.parametrize("seed", range(4))
def test_relaxation_bound_cutoff_only_answers_whether_it_is_reached(seed):
    """With a cutoff the LP may stop early, but what it returns reaches the cutoff exactly when
    the full LP optimum does, and never exceeds that optimum (outer.py prunes on it)."""
    problem = random_problem(40, 6, 90, seed, budget_frac=10.0)
    full = relaxation_bound(problem)
    assert math.isfinite(full)
    for frac in (0.5, 0.9, 0.999, 1.001, 1.2):
        got = relaxation_bound(problem, cutoff=full * frac)
        assert got <= full * (1 + 1e-9)
        assert (got >= full * frac) == (frac <= 1.0), (frac, got, full)


@pytest.mark.parametrize("seed", range(4))
def test_mip_reaches_answers_whether_the_optimum_reaches_the_cutoff(seed):
    """solver.ilp.mip_reaches (the branch and bound with an objective bound that outer.py prunes
    with before solving): True exactly when the ILP's optimum is at least the cutoff, on random
    problems with and without binding memory budgets; cutoffs around the optimum, between the LP
    bound and the optimum, and above it."""
    from solver.ilp import mip_reaches

    problem = random_problem(16, 4, 30, seed, budget_frac=0.4 if seed % 2 else 10.0)
    sol = solve(problem)
    if sol.status == "infeasible":
        assert mip_reaches(problem, 0.0)
        return
    opt, lp = sol.objective, relaxation_bound(problem)
    assert lp <= opt * (1 + 1e-9)
    for cut in (lp * 0.9, (lp + opt) / 2, opt * 0.999, opt * 1.001, opt * 1.5):
        if abs(cut - opt) <= 1e-9 * opt:
            continue   # an integral LP: (lp + opt) / 2 is the optimum up to rounding
        assert mip_reaches(problem, cut) == (opt >= cut), (cut, lp, opt)


@pytest.mark.parametrize("seed", range(6))
def test_lp_first_returns_the_mip_optimum_and_skips_the_mip_when_integral(seed, monkeypatch):
    """solver/backends.py ``LP_FIRST``: on a large model the LP relaxation runs first and, when its
    optimum is integral, is the answer. The answer's objective equals the MIP's on problems whose
    LP is integral (a tree of edges, no binding memory: the MIP is then not run) and on ones whose
    LP is fractional (cycles, a binding budget: the MIP runs)."""
    import solver.backends as SB

    tree = seed % 2 == 0
    problem = random_problem(40, 6, 39 if tree else 90, seed, budget_frac=10.0 if tree else 0.4)
    if tree:   # a path: node i -> i + 1, so the LP's local polytope is exact
        problem.edges = [Edge(i, i + 1, e.cost) for i, e in enumerate(problem.edges)]
    assert build(problem).lp.num_cols > SB.MIP_PRESOLVE_MAX_COLUMNS
    mips = []
    real = SB._run_highs

    def counting(model, *a, mip=True, **k):
        mips.append(mip)
        return real(model, *a, mip=mip, **k)
    monkeypatch.setattr(SB, "_run_highs", counting)
    got = solve(problem, mip_gap=1e-7)
    ran_mip = any(mips)
    monkeypatch.setattr(SB, "LP_FIRST", False)
    ref = solve(problem, mip_gap=1e-7)
    assert got.status == ref.status
    if ref.status == "infeasible":
        return
    assert math.isclose(got.objective, ref.objective, rel_tol=1e-7, abs_tol=tie_tol(problem)), (got, ref)
    obj, mem = evaluate(problem, got.choice, got.checkpoint)
    assert fits(problem, mem) and obj == got.objective
    # both paths taken: these seeds' cyclic problems have fractional LPs
    assert ran_mip == (not tree), "the MIP runs exactly when the LP optimum is fractional"
    assert mips[0] is False   # the LP went first either way


def test_highs_banner_is_not_printed():
    """HiGHS prints its banner on stdout when its first instance is built; `autopar plan`'s output
    starts with the plan (solver/backends.py ``_new_highs``)."""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("from solver.ilp import solve; from helpers.solver_problems import random_problem; "
            "print('status', solve(random_problem(12, 3, 10, seed=0), backend='highs').status)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(tests), tests])})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HiGHS" not in out.stdout and out.stdout.startswith("status"), out.stdout
