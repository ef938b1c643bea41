"""The plan search's driver: ``plan_search`` visits the dimensions of a plan in this order.

0. Pins. ``pp`` and ``num_micro_batches`` pinned: autopar/search/pipeline.py's pinned planning
   (schedule 1f1b unless pinned). ``pp`` pinned alone: the pipelined candidates of that degree
   (and of the pinned schedule, if any), the fastest that fits (``_pinned_degree``). ``pp=1``, a
   checkpoint pin or a pin that rules pipelining out (a grid mode): the pp=1 search only, then
   step 3.
1. pp=1 (``search_with_grid``): the configurations (mesh shape, ZeRO stage, micro-batch count,
   the strategies by ILP: ``outer.search_configurations``), then the 2D / 2.5D / 3D grid modes
   against its best plan (autopar/search/grid_search.py), which the next steps must beat. It may
   find nothing that fits memory (the ``MemoryBudgetError`` is kept, not raised yet). Before an
   ILP on a mesh with two model axes it asks ``before_large``: when the pipelined candidates'
   best bound is clearly below that configuration's LP bound (``PIPELINED_FIRST_GAP``) and the
   ILP does not solve within ``outer.LARGE_ILP_SECONDS``, step 2 runs first and its best plan
   prunes the rest of the pp=1 search (``outer.Incumbent``). The order changes no plan.
2. Pipelined candidates (autopar/search/pipeline_candidates.py: pp, schedule, micro-batch count,
   best bound first, in forked workers where that pays). One is chosen only if it beats the pp=1
   plan (or pp=1 found nothing that fits).
3. Sequence axes (autopar/search/sequence_search.py), with neither ``sp`` nor ``sp_mode`` pinned
   and attention over a sequence: when nothing fits, the pp=1 search again with each
   sequence-axis size pinned (the fastest plan that fits wins, else the MemoryBudgetError with the
   smallest peak over all); when some attention's sequence is long
   (``sequence_search.SP_UPFRONT_RATIO``), the same searches also after a plan was found, kept if
   faster. Either way the pipelined candidates then run again with a sequence axis in every stage
   (``sequence_search.stage_sp_sizes``), bounded by the pp=1 sequence-parallel plan's compute.

Every search of one call shares its candidates and pricing caches (``context.PlanCaches``).
"""
from __future__ import annotations

import math
import time

from autopar.errors import ConstraintError, MemoryBudgetError
from autopar.rules.sequence import seq_axes
from autopar.search.grid_search import best_grid
from autopar.search.context import CutOff, PlanCaches, Planner
from autopar.search.outer import conclude, search_configurations
from autopar.search.pipeline import search_pipelined
from autopar.search.pipeline_candidates import SCHEDULES, Pipelined, step_time
from autopar.search.pipeline_pins import canonical_schedules, check_pins, pipeline_pins, unpipelined_pin
from autopar.search.sequence_search import (fastest_with_sp, has_sequence_attention, no_fit_error, search_with_sp,
                                            sp_free, stage_sp_sizes, upfront)

BEST_BOUND_FIRST = True   # step 1: pipelined candidates before pp=1's large ILPs (tests switch it off: no plan changes)
PIPELINED_FIRST_GAP = 0.9   # ... when their best bound is below this fraction of that ILP's LP bound


def search_with_grid(graph, cluster, base, constraints: dict | None = None, caches: PlanCaches | None = None,
                     **options):
    """Step 1 of the module doc, one search: the ILP over the configurations
    (``outer.search_configurations``), then the 2D / 2.5D / 3D grid modes against its best plan
    (``grid_search.best_grid``). (Result or GridResult, stats)."""
    ctx = search_configurations(graph, cluster, base, constraints, caches, **options)
    grid = best_grid(graph, cluster, base, ctx.constraints, None if ctx.best is None else ctx.best_time(), ctx.stats,
                     ctx.options.log, ctx.options.exhaustive, ctx.caches.grid_bounds)
    return conclude(ctx, grid)


def plan_search(graph, cluster, base, constraints: dict | None, **kw):
    """(Result, stats, pipeline figures or None): the best plan over the dimensions of the module
    doc, in its order. ``kw``: outer.search's options."""
    constraints = canonical_schedules(dict(constraints or {}))
    # candidates and pricing caches per mesh, across the searches below
    planner = Planner(graph, cluster, base, search_with_grid, dict(kw, caches=PlanCaches()))
    pp, _ = pipeline_pins(constraints)
    if pp > 1 and "num_micro_batches" in constraints:
        return search_pipelined(graph, cluster, base, constraints, planner.search_fn, **planner.kw)
    if pp > 1:
        return _pinned_degree(planner, constraints, pp)
    flat = {k: v for k, v in constraints.items() if k != "pp"}
    if "pp" in constraints or constraints.get("checkpoint") not in (None, "none") or unpipelined_pin(flat):
        try:
            res = planner.search(flat)
        except MemoryBudgetError as e:   # retried with sequence axes (step 3 of the module doc), pp=1
            return _with_sp(planner, flat, e, None)
        return _faster_with_sp(planner, flat, (*res, None), None) or (*res, None)
    best = best_stats = None
    err = None
    pipe = Pipelined(planner, flat, time.perf_counter())
    early: dict = {}

    def before_large(best1, lp):
        """Best bound first across pipeline degrees (module doc, step 1): asked by the pp=1 search
        before an ILP on a mesh with two model axes. When some pipelined candidate's bound, from
        the pp=1 plan so far, is clearly below that configuration's LP bound
        (``PIPELINED_FIRST_GAP``), the answer is a function the search calls if that ILP turns
        out slow: it visits the pipelined candidates then, against the
        plan so far, in the order of estimates from ``compute_floor`` (no plan the pp=1 search can
        still return computes faster; the plan so far may compute slower than the one it ends with);
        the best pipelined plan's step then prunes the rest of the pp=1 search. The order only
        decides the speed, and visiting pipelined candidates that the pp=1 plan would have pruned
        costs their inner searches, hence the clear gap."""
        so_far = best1.prediction["time_breakdown"]["compute"]
        if min((pipe.estimate(so_far, c) for c in pipe.candidates(so_far)), default=float("inf")) >= \
                PIPELINED_FIRST_GAP * lp:
            return None   # that ILP first, as without pipelining

        def go(compute_floor):
            pipe.first = True
            early["run"] = pipe.run(best1, {}, base_compute=compute_floor)
            return early["run"][2]["step_time"] if early["run"][2] is not None else None
        return go
    # with a time limit pp=1 runs first and whole (a plan early; the pipelined candidates get what is left)
    first = {} if kw.get("time_limit") is not None or not BEST_BOUND_FIRST else {"before_large": before_large}
    try:
        best, best_stats = planner.search(flat, **first)
    except CutOff:
        pass   # nothing at pp=1 beats the pipelined plan found in before_large
    except MemoryBudgetError as e:
        err = e
    except ConstraintError as e:
        # no configuration without a sequence axis (a global batch smaller than the nodes: long
        # contexts): a sequence axis across the nodes may place it (step 3), else ``e``
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
    if best is None:   # nothing fits: retried with sequence axes (step 3 of the module doc)
        return pipe.with_stats(_with_sp(planner, flat, err, pipe))
    incumbent = (best, best_stats, best_pipe)
    if upfront(graph, flat):   # step 3, long sequences
        incumbent = _faster_with_sp(planner, flat, incumbent, pipe) or incumbent
    return pipe.with_stats(incumbent)


def _pinned_degree(planner: Planner, constraints: dict, pp: int):
    """``pp`` pinned without ``num_micro_batches``: the free search's candidates of that degree
    (``pipeline_candidates.micro_batch_counts``, ``SCHEDULES`` or the pinned schedule), the fastest plan that
    fits. With none, the MemoryBudgetError of the smallest peak, else the first candidate's error
    (a pin no micro-batch count can meet says so for all)."""
    flat = {k: v for k, v in constraints.items() if k not in ("pp", "pp_schedule")}
    schedules = (constraints["pp_schedule"],) if "pp_schedule" in constraints else SCHEDULES
    pipe = Pipelined(planner, flat, time.perf_counter(), degrees=(pp,), schedules=schedules)
    best, stats, info = pipe.run(None, None)
    if best is not None:
        return pipe.with_stats((best, stats, info))
    memory = [e for e in pipe.errors if isinstance(e, MemoryBudgetError)]
    if memory:   # a stage partition's budget first (the inner searches run with it lifted)
        raise min(memory, key=lambda e: (e.budget_bytes != int(planner.base.budget), e.min_peak_bytes or float("inf")))
    if pipe.errors:
        raise pipe.errors[0]
    check_pins(planner.graph, planner.cluster, constraints, pp)   # no micro-batch count to try: it raises, saying why
    raise AssertionError("check_pins raises without num_micro_batches")


def _sp_of(result) -> int:
    """The sequence-parallel degree of a result: the product of its sequence axes (the Ulysses x
    ring hybrid has two)."""
    mesh = result.config.mesh
    return math.prod(mesh.shape[a] for a in seq_axes(mesh))


def _with_sp(planner: Planner, flat: dict, err, pipe):
    """Step 3 (module doc), nothing fits: the search with each sequence-axis size at pp=1
    (``sequence_search.search_with_sp``), then (``pipe``: the pipelined candidates; None: pp=1
    only) pipelined with a sequence axis in every stage (``sequence_search.stage_sp_sizes``: the
    pp=1 winner's size, or when nothing fits at pp=1 every size a stage's devices allow). The
    fastest plan that fits, or the MemoryBudgetError with the smallest peak over all."""
    try:
        best, stats = search_with_sp(planner, flat, err)
    except MemoryBudgetError as e:
        if pipe is None or not (sp_free(flat) and has_sequence_attention(planner.graph)):
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


def _faster_with_sp(planner: Planner, flat: dict, incumbent, pipe):
    """Step 3 (module doc), long sequences: a plan with a sequence axis faster than ``incumbent``
    (Result, stats, pipe or None): at pp=1 with each sequence-axis size, then pipelined with the
    pp=1 winner's size in every stage (``sequence_search.stage_sp_sizes``); or None."""
    incumbent_time = step_time(incumbent[0], incumbent[2])
    # cutoff: configurations whose work bound reaches the incumbent cannot beat it (outer.search)
    found = fastest_with_sp(planner, flat, cutoff=incumbent_time)
    if found is None:
        return None
    res, stats = found
    if pipe is None:
        return (res, stats, None) if res.prediction["step_time"] < incumbent_time else None
    start = (res, stats, None) if res.prediction["step_time"] < incumbent_time else incumbent
    sp = _sp_of(res)
    # the pp=1 sp plan's compute bounds its pipelined forms (pipeline_candidates' module doc, pruning)
    out = pipe.run(*start, sp_for=lambda sub: stage_sp_sizes(sub, sp),
                   base_compute=res.prediction["time_breakdown"]["compute"])
    return None if out[0] is incumbent[0] else out
