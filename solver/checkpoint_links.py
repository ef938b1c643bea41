"""Links between checkpoint groups (torch-free): a group with ``implied_by`` is on whenever that
other group is. autopar/search/build.py gives each block group with attention a selective-recompute
companion (its attention cores) implied by the block group, so the pair encodes none (off, off),
selective (off, on) and full (on, on) with two binaries and one row ``c[implied_by] <= c[g]``.

``validate_links`` (called by solver.ilp.validate), ``add_checkpoint_links`` (solver.ilp.build),
``links_hold`` (solver.bruteforce: decisions that respect the links).
"""
from __future__ import annotations

import numpy as np

from solver.errors import PlanError
from solver.problem import Problem


def validate_links(problem: Problem) -> None:
    """``implied_by`` names another group, and two pins do not contradict it."""
    groups = problem.checkpoint_groups
    for g in groups:
        j = g.implied_by
        if j is None:
            continue
        if not isinstance(j, (int, np.integer)) or not 0 <= j < len(groups) or groups[j] is g:
            raise PlanError(f"checkpoint group {g.name!r}: implied_by={j!r} is not another group's index")
        if groups[j].forced is True and g.forced is False:
            raise PlanError(f"checkpoint group {g.name!r} is pinned off but {groups[j].name!r}, which "
                          f"implies it, is pinned on")


def links_hold(problem: Problem, checkpoint) -> bool:
    """True when a decision respects every ``implied_by`` (used by brute force)."""
    return all(not checkpoint[g.implied_by] or checkpoint[i]
               for i, g in enumerate(problem.checkpoint_groups) if g.implied_by is not None)


def add_checkpoint_links(lp, problem: Problem, cs: list) -> None:
    """``c[implied_by] <= c[g]`` for every linked group (a pinned side becomes a bound)."""
    for gi, g in enumerate(problem.checkpoint_groups):
        if g.implied_by is None:
            continue
        a, b = cs[g.implied_by], cs[gi]
        if isinstance(a, bool) and isinstance(b, bool):
            continue   # consistent: validate_links refused a contradiction
        if isinstance(a, bool):
            if a:
                lp.row([(b, 1.0)], "GE", 1.0, f"link_{gi}")
        elif isinstance(b, bool):
            if not b:
                lp.row([(a, 1.0)], "LE", 0.0, f"link_{gi}")
        else:
            lp.row([(a, 1.0), (b, -1.0)], "LE", 0.0, f"link_{gi}")
