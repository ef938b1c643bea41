"""solver/tie_break.py: among choices of equal time, the one that uses less memory."""
from __future__ import annotations

import numpy as np

from solver.ilp import evaluate, solve
from solver.problem import CheckpointGroup, Edge, MemoryConstraint, Problem
from solver.tie_break import prefer_less_memory


def _frozen_weight(param_costs=(0.0, 0.0), bytes_=(100.0, 50.0), budget=1e9) -> Problem:
    """A weight (node 0: whole or split) feeding a GEMM (node 1: one strategy that needs the
    split, reached from either storage for free: a slice), as a frozen weight under tp."""
    return Problem(node_names=["weight", "gemm"], costs=[np.array(param_costs), np.array([1.0])],
                   edges=[Edge(0, 1, np.zeros((2, 1)))],
                   memory=[MemoryConstraint("peak", budget, terms=[(0, np.array(bytes_))])])


def test_equal_time_takes_the_smaller_storage():
    p = _frozen_weight()
    assert prefer_less_memory(p, [0, 0]) == [1, 0]
    sol = solve(p)
    assert sol.choice == [1, 0] and sol.objective == 1.0
    assert sol.peak_memory["peak"] == 50.0


def test_less_memory_that_costs_time_is_not_taken():
    p = _frozen_weight(param_costs=(0.0, 1e-9))
    assert prefer_less_memory(p, [0, 0]) == [0, 0]
    assert solve(p).choice == [0, 0]


def test_a_move_through_a_costlier_edge_is_not_taken():
    p = _frozen_weight()
    p.edges = [Edge(0, 1, np.array([[0.0], [1e-6]]))]
    assert prefer_less_memory(p, [0, 0]) == [0, 0]


def test_a_move_must_lower_every_constraint_it_touches_or_keep_it():
    p = _frozen_weight()
    p.memory.append(MemoryConstraint("backward", 1e9, terms=[(0, np.array([10.0, 20.0]))]))
    assert prefer_less_memory(p, [0, 0]) == [0, 0]


def test_nodes_of_checkpoint_groups_are_left_alone():
    p = _frozen_weight()
    p.checkpoint_groups = [CheckpointGroup("g", saved=[(0, np.array([1.0, 1.0]))])]
    assert prefer_less_memory(p, [0, 0]) == [0, 0]


def test_moves_keep_the_objective_and_lower_no_constraint_above_its_bytes():
    """A chain of ties: every move keeps the objective and no memory row grows."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = 6
        costs = [rng.integers(0, 2, size=3).astype(float) for _ in range(n)]
        edges = [Edge(i, i + 1, rng.integers(0, 2, size=(3, 3)).astype(float)) for i in range(n - 1)]
        mem = [MemoryConstraint("m", 1e9, terms=[(i, rng.integers(0, 3, size=3).astype(float)) for i in range(n)])]
        p = Problem(node_names=[str(i) for i in range(n)], costs=costs, edges=edges, memory=mem)
        start = [int(x) for x in rng.integers(0, 3, size=n)]
        moved = prefer_less_memory(p, start)
        (o0, m0), (o1, m1) = evaluate(p, start, []), evaluate(p, moved, [])
        assert o1 <= o0 and m1["m"] <= m0["m"]
        assert moved == start or m1["m"] < m0["m"]
