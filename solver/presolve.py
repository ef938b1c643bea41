"""Presolve: decisions that can be fixed before the ILP is built, without changing its optimum.

``fix_needless_checkpointing``: when every memory constraint holds with every undecided
checkpoint group off, whatever strategies are chosen, checkpointing cannot help. Turning a
group on only lowers memory and adds recompute time (never negative), so from any solution
with a group on, the same strategies with all undecided groups off are still feasible and no
slower (recompute times are checked to add no less than zero over every set of groups the links
allow). Pinning them off removes the group's binary and its z columns, which otherwise make
HiGHS explore a branch-and-bound tree for a choice that cannot matter (a 2-layer Hugging Face
Llama on 16 GPUs: minutes for one configuration with a selective-recompute companion group,
seconds without it).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from solver.problem import Problem


def _ceiling(terms, sizes) -> float:
    """Largest total of ``terms`` over every choice: per node the largest of its summed arrays."""
    per_node: dict[int, np.ndarray] = {}
    for n, arr in terms:
        per_node[n] = per_node.get(n, np.zeros(sizes[n])) + np.asarray(arr, dtype=float)
    return float(sum(float(np.max(a)) for a in per_node.values() if len(a)))


def _least_added_time(groups, sizes) -> float:
    """The smallest recompute time any allowed set of groups turned on can add, whatever the
    strategies (per node the least of its summed per-strategy times). A set is allowed when it
    respects the links (a group on turns on every group naming it as ``implied_by``); a block
    group's own time may be negative (its companion's time is counted there too), so sets are
    enumerated rather than groups checked one by one."""
    n = len(groups)
    least = math.inf
    for mask in range(1, 1 << n):
        on = {i for i in range(n) if mask >> i & 1}
        if any(g.implied_by in on and i not in on for i, g in enumerate(groups)):
            continue
        per_node: dict[int, np.ndarray] = {}
        for i in on:
            for node, arr in groups[i].recompute_time:
                per_node[node] = per_node.get(node, np.zeros(sizes[node])) + np.asarray(arr, dtype=float)
        least = min(least, float(sum(float(np.min(a)) for a in per_node.values() if len(a))))
    return least


MAX_ENUMERATED_GROUPS = 10   # 2**10 sets of groups; more is left to the solver


def fix_needless_checkpointing(problem: Problem) -> Problem:
    """``problem`` with its undecided checkpoint groups pinned off when that cannot change the
    optimum (module doc), else ``problem`` itself."""
    groups = problem.checkpoint_groups
    if not any(g.forced is None for g in groups) or any(g.forced for g in groups) \
            or len(groups) > MAX_ENUMERATED_GROUPS:
        return problem   # nothing undecided; a pinned-on group's links; too many sets to enumerate
    sizes = [len(c) for c in problem.costs]
    for m in problem.memory:
        if not math.isfinite(m.budget):
            continue
        total = m.const + _ceiling(m.terms, sizes) + sum(_ceiling(groups[gi].saved, sizes) for gi in m.groups)
        if total > m.budget:
            return problem
    if _least_added_time(groups, sizes) < 0.0:
        return problem   # some recomputation would save time: no dominance
    return dataclasses.replace(problem, checkpoint_groups=[
        dataclasses.replace(g, forced=False) if g.forced is None else g for g in groups])
