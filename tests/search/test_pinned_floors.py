"""The pinned checkpoint decisions of one problem (solver/decisions.py ``each_pinned``) share its
memory floors (solver/problem_checks.py ``memory_floor_parts``) and are not validated again by
``relaxation_bound`` / ``mip_reaches`` (issue 35, planning speed): the same decisions kept and the
same bounds, with the work counted."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings

import solver.decisions as decisions
import solver.ilp as ilp
from solver.problem import CheckpointGroup, MemoryConstraint, Problem
from solver.problem_checks import memory_floor_exceeds_budget
from tests.helpers.solver_problems import SETTINGS, problems


def _reference_exceeds(problem: Problem) -> bool:
    """memory_floor_exceeds_budget as it was: everything recomputed per constraint and group."""
    sizes = [len(c) for c in problem.costs]

    def floor(terms) -> float:
        out: dict = {}
        for n, arr in terms:
            out[n] = out.get(n, np.zeros(sizes[n])) + np.asarray(arr, dtype=float)
        return float(sum(float(np.min(a)) for a in out.values() if len(a)))

    for m in problem.memory:
        if not math.isfinite(m.budget):
            continue
        total = m.const + floor(m.terms)
        for gi in m.groups:
            g = problem.checkpoint_groups[gi]
            saved, kept = floor(g.saved), floor(g.kept)
            total += saved if g.forced is False else kept if g.forced else min(saved, kept)
        if total > m.budget + 1e-9 * max(1.0, abs(m.budget)):   # problem_checks._MEM_RTOL
            return True
    return False


@settings(max_examples=300, **SETTINGS)
@given(problems(max_nodes=5, max_strategies=4, min_groups=1))
def test_shared_floors_keep_the_same_decisions(problem):
    assert memory_floor_exceeds_budget(problem) == _reference_exceeds(problem)
    kept = [sub for sub, _ in decisions.each_pinned(problem, None, 0.0)]
    want = [sub for sub in decisions.pinned_problems(problem) if not _reference_exceeds(sub)]
    assert [[g.forced for g in s.checkpoint_groups] for s in kept] == \
        [[g.forced for g in s.checkpoint_groups] for s in want]


def _two_free_groups() -> Problem:
    rng = np.random.default_rng(0)
    n, s = 6, 3
    groups = [CheckpointGroup(f"g{i}", saved=[(i, rng.uniform(50, 60, s))], kept=[(i, rng.uniform(1, 2, s))],
                              recompute_memory=[(i, rng.uniform(1, 2, s))],
                              recompute_time=[(i, rng.uniform(1e-3, 2e-3, s))]) for i in range(2)]
    mem = [MemoryConstraint("dev", budget=100.0, const=10.0,
                            terms=[(i, rng.uniform(1, 10, s)) for i in range(n)], groups=[0, 1])]
    return Problem([f"n{i}" for i in range(n)], [rng.uniform(1e-3, 1e-2, s) for _ in range(n)], [], mem, groups)


def test_pinned_decisions_validated_once_and_floored_once(monkeypatch):
    problem = _two_free_groups()
    assert decisions.splits(problem) and len(decisions.pinned_problems(problem)) == 4
    calls = {"validate": 0, "parts": 0}
    validate, parts = ilp.validate, decisions.memory_floor_parts

    def counting_validate(p):
        calls["validate"] += 1
        return validate(p)

    def counting_parts(p):
        calls["parts"] += 1
        return parts(p)

    expected = min(ilp.relaxation_bound(sub) for sub in decisions.pinned_problems(problem))
    monkeypatch.setattr(ilp, "validate", counting_validate)
    monkeypatch.setattr(decisions, "memory_floor_parts", counting_parts)
    assert ilp.relaxation_bound(problem) == expected
    # one validation and one floors' pass for the four decisions (before: five and four)
    assert calls == {"validate": 1, "parts": 1}
    calls.update(validate=0, parts=0)
    assert ilp.mip_reaches(problem, expected * 0.5) is True
    assert calls == {"validate": 1, "parts": 1}
