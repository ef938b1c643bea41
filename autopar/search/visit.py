"""One configuration of the outer search (autopar/search/outer.py): the bounds in order
(``BOUNDS``: each a small function that prunes the configuration or passes it on), then its ILP,
whose plan becomes the incumbent (``SearchContext.best``) when it is the fastest so far.

A plan found elsewhere (``Incumbent``: the pipelined candidates, visited before a large ILP at
the driver's request, ``before_large``) stands in for the best plan: every bound prunes against
it, and before each ILP whose LP bound comes within ``MIP_CUT_WINDOW`` of it the branch and bound
over the bound problem is asked to prove no plan beats it (``solver.ilp.mip_reaches``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from autopar.pricing.edge_floor import edge_pairs, with_edge_floors
from autopar.pricing.price import edges_priced, price, price_edges
from autopar.pricing.saved_copies import copy_bytes, row_extra, with_copy_terms
from autopar.rules.candidates import Candidates
from autopar.search.build import bound_problem, build_problem, chosen, with_edges, work_problem
from autopar.search.configurations import Config
from autopar.search import floor_groups
from autopar.search.context import Incumbent, Result, SearchContext
from autopar.pricing.offload import NVME_MODES, host_budget, nvme_budget
from autopar.search.predict import host_bytes_of, predict, static_memory_lower_bound, step_time_lower_bound
from autopar.search.stage_memory_floor import exceeds_budget as stage_floor_exceeds_budget
from solver.errors import SolverTimeout
from solver.ilp import memory_floor_exceeds_budget, mip_reaches, relaxation_bound, solve
from solver.tree_bound import tree_lower_bound

# ZeRO-2's LP bound not solved where ZeRO-1's (at least as high) is below the target (``_lp_bound``;
# tests switch it off to check it changes no plan)
REUSE_ZERO1_LP = True
# Relative optimality gap at which each configuration's ILP stops: plans within 0.1% of the
# optimum of one configuration; the reported gap says what was reached.
MIP_GAP = 1e-3
# Prune with the LP relaxation (gradient communication free) before solving a configuration's ILP.
LP_BOUND = True
# Above this many (producer, consumer) strategy pairs to price (a mesh with two model axes: tens
# of thousands of shortest-path searches, seconds), an LP over the resharding floors is tried
# when the spanning-tree bound over them did not prune (the LP: about a second on such a mesh).
FLOOR_LP_PAIRS = 20_000
# An infeasible LP over the floors prunes the configuration as infeasible before its edges are
# priced (``_pruned_by_floors``; tests switch it off to check it changes no plan).
FLOOR_LP_INFEASIBLE = True
# In a pipelined candidate's inner search, a configuration no stage partition can fit (the proven
# floor of autopar/search/stage_memory_floor.py) is pruned before its edges are priced and its
# ILP solved (``_stage_memory``; tests switch it off to check it changes no plan).
STAGE_MEMORY_FLOOR = True
# Before solving a configuration whose LP bound is within this fraction of the plan to beat, the
# branch and bound over the same bound problem is asked whether its optimum reaches that plan
# (``solver.ilp.mip_reaches``): on large 2-axis meshes proving a cutoff costs a fraction of a
# solve. Further below, the proof is unlikely and would cost a solve.
MIP_CUT_WINDOW = 0.8
# An ILP on a mesh with two model axes that does not solve within this many seconds is "large":
# search's ``before_large`` is asked first (best bound first across pipeline degrees). Most ILPs
# (split by checkpoint decision: solver/decisions.py) solve in about a second; a lower limit
# sends a busy machine to pipelined candidates that the pp=1 plan would prune.
LARGE_ILP_SECONDS = 5.0


def visit(ctx: SearchContext, cfg, P, lower, cutoff=None, hook=None, group=None) -> None:
    """Prune or solve one configuration, updating ``ctx.best``: the bounds in ``BOUNDS`` order,
    then the ILP. ``group``: (``floor_groups.FloorGroups``, the configuration's queue index), whose
    envelope LP may prune it with its ZeRO / offload variants before its own floors' LP. (Warm-starting
    HiGHS from the last solved configuration on the same mesh was measured: no faster.)"""
    stats, opts = ctx.stats, ctx.options
    elapsed = ctx.elapsed()
    if opts.time_limit is not None and elapsed > opts.time_limit and ctx.best is not None:
        stats.pruned += 1
        return
    v = _Visit(ctx, cfg, P, lower, cutoff, hook,
               remaining=None if opts.time_limit is None else max(1.0, opts.time_limit - elapsed),
               cands=ctx.candidates(cfg.mesh), group=group)
    for bound in BOUNDS:
        if bound(v):
            return
    _solve(v)


@dataclass
class _Visit:
    """One configuration on its way through the bounds (``BOUNDS``) to the ILP."""
    ctx: SearchContext
    cfg: Config
    P: object
    lower: float
    cutoff: float | None
    hook: object
    remaining: float | None
    cands: Candidates
    edge_lower: float = -math.inf
    problem: object = None
    relaxed: object = None
    lp: float = -math.inf
    sol: object = None   # a solve's answer already (the large-ILP probe)
    group: object = None   # (FloorGroups, queue index) or None (``visit``)

    def beaten(self, bound: float) -> bool:
        """Pruned: ``bound`` reaches the best plan so far (never in an exhaustive search)."""
        best = self.ctx.best
        if self.ctx.options.exhaustive or best is None or bound < best.prediction["step_time"]:
            return False
        self.ctx.stats.pruned += 1
        return True

    def cut(self, bound) -> bool:
        """Is the configuration cut off by ``search``'s ``cutoff``? ``bound``: a work bound, or a
        function computing one (not computed without a cutoff: this runs per configuration)."""
        if self.cutoff is None or (bound() if callable(bound) else bound) < self.cutoff:
            return False
        self.ctx.stats.pruned += 1
        self.ctx.stats.cut_off += 1
        return True

    def work_target(self) -> float:
        """What a work bound (no gradient communication) must reach to prune: the best plan or the cutoff."""
        return min(self.ctx.best_time(), math.inf if self.cutoff is None else self.cutoff)

    def infeasible(self) -> bool:
        self.ctx.stats.infeasible += 1
        self.ctx.infeasible.append((self.problem, self.cands, self.P))
        return True


def _work_cutoff(v: _Visit) -> bool:
    return v.cut(lambda: step_time_lower_bound(v.P, work_only=True))


def _node_bound(v: _Visit) -> bool:
    """Every node at its cheapest strategy, resharding free."""
    return v.beaten(v.lower)


def _static_memory(v: _Visit) -> bool:
    need = host_bytes_of(v.P) if v.cfg.settings.offload != "none" else 0.0
    if need > host_budget(v.ctx.cluster):
        _host_exceeded(v.ctx.stats, need)   # the host cannot hold even the least any plan offloads
        return True
    if v.cfg.settings.offload in NVME_MODES and host_bytes_of(v.P, key="nvme") > nvme_budget(v.ctx.cluster):
        v.ctx.stats.infeasible += 1   # the drives cannot hold even the least state any plan puts there
        return True
    if static_memory_lower_bound(v.P) <= v.ctx.base.budget:
        return False
    v.ctx.stats.infeasible += 1
    v.ctx.memory_floors.append((v.cfg, v.P))
    return True


def _floors(v: _Visit) -> bool:
    """The resharding floors, only where the matrices are not priced yet: where they are, the
    bounds below use them, and a floor prunes nothing they do not."""
    ctx = v.ctx
    if ctx.options.exhaustive or (ctx.best is None and v.cutoff is None) or edges_priced(
            v.cands, ctx.cluster, v.cfg.settings):
        return False
    got = _pruned_by_floors(v.cfg, v.P, v.cands, ctx.cluster, ctx.best, v.remaining, v.cutoff, v.problem,
                            _group_bound(v))
    if got is INFEASIBLE:
        # the floors' LP has no solution: nor has the LP over the priced edges (the edges add
        # transportation columns any fractional choice satisfies: only the memory rows, the same
        # in both, decide feasibility), which the exact path would price the edges to find out
        return v.infeasible()
    if not got:
        return False
    ctx.stats.pruned += 1
    ctx.stats.pruned_unpriced += 1
    if ctx.best is None:   # no plan to beat: it was the cutoff that settled it
        ctx.stats.cut_off += 1
    return True


def _edge_bound(v: _Visit) -> bool:
    """The per-node bound with the resharding each node cannot avoid (the edges priced here)."""
    price_edges(v.cands, v.ctx.cluster, v.cfg.settings, v.P)
    v.problem = with_edges(v.problem, v.P)   # built before the edges were priced (_memory_floor)
    v.edge_lower = step_time_lower_bound(v.P, edges=True)
    return v.beaten(v.edge_lower) or v.cut(lambda: step_time_lower_bound(v.P, edges=True, work_only=True))


def _stage_memory(v: _Visit) -> bool:
    """A pipelined candidate's inner configuration (``SearchOptions.stage_memory``) whose every
    plan, under every stage partition ``plan_stages`` may choose, puts some rank over the budget
    (autopar/search/stage_memory_floor.py: each node at its smallest bytes, the schedule's alive
    micro-batches): its ILP would find a plan the partition then rejects. Only where the search's
    MemoryBudgetError states no smallest peak (``min_peak`` off: the first attempt, whose error
    only sends the candidate to its checkpointed retry), as the inner search's own smallest peak
    is no stage's."""
    opts = v.ctx.options
    spec = opts.stage_memory
    if spec is None or not STAGE_MEMORY_FLOOR or opts.exhaustive or opts.min_peak:
        return False
    if not stage_floor_exceeds_budget(spec, v.ctx.graph, v.cands, v.P, v.cfg.settings.checkpoint):
        return False
    v.ctx.stats.infeasible += 1
    v.ctx.stats.stage_floor_pruned += 1
    v.ctx.memory_floors.append((v.cfg, v.P))   # the search then ends in a MemoryBudgetError
    return True


def _memory_floor(v: _Visit) -> bool:
    """No choice fits (each node at its smallest bytes): HiGHS takes seconds to prove it. The
    memory rows do not depend on resharding, so this runs before the edges are priced (in a
    pipelined candidate's inner search, it prunes about two in five configurations that reach it)."""
    v.problem = build_problem(v.cands, v.P, v.cfg.settings)
    return memory_floor_exceeds_budget(v.problem) and v.infeasible()


def _tree_bound(v: _Visit) -> bool:
    """The spanning-tree bound of the LP relaxation's problem (gradient communication free):
    milliseconds where the LP takes tenths of a second."""
    if v.ctx.options.exhaustive or not LP_BOUND:
        return False
    v.relaxed = bound_problem(v.problem, v.P)
    tree = tree_lower_bound(v.relaxed) if v.work_target() < math.inf else -math.inf
    return v.beaten(tree) or v.cut(tree)


def _lp_bound(v: _Visit) -> bool:
    """The LP relaxation with gradient communication free: about a quarter of the ILP's time,
    often within a few % of the plan, and an infeasible LP means an infeasible ILP (which HiGHS
    is slow to prove). ZeRO-2's bound problem is ZeRO-1's (the same costs with gradient
    communication free: they differ only there, autopar/pricing/price.py) with less memory, so
    its LP is at most ZeRO-1's: when that is below the target, so is this one, and it is not
    solved."""
    ctx, cfg = v.ctx, v.cfg
    if v.relaxed is None:
        return False
    stats, work_target = ctx.stats, v.work_target()
    lp_key = (ctx.cluster, cfg.settings.num_micro_batches, cfg.settings.precision, ctx.base.budget,
              cfg.settings.offload)
    zero1_lp = ctx.caches.zero1_lp.setdefault((ctx.policy, cfg.mesh), {})
    try:   # only whether it reaches the target matters
        if REUSE_ZERO1_LP and cfg.settings.zero == 2 and zero1_lp.get(lp_key, math.inf) < work_target:
            lp = zero1_lp[lp_key]   # an upper bound of this LP: used below as an estimate only
            stats.lp_reused += 1
        else:
            lp = relaxation_bound(v.relaxed, time_limit=v.remaining,
                                  cutoff=None if work_target == math.inf else work_target)
            stats.lp_bounds += 1
            if cfg.settings.zero == 1 and lp < work_target:   # solved to the end: exact
                zero1_lp[lp_key] = lp
    except SolverTimeout:
        # the LP ran out of the time left (HiGHS raises when it stops with no solution):
        # keep the best plan so far; with none yet, let the ILP try this configuration
        if ctx.best is not None:
            stats.timed_out += 1   # configurations cut short
            stats.pruned += 1
            return True
        lp = -math.inf
    v.lp = lp
    if lp == math.inf:
        return v.infeasible()
    return v.beaten(lp) or v.cut(lp)


def _pipelined_first(v: _Visit) -> bool:
    """Best bound first across pipeline degrees (search's ``before_large``), for an ILP that is
    large: one that does not solve within LARGE_ILP_SECONDS (small models' 2-axis ILPs solve in
    tenths of a second, and their pipelined candidates are pruned by the pp=1 plan they would
    wait for). A probe that finishes is the solve (HiGHS is deterministic); one that does not is
    dropped, and the pipelined candidates' best plan becomes the incumbent."""
    ctx, best = v.ctx, v.ctx.best
    if v.relaxed is None or v.hook is None or best is None or isinstance(best, Incumbent) \
            or len(v.cfg.mesh.model_axes()) < 2 or v.remaining is not None:
        return False
    go = v.hook(best, v.lp)   # None: this ILP first whatever its size
    if go is None:
        return False
    try:
        v.sol = solve(v.problem, time_limit=LARGE_ILP_SECONDS, mip_gap=MIP_GAP)
        if v.sol.status == "feasible":
            v.sol = None   # stopped at the limit: not the solve's answer
    except SolverTimeout:   # no solution within the limit
        v.sol = None
    if v.sol is not None:
        return False
    ctx.stats.large_ilps += 1
    found = go()
    if found is not None and found < best.prediction["step_time"]:
        ctx.best = Incumbent(found)
        if v.lp >= found:
            ctx.stats.pruned += 1
            return True
    return False


def _mip_cut(v: _Visit) -> bool:
    """The branch and bound over the bound problem proves no plan of this configuration beats
    the target. Only against a plan found elsewhere (``Incumbent``), i.e. after a large ILP: a
    small ILP solves about as fast as the proof, and inside a pipelined candidate's inner search
    the memory budget is lifted and its ILPs solve in tenths of a second."""
    if v.relaxed is None or v.sol is not None or not isinstance(v.ctx.best, Incumbent):
        return False
    target = v.work_target()
    if v.lp >= MIP_CUT_WINDOW * target and mip_reaches(v.relaxed, target, time_limit=v.remaining):
        v.ctx.stats.pruned += 1
        v.ctx.stats.mip_pruned += 1
        return True
    return False


# The bounds a configuration meets before its ILP, in order (cheapest first); each prunes it
# (True) or passes it on. The work bounds (no gradient communication) answer search's cutoff.
BOUNDS = (_work_cutoff, _node_bound, _static_memory, _stage_memory, _memory_floor, _floors, _edge_bound, _tree_bound,
          _lp_bound, _pipelined_first, _mip_cut)


def _solve(v: _Visit) -> None:
    """The configuration's ILP; its plan becomes the incumbent if it is the fastest so far."""
    ctx, cfg, stats = v.ctx, v.cfg, v.ctx.stats
    try:
        sol = v.sol if v.sol is not None else solve(v.problem, time_limit=v.remaining, mip_gap=MIP_GAP)
    except SolverTimeout:
        # out of time before the solver found any plan of this configuration: keep the best one;
        # with none yet, the next configurations still get their second each, and search() says
        # so if all time out
        stats.timed_out += 1
        stats.pruned += 1
        return
    stats.solved += 1
    stats.solve_seconds += sol.solve_seconds
    if sol.status != "infeasible":
        sol = _with_saved_copies(v.problem, sol, v.cands, v.P, v.remaining, stats)
    if sol.status == "infeasible":
        v.infeasible()
        return
    pred = predict(v.cands, v.P, cfg.settings, v.problem, sol, ctx.cluster)
    if "offload" in pred and pred["offload"]["host_bytes"] > pred["offload"]["host_budget"]:
        _host_exceeded(stats, pred["offload"]["host_bytes"])   # its splits leave more on the host than its share
        return
    if "offload" in pred and pred["offload"].get("nvme_bytes", 0) > pred["offload"].get("nvme_budget", 0):
        stats.infeasible += 1   # more optimizer state than the rank's share of the NVMe drives
        return
    if ctx.options.log:
        ctx.options.log(f"{cfg.mesh.describe():>18}  zero={cfg.settings.zero} offload={cfg.settings.offload} "
                        f"micro={cfg.settings.num_micro_batches:<4} "
                        f"step={pred['step_time']:.4g}s (bounds {v.lower:.4g}, {v.edge_lower:.4g}) "
                        f"peak={pred['peak_memory'] / 2**30:.2f}GiB solved in {sol.solve_seconds:.2f}s")
    if ctx.best is None or pred["step_time"] < ctx.best.prediction["step_time"] - 1e-12:
        ctx.best = Result(cfg, v.cands, v.P, v.problem, sol, pred)
        stats.gap = sol.gap


def _host_exceeded(stats, need: float) -> None:
    """An offloaded configuration whose host bytes per rank exceed the node's share: infeasible,
    and the least such need kept for the error that says so (outer._raise_no_plan)."""
    stats.infeasible += 1
    stats.host_exceeded += 1
    stats.host_min_need = need if stats.host_min_need is None else min(stats.host_min_need, need)


def _exact_memory(problem, sol, cands, P) -> dict[str, float]:
    """Bytes per memory constraint of a solution with the copies its reshards save
    (autopar/pricing/saved_copies.py) added to the ILP's node terms."""
    add = row_extra(problem, sol, copy_bytes(cands, P, chosen(problem, sol)))
    return {k: v + add.get(k, 0.0) for k, v in sol.peak_memory.items()}


def _with_saved_copies(problem, sol, cands, P, remaining, stats):
    """The solution with the copies its reshards save (autopar/pricing/saved_copies.py) in its
    memory. When they push it over a budget, the ILP is solved again with those copies charged to
    their consumers for the producers' strategies it chose (``with_copy_terms``), up to three
    times; the first plan that fits is returned, else the configuration is infeasible (its exact
    peaks are kept for the MemoryBudgetError's smallest peak)."""
    seen: set = set()
    probe = problem
    for attempt in range(4):
        mem = _exact_memory(problem, sol, cands, P)
        if all(mem.get(m.name, 0.0) <= m.budget * (1 + 1e-9) for m in problem.memory):
            sol.peak_memory = mem
            return sol
        peak = max(mem.values(), default=0.0)
        stats.exact_min_peak = peak if stats.exact_min_peak is None else min(stats.exact_min_peak, peak)
        nxt = with_copy_terms(probe, cands, P, chosen(problem, sol), seen)
        if attempt == 3 or nxt is probe:
            break
        probe = nxt
        try:
            sol = solve(probe, time_limit=remaining, mip_gap=MIP_GAP)
        except SolverTimeout:
            break
        stats.solved += 1
        stats.saved_copy_resolves += 1
        if sol.status == "infeasible":
            return sol
    return dataclasses.replace(sol, status="infeasible")


INFEASIBLE = "infeasible"   # _pruned_by_floors' answer when the LP over the floors has no solution


def _group_bound(v: _Visit):
    """``group(target)``: the envelope LP's answer for the configuration's ZeRO / offload
    variants (autopar/search/floor_groups.py), solved once per group; None without a group."""
    if v.group is None or not floor_groups.GROUPED_FLOOR_LP:
        return None
    groups, index = v.group
    ctx = v.ctx

    def make_problem(cfg, P):
        cands = ctx.candidates(cfg.mesh)
        F = with_edge_floors(P, cands, ctx.cluster, cfg.settings)
        return bound_problem(build_problem(cands, F, cfg.settings), F)

    def solve_lp(problem, cutoff):
        try:
            return relaxation_bound(problem, time_limit=v.remaining, cutoff=cutoff)
        except SolverTimeout:
            return -math.inf

    def price_lazy(cfg):
        return price(ctx.candidates(cfg.mesh), ctx.cluster, cfg.settings, edges=False)

    return lambda target: groups.bound(index, v.cfg, make_problem, price_lazy, solve_lp, target, ctx.best_time())


def _pruned_by_floors(cfg, P, cands, cluster, best, remaining, cutoff=None, problem=None, group=None):
    """Whether the resharding floors (autopar/pricing/edge_floor.py: each matrix entry's fewest
    collectives at their latency, no shortest-path search) already bound this configuration
    above the best plan: first the per-node bound, then the spanning-tree bound over the floors
    (solver/tree_bound.py), then, where pricing the edges would be costly (``FLOOR_LP_PAIRS``),
    the LP relaxation over the floors. Either way no edge is priced. ``problem``: the
    configuration's ``build_problem`` already made (its edges are replaced by the floors).
    ``INFEASIBLE`` (with ``FLOOR_LP_INFEASIBLE``) when that LP has no solution: the configuration
    has no plan (Gemma 2's nm=1 and 2 on its three-axis meshes: their edges, 2-3 s each, were
    priced only for the LP over them to say so)."""
    F = with_edge_floors(P, cands, cluster, cfg.settings)
    target = math.inf if best is None else best.prediction["step_time"]
    if best is not None and step_time_lower_bound(F, edges=True) >= target:
        return True
    if cutoff is not None:   # the work bounds (no gradient communication) against search's cutoff too
        target = min(target, cutoff)
        if step_time_lower_bound(F, edges=True, work_only=True) >= target:
            return True
    if not LP_BOUND:
        return False
    # The spanning-tree bound over the floors (memory ignored, like the per-node bounds above): a
    # few ms on hf_llama's meshes, where pricing the edges takes 40-120 ms (it prunes its 1x4 and
    # 1x2x2 meshes and two of its pipelined inner configurations before their edges are priced);
    # the LP below only where pricing would cost seconds.
    if tree_lower_bound(work_problem(cands, F)) >= target:
        return True
    if edge_pairs(cands, cluster) < FLOOR_LP_PAIRS:
        return False
    if group is not None:   # the envelope of its ZeRO / offload variants (autopar/search/floor_groups.py)
        got = group(target)
        if got == floor_groups.INFEASIBLE and FLOOR_LP_INFEASIBLE:
            return INFEASIBLE
        if isinstance(got, float) and got >= target:
            return True
    problem = build_problem(cands, F, cfg.settings) if problem is None else with_edges(problem, F)
    if memory_floor_exceeds_budget(problem):
        return False   # the exact path reports it (and keeps the problem for the error message)
    relaxed = bound_problem(problem, F)
    try:
        lp = relaxation_bound(relaxed, time_limit=remaining, cutoff=target)
    except SolverTimeout:
        return False
    if lp == math.inf and FLOOR_LP_INFEASIBLE:
        return INFEASIBLE
    return lp != math.inf and lp >= target


__all__ = ["visit", "BOUNDS", "MIP_GAP", "LP_BOUND", "FLOOR_LP_PAIRS", "STAGE_MEMORY_FLOOR", "MIP_CUT_WINDOW",
           "LARGE_ILP_SECONDS"]
