"""One LP over the resharding floors for a group of configurations (autopar/search/visit.py
``_pruned_by_floors``): the ZeRO stages and offload modes of one mesh and micro-batch count.

Where pricing a configuration's edges would cost seconds, the outer search solves the LP
relaxation over the floors (autopar/pricing/edge_floor.py) to prune it before pricing. The
variants of one (mesh, micro-batch count) share the floors, the strategies and the liveness
structure, and differ only in their node costs (the optimizer step, ZeRO-3's gathers, the
host's step) and their memory terms (ZeRO's shards, what is offloaded). Their lower envelope
(``lower_envelope``: per strategy the least cost and the least bytes of any member, the same
checkpoint groups and memory rows) is a problem every member's integer plan is a plan of, no
slower and no larger: its LP relaxation bounds every member's step from below, and when it has
no solution neither has any member. So one LP answers for all members when it reaches the plan
to beat (or is infeasible); when it does not, each member's own LP is solved as before. ZeRO-3
(whose gathers make its costs the highest and its memory the least) forms its own group
(``group_key``), so the envelope of the others is not weakened by ZeRO-3's memory.
"""
from __future__ import annotations

import math

import numpy as np

from solver.problem import CheckpointGroup, Edge, MemoryConstraint, Problem

# The grouped floor LP is tried before a configuration's own (tests switch it off to check it
# changes no plan).
GROUPED_FLOOR_LP = True
INFEASIBLE = "infeasible"


def group_key(cfg) -> tuple:
    """The configurations that share one envelope: same mesh and micro-batch count (so the same
    floors and valid strategies), ZeRO-3 apart from the other stages."""
    s = cfg.settings
    return (cfg.mesh, s.num_micro_batches, s.precision, s.budget, s.checkpoint, s.zero == 3)


def _same_terms(a: list, b: list) -> bool:
    return len(a) == len(b) and all(i == j and x.shape == y.shape for (i, x), (j, y) in zip(a, b))


def _least_terms(terms: list[list]) -> list:
    return [(i, np.minimum.reduce([t[k][1] for t in terms])) for k, (i, _) in enumerate(terms[0])]


def lower_envelope(problems: list[Problem]) -> Problem | None:
    """A problem whose every integer plan is a plan of each of ``problems``, at no more cost and
    no more bytes per memory row (per strategy the least cost, edge entry and bytes of any of
    them, the same rows and checkpoint groups); None when they are not of one structure (nodes,
    kept strategies, edges, memory rows, groups), so no envelope is formed. Its optimum, and any
    lower bound of it, is at most each problem's optimum; infeasible only if each is."""
    first = problems[0]
    for p in problems[1:]:
        if p.node_names != first.node_names or len(p.costs) != len(first.costs) \
                or any(a.shape != b.shape for a, b in zip(p.costs, first.costs)):
            return None
        if (p.kept is None) != (first.kept is None) or (p.kept is not None and any(
                not np.array_equal(a, b) for a, b in zip(p.kept, first.kept))):
            return None
        if len(p.edges) != len(first.edges) or any((e.src, e.dst, e.cost.shape) != (f.src, f.dst, f.cost.shape)
                                                   for e, f in zip(p.edges, first.edges)):
            return None
        if len(p.memory) != len(first.memory) or any(
                (m.name, m.budget, m.groups) != (f.name, f.budget, f.groups) or not _same_terms(m.terms, f.terms)
                for m, f in zip(p.memory, first.memory)):
            return None
        if len(p.checkpoint_groups) != len(first.checkpoint_groups) or any(
                (g.name, g.forced, g.implied_by) != (f.name, f.forced, f.implied_by)
                or not all(_same_terms(getattr(g, a), getattr(f, a))
                           for a in ("saved", "kept", "recompute_memory", "recompute_time"))
                for g, f in zip(p.checkpoint_groups, first.checkpoint_groups)):
            return None
    costs = [np.minimum.reduce([p.costs[i] for p in problems]) for i in range(len(first.costs))]
    edges = [Edge(e.src, e.dst, np.minimum.reduce([p.edges[k].cost for p in problems]))
             for k, e in enumerate(first.edges)]
    memory = [MemoryConstraint(m.name, m.budget, min(p.memory[k].const for p in problems),
                               _least_terms([p.memory[k].terms for p in problems]), list(m.groups))
              for k, m in enumerate(first.memory)]
    groups = [CheckpointGroup(g.name, *(_least_terms([getattr(p.checkpoint_groups[k], a) for p in problems])
                                        for a in ("saved", "kept", "recompute_memory", "recompute_time")),
                              g.forced, g.implied_by)
              for k, g in enumerate(first.checkpoint_groups)]
    out = Problem(node_names=list(first.node_names), costs=costs, edges=edges, memory=memory,
                  checkpoint_groups=groups, strategy_names=first.strategy_names)
    out.kept = first.kept
    return out


class FloorGroups:
    """The outer search's configurations by ``group_key`` (queue index -> config, its priced nodes
    once known, its node bound) and each group's envelope LP, solved once, over the members not
    yet visited and not beaten by their node bound when it is first asked for: its answer holds
    for those members only."""

    def __init__(self):
        self.members: dict[tuple, dict[int, list]] = {}   # key -> {queue index: [cfg, P or None, node bound]}
        self.visited: set[int] = set()
        self.answers: dict[tuple, tuple[set, object]] = {}   # key -> (members it covers, answer)

    def add(self, index: int, cfg, P, lower: float) -> None:
        """A configuration of the queue; ``P`` None when it is priced only when visited (then
        ``lower`` is its twin's bound, which prunes it unpriced when the best plan reaches it)."""
        self.members.setdefault(group_key(cfg), {})[index] = [cfg, P, lower]

    def visiting(self, index: int, cfg, P) -> None:
        """The configuration at ``index`` is being visited, priced as ``P``."""
        self.visited.add(index)
        member = self.members.get(group_key(cfg), {}).get(index)
        if member is not None:
            member[1] = P

    def priced(self, index: int, cfg):
        """The priced nodes of a lazy member if the envelope priced them already, else None."""
        return self.members.get(group_key(cfg), {}).get(index, [None, None])[1]

    def bound(self, index: int, cfg, make_problem, price, solve_lp, target: float, best: float):
        """The envelope LP's answer for the group of ``cfg`` (a float, ``INFEASIBLE``, or None
        when there is no envelope or it does not cover ``cfg``): ``make_problem(cfg, P)`` a
        member's bound problem over the floors, ``price(cfg)`` a lazy member's nodes,
        ``solve_lp(problem, cutoff)`` the LP; ``best`` the best plan's step (members whose node
        bound reaches it are pruned before their floors and left out)."""
        key = group_key(cfg)
        if key not in self.answers:
            group = self.members.get(key, {})
            left = sorted(i for i, m in group.items()
                          if i == index or (i not in self.visited and m[2] < best))
            answer = None
            if len(left) >= 2:
                problems = []
                for i in left:
                    member = group[i]
                    if member[1] is None:
                        member[1] = price(member[0])
                    problems.append(make_problem(member[0], member[1]))
                env = lower_envelope(problems)
                if env is not None:
                    answer = solve_lp(env, None if target == math.inf else target)
                    if answer == math.inf:
                        answer = INFEASIBLE
            self.answers[key] = (set(left), answer)
        covered, answer = self.answers[key]
        return answer if index in covered else None


__all__ = ["GROUPED_FLOOR_LP", "INFEASIBLE", "FloorGroups", "group_key", "lower_envelope"]
