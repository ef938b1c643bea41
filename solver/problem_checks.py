"""Checking a sharding Problem and one decision of it in numpy (torch-free): ``validate`` (a
malformed Problem is a PlanError naming its first bad part), ``evaluate`` (a decision's objective
and bytes per memory constraint), ``fits`` and ``memory_floor_exceeds_budget`` (no choice can fit).
Shared by the ILP (solver/ilp.py), brute force and the per-decision split (solver/decisions.py).
"""
from __future__ import annotations

import math

import numpy as np

from solver.checkpoint_links import validate_links as _validate_links
from solver.errors import PlanError
from solver.problem import Problem

_MEM_RTOL = 1e-9       # relative slack allowed when checking a budget in numpy


def _input_error(message: str) -> Exception:
    return PlanError(message)


# ----------------------------------------------------------------------------- validation

def validate(problem: Problem) -> None:
    """Raise ``autopar.errors.PlanError`` naming the first malformed part of ``problem``."""
    n = problem.num_nodes
    if len(problem.node_names) != n:
        raise _input_error(f"Problem has {len(problem.node_names)} node_names but {n} cost arrays; "
                           "give one name per node")
    sizes = []
    for i, c in enumerate(problem.costs):
        a = np.asarray(c, dtype=float)
        if a.ndim != 1 or a.size == 0:
            raise _input_error(f"node {i} ({problem.node_names[i]!r}): costs must be a 1-D array with "
                               f"at least one strategy, got shape {a.shape}")
        if not np.all(np.isfinite(a)):
            raise _input_error(f"node {i} ({problem.node_names[i]!r}): costs contain NaN or inf")
        sizes.append(a.size)
    if problem.strategy_names is not None:
        for i, names in enumerate(problem.strategy_names):
            if i >= n or len(names) != sizes[i]:
                raise _input_error(f"strategy_names[{i}] does not match node {i}'s number of strategies")

    def check_node(where: str, node: int) -> None:
        if not isinstance(node, (int, np.integer)) or not 0 <= node < n:
            raise _input_error(f"{where}: node index {node!r} is not in [0, {n})")

    for k, e in enumerate(problem.edges):
        check_node(f"edge {k} src", e.src)
        check_node(f"edge {k} dst", e.dst)
        m = np.asarray(e.cost, dtype=float)
        want = (sizes[e.src], sizes[e.dst])
        if m.shape != want:
            raise _input_error(f"edge {k} ({problem.node_names[e.src]!r} -> {problem.node_names[e.dst]!r}): "
                               f"cost matrix has shape {m.shape}, expected {want} "
                               "(src strategies x dst strategies)")
        if not np.all(np.isfinite(m)):
            raise _input_error(f"edge {k}: cost matrix contains NaN or inf")

    def check_terms(where: str, terms) -> None:
        for node, arr in terms:
            check_node(where, node)
            a = np.asarray(arr, dtype=float)
            if a.shape != (sizes[node],):
                raise _input_error(f"{where}: array for node {node} has shape {a.shape}, "
                                   f"expected ({sizes[node]},) (one value per strategy)")
            if not np.all(np.isfinite(a)):
                raise _input_error(f"{where}: array for node {node} contains NaN or inf")

    g_count = len(problem.checkpoint_groups)
    for gi, g in enumerate(problem.checkpoint_groups):
        for part in ("saved", "kept", "recompute_memory", "recompute_time"):
            check_terms(f"checkpoint group {g.name!r} {part}", getattr(g, part))
    _validate_links(problem)
    seen = set()
    for m in problem.memory:
        if m.name in seen:
            raise _input_error(f"two memory constraints are named {m.name!r}; names key "
                               "Solution.peak_memory, make them unique")
        seen.add(m.name)
        if math.isnan(m.budget) or not math.isfinite(m.const):
            raise _input_error(f"memory constraint {m.name!r}: budget must not be NaN and const must be finite")
        check_terms(f"memory constraint {m.name!r}", m.terms)
        for gi in m.groups:
            if not isinstance(gi, (int, np.integer)) or not 0 <= gi < g_count:
                raise _input_error(f"memory constraint {m.name!r}: checkpoint group index {gi!r} "
                                   f"is not in [0, {g_count})")


# ----------------------------------------------------------------------------- evaluation

def _group_bytes(group, choice, checkpointed: bool) -> float:
    """Bytes the group holds through backward (kept when checkpointed, else saved)."""
    terms = group.kept if checkpointed else group.saved
    return float(sum(float(arr[choice[n]]) for n, arr in terms))


def _recompute_bytes(group, choice, checkpointed: bool) -> float:
    """Bytes one block of the group saves again while backward recomputes it."""
    if not checkpointed:
        return 0.0
    return float(sum(float(arr[choice[n]]) for n, arr in group.recompute_memory))


def evaluate(problem: Problem, choice, checkpoint) -> tuple[float, dict[str, float]]:
    """Objective (seconds) and bytes per memory constraint of one decision. Pure numpy.

    ``checkpoint`` is taken as given (a ``forced`` pin is not applied here).
    """
    if len(choice) != problem.num_nodes:
        raise _input_error(f"choice has {len(choice)} entries for {problem.num_nodes} nodes")
    if len(checkpoint) != len(problem.checkpoint_groups):
        raise _input_error(f"checkpoint has {len(checkpoint)} entries for "
                           f"{len(problem.checkpoint_groups)} checkpoint groups")
    obj = sum(float(c[s]) for c, s in zip(problem.costs, choice))
    # A self edge reads M[s, s] here automatically, since choice[src] == choice[dst].
    obj += sum(float(e.cost[choice[e.src], choice[e.dst]]) for e in problem.edges)
    for g, on in zip(problem.checkpoint_groups, checkpoint):
        if on:
            obj += sum(float(arr[choice[n]]) for n, arr in g.recompute_time)
    mem = {}
    for m in problem.memory:
        total = m.const + sum(float(arr[choice[n]]) for n, arr in m.terms)
        total += sum(_group_bytes(problem.checkpoint_groups[gi], choice, bool(checkpoint[gi]))
                     for gi in m.groups)
        # one block is recomputed at a time: the largest working set, not the sum
        total += max([_recompute_bytes(problem.checkpoint_groups[gi], choice, bool(checkpoint[gi]))
                      for gi in m.groups] + [0.0])
        mem[m.name] = float(total)
    return float(obj), mem


def fits(problem: Problem, memory_bytes: dict[str, float]) -> bool:
    """True when every memory constraint's bytes are within its budget (relative 1e-9 slack)."""
    return all(memory_bytes[m.name] <= m.budget + _MEM_RTOL * max(1.0, abs(m.budget))
               for m in problem.memory)


def _sum_terms(terms, sizes) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    for n, arr in terms:
        out.setdefault(n, np.zeros(sizes[n]))
        out[n] = out[n] + np.asarray(arr, dtype=float)
    return out


def memory_floor_parts(problem: Problem) -> list[tuple[int, float, list[tuple[int, float, float]]]]:
    """What ``memory_floor_exceeds_budget`` sums, per memory constraint with a finite budget:
    (its index, its constant plus each node's smallest bytes, per listed checkpoint group (index,
    smallest saved bytes, smallest kept bytes)). None of it depends on the groups' ``forced``
    pins, so the pinned decisions of one problem (solver/decisions.py ``each_pinned``) share it;
    a group's two floors are computed once however many constraints list it."""
    sizes = [len(c) for c in problem.costs]

    def floor(terms) -> float:
        return float(sum(float(arr.min()) for arr in _sum_terms(terms, sizes).values() if len(arr)))

    groups: dict[int, tuple[float, float]] = {}
    parts = []
    for mi, m in enumerate(problem.memory):
        if not math.isfinite(m.budget):
            continue
        per_group = []
        for gi in m.groups:
            if gi not in groups:
                g = problem.checkpoint_groups[gi]
                groups[gi] = (floor(g.saved), floor(g.kept))
            per_group.append((gi, *groups[gi]))
        parts.append((mi, m.const + floor(m.terms), per_group))
    return parts


def floor_exceeds_budget(parts, problem: Problem) -> bool:
    """``memory_floor_exceeds_budget`` from ``memory_floor_parts`` (of ``problem`` or of a problem
    that differs from it in the groups' ``forced`` pins only), under ``problem``'s pins."""
    for mi, total, per_group in parts:
        m = problem.memory[mi]
        for gi, saved, kept in per_group:
            forced = problem.checkpoint_groups[gi].forced
            total += saved if forced is False else kept if forced else min(saved, kept)
        if total > m.budget + _MEM_RTOL * max(1.0, abs(m.budget)):
            return True
    return False


def memory_floor_exceeds_budget(problem: Problem) -> bool:
    """True when some memory constraint cannot hold whatever the choice: its constant plus each
    node's smallest bytes plus, per checkpoint group, the smaller of its smallest saved and
    kept bytes (recompute working sets taken as 0) is over budget. Pure numpy, a quick
    infeasibility test before the solver spends seconds proving it."""
    return floor_exceeds_budget(memory_floor_parts(problem), problem)
