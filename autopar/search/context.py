"""The explicit state of the search: what one ``autopar.plan`` call's searches share
(``PlanCaches``), the options of one search (``SearchOptions``), its counters (``SearchStats``)
and the state one search carries from configuration to configuration (``SearchContext``: the
incumbent, the deadline, the caches, the counters). autopar/search/outer.py reads and updates it.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

from autopar.cluster import Cluster
from autopar.pricing.price import Settings
from autopar.rules.candidates import Candidates, candidates
from autopar.search.configurations import Config


@dataclass
class PlanCaches:
    """What every search of one plan shares: pp=1, each pipelined candidate's inner search on a
    stage's sub-mesh, the reruns with a sequence axis. Nothing here changes a plan, only how
    often it is computed."""
    candidates: dict = field(default_factory=dict)   # policy -> mesh -> Candidates (and their pricing memos)
    zero1_lp: dict = field(default_factory=dict)   # (policy, mesh) -> {LP key: ZeRO-1's LP bound} (outer._visit)
    reshards: dict = field(default_factory=dict)   # link family -> reshard traffic (Candidates.reshards)
    grid_bounds: dict = field(default_factory=dict)   # grid bound parts (autopar/search/grid_bound.py)

    def candidates_of(self, graph, mesh, policy) -> Candidates:
        """The candidates of ``graph`` on ``mesh`` under ``policy``, built once."""
        by_mesh = self.candidates.setdefault(policy, {})
        if mesh not in by_mesh:
            by_mesh[mesh] = candidates(graph, mesh, policy, reshards=self.reshards)
        return by_mesh[mesh]


@dataclass(frozen=True)
class SearchOptions:
    """How one search runs (outer.search's keywords).

    ``exhaustive``: every configuration solved (no bound pruning, no time limit: the reference the
    pruned search must match, used by tests); ``progress``: the live progress line on or off
    (default: when stderr is a terminal); ``max_zero``: the highest unpinned ZeRO stage (pipelined
    stages: autopar/search/pipeline_pins.py ``max_zero``); ``cutoff`` (seconds): a configuration
    whose work bound W reaches it (with ``cutoff_fill_drain`` F > 1, a pipeline's proven fill and
    drain, autopar/search/pipeline_bounds.py: also one whose W minus its optimizer step, bounded
    by ``optimizer_ceiling``, reaches it over F) is not solved, and ``CutOff`` is raised if that
    leaves no plan; ``before_large(best, lp)``: asked before a large ILP (outer.search's doc);
    ``min_peak``: whether a MemoryBudgetError states the smallest peak (below)."""
    time_limit: float | None = None
    log: object = None
    policy: str | None = None
    exhaustive: bool = False
    progress: bool | None = None
    max_zero: int = 3
    cutoff: float | None = None
    cutoff_fill_drain: float = 1.0
    before_large: object = None
    # False: when nothing fits, the MemoryBudgetError carries no smallest peak (no min-peak ILPs,
    # no edges priced for it): a pipelined candidate's first inner search, whose error only sends
    # it to its checkpointed retry (autopar/search/pipeline_candidates.py ``_evaluate``)
    min_peak: bool = True
    # a pipelined candidate's inner search (autopar/search/stage_memory_floor.py ``StageMemory``):
    # its configurations that no stage partition fits are pruned before their ILP (visit.py
    # ``_stage_memory``); None elsewhere
    stage_memory: object = None


@dataclass
class SearchStats:
    """A search's counters. The first five (and ``seconds``) are always reported, the others
    only once they count something."""
    configs: int = 0
    pruned: int = 0
    solved: int = 0
    infeasible: int = 0
    gap: float = 0.0
    cut_off: int = 0   # configurations the cutoff pruned
    pruned_unpriced: int = 0   # pruned by the resharding floors, edges not priced
    lp_reused: int = 0   # ZeRO-2 LP bounds taken from ZeRO-1's
    lp_bounds: int = 0   # LP bounds solved
    timed_out: int = 0   # configurations the time limit cut short
    large_ilps: int = 0   # large ILPs that sent the search to the pipelined candidates first
    mip_pruned: int = 0   # pruned by the branch and bound's proof
    stage_floor_pruned: int = 0   # inner configurations no stage partition fits (visit._stage_memory)
    host_exceeded: int = 0   # offloaded configurations whose host bytes exceed the node's share
    host_min_need: float | None = None   # the least host bytes per rank any of those needed
    solve_seconds: float = 0.0
    saved_copy_resolves: int = 0
    exact_min_peak: float | None = None   # smallest peak with the saved copies, of plans over budget
    grid_min_peak: float | None = None   # smallest peak of grid plans over budget
    seconds: float | None = None

    ALWAYS = ("configs", "pruned", "solved", "infeasible", "gap")

    def as_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in self.ALWAYS or (v is not None and v != 0):
                out[f.name] = v
        return out


@dataclass
class Planner:
    """The searches of one ``autopar.plan`` call: the model, the cluster and base settings, the
    pp=1 search (outer.search) and the options every call of it gets (``caches`` among them: the
    plan's ``PlanCaches``)."""
    graph: object
    cluster: Cluster
    base: Settings
    search_fn: object
    kw: dict

    def search(self, constraints: dict, **overrides):
        """The pp=1 search of the whole cluster under ``constraints`` (``overrides``: options)."""
        return self.search_fn(self.graph, self.cluster, self.base, constraints, **dict(self.kw, **overrides))


@dataclass
class SearchContext:
    """One search's state: its inputs, the incumbent (``best``: a Result, a plan found elsewhere
    as an ``Incumbent``, or None), the deadline (``t0`` + ``options.time_limit``), the caches it
    shares with the plan's other searches, its counters and the configurations kept for the
    MemoryBudgetError (``infeasible``: (problem, candidates, priced); ``memory_floors``:
    (config, priced) whose static memory alone exceeds the budget)."""
    graph: object
    cluster: Cluster
    base: Settings
    constraints: dict   # validated pins (autopar.constraints.Constraints.to_dict)
    options: SearchOptions
    caches: PlanCaches
    policy: str | None = None
    t0: float = field(default_factory=time.perf_counter)
    best: object = None
    stats: SearchStats = field(default_factory=SearchStats)
    infeasible: list = field(default_factory=list)
    memory_floors: list = field(default_factory=list)

    def candidates(self, mesh) -> Candidates:
        return self.caches.candidates_of(self.graph, mesh, self.policy)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def best_time(self) -> float:
        return math.inf if self.best is None else self.best.prediction["step_time"]


@dataclass
class Incumbent:
    """A plan found outside this search (a pipelined one: autopar/search/pipeline_candidates.py),
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


class CutOff(Exception):
    """``search`` found no plan because its ``cutoff`` pruned the configurations, or none beats
    the plan found elsewhere (``Incumbent``). Internal control flow, not a PlanError: the
    pipelined search skips that candidate."""


__all__ = ["Incumbent", "Result", "CutOff", "PlanCaches", "Planner", "SearchOptions", "SearchStats", "SearchContext"]
