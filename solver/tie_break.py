"""Among plans of equal time, the one that uses less memory: a pass over a solved choice.

The ILP minimises time; memory is only a constraint, so between two choices of the same time the
solver returns either. A frozen weight is the case a user sees: kept whole on every
tensor-parallel rank (each rank slices what its GEMM needs, for free) or stored split, it costs
the same time, and the whole copy holds memory for nothing.

``prefer_less_memory`` visits the nodes once, in order, and moves a node to another strategy when
that costs no more time (its own cost plus its edges to the neighbours' chosen strategies) and no
more bytes in any memory constraint, and fewer in one. Each move keeps the objective (or lowers
it) and every constraint's bytes (or lowers them), so a feasible optimal choice stays feasible and
optimal. Nodes in checkpoint groups are left alone: their bytes depend on the group's decision.
"""
from __future__ import annotations

import numpy as np

from solver.problem import Problem


def prefer_less_memory(problem: Problem, choice: list[int]) -> list[int]:
    """``choice`` with ties moved to strategies that use less memory (module doc)."""
    n = problem.num_nodes
    touching: list[list] = [[] for _ in range(n)]
    for e in problem.edges:
        touching[e.src].append(e)
        if e.dst != e.src:
            touching[e.dst].append(e)
    rows: list[dict[int, list]] = [{} for _ in range(n)]   # node -> memory row -> its byte arrays
    for r, m in enumerate(problem.memory):
        for i, arr in m.terms:
            rows[i].setdefault(r, []).append(arr)
    grouped = {i for g in problem.checkpoint_groups
               for terms in (g.saved, g.kept, g.recompute_memory, g.recompute_time) for i, _ in terms}
    out = list(choice)
    for i in range(n):
        if i in grouped or not rows[i] or len(problem.costs[i]) < 2:
            continue
        # bytes per memory row (rows x strategies), summed over the node's terms in each row
        per_row = np.stack([np.sum(arrs, axis=0, dtype=np.float64) for arrs in rows[i].values()])
        for k in np.flatnonzero((per_row <= per_row[:, [out[i]]]).all(axis=0)):
            j = out[i]   # the node's strategy now (an earlier k may have been taken)
            d = per_row[:, k] - per_row[:, j]
            if (d <= 0).all() and (d < 0).any() and _time_delta(problem, touching[i], out, i, j, int(k)) <= 0:
                out[i] = int(k)
    return out


def _time_delta(problem: Problem, edges, choice, i: int, j: int, k: int) -> float:
    """Seconds the objective changes when node ``i`` moves from strategy ``j`` to ``k``."""
    dt = float(problem.costs[i][k]) - float(problem.costs[i][j])
    for e in edges:
        if e.src == e.dst:   # a repeated block feeding its next repeat: the diagonal
            dt += float(e.cost[k, k]) - float(e.cost[j, j])
        elif e.src == i:
            dt += float(e.cost[k, choice[e.dst]]) - float(e.cost[j, choice[e.dst]])
        else:
            dt += float(e.cost[choice[e.src], k]) - float(e.cost[choice[e.src], j])
    return dt


__all__ = ["prefer_less_memory"]
