"""A fast lower bound of a Problem's optimum by dynamic programming over a spanning tree.

The ILP's objective is node costs + edge costs + recompute time (>= 0); dropping the memory
rows and the checkpoint decisions leaves a pairwise min-sum problem whose optimum bounds the
ILP's from below. That problem is exact by dynamic programming when the edges form a forest.
A traced model's graph is not one (residual adds, q/k/v sharing one input), so:

- parallel edges between the same two nodes are summed (a reversed one transposed first) and
  self edges (a repeated block feeding its next repeat) add their diagonal to the node;
- a maximum spanning forest keeps the edges whose matrices vary most (max - min), where dropping
  them would lose the most;
- every other edge is relaxed onto both of its nodes (``_split``): a[s] = min_t M[s, t] added to
  the first node's costs and b[t] = min_s (M[s, t] - a[s]) >= 0 to the second's. For every pair
  a[s] + b[t] <= a[s] + (M[s, t] - a[s]) = M[s, t], so the sum stays below the true cost of every
  choice; and it is at least the one-sided relaxation ``a`` alone (b >= 0). (Relaxing onto the
  second node only, min_s M[s, t], was 1.4% short of pruning hf_llama's 1x2x2 mesh on its
  resharding floors, where this prunes it: 40x cheaper than the LP that did.)
- the forest is solved exactly, leaves first: a child's message to its parent is, per parent
  strategy, the least of (child's costs + its own children's messages + the edge).

Every choice of strategies costs at least the result, so it is a valid bound for pruning
(autopar/search/outer.py uses it before the LP relaxation, which takes about 100x longer on
thousands of strategies). It is at least the per-node bound with every edge relaxed onto its first
node (the row minima; the forest and the column minima of the rest only tighten it) and neither
above nor below the LP relaxation in general: the LP keeps every edge and
the memory rows, the forest solves its edges integrally.
"""
from __future__ import annotations

import networkx as nx
import numpy as np

from solver.problem import Problem


def _folded(problem: Problem):
    """Node cost vectors with self edges added, and {(u, v) with u < v: summed matrix [u, v]}."""
    costs = [np.asarray(c, dtype=float).copy() for c in problem.costs]
    pairs: dict[tuple[int, int], np.ndarray] = {}
    for e in problem.edges:
        m = np.asarray(e.cost, dtype=float)
        if e.src == e.dst:
            costs[e.src] += np.diag(m)
            continue
        u, v, m = (e.src, e.dst, m) if e.src < e.dst else (e.dst, e.src, m.T)
        pairs[u, v] = pairs[u, v] + m if (u, v) in pairs else m
    return costs, pairs


def _split(m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) with a[s] + b[t] <= m[s, t] for every pair (module doc): a the row minima, b the
    column minima of what is left."""
    a = m.min(axis=1)
    return a, (m - a[:, None]).min(axis=0)


def tree_lower_bound(problem: Problem) -> float:
    """A lower bound (seconds) of ``problem``'s optimum over every choice (module doc)."""
    costs, pairs = _folded(problem)
    g = nx.Graph()
    g.add_nodes_from(range(len(costs)))
    for (u, v), m in pairs.items():
        spread = float(m.max() - m.min()) if m.size else 0.0
        if spread > 0.0:
            g.add_edge(u, v, weight=spread)
        else:   # a constant matrix: its value whatever the choice
            costs[u] = costs[u] + (float(m.min()) if m.size else 0.0)
    tree = nx.maximum_spanning_tree(g)
    for (u, v), m in pairs.items():
        if g.has_edge(u, v) and not tree.has_edge(u, v):
            a, b = _split(m)   # relaxed onto both nodes (module doc)
            costs[u] = costs[u] + a
            costs[v] = costs[v] + b
    total = 0.0
    for comp in nx.connected_components(tree):
        root = min(comp)
        order = list(nx.dfs_preorder_nodes(tree, root))
        parent = {root: None}
        for n in order:
            for c in tree.neighbors(n):
                if c not in parent:
                    parent[c] = n
        belief = {n: costs[n] for n in comp}
        for n in reversed(order):   # children before parents
            p = parent[n]
            if p is None:
                continue
            m = pairs[p, n] if (p, n) in pairs else pairs[n, p].T   # [parent strategy, child strategy]
            belief[p] = belief[p] + (m + belief[n][None, :]).min(axis=1)
        total += float(belief[root].min())
    return total
