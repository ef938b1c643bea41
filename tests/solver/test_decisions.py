"""solver/decisions.py: the ILP, its LP bound and its cutoff proof run once per checkpoint
decision with the groups pinned. Same optimum as the model with the decisions free (and brute
force); a bound between the free LP's and the optimum; links respected."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings

from solver import decisions
from solver.bruteforce import brute_force
from solver.ilp import mip_reaches, relaxation_bound, solve
from solver.problem import CheckpointGroup, MemoryConstraint, Problem
from helpers.solver_problems import SETTINGS, assert_matches, problems, tie_tol


def _free(monkeypatch):
    """Run the next calls with the decisions free (one model), as before solver/decisions.py."""
    monkeypatch.setattr(decisions, "MAX_SPLIT_GROUPS", 0)


@settings(max_examples=150, **SETTINGS)
@given(problems(min_groups=1))
def test_split_solve_matches_brute_force_and_the_free_model(problem):
    ref = brute_force(problem)
    split = solve(problem)
    assert_matches(problem, split, ref)
    saved = decisions.MAX_SPLIT_GROUPS
    try:
        decisions.MAX_SPLIT_GROUPS = 0
        free = solve(problem)
        free_lp = relaxation_bound(problem)
    finally:
        decisions.MAX_SPLIT_GROUPS = saved
    assert (free.status == "infeasible") == (split.status == "infeasible")
    split_lp = relaxation_bound(problem)
    if ref.status == "infeasible":
        assert split_lp == math.inf or split_lp >= free_lp - tie_tol(problem)
        return
    assert math.isclose(free.objective, split.objective, rel_tol=1e-6, abs_tol=tie_tol(problem))
    # each pinned LP restricts the free one, and bounds its own decision's optimum
    tol = 1e-6 * abs(ref.objective) + tie_tol(problem)
    assert free_lp - tol <= split_lp <= ref.objective + tol, (free_lp, split_lp, ref.objective)
    for cut in (split_lp * 0.5, ref.objective * 0.999, ref.objective * 1.001 + 1e-9, ref.objective * 2 + 1):
        if abs(cut - ref.objective) <= tol:
            continue
        assert mip_reaches(problem, cut) == (ref.objective >= cut), (cut, ref.objective)


def _block_and_companion(forced=(None, None)):
    """One node, a block group and its selective companion (implied by the block group)."""
    return Problem(["n"], [np.array([1.0, 2.0])], [], [MemoryConstraint("dev", 50.0, terms=[], groups=[0, 1])], [
        CheckpointGroup("blocks", saved=[(0, np.array([60.0, 30.0]))], kept=[(0, np.array([5.0, 5.0]))],
                        recompute_time=[(0, np.array([1.5, 1.5]))], forced=forced[0]),
        CheckpointGroup("blocks/attention", saved=[(0, np.array([25.0, 25.0]))], kept=[(0, np.array([0.0, 0.0]))],
                        recompute_time=[(0, np.array([0.1, 0.1]))], forced=forced[1], implied_by=0)])


def test_pinned_problems_respect_links_and_pins():
    combos = [tuple(g.forced for g in p.checkpoint_groups) for p in decisions.pinned_problems(_block_and_companion())]
    assert combos == [(False, False), (False, True), (True, True)]   # none, selective, full
    pinned = decisions.pinned_problems(_block_and_companion(forced=(None, True)))
    assert [tuple(g.forced for g in p.checkpoint_groups) for p in pinned] == [(False, True), (True, True)]
    assert not decisions.splits(_block_and_companion(forced=(False, True)))


def test_where_memory_binds_the_pinned_bound_is_tighter(monkeypatch):
    """The configuration shape that made the split worth it (module doc): memory forces a
    decision, and the free LP mixes the decisions where the pinned LPs only mix strategies."""
    problem = _block_and_companion()
    opt = brute_force(problem)
    assert opt.checkpoint == [False, True] and opt.objective == 2.0 + 0.1   # selective, strategy 1
    assert solve(problem).objective == opt.objective
    split = relaxation_bound(problem)
    _free(monkeypatch)
    free = relaxation_bound(problem)
    assert free < split - 0.05 and split <= opt.objective, (free, split)
