"""The outer search over pipeline degrees: pp, schedule and micro-batch count next to the rest.

``autopar.plan`` calls ``plan_search`` once. With ``pp`` pinned it is autopar/search/pipeline.py's pinned
planning; with ``pp=1`` pinned the ordinary search. Otherwise:

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
   (``sequence_search.faster_with_sp``; small models' sequences are far shorter, so they never pay).

Pruning (why small models stay fast): a pipelined step cannot take less than the pp=1 plan's
compute time times 1 + (pp - 1) / (m * v) (same FLOPs on the same devices, plus the least fill
and drain of 1F1B / interleaving with v stages per rank); a candidate whose bound is not below
the pp=1 step time is not searched. This bound assumes the pipelined stages compute no faster
than the pp=1 plan does, which holds when both split work over the same devices evenly.
Candidates are visited in order of that bound, so a good pipelined plan found early prunes the
rest. Inside a candidate's inner search (the whole model on one stage's sub-mesh) a configuration
is cut off when its work bound W (compute, in-op and resharding communication and optimizer step
of the whole model, gradient communication aside) reaches p times the incumbent: the p stages
split that work (each stage's time is its nodes' share of it), so the busiest rank's pipeline time
plus its share (>= 1/p) of the optimizer step is at least W / p (``outer.search``'s ``cutoff``). A ``time_limit`` covers the whole search: pipelined candidates get what pp=1 left.

Only executable plans are searched: a pipelined stage runs ZeRO 0-3 (tied parameters too), but
ZeRO <= 2 under zero-bubble, which is only pinned, never searched (``pipeline.max_zero``;
autopar/execution/pipeline_run.py refuses the rest).
"""
from __future__ import annotations

import time

from autopar.errors import ConstraintError, MemoryBudgetError, PlanError

MAX_PP = 16
SCHEDULES = ("1f1b", "interleaved-1f1b")   # gpipe: 1F1B's time with more memory; zero-bubble: pin it
MICRO_FACTORS = (1, 2, 4, 8, 16)   # module doc, step 2
MEGATRON_MBS = (1, 2)
INNER_CUTOFF = True   # module doc, pruning (tests switch it off to check it changes no plan)


def _pp_choices(graph, cluster, constraints: dict) -> list[int]:
    from codegen.stages import pipeline_units
    from autopar.search.pipeline import stage_cluster

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
        from autopar.search.pipeline import stage_cluster
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
    from autopar.search.pipeline import (canonical_schedules, pipeline_pins, search_pipelined, unpipelined_pin,
                                  virtual_stages)
    from autopar.search.outer import global_batch

    constraints = canonical_schedules(dict(constraints or {}))
    kw = dict(kw, shared_candidates={})   # candidates and pricing caches per mesh, across the searches below
    pp, _ = pipeline_pins(constraints)
    if pp > 1:
        return search_pipelined(graph, cluster, base, constraints, search_fn, **kw)
    flat = {k: v for k, v in constraints.items() if k != "pp"}
    if "pp" in constraints or constraints.get("checkpoint") not in (None, "none") or unpipelined_pin(flat):
        try:
            res = search_fn(graph, cluster, base, flat, **kw)
        except MemoryBudgetError as e:   # retried with sequence axes (step 4 of the module doc)
            return (*_with_sp(graph, cluster, base, flat, search_fn, e, kw), None)
        return (*(_faster_with_sp(graph, cluster, base, flat, search_fn, kw, res[0].prediction["step_time"])
                  or res), None)
    t0 = time.perf_counter()
    best = best_stats = best_pipe = None
    err = None
    try:
        best, best_stats = search_fn(graph, cluster, base, flat, **kw)
    except MemoryBudgetError as e:
        err = e
    base_time = best.prediction["step_time"] if best is not None else float("inf")
    base_compute = best.prediction["time_breakdown"]["compute"] if best is not None else 0.0
    batch = global_batch(graph)
    inner_cache: dict = {}
    tried = 0

    def cached_search(g, sub, settings, inner, **kw2):
        key = (sub.nodes, sub.devices_per_node, settings.budget, repr(sorted(inner.items())))
        if key not in inner_cache:
            try:
                inner_cache[key] = search_fn(g, sub, settings, inner, **kw2)
            except (MemoryBudgetError, ConstraintError, PlanError) as e:
                inner_cache[key] = e
        if isinstance(inner_cache[key], Exception):
            raise inner_cache[key]
        return inner_cache[key]

    # Every pipelined candidate with its lower bound (module doc: pruning), visited best bound
    # first so that a good pipelined plan found early prunes the rest.
    cands = []
    for p in _pp_choices(graph, cluster, constraints):
        for sched in SCHEDULES:
            v = virtual_stages(sched)
            for m in micro_batch_counts(p, batch, cluster):
                if "num_micro_batches" in constraints and constraints["num_micro_batches"] != m:
                    continue
                cands.append((base_compute * (1 + (p - 1) / (m * v)), p, SCHEDULES.index(sched), m, sched))
    best_time = base_time
    pruned = 0
    for bound, p, _, m, sched in sorted(cands):
        if bound >= best_time:
            pruned += 1
            continue
        limit = kw.get("time_limit")
        if limit is not None and time.perf_counter() - t0 >= limit:
            break   # the time limit covers the whole search, pipelined candidates included
        pins = dict(flat, pp=p, pp_schedule=sched, num_micro_batches=m)
        kw_left = kw if limit is None else dict(kw, time_limit=max(1.0, limit - (time.perf_counter() - t0)))
        if INNER_CUTOFF and best_time < float("inf"):   # inner plans whose work over p stages cannot beat it (module doc)
            kw_left = dict(kw_left, cutoff=best_time * p)
        try:
            result, stats, pipe = search_pipelined(graph, cluster, base, pins, cached_search, **kw_left)
        except (MemoryBudgetError, ConstraintError, PlanError):
            continue
        tried += 1
        if pipe["step_time"] < best_time:
            best, best_stats, best_pipe, best_time = result, stats, pipe, pipe["step_time"]
    if best is None:   # nothing fits: retried with sequence axes (step 4 of the module doc)
        return (*_with_sp(graph, cluster, base, flat, search_fn, err, kw), None)
    sp_best = _faster_with_sp(graph, cluster, base, flat, search_fn, kw, best_time)   # step 4, long sequences
    if sp_best is not None:
        return (*sp_best, None)
    from autopar.search.outer import CutOff
    cut = sum(isinstance(r, CutOff) for r in inner_cache.values())
    best_stats = dict(best_stats, pipeline_candidates=tried, pipeline_pruned=pruned, inner_searches=len(inner_cache),
                      inner_cut_off=cut,
                      pipeline_seconds=time.perf_counter() - t0)
    return best, best_stats, best_pipe


def _with_sp(graph, cluster, base, flat, search_fn, err, kw):
    """Step 4 (module doc): the search with each sequence-axis size, or ``err`` / the smallest peak."""
    from autopar.search.sequence_search import search_with_sp
    return search_with_sp(graph, cluster, flat, err, lambda cons: search_fn(graph, cluster, base, cons, **kw))


def _faster_with_sp(graph, cluster, base, flat, search_fn, kw, incumbent_time):
    """Step 4 (module doc), long sequences: a plan with a sequence axis faster than the incumbent, or None."""
    from autopar.search.sequence_search import faster_with_sp
    # cutoff: configurations whose work bound reaches the incumbent cannot beat it (outer.search)
    return faster_with_sp(graph, cluster, flat, incumbent_time,
                          lambda cons: search_fn(graph, cluster, base, cons, **dict(kw, cutoff=incumbent_time)))
