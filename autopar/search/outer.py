"""The outer search: mesh shapes × ZeRO stage × micro-batch count, each priced by one ILP.

For every logical mesh of the cluster (dp × tp[, tp2]) the candidate strategies are enumerated
once (``candidates.candidates``); then each (ZeRO stage, number of micro-batches) prices them
(``pricing.price``), builds the Problem and solves it. A configuration whose lower bound (every
node at its cheapest strategy, resharding free) cannot beat the best plan so far is pruned
without calling the solver: the bounds are ``BOUNDS``, in order, each a small function of one
configuration (``_Visit``) that prunes it or passes it on; the search's state (incumbent,
deadline, caches, counters) is a ``context.SearchContext``. ``constraints`` pin any of the
degrees and the search completes the rest.

A plan found elsewhere (``Incumbent``: the pipelined candidates, visited before a large ILP at
autopar/search/pipeline_search.py's request, ``before_large``) stands in for the best plan: every
bound prunes against it, and before each ILP whose LP bound comes within ``MIP_CUT_WINDOW`` of it
the branch and bound over the bound problem is asked to prove no plan beats it
(``solver.ilp.mip_reaches``).
"""
from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass

from autopar.rules import sequence
from autopar.frontend.batching import global_batch
from autopar.search.configurations import Config, allowed_meshes, check_constraints, configurations, micro_batch_error
from autopar.search.build import bound_problem, build_problem, chosen, work_problem
from autopar.search.context import PlanCaches, SearchContext, SearchOptions, SearchStats
from autopar.search.grid_bound import grid_compute_floor
from autopar.rules.candidates import Candidates
from codegen.grid_layout import GRID_MODES
from autopar.pricing.edge_floor import edge_pairs, with_edge_floors
from autopar.pricing.price import Settings, edges_priced, price, price_edges
from autopar.pricing.saved_copies import copy_bytes, row_extra, with_copy_terms
from autopar.cluster import Cluster
from autopar.errors import ConstraintError, MemoryBudgetError
from autopar.search.predict import checkpoint_mode, predict, static_memory_lower_bound, step_time_lower_bound
from autopar.frontend.trace import TracedGraph
from solver.errors import SolverTimeout
from solver.ilp import memory_floor_exceeds_budget, min_peak_solution, mip_reaches, relaxation_bound, solve
from solver.tree_bound import tree_lower_bound

# ZeRO-2's LP bound not solved where ZeRO-1's (at least as high) is below the target (_visit;
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


@dataclass
class Incumbent:
    """A plan found outside this search (a pipelined one: autopar/search/pipeline_search.py),
    standing in for the best plan so far: every bound prunes against its step time, and a search
    that ends with it found nothing faster (``CutOff``)."""
    step_time: float

    @property
    def prediction(self) -> dict:
        return {"step_time": self.step_time}


@dataclass
class Result:
    config: Config
    cands: Candidates
    priced: object
    problem: object
    solution: object
    prediction: dict


class Progress:
    """A progress line for long searches: configurations visited / pruned / best so far. A rich
    live line on stderr when it is a terminal; with ``log`` (verbose) also one logged line per
    configuration."""

    def __init__(self, total: int, log=None, live: bool | None = None, label: str = "planning"):
        self.total, self.log, self.live = total, log, None
        if live is None:
            live = sys.stderr.isatty()
        if live:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            self.live = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                 console=Console(stderr=True), transient=True)
            self.task = self.live.add_task("configurations", total=total, info="")
            self.live.start()

    def update(self, stats: SearchStats, best) -> None:
        done = stats.configs
        info = (f"configurations visited {done}/{self.total}, pruned {stats.pruned}, solved {stats.solved}, "
                f"best {best.prediction['step_time']:.4g} s" if best is not None else "best none yet")
        self.show(done, info, info.split(", ", 1)[-1])

    def show(self, done: int, info: str, short: str | None = None, tag: str = "search") -> None:
        """``done`` of the total, ``info`` in the log line, ``short`` (default ``info``) on the live line."""
        if self.live is not None:
            self.live.update(self.task, completed=done, info=info if short is None else short)
        if self.log:
            self.log(f"[{tag}] {info}")

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


def search(graph: TracedGraph, cluster: Cluster, base: Settings, constraints: dict | None = None,
           caches: PlanCaches | None = None, **options) -> tuple[Result, dict]:
    """The best configuration and search statistics (``search_configurations``, ``conclude``; the
    grid modes are not searched here: autopar/search/pipeline_search.py ``search_with_grid``)."""
    return conclude(search_configurations(graph, cluster, base, constraints, caches, **options))


def search_configurations(graph: TracedGraph, cluster: Cluster, base: Settings, constraints: dict | None = None,
                          caches: PlanCaches | None = None, **options) -> SearchContext:
    """Every configuration priced, then pruned or solved, best bound first; the search's state
    (its best plan in ``best``) is returned for ``conclude``. ``options``: ``SearchOptions``'s fields
    (autopar/search/context.py); ``caches``: what the searches of one ``autopar.plan`` call share
    (pp=1, every pipelined candidate's inner search on a stage's sub-mesh, the reruns with a
    sequence axis; default: this search's own).

    ``before_large(best, lp)``: asked before an ILP on a mesh with two model axes that its bounds
    did not prune, with the best plan so far and that configuration's LP bound; it answers None
    (solve it) or a function ``go(compute_floor)``, called (once) when that ILP does not solve
    within ``LARGE_ILP_SECONDS``, with a lower bound of the compute time of any plan this search
    can still return. ``go`` may return the step time of a plan found elsewhere (the pipelined
    candidates: autopar/search/pipeline_search.py), which every bound prunes against from then on
    (``Incumbent``); ``CutOff`` is raised if nothing beats it."""
    opts = SearchOptions(**options)
    if opts.exhaustive:
        opts = dataclasses.replace(opts, time_limit=None)
    constraints = check_constraints(constraints)
    if constraints.get("pp", 1) > 1:
        raise ConstraintError("pipelined plans (pp > 1) are made by autopar.plan (autopar/search/pipeline.py), not search()")
    ctx = SearchContext(graph, cluster, base, constraints, opts, caches if caches is not None else PlanCaches(),
                        policy=sequence.policy_for(opts.policy, constraints))
    stats = ctx.stats
    configs = list(configurations(graph, cluster, base, constraints, opts.max_zero))
    if not configs and constraints.get("tp_mode") not in GRID_MODES:
        batch = global_batch(graph)
        dps = [m.degree("dp") for m in allowed_meshes(cluster, constraints) if batch % m.degree("dp") == 0]
        raise ConstraintError(micro_batch_error(batch, dps, constraints)
                              or _no_config_message(graph, cluster, constraints))
    # Price the nodes of every configuration (cheap: ops once per mesh and micro-batch count,
    # parameters per ZeRO stage), then visit them best bound first so that the bound prunes as
    # much as possible.
    queue = []
    for i, cfg in enumerate(configs):
        P = price(ctx.candidates(cfg.mesh), cluster, cfg.settings, edges=False)
        queue.append((step_time_lower_bound(P), i, cfg, P))
    # Best bound first, but meshes with one model axis or none before the rest: their ILPs are
    # small (a few hundred strategies against thousands on two model axes), so they give an
    # incumbent in a fraction of a second, and it prunes the large ones by their bounds. Only
    # the order changes: every configuration is still pruned by a bound or solved.
    queue.sort(key=lambda q: (min(len(q[2].mesh.model_axes()), 2), q[0], q[1]))
    pos, asked = 0, []

    def ask(best, lp):
        """``before_large``'s answer, its run given the compute floor of what is left: the
        configurations not visited yet (each node at its cheapest compute) and the grid modes."""
        go = opts.before_large(best, lp)
        if go is None:
            return None

        def run():
            asked.append(lp)   # once
            floor = min([compute_floor(ctx.candidates(c.mesh), P) for _, _, c, P in queue[pos:]]
                        + [grid_compute_floor(graph, cluster, base, constraints, ctx.caches.grid_bounds)])
            return go(min(floor, best.prediction["time_breakdown"]["compute"]))
        return run
    bar = Progress(len(queue), opts.log, opts.progress)
    try:
        for pos, (lower, _, cfg, P) in enumerate(queue):
            stats.configs += 1
            hook = ask if opts.before_large is not None and not opts.exhaustive and not asked else None
            cut_at = None if opts.exhaustive or opts.cutoff is None else \
                (opts.cutoff + opts.cutoff_bubble * optimizer_ceiling(P)) / (1 + opts.cutoff_bubble)
            _visit(ctx, cfg, P, lower, cut_at, hook)
            bar.update(stats, ctx.best)
    finally:
        bar.close()
    return ctx


def conclude(ctx: SearchContext, alternative=None) -> tuple[Result, dict]:
    """The search's plan and statistics: ``alternative`` (a plan another pass found faster than
    ``ctx.best``: a grid mode's) or ``ctx.best``; or why there is none."""
    stats = ctx.stats
    best = alternative if alternative is not None else ctx.best
    stats.seconds = ctx.elapsed()
    if isinstance(best, Incumbent):
        raise CutOff(f"no configuration beats the plan found elsewhere ({best.step_time:.4g} s)")
    if best is None and stats.cut_off:
        raise CutOff(f"{stats.cut_off} of {stats.configs} configurations cut off at {ctx.options.cutoff:.4g} s, "
                     f"the rest found no plan")
    if best is None:
        _raise_no_plan(ctx)
    return best, stats.as_dict()


def _raise_no_plan(ctx: SearchContext):
    """Why the search found no plan: out of time, out of memory (with the smallest peak any plan
    reaches), or no configuration the pins allow."""
    stats, cluster, base = ctx.stats, ctx.cluster, ctx.base
    if stats.timed_out:
        raise SolverTimeout(f"no plan found within time_limit={ctx.options.time_limit} s: the solver ran out of time on "
                            f"{stats.timed_out} of {stats.configs} configurations before finding any plan; "
                            f"raise time_limit or pin more of the degrees (constraints=)")
    grid_floor = stats.grid_min_peak    # grid configurations that lowered but did not fit
    if ctx.infeasible or ctx.memory_floors or grid_floor is not None:
        # the true smallest peak (not a bound): solve each configuration for its minimum peak
        for cfg, P in ctx.memory_floors:
            cands = ctx.candidates(cfg.mesh)
            price_edges(cands, cluster, cfg.settings, P)
            ctx.infeasible.append((build_problem(cands, P, cfg.settings), cands, P))
        floor = min([_min_peak(*x) for x in ctx.infeasible] + ([grid_floor] if grid_floor is not None else [])
                    + [stats.exact_min_peak if stats.exact_min_peak is not None else math.inf])
        raise MemoryBudgetError(
            f"no plan fits in the memory budget of {format_bytes(base.budget)} per device: the smallest "
            f"peak memory any plan reaches is {format_bytes(floor)}. Raise memory_budget to at least "
            f"that, add devices, use a smaller batch, or relax constraints.",
            min_peak_bytes=int(math.ceil(floor)), budget_bytes=int(base.budget))   # a budget that fits: up
    raise ConstraintError(_no_config_message(ctx.graph, cluster, ctx.constraints))


def optimizer_ceiling(P) -> float:
    """Optimizer seconds no plan of a priced configuration exceeds: each parameter at its largest."""
    return float(sum(float(a.max()) for a in P.optimizer.values() if len(a)))


def compute_floor(cands, P) -> float:
    """Compute seconds no plan of a priced configuration goes below: each node at its cheapest."""
    return float(sum(float(P.compute[n].min()) for n in cands.reps if n in P.compute and len(P.compute[n])))


def _visit(ctx: SearchContext, cfg, P, lower, cutoff=None, hook=None) -> None:
    """Prune or solve one configuration, updating ``ctx.best``: the bounds in ``BOUNDS`` order,
    then the ILP. (Warm-starting HiGHS from the last solved configuration on the same mesh was
    measured: no faster.)"""
    stats, opts = ctx.stats, ctx.options
    elapsed = ctx.elapsed()
    if opts.time_limit is not None and elapsed > opts.time_limit and ctx.best is not None:
        stats.pruned += 1
        return
    v = _Visit(ctx, cfg, P, lower, cutoff, hook,
               remaining=None if opts.time_limit is None else max(1.0, opts.time_limit - elapsed),
               cands=ctx.candidates(cfg.mesh))
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
            v.cands, ctx.cluster, v.cfg.settings) or not _pruned_by_floors(
                v.cfg, v.P, v.cands, ctx.cluster, ctx.best, v.remaining, v.cutoff):
        return False
    ctx.stats.pruned += 1
    ctx.stats.pruned_unpriced += 1
    if ctx.best is None:   # no plan to beat: it was the cutoff that settled it
        ctx.stats.cut_off += 1
    return True


def _edge_bound(v: _Visit) -> bool:
    """The per-node bound with the resharding each node cannot avoid (the edges priced here)."""
    price_edges(v.cands, v.ctx.cluster, v.cfg.settings, v.P)
    v.edge_lower = step_time_lower_bound(v.P, edges=True)
    return v.beaten(v.edge_lower) or v.cut(lambda: step_time_lower_bound(v.P, edges=True, work_only=True))


def _memory_floor(v: _Visit) -> bool:
    """No choice fits (each node at its smallest bytes): HiGHS takes seconds to prove it."""
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
    lp_key = (ctx.cluster, cfg.settings.num_micro_batches, cfg.settings.precision, ctx.base.budget)
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
BOUNDS = (_work_cutoff, _node_bound, _static_memory, _floors, _edge_bound, _memory_floor, _tree_bound, _lp_bound,
          _pipelined_first, _mip_cut)


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
    if ctx.options.log:
        ctx.options.log(f"{cfg.mesh.describe():>18}  zero={cfg.settings.zero} micro={cfg.settings.num_micro_batches:<4} "
                        f"step={pred['step_time']:.4g}s (bounds {v.lower:.4g}, {v.edge_lower:.4g}) "
                        f"peak={pred['peak_memory'] / 2**30:.2f}GiB solved in {sol.solve_seconds:.2f}s")
    if ctx.best is None or pred["step_time"] < ctx.best.prediction["step_time"] - 1e-12:
        ctx.best = Result(cfg, v.cands, v.P, v.problem, sol, pred)
        stats.gap = sol.gap


def _exact_memory(problem, sol, cands, P) -> dict[str, float]:
    """Bytes per memory constraint of a solution with the copies its reshards save
    (autopar/pricing/saved_copies.py) added to the ILP's node terms."""
    add = row_extra(problem, sol, copy_bytes(cands, P, chosen(problem, sol)))
    return {k: v + add.get(k, 0.0) for k, v in sol.peak_memory.items()}


def _min_peak(problem, cands, P) -> float:
    """The smallest peak memory of a configuration in the ILP's node terms (the min-peak ILP).
    Not raised by the copies reshards save (autopar/pricing/saved_copies.py): the min-peak plan
    is free to reshard anywhere, so its copies overstate what a plan needs (a Llama-7B shape at 1M
    tokens on 64 A100s: 338 GiB against 82.4 GiB of a real plan, whose node terms say 80.8 GiB)."""
    return max(min_peak_solution(problem).peak_memory.values(), default=0.0)


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


def _pruned_by_floors(cfg, P, cands, cluster, best, remaining, cutoff=None) -> bool:
    """Whether the resharding floors (autopar/pricing/edge_floor.py: each matrix entry's fewest
    collectives at their latency, no shortest-path search) already bound this configuration
    above the best plan: first the per-node bound, then the spanning-tree bound over the floors
    (solver/tree_bound.py), then, where pricing the edges would be costly (``FLOOR_LP_PAIRS``),
    the LP relaxation over the floors. Either way no edge is priced."""
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
    problem = build_problem(cands, F, cfg.settings)
    if memory_floor_exceeds_budget(problem):
        return False   # the exact path reports it (and keeps the problem for the error message)
    relaxed = bound_problem(problem, F)
    try:
        lp = relaxation_bound(relaxed, time_limit=remaining, cutoff=target)
    except SolverTimeout:
        return False
    return lp != math.inf and lp >= target


class CutOff(Exception):
    """``search`` found no plan because its ``cutoff`` pruned the configurations, or none beats
    the plan found elsewhere (``Incumbent``). Internal control flow, not a PlanError: the
    pipelined search skips that candidate."""


def format_bytes(x: float) -> str:
    """Both a readable size and the exact byte count, so the number can be used as a budget."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= size:
            return f"{x / size:.2f} {unit} ({int(x):,} bytes)"
    return f"{int(x):,} bytes"


def _no_config_message(graph, cluster, constraints) -> str:
    batch = global_batch(graph)
    return (f"no configuration satisfies the constraints {constraints} on {cluster.num_devices} devices "
            f"({cluster.nodes} node(s) × {cluster.devices_per_node}) with global batch {batch}: dp × tp must "
            f"equal the number of devices, tp at most {cluster.devices_per_node} (one node), the batch must "
            f"divide by dp × num_micro_batches")


def degrees_of(result: Result) -> dict:
    mesh = result.config.mesh
    s = result.config.settings
    dp = mesh.degree("dp")
    model = [mesh.shape[a] for a in sequence.param_axes(mesh)]
    batch = global_batch(result.cands.graph)
    return {
        "dp": dp, "tp": math.prod(model) if model else 1, "tp_mode": "1d" if len(model) <= 1 else "2d-reshard",
        "tp_shape": model, **sequence.degrees(result.cands, chosen(result.problem, result.solution), mesh), "pp": 1, "pp_schedule": None,
        "micro_batch_size": batch // dp // s.num_micro_batches, "num_micro_batches": s.num_micro_batches,
        "zero": s.zero, "checkpoint": checkpoint_mode(result.prediction["checkpoint"]), "offload": False,
    }
