"""The pipelined candidates (pp, schedule, micro-batch count[, sequence axis]) of the free
search, visited best bound first against an incumbent (``Pipelined``).

The candidates: every pp a user could pin, from 2 up to the model's blocks, that the cluster
allows (``pipeline_pins.stage_cluster``: stages of equal whole nodes, or equal parts of a single
node; 35 stages on 315 nodes, 64 on 384, not only powers of two), schedules ``SCHEDULES``, and
micro-batch counts ``pp * MICRO_FACTORS`` dividing the batch together with the counts
Megatron-style runs use (micro-batch size ``MEGATRON_MBS`` with tensor parallelism over a node:
m = batch / (dp x mbs), dp = a stage's nodes; such counts often have a factor 3 no pp x 2^k
reaches). Degrees that are not powers of two, or above ``FACTOR_MAX_PP``, get the Megatron-style
counts only (each (pp, m) costs an inner search on a sub-mesh of its own). A candidate is also
tried with every block checkpointed (``CHECKPOINTED``), unless its bound with the recomputation
(``retry_bound``) reaches the better of the incumbent and its own plan: recomputation frees the
memory of faster configurations, so a pin such as Megatron-LM's 1T run (pp=64,
checkpoint="full") is among the free search's candidates. Each is
``pipeline.search_pipelined`` with those pins (the inner plan on the stage sub-mesh, the DP
partition, the simulated schedule); the inner plan depends only on (pp, m) and the other pins, so
it is searched once per (pp, m) and reused for every schedule (``inner_cache``).

Pruning (autopar/search/pipeline_bounds.py). Candidates are visited in order of an estimate of
their least step, the pp=1 plan's compute times the equal-stage fill and drain
1 + (p - 1) / (m v), and a candidate whose estimate reaches the incumbent's step time is not
searched, so a good plan found early prunes the rest. Inside a candidate's inner search (the
whole model on one stage's sub-mesh) a configuration is cut off when its work bound W over p
stages reaches the incumbent, or (W - O) F / p does, O its optimizer step (at most
``outer.optimizer_ceiling``), F the least equal-stage factor of the schedules sharing that inner
search (``outer.search``'s ``cutoff`` and ``cutoff_fill_drain``). These estimates are not proofs:
unequal stages can beat the equal-stage fill and drain, and a stage can compute faster than the
pp=1 plan (less recomputation). So by default (``PROVEN_BOUNDS``) the search prunes with bounds
that hold for any partition into chunks of whole blocks instead (``pipeline_bounds.least_pipelined_step``
from the compute and block floors, and the schedule order's LP, ``proven_step``; in the inner
cutoff the factor that makes it the cut, ``cutoff_factor``): the free search then never returns a
plan slower than one a pin of the same search reaches. It prunes a little less than the
estimates (1.0-1.2x their CPU time on Narayanan et al.'s Table 1, benchmarks/RESULTS.md section
12); ``PROVEN_BOUNDS = False`` prunes with the estimates, and tests check that they find the same
plans (tests/search/test_pipeline_bounds.py). With ``MESH_WORK_FLOOR`` the
proven prune also tries, where the rest does not prune, ``stage_work_floor``: the candidate's
stage sub-mesh priced with its micro-batches, each node at its cheapest over the meshes its inner
search visits (autopar/search/stage_work_floor.py); valid and 1.01-1.02 times the compute floor
on Table 1's 18.4B row, but it prices every mesh of the sub-mesh (about a second a candidate,
more than many inner searches), so it is off. A checkpointed retry (every block recomputed) is
pruned, under either setting, when its proven bound with the blocks' recomputation in the work
(``pipeline_bounds.device_recompute_floor``, about a third of the compute) reaches the incumbent
(``retry_bound``, ``RETRY_BOUND``).
A ``time_limit`` covers the whole search: pipelined candidates get what pp=1
left.

With more than one core the candidates run in forked worker processes
(autopar/search/pipeline_forked.py). Only executable plans are searched: a pipelined stage runs
ZeRO 0-3, but ZeRO <= 2 under zero-bubble, which is only pinned, never searched
(``pipeline_pins.max_zero``).
"""
from __future__ import annotations

import time

from autopar.errors import ConstraintError, MemoryBudgetError, PlanError
from autopar.frontend.batching import global_batch
from autopar.search.context import CutOff
from autopar.search.pipeline_bounds import block_time_floor, cutoff_factor, device_floors, equal_stage_factor, \
    least_pipelined_step, proven_step
from autopar.search.pipeline import search_pipelined
from autopar.search.pipeline_forked import fork_workers, run_forked
from autopar.search.pipeline_pins import stage_cluster
from autopar.search.stage_memory_floor import StageMemory
from autopar.search.stage_work_floor import stage_work_floor
from codegen.stages import pipeline_units

FACTOR_MAX_PP = 16   # degrees above, or not powers of two: the Megatron-style counts only (micro_batch_counts)
CHECKPOINTED = True   # a candidate is tried again with every block checkpointed (module doc)
SCHEDULES = ("1f1b", "interleaved-1f1b")   # gpipe: 1F1B's time with more memory; zero-bubble: pin it
MICRO_FACTORS = (1, 2, 4, 8, 16)   # module doc
MEGATRON_MBS = (1, 2)
INNER_CUTOFF = True   # module doc, pruning (tests switch it off to check it changes no plan)
INNER_FILL_DRAIN = True   # ... with the fill and drain in it (idem)
PROVEN_BOUNDS = True   # prune with bounds valid for any stage partition, not estimates (module doc)
ORDER_LP = True   # ... with the schedule order's LP among them (pipeline_bounds.proven_step)
MESH_WORK_FLOOR = False   # with PROVEN_BOUNDS, also the stage sub-mesh's work floor (module doc; off: it costs more)
RETRY_BOUND = True   # a checkpointed retry is pruned by its proven bound with recomputation (module doc)

def pp_choices(graph, cluster, constraints: dict) -> list[int]:
    """Every pipeline degree a user could pin (module doc): 2 <= pp <= the model's blocks, stages
    of equal whole nodes or equal parts of a single node (``pipeline_pins.stage_cluster``); not
    only powers of two (Megatron-LM ran its 529.6B model on 35 stages, its 1T model on 64)."""
    units = len(pipeline_units(graph))
    out = []
    for pp in range(2, units + 1):
        try:
            stage_cluster(cluster, pp)
        except ConstraintError:
            continue
        if cluster.num_devices % pp == 0:
            out.append(pp)
    return out


def micro_batch_counts(pp: int, batch: int, cluster=None) -> list[int]:
    """The micro-batch counts the free search tries with ``pp`` stages (module doc): pp x
    MICRO_FACTORS, and with ``cluster`` the Megatron-style counts batch / (dp x b) for micro-batch
    sizes b in MEGATRON_MBS, dp being what a stage's devices leave for data parallelism when
    tensor parallelism takes a whole node (dp = stage nodes). Only counts >= pp dividing the batch."""
    ms = {pp * f for f in MICRO_FACTORS}
    if cluster is not None:
        try:
            sub = stage_cluster(cluster, pp)
        except ConstraintError:
            sub = None
        if sub is not None:
            dp = sub.num_devices // sub.devices_per_node
            megatron = {batch // (dp * b) for b in MEGATRON_MBS if batch % (dp * b) == 0}
            megatron = {m for m in megatron if m >= pp and batch % m == 0}
            if megatron and (pp & (pp - 1) or pp > FACTOR_MAX_PP):
                ms = megatron   # module doc: other degrees get the Megatron-style counts only
            else:
                ms |= megatron
    return sorted(m for m in ms if m >= pp and batch % m == 0)


def step_time(result, pipe) -> float:
    """The step time of a Result, or of its pipelined form (``pipe``: the pipeline figures)."""
    return pipe["step_time"] if pipe is not None else result.prediction["step_time"]


class Pipelined:
    """The pipelined candidates (pp, schedule, m), optionally with a sequence axis pinned
    (pipeline_search's step 3), visited best bound first against an incumbent. One object per
    ``plan_search``: its inner-search cache and counters are shared by every visit."""

    def __init__(self, planner, flat: dict, t0: float, degrees=None, schedules=SCHEDULES):
        self.graph, self.cluster = planner.graph, planner.cluster
        self.base, self.search_fn = planner.base, planner.search_fn
        self.flat, self.kw, self.t0 = flat, planner.kw, t0
        self.degrees = degrees   # the pipeline degrees to try (None: ``pp_choices``)
        self.schedules = schedules
        self.errors: list = []   # why candidates could not be planned, in the order visited
        self.inner_cache: dict = {}   # (pp, m[, sp]) inner plans, shared by every schedule (module doc)
        self.tried = self.pruned = 0
        self.first = False   # visited before the pp=1 search ended (plan_search's before_large)
        # smallest peaks of pipelined plans that did not fit (pipeline_search's step 3: its error)
        self.floors: list = []
        self.remote_inner: dict = {}   # inner searches run in worker processes: {key: cut off?}
        self.kept: dict = {}   # in a worker: its candidates' (Result, stats, pipe) until fetched
        self.workers = 0   # the most worker processes a visit forked (stats: pipeline_workers)
        self._floors: tuple | None = None   # (compute, block, recompute floors), computed on first use
        self.retries_pruned = 0   # checkpointed retries not searched (``retry_bound``)
        self.work_floors: dict = {}   # (pp, m, sp) -> ``stage_work_floor`` (MESH_WORK_FLOOR)
        self.grid_memo: dict = {}   # grid_bound's memo for those floors

    def with_stats(self, out: tuple) -> tuple:
        """``out`` (Result, stats, pipe) with the pipelined candidates' counters in its stats."""
        cut = {**self.remote_inner, **{k: isinstance(r, CutOff) for k, r in self.inner_cache.items()}}
        stats = dict(out[1], pipeline_candidates=self.tried, pipeline_pruned=self.pruned,
                     inner_searches=len(cut), inner_cut_off=sum(cut.values()), pipeline_workers=self.workers,
                     retries_pruned=self.retries_pruned,
                     pipelined_first=self.first,
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

    @property
    def compute_floor(self) -> float:
        """``pipeline_bounds.device_compute_floor`` of this search's model and cluster (once)."""
        return self._device_floors()[0]

    @property
    def block_floor(self) -> float:
        """``pipeline_bounds.device_block_floor`` of this search's model and cluster (once)."""
        return self._device_floors()[1]

    @property
    def recompute_floor(self) -> float:
        """``pipeline_bounds.device_recompute_floor`` of this search's model and cluster (once)."""
        return self._device_floors()[2]

    def _device_floors(self) -> tuple:
        if self._floors is None:
            self._floors = device_floors(self.graph, self.cluster, self.base, recompute=True)
        return self._floors

    def mesh_bound(self, p: int, m: int, sched: str, sp) -> float:
        """``proven_step`` with ``stage_work_floor`` (the candidate's stage sub-mesh priced with its
        micro-batches) as the ranks' mean work, once per (pp, m, sp) (module doc, pruning)."""
        key = (p, m, sp)
        if key not in self.work_floors:
            self.work_floors[key] = stage_work_floor(self.graph, self.cluster, self.base, p, m, self.flat, sp,
                                                     self.grid_memo)
        work = max(self.compute_floor, self.work_floors[key])
        return proven_step(sched, p, m, work, block_time_floor(self.block_floor, p, m))

    def retry_bound(self, p: int, m: int, sched: str) -> float:
        """A proven bound on the step of the candidate's checkpointed retry (every block
        recomputed): ``pipeline_bounds.proven_step`` with the compute floor plus the recompute
        floor as the ranks' mean work (module doc, pruning)."""
        block = block_time_floor(self.block_floor, p, m)
        work = self.compute_floor + self.recompute_floor
        return proven_step(sched, p, m, work, block) if ORDER_LP else least_pipelined_step(sched, p, m, work, block)

    def candidates(self, base_compute: float, sp_for=None) -> list[tuple]:
        """(bound, pp, schedule index, m, schedule, sp) of every candidate, the bound what prunes
        it (module doc: the estimate from ``base_compute``, the pp=1 plan's compute, or with
        ``PROVEN_BOUNDS`` its least step); ``sp_for(stage cluster)``: the sequence-axis sizes to
        pin with that stage sub-mesh (None: no sequence axis)."""
        batch = global_batch(self.graph)
        out = []
        for p in self.degrees or pp_choices(self.graph, self.cluster, self.flat):
            sps = [None] if sp_for is None else sp_for(stage_cluster(self.cluster, p))
            for sp in sps:
                for sched in self.schedules:
                    for m in micro_batch_counts(p, batch, self.cluster):
                        if "num_micro_batches" in self.flat and self.flat["num_micro_batches"] != m:
                            continue
                        bound = least_pipelined_step(sched, p, m, self.compute_floor,
                                                     block_time_floor(self.block_floor, p, m)) if PROVEN_BOUNDS \
                            else base_compute * equal_stage_factor(sched, p, m)
                        out.append((bound, p, self.schedules.index(sched), m, sched, sp or 0))
        return out

    @staticmethod
    def estimate(base_compute: float, candidate: tuple) -> float:
        """The visiting order's key: ``base_compute`` with the equal-stage fill and drain."""
        _, p, _, m, sched, _ = candidate
        return base_compute * equal_stage_factor(sched, p, m)

    def run(self, best, best_stats, best_pipe=None, sp_for=None, base_compute=None):
        """The best of (``best``, ``best_pipe``) and the pipelined candidates: (Result, stats, pipe).
        Visited in order of their estimate from ``base_compute`` (the pp=1 plan's compute; default
        ``best``'s), pruned by their bound (module doc, pruning). In forked workers when that pays
        (autopar/search/pipeline_forked.py), else here, in order."""
        best_time = step_time(best, best_pipe) if best is not None else float("inf")
        if base_compute is None:
            base_compute = best.prediction["time_breakdown"]["compute"] if best is not None else 0.0
        order = sorted(self.candidates(base_compute, sp_for),
                       key=lambda c: (self.estimate(base_compute, c), c[1:]))
        workers = fork_workers(self, order, best_time)
        if workers > 1:
            return run_forked(self, order, workers, best, best_stats, best_pipe, best_time)
        for bound, p, _, m, sched, sp in order:
            if PROVEN_BOUNDS and ORDER_LP and bound < best_time:   # the order LP, only where it may prune
                bound = proven_step(sched, p, m, self.compute_floor, block_time_floor(self.block_floor, p, m))
                if MESH_WORK_FLOOR and bound < best_time:
                    bound = max(bound, self.mesh_bound(p, m, sched, sp))
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
        stage partition fits (its smallest peak kept for pipeline_search's step 3)."""
        kw, limit = self.kw, self.kw.get("time_limit")
        pins = dict(self.flat, pp=p, pp_schedule=sched, num_micro_batches=m, **({"sp": sp} if sp else {}))
        kw_left = kw if limit is None else dict(kw, time_limit=max(1.0, limit - (time.perf_counter() - self.t0)))
        if INNER_CUTOFF and best_time < float("inf"):   # inner plans whose work over p stages cannot beat it
            # with the least fill and drain of the schedules sharing this inner search (module doc)
            factor = 1.0 if not INNER_FILL_DRAIN else \
                cutoff_factor(self.schedules, p, m, best_time, block_time_floor(self.block_floor, p, m),
                              order=ORDER_LP) \
                if PROVEN_BOUNDS else min(equal_stage_factor(sched, p, m) for sched in self.schedules)
            kw_left = dict(kw_left, cutoff=best_time * p, cutoff_fill_drain=factor)
        retried = CHECKPOINTED and "checkpoint" not in self.flat and sched != "zero-bubble"
        # a first attempt whose MemoryBudgetError only sends it to the checkpointed retry: that
        # error's smallest peak is never read, so its inner search does not solve for it (its
        # inner plan, if any, is the same); ``inner_cache`` shares an inner search between the
        # schedules, so only where every schedule of this object is retried
        lazy = retried and "zero-bubble" not in self.schedules
        try:
            first_fit = True
            try:
                # its configurations that no stage partition fits are pruned before their ILP, under
                # every schedule sharing the inner search (autopar/search/stage_memory_floor.py)
                first = dict(kw_left, min_peak=False,
                             stage_memory=StageMemory(p, m, self.base.budget, tuple(self.schedules))) \
                    if lazy else kw_left
                out = ("ok", *search_pipelined(self.graph, self.cluster, self.base, pins, self.cached_search,
                                               **first))
            except MemoryBudgetError:
                if not retried:
                    raise
                out, first_fit = None, False
            except CutOff:
                if not retried:
                    raise
                out = None
            if not retried:
                return out
            # every block recomputed, also where the first attempt fits: recomputation frees the
            # memory of configurations faster than the first attempt's plan (1T: pp=8 fits without
            # it under ZeRO-3 at 93 s or more, cut off; with every block recomputed 77.04 s), so a
            # pin such as Megatron-LM's 1T run (pp=64, checkpoint="full") is among the candidates
            beat = best_time if out is None else min(best_time, out[3]["step_time"])
            if RETRY_BOUND and beat < float("inf") and self.retry_bound(p, m, sched) >= beat:
                self.retries_pruned += 1   # recomputing every block cannot beat it
                return out if out is not None else ("skip",)
            # with a plan in hand (``beat``) nobody reads the retry's smallest peak (only a search
            # with no plan at all names it): its configurations that no stage partition fits are
            # pruned before their ILP, as the first attempt's
            again_kw = dict(kw_left, min_peak=False,
                            stage_memory=StageMemory(p, m, self.base.budget, tuple(self.schedules))) \
                if beat < float("inf") and "zero-bubble" not in self.schedules else kw_left
            try:
                again = ("ok", *search_pipelined(self.graph, self.cluster, self.base, dict(pins, checkpoint="full"),
                                                 self.cached_search, **again_kw))
            except (PlanError, CutOff):   # MemoryBudgetError among them
                if out is None and not first_fit:
                    raise
                return out if out is not None else ("skip",)
            return again if out is None or again[3]["step_time"] < out[3]["step_time"] else out
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


__all__ = ["Pipelined", "micro_batch_counts", "pp_choices", "step_time", "SCHEDULES"]
