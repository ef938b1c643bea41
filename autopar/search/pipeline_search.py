"""The outer search over pipeline degrees: pp, schedule and micro-batch count next to the rest.

``autopar.plan`` calls ``plan_search`` once. With ``pp`` and ``num_micro_batches`` pinned it is
autopar/search/pipeline.py's pinned planning (schedule 1f1b unless pinned); with ``pp`` pinned
alone, step 2's candidates of that degree (and of the pinned schedule, if any), the fastest that
fits (``_pinned_degree``); with ``pp=1`` pinned the ordinary search. Otherwise:

1. The ordinary search (pp=1: mesh shape, ZeRO, micro-batch size, strategies) runs first; it may
   find nothing that fits memory (a ``MemoryBudgetError`` is kept, not raised yet).
2. Pipelined candidates: pp in the powers of two from 2 up to ``MAX_PP`` that the model's blocks
   and the cluster allow (``pipeline.stage_cluster``), schedules ``SCHEDULES`` and micro-batch
   counts ``pp * MICRO_FACTORS`` dividing the batch. Factors up to 16: Megatron-style runs use many
   more micro-batches than stages (micro-batch size 1, m = batch / dp), and at 4pp the 1F1B bubble
   is still (pp - 1) / 4pp of the step; with factors only up to 4 a 39B GPT on 64 A100s missed
   the grid's pp=4, m=64 plan by 0.3% (benchmarks/RESULTS.md section 10(c)). And the counts
   Megatron-LM runs: micro-batch size 1 or 2 with tensor parallelism over a node, i.e.
   m = batch / (dp x mbs) with dp = the stage's nodes; batch / dp often has a factor 3 that no
   pp x 2^k reaches (GPT-3 175B, batch 1536 on 1024 A100s, pp=8: m=96 was 9% faster than
   anything the search tried). Larger counts have the smaller bound (below), so they are visited
   first and a good one prunes the smaller counts. Each is ``pipeline.search_pipelined`` with
   those pins (the inner plan on the stage sub-mesh, the DP partition, the simulated schedule);
   the inner plan depends only on (pp, m) and the user's other pins, so it is searched once per
   (pp, m) and reused for every schedule (``inner_cache``).
3. The pipelined candidate with the least predicted step time is chosen only if it beats the
   pp=1 plan's (or pp=1 found nothing that fits).
4. Sequence parallelism (issue 7): when neither step found a plan that fits memory, sp and
   sp_mode are not pinned and the model runs attention over a sequence, the ordinary search runs
   again with each sequence-axis size pinned (Ulysses, ring or K/V all-gather chosen per attention
   op by the ILP: autopar/search/sequence_search.py ``search_with_sp``); the fastest plan that fits wins, and
   if none does the MemoryBudgetError reports the smallest peak over all of them. When some
   attention's sequence is at least ``sequence_search.SP_UPFRONT_RATIO`` (2) times its hidden size, the
   same sp searches also run after a plan was found, and one of them wins if it is faster
   (``sequence_search.fastest_with_sp``; small models' sequences are far shorter, so they never pay).
   Either way the pipelined candidates of step 2 are then visited again with a sequence axis in
   every stage (pinned ``sp``, the attention mode the ILP's): the size of the best pp=1 plan with a
   sequence axis (the largest size up to it that divides a stage's devices), or, when nothing fits
   at pp=1 even with one, every size a stage's devices allow (``sequence_search.stage_sp_sizes``);
   their bound is the pp=1 sequence-parallel plan's compute (0 without one: the inner cutoff still
   prunes). So a long-context model whose parameters need stages and whose activations need a
   sequence axis gets pp x sp (tests/test_sp_pipeline.py). Models that never reach step 4 plan
   as before.

Pruning (why small models stay fast): a pipelined step cannot take less than the pp=1 plan's
compute time times 1 + (pp - 1) / (m * v) (same FLOPs on the same devices, plus the least fill
and drain of 1F1B / interleaving with v stages per rank); a candidate whose bound is not below
the pp=1 step time is not searched. This bound assumes the pipelined stages compute no faster
than the pp=1 plan does, which holds when both split work over the same devices evenly.
Candidates are visited in order of that bound, so a good pipelined plan found early prunes the
rest. Inside a candidate's inner search (the whole model on one stage's sub-mesh) a configuration
is cut off when its work bound cannot beat the incumbent over p stages. Its work bound W is the
compute, in-op and resharding communication and optimizer step of the whole model, gradient
communication aside; the p stages split that work (each stage's time is its nodes' share of it).
The pipeline part of it, W minus the optimizer step O, runs with the same least fill and drain as
above, so the busiest rank's pipeline time plus its share (>= 1/p) of the optimizer step is at
least ((W - O)(1 + b) + O) / p with b = (p - 1) / (m v), v the most virtual stages of the
schedules sharing that inner search (``SCHEDULES``), under the same even-split assumption; O is
at most each parameter's largest optimizer time (``outer.search``'s ``cutoff`` and
``cutoff_bubble``). Without the fill and drain (until 2026-11-27) GPT 18.4B's (tp=8 pinned, 256
A100s) nine inner searches that ended in plans 7-38% slower than its pp=1 plan, or in stages that
do not fit, ran to the end (2-3.4 s each); now they are cut off. A ``time_limit`` covers the whole search: pipelined candidates get what pp=1 left.

Best bound first across pipeline degrees (no ``time_limit``): the pp=1 search asks before an ILP
on a mesh with two model axes (``before_large`` in ``plan_search``). When the pipelined
candidates' best bound (from the pp=1 plan so far) is clearly below that configuration's LP
bound and the ILP does not solve within ``outer.LARGE_ILP_SECONDS``, the pipelined candidates are
visited first, their pruning bounds from a compute floor of every plan the pp=1 search can still
return (each remaining configuration's nodes at their cheapest, the grid modes' linears:
autopar/search/grid_bound.py); the best pipelined plan then prunes the rest of the pp=1 search
(``outer.Incumbent``: its bounds, and ``solver.ilp.mip_reaches`` before each ILP). GPT-3 175B on
128 DGX nodes: its four 2-axis ILPs (5-9 s each, LP bounds 15.8-16.2 s against the pp=1 plan's
19.58 s) were proved unable to beat the pipelined 16.16 s plan in 1.2-1.6 s each, and the grid pass
lowered no geometry. Since the ILPs are solved per checkpoint decision (solver/decisions.py) those
ILPs take about a second and the pp=1 search ends first (2.5 s); the rule stays for ILPs that are
still slow. The order changes no plan (tests/test_pipeline_plan.py).

Workers: with more than one core and no ``time_limit``, once the pp=1 search took
``FORK_MIN_SECONDS``, the pipelined candidates are evaluated in forked worker processes
(autopar/search/candidate_workers.py), a lane per pipeline degree so that a stage sub-mesh's
caches and inner plans are built once (``_run_forked``). A candidate is handed out unless its
bound reaches the best step time known at that moment, and its inner cutoff is that time times p
(any plan found bounds it); the plan is the least step time, the earlier candidate on a tie, as
in order. Workers send back step times; the winner's plan is then fetched from its worker, its
candidates rebuilt here (evaluated again here, with the incumbent its worker had, if that fails).
Forking needs Linux and no other Python thread running (``candidate_workers.can_fork``). GPT-3
175B on 128 DGX nodes on these 2-core machines: 67.7 -> 42-47 s (RESULTS.md section 1i). ``AUTOPAR_PLAN_WORKERS=1`` plans in one
process; tests compare both ways (tests/test_candidate_workers.py).

Only executable plans are searched: a pipelined stage runs ZeRO 0-3 (tied parameters too), but
ZeRO <= 2 under zero-bubble, which is only pinned, never searched (``pipeline.max_zero``;
autopar/execution/pipeline_run.py refuses the rest).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time

from autopar.errors import ConstraintError, MemoryBudgetError, PlanError
from autopar.search.context import PlanCaches
from autopar.search.outer import CutOff, Progress

MAX_PP = 16
SCHEDULES = ("1f1b", "interleaved-1f1b")   # gpipe: 1F1B's time with more memory; zero-bubble: pin it
MICRO_FACTORS = (1, 2, 4, 8, 16)   # module doc, step 2
MEGATRON_MBS = (1, 2)
INNER_CUTOFF = True   # module doc, pruning (tests switch it off to check it changes no plan)
INNER_FILL_DRAIN = True   # ... with the least fill and drain in it (idem)
BEST_BOUND_FIRST = True   # module doc, pruning: pipelined candidates before pp=1's large ILPs (idem)
PIPELINED_FIRST_GAP = 0.9   # ... when their best bound is below this fraction of that ILP's LP bound
FORK_WORKERS = True   # module doc, workers: candidates in forked processes (tests compare it switched off)
FORK_MIN_SECONDS = 1.0   # ... once the search so far took this long (small models: forking costs more)


def _pp_choices(graph, cluster, constraints: dict) -> list[int]:
    from codegen.stages import pipeline_units
    from autopar.search.pipeline_pins import stage_cluster

    units = len(pipeline_units(graph))
    out, pp = [], 2
    while pp <= min(MAX_PP, units):
        try:
            stage_cluster(cluster, pp)
            if cluster.num_devices % pp == 0:
                out.append(pp)
        except ConstraintError:
            pass
        pp *= 2
    return out


def micro_batch_counts(pp: int, batch: int, cluster=None) -> list[int]:
    """The micro-batch counts the free search tries with ``pp`` stages (module doc, step 2): pp x
    MICRO_FACTORS, and with ``cluster`` the Megatron-style counts batch / (dp x b) for micro-batch
    sizes b in MEGATRON_MBS, dp being what a stage's devices leave for data parallelism when
    tensor parallelism takes a whole node (dp = stage nodes). Only counts >= pp dividing the batch."""
    ms = {pp * f for f in MICRO_FACTORS}
    if cluster is not None:
        from autopar.search.pipeline_pins import stage_cluster
        try:
            sub = stage_cluster(cluster, pp)
        except ConstraintError:
            sub = None
        if sub is not None:
            dp = sub.num_devices // sub.devices_per_node
            ms |= {batch // (dp * b) for b in MEGATRON_MBS if batch % (dp * b) == 0}
    return sorted(m for m in ms if m >= pp and batch % m == 0)


def plan_search(graph, cluster, base, constraints: dict | None, search_fn, **kw):
    """(Result, stats, pipeline figures or None): the best plan over pp=1 and pipelined candidates."""
    from autopar.search.pipeline import search_pipelined
    from autopar.search.pipeline_pins import canonical_schedules, pipeline_pins, unpipelined_pin

    constraints = canonical_schedules(dict(constraints or {}))
    kw = dict(kw, caches=PlanCaches())   # candidates and pricing caches per mesh, across the searches below
    pp, _ = pipeline_pins(constraints)
    if pp > 1 and "num_micro_batches" in constraints:
        return search_pipelined(graph, cluster, base, constraints, search_fn, **kw)
    if pp > 1:
        return _pinned_degree(graph, cluster, base, constraints, search_fn, kw, pp)
    flat = {k: v for k, v in constraints.items() if k != "pp"}
    if "pp" in constraints or constraints.get("checkpoint") not in (None, "none") or unpipelined_pin(flat):
        try:
            res = search_fn(graph, cluster, base, flat, **kw)
        except MemoryBudgetError as e:   # retried with sequence axes (step 4 of the module doc), pp=1
            return _with_sp(graph, cluster, base, flat, search_fn, e, kw, None)
        return _faster_with_sp(graph, cluster, base, flat, search_fn, kw, (*res, None), None) or (*res, None)
    t0 = time.perf_counter()
    best = best_stats = None
    err = None
    pipe = _Pipelined(graph, cluster, base, flat, search_fn, kw, t0)
    early: dict = {}

    def before_large(best1, lp):
        """Best bound first across pipeline degrees (module doc, pruning): asked by the pp=1 search
        before an ILP on a mesh with two model axes. When some pipelined candidate's bound, from
        the pp=1 plan so far, is clearly below that configuration's LP bound
        (``PIPELINED_FIRST_GAP``), the answer is a function the search calls if that ILP turns
        out slow (GPT-3 175B: 5-9 s each): it visits the pipelined candidates then, against the
        plan so far, pruned with bounds from ``compute_floor`` (no plan the pp=1 search can still
        return computes faster; the plan so far may compute slower than the one it ends with);
        the best pipelined plan's step then prunes the rest of the pp=1 search. The order only
        decides the speed, and visiting pipelined candidates that the pp=1 plan would have pruned
        costs their inner searches, hence the clear gap (GPT-3 175B: bounds of 13 s against an LP
        bound of 15.8 s; zoo Llama on 4 DGX nodes: 1.77 ms against 1.80 ms, and its pp=1 plan
        prunes them all)."""
        so_far = best1.prediction["time_breakdown"]["compute"]
        if min((c[0] for c in pipe.candidates(so_far)), default=float("inf")) >= PIPELINED_FIRST_GAP * lp:
            return None   # that ILP first, as without pipelining

        def go(compute_floor):
            pipe.first = True
            early["run"] = pipe.run(best1, {}, base_compute=compute_floor)
            return early["run"][2]["step_time"] if early["run"][2] is not None else None
        return go
    # with a time limit pp=1 runs first and whole (a plan early; the pipelined candidates get what is left)
    kw1 = kw if kw.get("time_limit") is not None or not BEST_BOUND_FIRST else dict(kw, before_large=before_large)
    try:
        best, best_stats = search_fn(graph, cluster, base, flat, **kw1)
    except CutOff:
        pass   # nothing at pp=1 beats the pipelined plan found in before_large
    except MemoryBudgetError as e:
        err = e
    except ConstraintError as e:
        # no configuration without a sequence axis (a global batch smaller than the nodes: long
        # contexts): a sequence axis across the nodes may place it (step 4 below), else ``e``
        from autopar.search.sequence_search import has_sequence_attention, sp_free
        if not (sp_free(flat) and has_sequence_attention(graph)):
            raise
        err = e
    if "run" in early:   # the pipelined candidates were visited (before_large)
        found = early["run"]
        if found[2] is not None and (best is None or found[2]["step_time"] < best.prediction["step_time"]):
            best, best_stats, best_pipe = found
        else:
            best_pipe = None
    else:
        best, best_stats, best_pipe = pipe.run(best, best_stats)
    if best is None:   # nothing fits: retried with sequence axes (step 4 of the module doc)
        return pipe.with_stats(_with_sp(graph, cluster, base, flat, search_fn, err, kw, pipe))
    incumbent = (best, best_stats, best_pipe)
    if upfront_sp(graph, flat):   # step 4, long sequences
        incumbent = _faster_with_sp(graph, cluster, base, flat, search_fn, kw, incumbent, pipe) or incumbent
    return pipe.with_stats(incumbent)


def _pinned_degree(graph, cluster, base, constraints: dict, search_fn, kw, pp: int):
    """``pp`` pinned without ``num_micro_batches``: the free search's candidates of that degree
    (step 2: ``micro_batch_counts``, ``SCHEDULES`` or the pinned schedule), the fastest plan that
    fits. With none, the MemoryBudgetError of the smallest peak, else the first candidate's error
    (a pin no micro-batch count can meet says so for all)."""
    from autopar.search.pipeline_pins import check_pins

    flat = {k: v for k, v in constraints.items() if k not in ("pp", "pp_schedule")}
    schedules = (constraints["pp_schedule"],) if "pp_schedule" in constraints else SCHEDULES
    pipe = _Pipelined(graph, cluster, base, flat, search_fn, kw, time.perf_counter(), degrees=(pp,),
                      schedules=schedules)
    best, stats, info = pipe.run(None, None)
    if best is not None:
        return pipe.with_stats((best, stats, info))
    memory = [e for e in pipe.errors if isinstance(e, MemoryBudgetError)]
    if memory:   # a stage partition's budget first (the inner searches run with it lifted)
        raise min(memory, key=lambda e: (e.budget_bytes != int(base.budget), e.min_peak_bytes or float("inf")))
    if pipe.errors:
        raise pipe.errors[0]
    check_pins(graph, cluster, constraints, pp)   # no micro-batch count to try: it raises, saying why
    raise AssertionError("check_pins raises without num_micro_batches")


def _time(result, pipe) -> float:
    return pipe["step_time"] if pipe is not None else result.prediction["step_time"]


def upfront_sp(graph, flat) -> bool:
    from autopar.search.sequence_search import upfront
    return upfront(graph, flat)


class _Pipelined:
    """Step 2 of the module doc: the pipelined candidates (pp, schedule, m), optionally with a
    sequence axis pinned (step 4), visited best bound first against an incumbent. One object per
    ``plan_search``: its inner-search cache and counters are shared by every visit."""

    def __init__(self, graph, cluster, base, flat, search_fn, kw, t0, degrees=None, schedules=SCHEDULES):
        self.graph, self.cluster, self.base, self.flat, self.search_fn = graph, cluster, base, flat, search_fn
        self.kw, self.t0 = kw, t0
        self.degrees = degrees   # the pipeline degrees to try (None: ``_pp_choices``)
        self.schedules = schedules
        self.errors: list = []   # why candidates could not be planned, in the order visited
        self.inner_cache: dict = {}   # (pp, m[, sp]) inner plans, shared by every schedule (module doc)
        self.tried = self.pruned = 0
        self.first = False   # visited before the pp=1 search ended (plan_search's before_large)
        self.floors: list = []   # smallest peaks of pipelined plans that did not fit (step 4's error)
        self.remote_inner: dict = {}   # inner searches run in worker processes: {key: cut off?}
        self.kept: dict = {}   # in a worker: its candidates' (Result, stats, pipe) until fetched
        self.workers = 0   # the most worker processes a visit forked (stats: pipeline_workers)

    def with_stats(self, out: tuple) -> tuple:
        """``out`` (Result, stats, pipe) with the pipelined candidates' counters in its stats."""
        cut = {**self.remote_inner, **{k: isinstance(r, CutOff) for k, r in self.inner_cache.items()}}
        stats = dict(out[1], pipeline_candidates=self.tried, pipeline_pruned=self.pruned,
                     inner_searches=len(cut), inner_cut_off=sum(cut.values()), pipeline_workers=self.workers, pipelined_first=self.first,
                     pipeline_seconds=time.perf_counter() - self.t0)
        return out[0], stats, out[2]

    def cached_search(self, g, sub, settings, inner, **kw2):
        key = (sub.nodes, sub.devices_per_node, settings.budget, repr(sorted(inner.items())))
        if key not in self.inner_cache:
            try:
                self.inner_cache[key] = self.search_fn(g, sub, settings, inner, **kw2)
            except (PlanError, CutOff) as e:
                self.inner_cache[key] = e
        if isinstance(self.inner_cache[key], Exception):
            raise self.inner_cache[key]
        return self.inner_cache[key]

    def candidates(self, base_compute: float, sp_for=None) -> list[tuple]:
        """(bound, pp, schedule index, m, schedule, sp) of every candidate; ``sp_for(stage cluster)``:
        the sequence-axis sizes to pin with that stage sub-mesh (None: no sequence axis)."""
        from autopar.search.configurations import global_batch
        from autopar.search.pipeline_pins import stage_cluster, virtual_stages

        batch = global_batch(self.graph)
        out = []
        for p in self.degrees or _pp_choices(self.graph, self.cluster, self.flat):
            sps = [None] if sp_for is None else sp_for(stage_cluster(self.cluster, p))
            for sp in sps:
                for sched in self.schedules:
                    v = virtual_stages(sched)
                    for m in micro_batch_counts(p, batch, self.cluster):
                        if "num_micro_batches" in self.flat and self.flat["num_micro_batches"] != m:
                            continue
                        out.append((base_compute * (1 + (p - 1) / (m * v)), p, self.schedules.index(sched), m, sched,
                                    sp or 0))
        return out

    def run(self, best, best_stats, best_pipe=None, sp_for=None, base_compute=None):
        """The best of (``best``, ``best_pipe``) and the pipelined candidates: (Result, stats, pipe).
        The bound of a candidate is ``base_compute`` (the pp=1 plan's compute; default ``best``'s)
        times the least fill and drain (module doc, pruning). In forked workers when that pays
        (``_workers``), else here, in order."""
        best_time = _time(best, best_pipe) if best is not None else float("inf")
        if base_compute is None:
            base_compute = best.prediction["time_breakdown"]["compute"] if best is not None else 0.0
        order = sorted(self.candidates(base_compute, sp_for))
        workers = self._workers(order, best_time)
        if workers > 1:
            return self._run_forked(order, workers, best, best_stats, best_pipe, best_time)
        for bound, p, _, m, sched, sp in order:
            if bound >= best_time:
                self.pruned += 1
                continue
            limit = self.kw.get("time_limit")
            if limit is not None and time.perf_counter() - self.t0 >= limit:
                break   # the time limit covers the whole search, pipelined candidates included
            out = self._evaluate(p, m, sched, sp, best_time)
            if out[0] != "ok":
                continue
            self.tried += 1
            result, stats, pipe = out[1:]
            if pipe["step_time"] < best_time:
                best, best_stats, best_pipe, best_time = result, stats, pipe, pipe["step_time"]
        return best, best_stats, best_pipe

    def _evaluate(self, p, m, sched, sp, best_time):
        """One candidate against an incumbent of ``best_time`` seconds: ("ok", Result, stats, pipe),
        ("skip",) when it cannot be met or its inner search was cut off, ("memory",) when no
        stage partition fits (its smallest peak kept for step 4's error)."""
        from autopar.search.pipeline import search_pipelined
        from autopar.search.pipeline_pins import virtual_stages

        kw, limit = self.kw, self.kw.get("time_limit")
        pins = dict(self.flat, pp=p, pp_schedule=sched, num_micro_batches=m, **({"sp": sp} if sp else {}))
        kw_left = kw if limit is None else dict(kw, time_limit=max(1.0, limit - (time.perf_counter() - self.t0)))
        if INNER_CUTOFF and best_time < float("inf"):   # inner plans whose work over p stages cannot beat it
            # with the least fill and drain of any schedule sharing this inner search (module doc)
            v = max(virtual_stages(s) for s in self.schedules)
            kw_left = dict(kw_left, cutoff=best_time * p, cutoff_bubble=(p - 1) / (m * v) if INNER_FILL_DRAIN else 0.0)
        try:
            return ("ok", *search_pipelined(self.graph, self.cluster, self.base, pins, self.cached_search, **kw_left))
        except MemoryBudgetError as e:
            self.errors.append(e)
            if e.budget_bytes == int(self.base.budget) and e.min_peak_bytes is not None:
                self.floors.append(e.min_peak_bytes)   # a stage partition that did not fit (plan_stages)
            return ("memory",)
        except CutOff:
            return ("skip",)
        except PlanError as e:   # a pin this candidate cannot meet (ConstraintError, a sequence mode), a time-out
            self.errors.append(e)
            return ("skip",)

    def _workers(self, order, best_time) -> int:
        """Worker processes for ``order`` (autopar/search/candidate_workers.py): only without a time
        limit, with two or more pipeline degrees left to search (a lane per degree), and when the
        pp=1 search took ``FORK_MIN_SECONDS`` (inner searches as cheap as a small model's cost
        less than forking)."""
        from autopar.search.candidate_workers import can_fork, worker_count

        if not FORK_WORKERS or self.kw.get("time_limit") is not None or not can_fork():
            return 0
        if time.perf_counter() - self.t0 < FORK_MIN_SECONDS:
            return 0
        degrees = {c[1] for c in order if c[0] < best_time}
        return min(worker_count(), len(degrees)) if len(degrees) > 1 else 0

    def _in_worker(self, task):
        """A worker's answer to ("evaluate", candidate) or ("fetch", candidate) (``_run_forked``)."""
        kind, args = task
        return self._remote(*args) if kind == "evaluate" else self._detached(args)

    def _remote(self, p, m, sched, sp, best_time):
        """What a worker sends back for one candidate: ("ok", step time) or ``_evaluate``'s other
        answers, the inner searches it ran ({key: cut off?}) and the floors it found. A plan is
        kept until the parent fetches the winner."""
        before, floors = set(self.inner_cache), len(self.floors)
        self.kw = dict(self.kw, progress=False)   # one live progress line: the parent's
        out = self._evaluate(p, m, sched, sp, best_time)
        new = {k: isinstance(v, CutOff) for k, v in self.inner_cache.items() if k not in before}
        if out[0] != "ok":
            return out[0], None, new, self.floors[floors:]
        self.kept[(p, m, sched, sp)] = out[1:]
        return "ok", out[3]["step_time"], new, self.floors[floors:]

    def _detached(self, key):
        """A kept (Result, stats, pipe) that can cross a pipe: its candidates (fx nodes) replaced by
        where the parent finds or rebuilds them, (policy, mesh); None if they are not in the
        shared cache (the parent then evaluates the candidate again)."""
        result, stats, pipe = self.kept[key]
        for policy, by_mesh in self.kw["caches"].candidates.items():
            for mesh, cands in by_mesh.items():
                if cands is result.cands:
                    return dataclasses.replace(result, cands=None), stats, pipe, (policy, mesh)
        return None

    def _attached(self, got):
        """``_detached``'s answer with its candidates found in, or rebuilt into, the shared cache."""
        result, stats, pipe, (policy, mesh) = got
        return dataclasses.replace(result, cands=self.kw["caches"].candidates_of(self.graph, mesh, policy)), stats, pipe

    def _run_forked(self, order, workers, best, best_stats, best_pipe, best_time):
        """``run`` with the candidates evaluated in ``workers`` forked processes (module doc,
        workers). Each pipeline degree belongs to one lane (its sub-mesh's caches built once): a
        free lane takes its degrees' next candidate, else adopts the degree whose next candidate
        comes first. A candidate is handed out unless its bound reaches the best step time known
        then, with the inner cutoff of that time; the plan is the least step time, the earlier
        candidate (``order``) on a tie, as in order. The winner's plan is fetched from its worker;
        evaluated again here if that fails, with the incumbent its worker had when it first
        searched that (pp, m), so the same inner plan."""
        from collections import deque

        from autopar.search.candidate_workers import Lanes

        self.workers = max(self.workers, workers)
        pruned0 = self.pruned
        queues: dict = {}   # pp -> candidate indices, in order
        for i, c in enumerate(order):
            queues.setdefault(c[1], deque()).append(i)
        owner: dict = {}   # pp -> lane
        first_best: dict = {}   # (pp, m, sp) -> the incumbent its inner search was cut off against
        done: dict = {}
        ran_on: dict = {}   # candidate index -> lane
        busy = [None] * workers
        with Lanes(workers, self._in_worker) as lanes, _progress(self, len(order), workers) as bar:
            def next_for(lane):
                mine = [pp for pp, ln in owner.items() if ln == lane and queues[pp]]
                if not mine:
                    free = [pp for pp in queues if pp not in owner and queues[pp]]
                    if not free:
                        return None
                    pp = min(free, key=lambda x: queues[x][0])
                    owner[pp] = lane
                    mine = [pp]
                return queues[min(mine, key=lambda x: queues[x][0])].popleft()

            def top_up():
                for lane in range(workers):
                    while busy[lane] is None and lanes.alive[lane]:
                        i = next_for(lane)
                        if i is None:
                            break
                        bound, p, _, m, sched, sp = order[i]
                        if bound >= best_time:
                            self.pruned += 1
                            continue
                        first_best.setdefault((p, m, sp), best_time)
                        lanes.send(lane, i, ("evaluate", (p, m, sched, sp, best_time)))
                        busy[lane], ran_on[i] = i, lane

            def here(degrees):
                """The candidates left of ``degrees`` evaluated in this process (their worker died)."""
                nonlocal best_time
                for pp in degrees:
                    while queues[pp]:
                        j = queues[pp].popleft()
                        if order[j][0] >= best_time:
                            self.pruned += 1
                            continue
                        done[j] = self._local_answer(j, order, best_time, first_best)
                        self._count(done[j])
                        if done[j][0] == "ok":
                            best_time = min(best_time, done[j][1])
            top_up()
            while any(b is not None for b in busy):
                lane, i, out = lanes.receive()
                if i is None:   # the worker died with its task: that one and its degrees' rest here
                    i, busy[lane] = busy[lane], None
                    out = self._local_answer(i, order, best_time, first_best)
                    ran_on.pop(i)
                    here([pp for pp, ln in owner.items() if ln == lane])
                busy[lane] = None
                done[i] = out
                if out[0] == "error":
                    raise PlanError(f"a planning worker failed on pipelined candidate {order[i][1:]}: "
                                    f"{out[1]}\n{out[2]}")
                self._count(out)
                if out[0] == "ok":
                    best_time = min(best_time, out[1])
                top_up()
                bar.show(len(done) + self.pruned - pruned0,
                         f"pipelined candidates {len(done)} evaluated, {self.pruned - pruned0} pruned of {len(order)} "
                         f"in {workers} workers, best {best_time:.4g} s", tag="pipeline")
            here(list(queues))   # left only when every worker died
            won = [i for i, out in done.items() if out[0] == "ok" and out[1] == best_time]
            if not won or (best is not None and _time(best, best_pipe) <= best_time):
                return best, best_stats, best_pipe
            i = min(won)
            _, p, _, m, sched, sp = order[i]
            got = None
            if i in ran_on and lanes.alive[ran_on[i]]:
                lanes.send(ran_on[i], i, ("fetch", (p, m, sched, sp)))
                _, j, got = lanes.receive()
                got = got if j == i and isinstance(got, tuple) and len(got) == 4 else None
        if got is not None:
            return self._attached(got)
        out = self._evaluate(p, m, sched, sp, first_best[(p, m, sp)])
        if out[0] != "ok":
            raise PlanError(f"pipelined candidate pp={p}, m={m}, {sched} planned in a worker but not again "
                            f"here ({out[0]}): planning is not deterministic")
        return out[1:]

    def _count(self, out) -> None:
        """A worker's answer in this search's counters."""
        self.remote_inner.update(out[2])
        self.floors.extend(out[3])
        if out[0] == "ok":
            self.tried += 1

    def _local_answer(self, i, order, best_time, first_best):
        """A candidate whose worker died, evaluated here: an answer shaped as a worker's."""
        _, p, _, m, sched, sp = order[i]
        first_best.setdefault((p, m, sp), best_time)
        out = self._evaluate(p, m, sched, sp, first_best[(p, m, sp)])
        step = out[3]["step_time"] if out[0] == "ok" else None
        return out[0], step, {}, []


@contextlib.contextmanager
def _progress(pipe, total: int, workers: int):
    """The pipelined candidates' progress line (``outer.Progress``): entered after the workers
    were forked (a live line runs a thread), stopped on exit."""
    bar = Progress(total, pipe.kw.get("log"), pipe.kw.get("progress"), f"pipelined candidates ({workers} workers)")
    try:
        yield bar
    finally:
        bar.close()


def _sp_of(result) -> int:
    """The sequence-parallel degree of a result: the product of its sequence axes (the Ulysses x
    ring hybrid has two)."""
    import math

    from autopar.rules.sequence import seq_axes
    mesh = result.config.mesh
    return math.prod(mesh.shape[a] for a in seq_axes(mesh))


def _with_sp(graph, cluster, base, flat, search_fn, err, kw, pipe):
    """Step 4 (module doc), nothing fits: the search with each sequence-axis size at pp=1
    (``sequence_search.search_with_sp``), then (``pipe``: the pipelined candidates; None: pp=1
    only) pipelined with a sequence axis in every stage (``sequence_search.stage_sp_sizes``: the
    pp=1 winner's size, or when nothing fits at pp=1 every size a stage's devices allow). The
    fastest plan that fits, or the MemoryBudgetError with the smallest peak over all."""
    from autopar.search.sequence_search import (has_sequence_attention, no_fit_error, search_with_sp, sp_free,
                                                stage_sp_sizes)

    def run(cons):
        return search_fn(graph, cluster, base, cons, **kw)
    try:
        best, stats = search_with_sp(graph, cluster, flat, err, run)
    except MemoryBudgetError as e:
        if pipe is None or not (sp_free(flat) and has_sequence_attention(graph)):
            raise
        best, stats, best_pipe = pipe.run(None, None, sp_for=stage_sp_sizes)
        if best is not None:
            return best, stats, best_pipe
        floors = [f for f in (e.min_peak_bytes, *pipe.floors) if f is not None]
        if not floors or min(floors) == e.min_peak_bytes:
            raise
        raise no_fit_error(e.budget_bytes, min(floors)) from None
    if pipe is None:
        return best, stats, None
    sp = _sp_of(best)
    return pipe.run(best, stats, sp_for=lambda sub: stage_sp_sizes(sub, sp))


def _faster_with_sp(graph, cluster, base, flat, search_fn, kw, incumbent, pipe):
    """Step 4 (module doc), long sequences: a plan with a sequence axis faster than ``incumbent``
    (Result, stats, pipe or None): at pp=1 with each sequence-axis size, then pipelined with the
    pp=1 winner's size in every stage (``sequence_search.stage_sp_sizes``); or None."""
    from autopar.search.sequence_search import fastest_with_sp, stage_sp_sizes

    incumbent_time = _time(incumbent[0], incumbent[2])
    # cutoff: configurations whose work bound reaches the incumbent cannot beat it (outer.search)
    found = fastest_with_sp(graph, cluster, flat,
                            lambda cons: search_fn(graph, cluster, base, cons, **dict(kw, cutoff=incumbent_time)))
    if found is None:
        return None
    res, stats = found
    if pipe is None:
        return (res, stats, None) if res.prediction["step_time"] < incumbent_time else None
    start = (res, stats, None) if res.prediction["step_time"] < incumbent_time else incumbent
    sp = _sp_of(res)
    # the pp=1 sp plan's compute bounds its pipelined forms (module doc, pruning)
    out = pipe.run(*start, sp_for=lambda sub: stage_sp_sizes(sub, sp),
                   base_compute=res.prediction["time_breakdown"]["compute"])
    return None if out[0] is incumbent[0] else out
