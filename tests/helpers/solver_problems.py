"""Random ILP problems (hypothesis strategies) and the checks of a solution against the exhaustive
reference, shared by tests/solver/test_solver.py and tests/solver/test_decisions.py."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, event
from hypothesis import strategies as st

from solver.ilp import evaluate, fits
from solver.problem import CheckpointGroup, Edge, MemoryConstraint, Problem

SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def arrays(draw, size: int, hi: float, unit: float = 1.0, integer: bool = False) -> np.ndarray:
    if integer:
        vals = draw(st.lists(st.integers(0, int(hi)), min_size=size, max_size=size))
    else:
        vals = draw(st.lists(st.floats(0, hi, allow_nan=False, width=32), min_size=size, max_size=size))
    return np.array(vals, dtype=float) * unit


@st.composite
def matrices(draw, rows: int, cols: int, unit: float) -> np.ndarray:
    kind = draw(st.sampled_from(["dense", "zero", "separable", "dense"]))
    if kind == "zero":
        return np.zeros((rows, cols))
    if kind == "separable":  # folds into node costs: exercises _fold_edges
        a, b = draw(arrays(rows, 5.0, unit)), draw(arrays(cols, 5.0, unit))
        return a[:, None] + b[None, :]
    vals = draw(st.lists(st.floats(0, 10.0, width=32), min_size=rows * cols, max_size=rows * cols))
    return np.array(vals, dtype=float).reshape(rows, cols) * unit


@st.composite
def terms(draw, sizes: list[int], hi: int, unit: float = 1.0, integer: bool = True):
    nodes = draw(st.lists(st.integers(0, len(sizes) - 1), max_size=3))
    return [(n, draw(arrays(sizes[n], hi, unit, integer))) for n in nodes]


@st.composite
def problems(draw, max_nodes: int = 5, max_strategies: int = 4, min_groups: int = 0) -> Problem:
    n = draw(st.integers(2, max_nodes))
    sizes = draw(st.lists(st.integers(1, max_strategies), min_size=n, max_size=n))
    # Costs span 1e-6 s to 100 s across nodes so the objective scaling is exercised.
    units = draw(st.lists(st.sampled_from([1e-6, 1e-3, 1.0, 10.0]), min_size=n, max_size=n))
    costs = [draw(arrays(k, 10.0, u)) for k, u in zip(sizes, units)]
    edges = []
    for _ in range(draw(st.integers(0, 6))):
        u, v = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))  # u == v: a self edge
        edges.append(Edge(u, v, draw(matrices(sizes[u], sizes[v], draw(st.sampled_from([1e-6, 1e-3, 1.0]))))))
    groups = []
    for g in range(draw(st.integers(min_groups, 2))):
        groups.append(CheckpointGroup(
            name=f"g{g}", saved=draw(terms(sizes, 200)), kept=draw(terms(sizes, 20)),
            recompute_memory=draw(terms(sizes, 20)),
            recompute_time=draw(terms(sizes, 10, unit=draw(st.sampled_from([1e-3, 1.0])), integer=False)),
            forced=draw(st.sampled_from([None, None, True, False]))))
    memory = []
    for m in range(draw(st.integers(0, 3))):
        budget = draw(st.sampled_from([math.inf, float(draw(st.integers(0, 300)))]
                                      + [float(draw(st.integers(60, 300)))] * 2))
        memory.append(MemoryConstraint(
            name=f"m{m}", budget=budget, const=float(draw(st.integers(0, 60))), terms=draw(terms(sizes, 100)),
            groups=draw(st.lists(st.integers(0, len(groups) - 1), min_size=1, max_size=2)) if groups else []))
    return Problem([f"n{i}" for i in range(n)], costs, edges, memory, groups)


def random_problem(n: int, s: int, e: int, seed: int, budget_frac: float = 0.4, chain: bool = False) -> Problem:
    rng = np.random.default_rng(seed)
    costs = [rng.uniform(1e-4, 1e-2, s) for _ in range(n)]
    edges = []
    for _ in range(e):
        u = int(rng.integers(0, n - 4))
        v = u + int(rng.integers(1, 4)) if chain else int(rng.integers(u + 1, n))
        edges.append(Edge(u, v, rng.uniform(0, 1e-2, (s, s))))
    mem = [MemoryConstraint("dev", budget=n * s * budget_frac, terms=[(i, rng.uniform(0, s, s)) for i in range(n)])]
    return Problem([f"n{i}" for i in range(n)], costs, edges, mem)


def tie_tol(problem: Problem) -> float:
    """Absolute objective tolerance: differences under 1e-8 of the largest cost are solver ties."""
    coefs = [np.abs(c).max() for c in problem.costs] + [np.abs(e.cost).max() for e in problem.edges]
    coefs += [np.abs(a).max() for g in problem.checkpoint_groups for _, a in g.recompute_time]
    return 1e-8 * max(coefs)


def assert_matches(problem: Problem, sol, ref) -> None:
    # Shown by --hypothesis-show-statistics: the mix of outcomes the generator reaches.
    event(f"status={ref.status}")
    event(f"a group is checkpointed={any(ref.checkpoint)}")
    assert sol.status in ("optimal", "infeasible")
    assert (sol.status == "infeasible") == (ref.status == "infeasible"), (sol, ref)
    if ref.status == "infeasible":
        assert sol.choice == []
        return
    assert math.isclose(sol.objective, ref.objective, rel_tol=1e-6, abs_tol=tie_tol(problem)), (sol, ref)
    # The ILP's decision is itself feasible and its reported numbers are that decision's.
    obj, mem = evaluate(problem, sol.choice, sol.checkpoint)
    assert fits(problem, mem)
    assert obj == sol.objective and mem == sol.peak_memory
    for g, on in zip(problem.checkpoint_groups, sol.checkpoint):
        assert g.forced is None or g.forced == on
