"""Assembling the torch-free ``Problem`` the solver takes (step 3, after autopar/rules/candidates.py
and autopar/pricing/price.py): objective terms, edges, liveness memory constraints and checkpoint
groups; ``restrict`` drops strategies invalid for the micro-batch count and ``chosen`` maps a
Solution back to candidate indices. Units: seconds and bytes only.
"""
from __future__ import annotations

import copy

import numpy as np

from autopar.errors import ConstraintError
from autopar.pricing.price import Priced, Settings, device_static
from autopar.pricing.selective_pricing import selective_groups
from autopar.rules import tensor_inputs
from autopar.rules.candidates import Candidates
from solver.problem import CheckpointGroup, Edge, MemoryConstraint, Problem


def build_problem(c: Candidates, P: Priced, s: Settings, liveness_points: int = 8) -> Problem:
    """Assemble the ILP: objective terms, edges, liveness memory constraints, checkpoint groups."""
    reps = c.reps
    index = {n: i for i, n in enumerate(reps)}
    costs = []
    for n in reps:
        info = c.nodes[n]
        S = len(info.strategies)
        costs.append(P.compute.get(n, np.zeros(S)) + P.comm.get(n, np.zeros(S)) + P.optimizer.get(n, np.zeros(S)))
    edges = _edges(index, P, None)
    static_terms = []
    for n, st in P.static.items():
        static_terms.append((index[n], device_static(st)))
    # Activation terms: block nodes go to their checkpoint group, the rest are always saved.
    groups: dict[int, CheckpointGroup] = {}
    plain_saved = []
    memo = c.memo.block_inputs   # depends on the graph and storage roots only: once per candidates
    block_inputs = {g: memo[g] if g in memo else memo.setdefault(g, _block_input_roots(c, g))
                    for g in range(len(c.graph.blocks))}
    for n in reps:
        if c.nodes[n].kind != "op" or not P.saved[n].any():
            continue
        g = c.block_of_rep.get(n)
        if g is None or c.nodes[n].repeats < 2:
            plain_saved.append((index[n], P.saved[n]))
            continue
        grp = groups.setdefault(g, CheckpointGroup(name=c.graph.blocks[g].name))
        k = c.nodes[n].repeats
        grp.saved.append((index[n], P.saved[n]))
        # Recomputing one block saves what it saved in forward, except the block's inputs: the
        # region keeps those anyway (they are its ``kept`` bytes), so the same storages are saved
        # again, not new ones (runtime/checkpoint.py; tests/execution/test_checkpointing.py measures it).
        again = P.saved[n] - sum((arr for root, arr in P.saved_by_root.get(n, {}).items()
                                  if root in block_inputs[g]), np.zeros_like(P.saved[n]))
        grp.recompute_memory.append((index[n], again / k))
        # forward compute plus the node's in-op forward collectives; the reshard edges the block
        # reruns depend on two nodes' choices and are added by predict.py for the chosen plan only
        grp.recompute_time.append((index[n], P.fwd_compute[n] + P.fwd_comm.get(n, 0.0)))
    for g, grp in groups.items():
        # What a checkpointed block keeps: its input, the residual stream — priced as the output of
        # the group's last node, one per repeat.
        last = c.graph.blocks[g].instances[0][-1]
        if last in index:
            grp.kept.append((index[last], P.transient[last] * c.nodes[last].repeats))
        if s.checkpoint == "full":
            grp.forced = True
        elif s.checkpoint == "none":
            grp.forced = False
        elif isinstance(s.checkpoint, tuple):
            grp.forced = dict(s.checkpoint).get(grp.name)
    if isinstance(s.checkpoint, tuple):
        unknown = sorted(set(dict(s.checkpoint)) - {g.name for g in groups.values()})
        if unknown:
            raise ConstraintError(f"constraint checkpoint names block groups {unknown} the model does not have "
                                  f"(its repeated block groups: {sorted(g.name for g in groups.values())})")
    cgroups = [groups[g] for g in sorted(groups)]
    cgroups += selective_groups(c, P, s, groups, cgroups, index)   # autopar/pricing/selective_pricing.py
    memory = []
    base_terms = static_terms + plain_saved
    gidx = list(range(len(cgroups)))
    # Liveness: the end of forward (every saved activation alive) plus the working set of the op
    # running then; checking the biggest few ops' working sets bounds the peak of both passes.
    ops = [n for n in reps if c.nodes[n].kind == "op"]
    ops.sort(key=lambda n: (-float(P.transient[n].max()) if len(P.transient[n]) else 0.0, n))
    for n in ops[:liveness_points] or [None]:
        terms = list(base_terms)
        if n is not None:
            terms.append((index[n], 2 * P.transient[n]))
        memory.append(MemoryConstraint(name=f"backward@{n}" if n else "end-of-forward", budget=s.budget,
                                       terms=terms, groups=gidx))
    names = [[st.name for st in c.nodes[n].strategies] for n in reps]
    problem = Problem(node_names=list(reps), costs=costs, edges=edges, memory=memory,
                      checkpoint_groups=cgroups, strategy_names=names)
    keep = [np.flatnonzero(P.valid[n]) if n in P.valid and P.valid[n].size else np.arange(len(costs[i]))
            for i, n in enumerate(reps)]
    return restrict(problem, keep)


def _block_input_roots(c: Candidates, g: int) -> set[str]:
    """Storage roots of the activations the first instance of block group ``g`` reads from
    outside itself (parameters and buffers excluded): what a checkpoint region keeps."""
    inst = c.graph.blocks[g].instances[0]
    inside = set(inst)
    nodes = c.memo.nodes_by_name(c.graph)
    roots = set()
    for name in inst:
        for p in tensor_inputs(nodes[name]):
            if p.name in inside or p.name in c.graph.param_fqn:
                continue
            roots.add(c.storage_root.get(p.name, p.name))
    return roots


def restrict(problem: Problem, keep: list[np.ndarray]) -> Problem:
    """The same problem over a subset of each node's strategies (those valid for the micro-batch
    count); ``problem.kept[i]`` maps the solver's index back to the candidate strategy."""
    if all(len(k) == len(c) for k, c in zip(keep, problem.costs)):
        problem.kept = [np.arange(len(c)) for c in problem.costs]
        return problem
    sub = lambda terms: [(n, arr[keep[n]]) for n, arr in terms]  # noqa: E731
    out = Problem(
        node_names=problem.node_names,
        costs=[c[k] for c, k in zip(problem.costs, keep)],
        edges=[Edge(e.src, e.dst, e.cost[np.ix_(keep[e.src], keep[e.dst])]) for e in problem.edges],
        memory=[MemoryConstraint(m.name, m.budget, m.const, sub(m.terms), list(m.groups)) for m in problem.memory],
        checkpoint_groups=[CheckpointGroup(g.name, sub(g.saved), sub(g.kept), sub(g.recompute_memory),
                                           sub(g.recompute_time), g.forced, g.implied_by)
                           for g in problem.checkpoint_groups],
        strategy_names=[[names[j] for j in k] for names, k in zip(problem.strategy_names, keep)],
    )
    out.kept = keep
    return out


def bound_problem(problem: Problem, P: Priced) -> Problem:
    """``problem`` with each node's cost lowered to what predict.py's step time charges at least:
    compute + in-op communication + optimizer step, gradient communication free (it may hide
    behind backward). Any lower bound of this problem's optimum (its LP relaxation) bounds the
    predicted step time of every plan of the configuration (autopar/search/outer.py prunes with it)."""
    out = copy.copy(problem)
    kept = problem.kept if problem.kept is not None else [np.arange(len(c)) for c in problem.costs]
    out.costs = []
    for n, k, old in zip(problem.node_names, kept, problem.costs):
        if n in P.compute:
            out.costs.append((P.compute[n] + P.comm[n] - P.grad_comm[n] + P.optimizer[n])[k])
        else:
            out.costs.append(np.zeros(len(old)))
    return out


def work_problem(c: Candidates, P: Priced) -> Problem:
    """``bound_problem(build_problem(c, P, s), P)`` without its memory rows and checkpoint groups:
    the same nodes, strategies (those valid for the micro-batch count), costs and edges, built
    without the liveness terms. What solver/tree_bound.py reads (it drops memory and checkpoint
    decisions: recompute time is >= 0), at a fraction of build_problem's cost; the outer search
    bounds configurations with it before pricing their edges (autopar/search/outer.py)."""
    reps = c.reps
    index = {n: i for i, n in enumerate(reps)}
    keep, costs = [], []
    for n in reps:
        S = len(c.nodes[n].strategies)
        k = np.flatnonzero(P.valid[n]) if n in P.valid and P.valid[n].size else np.arange(S)
        keep.append(k)
        costs.append((P.compute[n] + P.comm[n] - P.grad_comm[n] + P.optimizer[n])[k] if n in P.compute
                     else np.zeros(len(k)))
    return Problem(node_names=list(reps), costs=costs, edges=_edges(index, P, keep))


def with_edges(problem: Problem, P: Priced) -> Problem:
    """``problem`` (a ``build_problem``) with the resharding edges of ``P`` as they are now: the
    search builds the problem for its memory floor before the edges are priced
    (autopar/search/visit.py), then gives it the edges once they are."""
    index = {n: i for i, n in enumerate(problem.node_names)}
    out = copy.copy(problem)
    out.edges = _edges(index, P, problem.kept)
    return out


def _edges(index: dict, P: Priced, keep) -> list[Edge]:
    """The edges of ``P.edges`` between nodes of ``index``, over the strategies ``keep`` (None: all)."""
    edges = []
    for (u, v), m in sorted(P.edges.items()):
        if u in index and v in index:
            edges.append(Edge(index[u], index[v], m if keep is None else m[np.ix_(keep[index[u]], keep[index[v]])]))
    return edges


def chosen(problem: Problem, solution) -> dict[str, int]:
    """Node name -> index of the chosen candidate strategy (undoing ``restrict``)."""
    kept = getattr(problem, "kept", None)
    return {n: int(kept[i][solution.choice[i]]) if kept is not None else solution.choice[i]
            for i, n in enumerate(problem.node_names)}
