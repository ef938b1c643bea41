"""solver/presolve.py: checkpoint groups that cannot matter are pinned off, and only those."""
from __future__ import annotations

import math

import numpy as np
import pytest

from solver.bruteforce import brute_force
from solver.ilp import solve
from solver.presolve import fix_needless_checkpointing
from solver.problem import CheckpointGroup, Edge, MemoryConstraint, Problem


def block_and_core(block_time, core_time, budget: float) -> Problem:
    """Two nodes; a block group and its selective-recompute companion (implied_by the block),
    as autopar/search/build.py makes them: the block's own time may be negative (full recompute
    = block + core)."""
    costs = [np.array([1.0, 2.0]), np.array([3.0, 1.0])]
    block = CheckpointGroup("blocks", saved=[(0, np.array([50.0, 40.0]))], kept=[(0, np.array([5.0, 5.0]))],
                            recompute_memory=[(0, np.array([10.0, 10.0]))],
                            recompute_time=[(0, np.array(block_time, dtype=float))])
    core = CheckpointGroup("blocks/attention", saved=[(1, np.array([30.0, 20.0]))], kept=[(1, np.array([3.0, 3.0]))],
                           recompute_memory=[(1, np.array([8.0, 8.0]))],
                           recompute_time=[(1, np.array(core_time, dtype=float))], implied_by=0)
    mem = [MemoryConstraint("peak", budget=budget, const=1.0,
                            terms=[(0, np.array([4.0, 6.0])), (1, np.array([2.0, 2.0]))],
                            groups=[0, 1])]
    return Problem(["a", "b"], costs, [Edge(0, 1, np.array([[0.0, 0.5], [0.5, 0.0]]))], mem, [block, core])


def test_slack_memory_pins_every_group_off_and_keeps_the_optimum():
    p = block_and_core([-0.1, -0.2], [0.3, 0.4], budget=1e9)   # full = block + core >= 0 everywhere
    q = fix_needless_checkpointing(p)
    assert [g.forced for g in q.checkpoint_groups] == [False, False]
    sol, ref = solve(p), brute_force(p)
    assert sol.checkpoint == [False, False]
    assert math.isclose(sol.objective, ref.objective, rel_tol=1e-9)


@pytest.mark.parametrize("block_time,core_time,why", [
    ([-0.5, -0.5], [0.3, 0.4], "full recompute would save time"),
    ([0.1, 0.1], [-0.2, 0.4], "selective recompute would save time"),
])
def test_groups_that_save_time_are_left_to_the_solver(block_time, core_time, why):
    p = block_and_core(block_time, core_time, budget=1e9)
    assert fix_needless_checkpointing(p) is p, why
    sol, ref = solve(p), brute_force(p)
    assert math.isclose(sol.objective, ref.objective, rel_tol=1e-9)


def test_binding_memory_is_left_to_the_solver():
    # with both groups off the row can reach 1 + 6 + 2 + 50 + 30 = 89 bytes: over a budget of 60
    p = block_and_core([0.1, 0.1], [0.3, 0.4], budget=60.0)
    assert fix_needless_checkpointing(p) is p
    sol, ref = solve(p), brute_force(p)
    assert sol.status == ref.status and math.isclose(sol.objective, ref.objective, rel_tol=1e-9)


def test_a_group_pinned_on_is_left_alone():
    p = block_and_core([0.1, 0.1], [0.3, 0.4], budget=1e9)
    p.checkpoint_groups[0].forced = True   # the block on forces its core on (the link)
    assert fix_needless_checkpointing(p) is p
    assert solve(p).checkpoint == [True, True]
