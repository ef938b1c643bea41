"""The outer search: mesh shapes × ZeRO stage × micro-batch count, each priced by one ILP.

For every logical mesh of the cluster (dp × tp[, tp2]) the candidate strategies are enumerated
once (``candidates.candidates``); then each (ZeRO stage, number of micro-batches) prices them
(``pricing.price``), builds the Problem and solves it. A configuration whose lower bound (every
node at its cheapest strategy, resharding free) cannot beat the best plan so far is pruned
without calling the solver. ``constraints`` pin any of the degrees and the search completes
the rest.

A plan found elsewhere (``Incumbent``: the pipelined candidates, visited before a large ILP at
autopar/search/pipeline_search.py's request, ``before_large``) stands in for the best plan: every
bound prunes against it, and before each ILP whose LP bound comes within ``MIP_CUT_WINDOW`` of it
the branch and bound over the bound problem is asked to prove no plan beats it
(``solver.ilp.mip_reaches``).
"""
from __future__ import annotations

import math
import time
import dataclasses
from dataclasses import dataclass

from autopar.rules import sequence
from autopar.search.configurations import (Config, _micro_batch_error, allowed_meshes, check_constraints,
                                            configurations, global_batch)
from autopar.search.build import bound_problem, build_problem, chosen, work_problem
from autopar.rules.candidates import Candidates, candidates
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
# when the spanning-tree bound over them did not prune (the LP: about a second on such a mesh;
# on hf_llama's 1x2x2 mesh the tree bound, milliseconds, prunes it now).
FLOOR_LP_PAIRS = 20_000
# Before solving a configuration whose LP bound is within this fraction of the plan to beat, the
# branch and bound over the same bound problem is asked whether its optimum reaches that plan
# (``solver.ilp.mip_reaches``): on GPT-3 175B's 2-axis meshes the LP sits 15-19% below that
# optimum, and proving a cutoff takes 1.2-1.6 s of CPU where solving takes 6-10 s. Further
# below, the proof is unlikely and would cost a solve.
MIP_CUT_WINDOW = 0.8
# An ILP on a mesh with two model axes that does not solve within this many seconds is "large":
# search's ``before_large`` is asked first (best bound first across pipeline degrees). 5 s since
# the ILPs split by checkpoint decision (solver/decisions.py) solve in about a second: at 2 s a
# busy machine sent GPT 18.4B (tp=8 pinned) to its 21 pipelined candidates first, which its pp=1
# plan prunes as well (153 s against 130-141 s).
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


class _Progress:
    """A progress line for long searches: configurations visited / pruned / best so far. A rich
    live line on stderr when it is a terminal; with ``log`` (verbose) also one logged line per
    configuration."""

    def __init__(self, total: int, log=None, live: bool | None = None, label: str = "planning"):
        import sys
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

    def update(self, stats: dict, best) -> None:
        done = stats["configs"]
        info = (f"configurations visited {done}/{self.total}, pruned {stats['pruned']}, solved {stats['solved']}, "
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
           time_limit: float | None = None, log=None, policy: str | None = None,
           exhaustive: bool = False, progress: bool | None = None, max_zero: int = 3,
           shared_candidates: dict | None = None, cutoff: float | None = None,
           before_large=None, cutoff_bubble: float = 0.0) -> tuple[Result, dict]:
    """The best configuration and search statistics. ``exhaustive`` solves every configuration
    (no bound pruning, no time limit: the reference the pruned search must match, used by
    tests); ``progress`` forces the live progress line on or off (default: when stderr is a
    terminal); ``max_zero`` caps the unpinned ZeRO stages (pipelined stages execute all of them but
    ZeRO-3 under zero-bubble, autopar/search/pipeline_pins.py ``max_zero``); ``shared_candidates`` keeps each mesh's candidates and their
    pricing caches across the searches of one ``autopar.plan`` call (pp=1 and every pipelined
    candidate's inner search on a stage's sub-mesh: autopar/search/pipeline_search.py); ``cutoff``
    (seconds): a configuration whose work bound (``step_time_lower_bound(work_only=True)``: the
    compute, communication and optimizer time its plans spend, gradient communication aside)
    reaches it is not solved, and ``CutOff`` is raised if that leaves no plan (a pipelined
    candidate cannot beat the incumbent with such an inner plan: pipeline_search.py);
    ``cutoff_bubble`` (b >= 0): the work bound W of a configuration counts (1 + b) times except its
    optimizer step, bounded by U (each parameter's largest, ``optimizer_ceiling``), i.e. the
    configuration is cut off when W (1 + b) - b U reaches ``cutoff`` (a pipeline's fill and drain:
    pipeline_search.py);
    ``before_large(best, lp)``: asked before an ILP on a mesh with two model axes that its bounds
    did not prune, with the best plan so far and that configuration's LP bound; it answers None
    (solve it) or a function ``go(compute_floor)``, called (once) when that ILP does not solve
    within ``LARGE_ILP_SECONDS`` (seconds each on large models), with a lower bound of the compute
    time of any plan this search can still return. ``go`` may return the step time of a plan found
    elsewhere (the pipelined candidates, visited then: pipeline_search.py), which every bound
    prunes against from then on (``Incumbent``); ``CutOff`` is raised if nothing beats it."""
    constraints = check_constraints(constraints)
    if constraints.get("pp", 1) > 1:
        raise ConstraintError("pipelined plans (pp > 1) are made by autopar.plan (autopar/search/pipeline.py), not search()")
    policy = sequence.policy_for(policy, constraints)
    t0 = time.perf_counter()
    best: Result | None = None
    stats = {"configs": 0, "pruned": 0, "solved": 0, "infeasible": 0, "gap": 0.0}
    infeasible: list = []
    memory_floors: list = []   # configurations whose static memory alone exceeds the budget
    cand_cache: dict = ({} if shared_candidates is None else shared_candidates).setdefault(policy, {})
    configs = list(configurations(graph, cluster, base, constraints, max_zero))
    from autopar.search.grid_search import GRID_MODES, best_grid
    if not configs and constraints.get("tp_mode") not in GRID_MODES:
        batch = global_batch(graph)
        dps = [m.degree("dp") for m in allowed_meshes(cluster, constraints) if batch % m.degree("dp") == 0]
        raise ConstraintError(_micro_batch_error(batch, dps, constraints)
                              or _no_config_message(graph, cluster, constraints))
    if exhaustive:
        time_limit = None
    # Price the nodes of every configuration (cheap: ops once per mesh and micro-batch count,
    # parameters per ZeRO stage), then visit them best bound first so that the bound prunes as
    # much as possible.
    queue = []
    for i, cfg in enumerate(configs):
        if cfg.mesh not in cand_cache:
            cand_cache[cfg.mesh] = candidates(graph, cfg.mesh, policy)
        P = price(cand_cache[cfg.mesh], cluster, cfg.settings, edges=False)
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
        go = before_large(best, lp)
        if go is None:
            return None

        def run():
            from autopar.search.grid_bound import grid_compute_floor
            asked.append(lp)   # once
            floor = min([compute_floor(cand_cache[c.mesh], P) for _, _, c, P in queue[pos:]]
                        + [grid_compute_floor(graph, cluster, base, constraints)])
            return go(min(floor, best.prediction["time_breakdown"]["compute"]))
        return run
    bar = _Progress(len(queue), log, progress)
    try:
        for pos, (lower, _, cfg, P) in enumerate(queue):
            stats["configs"] += 1
            hook = ask if before_large is not None and not exhaustive and not asked else None
            cut_at = None if exhaustive or cutoff is None else \
                (cutoff + cutoff_bubble * optimizer_ceiling(P)) / (1 + cutoff_bubble)
            best = _visit(cfg, P, lower, best, stats, cand_cache, cluster, base, t0, time_limit, exhaustive,
                          infeasible, memory_floors, log, cut_at, hook)
            bar.update(stats, best)
    finally:
        bar.close()
    # 2D / 2.5D / 3D grid modes against the best ILP plan (autopar/search/grid_search.py)
    grid = best_grid(graph, cluster, base, constraints, None if best is None else best.prediction["step_time"],
                     stats, log, exhaustive)
    best = grid if grid is not None else best
    stats["seconds"] = time.perf_counter() - t0
    if isinstance(best, Incumbent):
        raise CutOff(f"no configuration beats the plan found elsewhere ({best.step_time:.4g} s)")
    if best is None and stats.get("cut_off"):
        raise CutOff(f"{stats['cut_off']} of {stats['configs']} configurations cut off at {cutoff:.4g} s, "
                     f"the rest found no plan")
    if best is None:
        if stats.get("timed_out"):
            raise SolverTimeout(f"no plan found within time_limit={time_limit} s: the solver ran out of time on "
                            f"{stats['timed_out']} of {stats['configs']} configurations before finding any plan; "
                            f"raise time_limit or pin more of the degrees (constraints=)")
        grid_floor = stats.get("grid_min_peak")    # grid configurations that lowered but did not fit
        if infeasible or memory_floors or grid_floor is not None:
            # the true smallest peak (not a bound): solve each configuration for its minimum peak
            for cfg, P in memory_floors:
                price_edges(cand_cache[cfg.mesh], cluster, cfg.settings, P)
                infeasible.append((build_problem(cand_cache[cfg.mesh], P, cfg.settings), cand_cache[cfg.mesh], P))
            floor = min([_min_peak(*x) for x in infeasible] + ([grid_floor] if grid_floor is not None else [])
                        + [stats.get("exact_min_peak", math.inf)])
            raise MemoryBudgetError(
                f"no plan fits in the memory budget of {_bytes(base.budget)} per device: the smallest "
                f"peak memory any plan reaches is {_bytes(floor)}. Raise memory_budget to at least "
                f"that, add devices, use a smaller batch, or relax constraints.",
                min_peak_bytes=int(math.ceil(floor)), budget_bytes=int(base.budget))   # a budget that fits: up
        raise ConstraintError(_no_config_message(graph, cluster, constraints))
    return best, stats


def optimizer_ceiling(P) -> float:
    """Optimizer seconds no plan of a priced configuration exceeds: each parameter at its largest."""
    return float(sum(float(a.max()) for a in P.optimizer.values() if len(a)))


def compute_floor(cands, P) -> float:
    """Compute seconds no plan of a priced configuration goes below: each node at its cheapest."""
    return float(sum(float(P.compute[n].min()) for n in cands.reps if n in P.compute and len(P.compute[n])))


def _visit(cfg, P, lower, best, stats, cand_cache, cluster, base, t0, time_limit, exhaustive, infeasible,
           memory_floors, log, cutoff=None, hook=None):
    """Prune or solve one configuration; returns the best result so far. (Warm-starting HiGHS
    from the last solved configuration on the same mesh was measured: no faster.)"""
    elapsed = time.perf_counter() - t0
    if time_limit is not None and elapsed > time_limit and best is not None:
        stats["pruned"] += 1
        return best

    def cut(bound) -> bool:
        """Is the configuration cut off by ``search``'s ``cutoff``? ``bound``: a work bound, or a
        function computing one (not computed without a cutoff: this runs per configuration)."""
        if cutoff is None or (bound() if callable(bound) else bound) < cutoff:
            return False
        stats["pruned"] += 1
        stats["cut_off"] = stats.get("cut_off", 0) + 1
        return True
    if cut(lambda: step_time_lower_bound(P, work_only=True)):
        return best
    # the work bounds below (tree, LP: no gradient communication) answer both questions at once
    work_target = min(math.inf if best is None else best.prediction["step_time"],
                      math.inf if cutoff is None else cutoff)
    remaining = None if time_limit is None else max(1.0, time_limit - elapsed)
    cands = cand_cache[cfg.mesh]
    if not exhaustive and best is not None and lower >= best.prediction["step_time"]:
        stats["pruned"] += 1
        return best
    if static_memory_lower_bound(P) > base.budget:
        stats["infeasible"] += 1
        memory_floors.append((cfg, P))
        return best
    # (the floors only where the matrices are not priced yet: where they are, the bounds below
    # use them, and a floor prunes nothing they do not)
    if not exhaustive and (best is not None or cutoff is not None) and not edges_priced(
            cands, cluster, cfg.settings) and _pruned_by_floors(cfg, P, cands, cluster, best, remaining, cutoff):
        stats["pruned"] += 1
        stats["pruned_unpriced"] = stats.get("pruned_unpriced", 0) + 1
        if best is None:   # no plan to beat: it was the cutoff that settled it
            stats["cut_off"] = stats.get("cut_off", 0) + 1
        return best
    price_edges(cands, cluster, cfg.settings, P)
    edge_lower = step_time_lower_bound(P, edges=True)
    if not exhaustive and best is not None and edge_lower >= best.prediction["step_time"]:
        stats["pruned"] += 1       # the bound with the resharding it cannot avoid
        return best
    if cut(lambda: step_time_lower_bound(P, edges=True, work_only=True)):
        return best
    problem = build_problem(cands, P, cfg.settings)
    if memory_floor_exceeds_budget(problem):
        # no choice fits (each node at its smallest bytes): HiGHS takes seconds to prove it
        stats["infeasible"] += 1
        infeasible.append((problem, cands, P))
        return best
    sol = None   # a solve's answer already (the large-ILP probe below)
    if not exhaustive and LP_BOUND:
        # The LP relaxation of the same problem with gradient communication free: about a
        # quarter of the ILP's time, often within a few % of the plan, and an infeasible LP
        # means an infeasible ILP (which HiGHS is slow to prove).
        relaxed = bound_problem(problem, P)
        # the spanning-tree bound first: milliseconds where the LP takes tenths of a second
        tree = tree_lower_bound(relaxed) if work_target < math.inf else -math.inf
        if best is not None and tree >= best.prediction["step_time"]:
            stats["pruned"] += 1
            return best
        if cut(tree):
            return best
        # ZeRO-2's bound problem is ZeRO-1's (the same costs with gradient communication free:
        # they differ only there, autopar/pricing/price.py) with less memory, so its LP is at
        # most ZeRO-1's: when that is below the target, so is this one, and it is not solved
        lp_key = (cluster, cfg.settings.num_micro_batches, cfg.settings.precision, base.budget)
        zero1_lp = cands.__dict__.setdefault("_zero1_lp", {})
        try:   # only whether it reaches the target matters
            if REUSE_ZERO1_LP and cfg.settings.zero == 2 and zero1_lp.get(lp_key, math.inf) < work_target:
                lp = zero1_lp[lp_key]   # an upper bound of this LP: used below as an estimate only
                stats["lp_reused"] = stats.get("lp_reused", 0) + 1
            else:
                lp = relaxation_bound(relaxed, time_limit=remaining,
                                      cutoff=None if work_target == math.inf else work_target)
                stats["lp_bounds"] = stats.get("lp_bounds", 0) + 1
                if cfg.settings.zero == 1 and lp < work_target:   # solved to the end: exact
                    zero1_lp[lp_key] = lp
        except SolverTimeout:
            # the LP ran out of the time left (HiGHS raises when it stops with no solution):
            # keep the best plan so far; with none yet, let the ILP try this configuration
            if best is not None:
                stats["timed_out"] = stats.get("timed_out", 0) + 1   # configurations cut short
                stats["pruned"] += 1
                return best
            lp = -math.inf
        if lp == math.inf:
            stats["infeasible"] += 1
            infeasible.append((problem, cands, P))
            return best
        if best is not None and lp >= best.prediction["step_time"]:
            stats["pruned"] += 1
            return best
        if cut(lp):
            return best
        if hook is not None and best is not None and not isinstance(best, Incumbent) \
                and len(cfg.mesh.model_axes()) >= 2 and remaining is None:
            # best-bound-first across pipeline degrees (search's ``before_large``), for an ILP
            # that is large: one that does not solve within LARGE_ILP_SECONDS (GPT-3 175B's
            # 2-axis meshes: 5-9 s each; small models' 2-axis ILPs solve in tenths of a second to
            # two seconds, and their pipelined candidates are pruned by the pp=1 plan they would
            # wait for). A probe
            # that finishes is the solve (HiGHS is deterministic); one that does not is dropped.
            go = hook(best, lp)   # None: this ILP first whatever its size
            if go is not None:
                try:
                    sol = solve(problem, time_limit=LARGE_ILP_SECONDS, mip_gap=MIP_GAP)
                    if sol.status == "feasible":
                        sol = None   # stopped at the limit: not the solve's answer
                except SolverTimeout:   # no solution within the limit
                    sol = None
            if go is not None and sol is None:
                stats["large_ilps"] = stats.get("large_ilps", 0) + 1
                found = go()
                if found is not None and found < best.prediction["step_time"]:
                    best = Incumbent(found)
                    if lp >= found:
                        stats["pruned"] += 1
                        return best
        work_target = min(math.inf if best is None else best.prediction["step_time"],
                          math.inf if cutoff is None else cutoff)
        # Only against a plan found elsewhere (``Incumbent``), i.e. after a large ILP: a small ILP
        # solves about as fast as the proof, and inside a pipelined candidate's inner search the
        # memory budget is lifted, its ILPs solve in tenths of a second (GPT-3 175B: 65 proofs
        # there took 12 s of CPU, none pruning)
        if sol is None and isinstance(best, Incumbent) and lp >= MIP_CUT_WINDOW * work_target and mip_reaches(
                relaxed, work_target, time_limit=remaining):
            # no plan of this configuration beats the target (the branch and bound proved it)
            stats["pruned"] += 1
            stats["mip_pruned"] = stats.get("mip_pruned", 0) + 1
            return best
    try:
        if sol is None:
            sol = solve(problem, time_limit=remaining, mip_gap=MIP_GAP)
    except SolverTimeout:
        # out of time before the solver found any plan of this configuration: keep the best one
        # (the old search raised here, losing the plan it had); with none yet, the next
        # configurations still get their second each, and search() says so if all time out
        stats["timed_out"] = stats.get("timed_out", 0) + 1
        stats["pruned"] += 1
        return best
    stats["solved"] += 1
    stats["solve_seconds"] = stats.get("solve_seconds", 0.0) + sol.solve_seconds
    if sol.status != "infeasible":
        sol = _with_saved_copies(problem, sol, cands, P, remaining, stats)
    if sol.status == "infeasible":
        stats["infeasible"] += 1
        infeasible.append((problem, cands, P))
        return best
    pred = predict(cands, P, cfg.settings, problem, sol, cluster)
    if log:
        log(f"{cfg.mesh.describe():>18}  zero={cfg.settings.zero} micro={cfg.settings.num_micro_batches:<4} "
            f"step={pred['step_time']:.4g}s (bounds {lower:.4g}, {edge_lower:.4g}) "
            f"peak={pred['peak_memory'] / 2**30:.2f}GiB solved in {sol.solve_seconds:.2f}s")
    if best is None or pred["step_time"] < best.prediction["step_time"] - 1e-12:
        best = Result(cfg, cands, P, problem, sol, pred)
        stats["gap"] = sol.gap
    return best


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
        stats["exact_min_peak"] = min(stats.get("exact_min_peak", math.inf), max(mem.values(), default=0.0))
        nxt = with_copy_terms(probe, cands, P, chosen(problem, sol), seen)
        if attempt == 3 or nxt is probe:
            break
        probe = nxt
        try:
            sol = solve(probe, time_limit=remaining, mip_gap=MIP_GAP)
        except SolverTimeout:
            break
        stats["solved"] += 1
        stats["saved_copy_resolves"] = stats.get("saved_copy_resolves", 0) + 1
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


def _bytes(x: float) -> str:
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
