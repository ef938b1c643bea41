"""The outer search: mesh shapes × ZeRO stage × micro-batch count, each priced by one ILP.

For every logical mesh of the cluster (dp × tp[, tp2]) the candidate strategies are enumerated
once (``candidates.candidates``); then each (ZeRO stage, number of micro-batches) prices them
(``pricing.price``), builds the Problem and solves it. A configuration whose lower bound (every
node at its cheapest strategy, resharding free) cannot beat the best plan so far is pruned
without calling the solver: the bounds are ``visit.BOUNDS``, in order, each a small function of one
configuration that prunes it or passes it on (autopar/search/visit.py); the search's state (incumbent,
deadline, caches, counters) is a ``context.SearchContext``. ``constraints`` pin any of the
degrees and the search completes the rest.
"""
from __future__ import annotations

import dataclasses
import math
import sys

from autopar.cluster import Cluster
from autopar.errors import ConstraintError, MemoryBudgetError
from autopar.frontend.batching import global_batch
from autopar.frontend.trace import TracedGraph
from autopar.pricing.price import Settings, price, price_edges
from autopar.rules import sequence
from autopar.search.build import build_problem, chosen
from autopar.search import floor_groups
from autopar.search.configurations import allowed_meshes, check_constraints, configurations, micro_batch_error
from autopar.search.context import (CutOff, Incumbent, PlanCaches, Result, SearchContext, SearchOptions,
                                    SearchStats)
from autopar.pricing.offload import host_budget
from autopar.search.grid_bound import grid_compute_floor
from autopar.search.predict import checkpoint_mode, step_time_lower_bound
from autopar.search.visit import visit
from codegen.grid_layout import GRID_MODES
from solver.errors import SolverTimeout
from solver.ilp import min_peak_solution


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
    within ``visit.LARGE_ILP_SECONDS``, with a lower bound of the compute time of any plan this search
    can still return. ``go`` may return the step time of a plan found elsewhere (the pipelined
    candidates: autopar/search/pipeline_search.py), which every bound prunes against from then on
    (``Incumbent``); ``CutOff`` is raised if nothing beats it."""
    opts = SearchOptions(**options)
    if opts.exhaustive:
        opts = dataclasses.replace(opts, time_limit=None)
    constraints = check_constraints(constraints)
    if constraints.get("pp", 1) > 1:
        raise ConstraintError("pipelined plans (pp > 1) are made by autopar.plan (autopar/search/pipeline.py), "
                              "not search()")
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
    queue, twins = [], {}
    for i, cfg in enumerate(configs):
        s = cfg.settings
        twin = twins.get((cfg.mesh, s.num_micro_batches, s.zero if cfg.mesh.degree("dp") > 1 else 0))
        if s.offload != "none" and twin is not None:
            # priced when visited: its twin's bound is a bound of it (``_offload_twin``)
            queue.append((twin[0], i, cfg, twin[1], True))
            continue
        P = price(ctx.candidates(cfg.mesh), cluster, s, edges=False)
        queue.append((step_time_lower_bound(P), i, cfg, P, False))
        if s.offload == "none":
            twins[cfg.mesh, s.num_micro_batches, s.zero] = (queue[-1][0], P)
    # Best bound first, but meshes with one model axis or none before the rest: their ILPs are
    # small (a few hundred strategies against thousands on two model axes), so they give an
    # incumbent in a fraction of a second, and it prunes the large ones by their bounds. Only
    # the order changes: every configuration is still pruned by a bound or solved.
    queue.sort(key=lambda q: (min(len(q[2].mesh.model_axes()), 2), q[0], q[1]))
    # The ZeRO / offload variants of each mesh and micro-batch count, for the envelope LP over
    # their floors that may prune them together (autopar/search/floor_groups.py).
    groups = None if opts.exhaustive else floor_groups.FloorGroups()
    if groups is not None:
        for lower, i, cfg, P, lazy in queue:
            groups.add(i, cfg, None if lazy else P, lower)
    # (An offloaded configuration's twin is the same mesh, micro-batches and ZeRO stage (ZeRO-0 on
    # one data-parallel rank) without offload: the same compute and communication, an optimizer
    # step priced faster on the device than on the host (autopar/pricing/offload.py), so the
    # twin's bound bounds it too and it is priced only if that bound does not prune it.)
    pos, asked = 0, []

    def ask(best, lp):
        """``before_large``'s answer, its run given the compute floor of what is left: the
        configurations not visited yet (each node at its cheapest compute) and the grid modes."""
        go = opts.before_large(best, lp)
        if go is None:
            return None

        def run():
            asked.append(lp)   # once
            floor = min([compute_floor(ctx.candidates(c.mesh), P) for _, _, c, P, _ in queue[pos:]]
                        + [grid_compute_floor(graph, cluster, base, constraints, ctx.caches.grid_bounds)])
            return go(min(floor, best.prediction["time_breakdown"]["compute"]))
        return run
    bar = Progress(len(queue), opts.log, opts.progress)
    try:
        for pos, (lower, i, cfg, P, lazy) in enumerate(queue):
            stats.configs += 1
            if lazy:
                best = ctx.best
                if best is not None and not opts.exhaustive and lower >= best.prediction["step_time"]:
                    stats.pruned += 1   # beaten by its twin's bound: never priced
                    bar.update(stats, ctx.best)
                    continue
                P = groups.priced(i, cfg) if groups is not None else None   # by the envelope (floor_groups)
                if P is None:
                    P = price(ctx.candidates(cfg.mesh), cluster, cfg.settings, edges=False)
                lower = step_time_lower_bound(P)
            hook = ask if opts.before_large is not None and not opts.exhaustive and not asked else None
            cut_at = None if opts.exhaustive or opts.cutoff is None else opts.cutoff
            if cut_at is not None and opts.cutoff_fill_drain > 1:   # step >= (W - O) F / p (pipeline_bounds)
                cut_at = min(cut_at, opts.cutoff / opts.cutoff_fill_drain + optimizer_ceiling(P))
            if groups is not None:
                groups.visiting(i, cfg, P)
            visit(ctx, cfg, P, lower, cut_at, hook, None if groups is None else (groups, i))
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
        raise SolverTimeout(f"no plan found within time_limit={ctx.options.time_limit} s: the solver ran out of "
                            f"time on "
                            f"{stats.timed_out} of {stats.configs} configurations before finding any plan; "
                            f"raise time_limit or pin more of the degrees (constraints=)")
    grid_floor = stats.grid_min_peak    # grid configurations that lowered but did not fit
    if (ctx.infeasible or ctx.memory_floors or grid_floor is not None) and not ctx.options.min_peak:
        # nobody reads the smallest peak (SearchOptions.min_peak): not solved for
        raise MemoryBudgetError(f"no plan fits in the memory budget of {format_bytes(base.budget)} per device",
                                min_peak_bytes=None, budget_bytes=int(base.budget))
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
            f"that, add devices, use a smaller batch, or relax constraints." + _host_text(ctx),
            min_peak_bytes=int(math.ceil(floor)), budget_bytes=int(base.budget))   # a budget that fits: up
    if stats.host_exceeded:
        raise MemoryBudgetError(
            f"no plan fits: the{_host_text(ctx).split('The', 1)[1]} Add nodes, use a smaller model or batch, or relax "
            f"constraints.", min_peak_bytes=None, budget_bytes=int(base.budget))
    raise ConstraintError(_no_config_message(ctx.graph, cluster, ctx.constraints))


def _host_text(ctx: SearchContext) -> str:
    """Why the offloaded configurations were no plan: the host memory they needed per rank."""
    stats = ctx.stats
    if not stats.host_exceeded:
        return ""
    return (f" The {stats.host_exceeded} offloaded configuration(s) need at least "
            f"{format_bytes(stats.host_min_need)} of host memory per rank, more than each rank's share of the "
            f"node's host memory ({format_bytes(host_budget(ctx.cluster))}).")


def optimizer_ceiling(P) -> float:
    """Optimizer seconds no plan of a priced configuration exceeds: each parameter at its largest."""
    return float(sum(float(a.max()) for a in P.optimizer.values() if len(a)))


def compute_floor(cands, P) -> float:
    """Compute seconds no plan of a priced configuration goes below: each node at its cheapest."""
    return float(sum(float(P.compute[n].min()) for n in cands.reps if n in P.compute and len(P.compute[n])))


def _min_peak(problem, cands, P) -> float:
    """The smallest peak memory of a configuration in the ILP's node terms (the min-peak ILP).
    Not raised by the copies reshards save (autopar/pricing/saved_copies.py): the min-peak plan
    is free to reshard anywhere, so its copies overstate what a plan needs (a Llama-7B shape at 1M
    tokens on 64 A100s: 338 GiB against 82.4 GiB of a real plan, whose node terms say 80.8 GiB)."""
    return max(min_peak_solution(problem).peak_memory.values(), default=0.0)


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
        "tp_shape": model, **sequence.degrees(result.cands, chosen(result.problem, result.solution), mesh),
        "pp": 1, "pp_schedule": None,
        "micro_batch_size": batch // dp // s.num_micro_batches, "num_micro_batches": s.num_micro_batches,
        "zero": s.zero, "checkpoint": checkpoint_mode(result.prediction["checkpoint"]), "offload": s.offload,
    }
