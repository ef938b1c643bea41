"""Pipeline schedule simulation: step time, bubble and live micro-batches of a per-rank action order.

Input: the order each rank runs its compute actions in (runtime/pipeline_orders.py takes it from
torch.distributed.pipelining, so what is priced is what torch runs) and per-stage durations.
An action is ``(kind, stage, micro_batch)``: ``F`` forward, ``B`` full backward, ``I``
input-gradient backward, ``W`` weight-gradient backward (zero-bubble schedules split B into I, W).

The model (kept simple on purpose, every rule visible here):

* Each rank runs its actions one at a time, in the given order, each as soon as its inputs exist.
* F(s, mb) needs F(s-1, mb) finished plus the activation transfer across boundary s-1.
* B or I (s, mb) needs F(s, mb) and, below the last stage, B/I(s+1, mb) finished plus the
  gradient transfer across boundary s. W(s, mb) needs I(s, mb). B costs I + W.
* Transfers are asynchronous (torch posts isend/irecv; the receiver waits): they delay the
  consumer, never occupy the sender. Two stages on the same rank (the V placement) transfer free.
  An approximation: torch's Schedule1F1B waits for a forward send together with the next
  backward receive (one batched p2p), which can hold a sender a little longer than modelled.
* Memory: micro-batch mb's saved activations on stage s are alive from the start of F(s, mb)
  until the end of its B, or of its W under split backward. Counting them alive until W is exact
  for torch 2.13, whose input-gradient pass keeps the whole autograd graph (``retain_graph=True``)
  for the weight pass; the gradients w.r.t. intermediates that torch also holds between I and W
  are not counted here (``held_for_weight`` reports how many micro-batches are in that state, so a
  caller can add them). At equal times a free is counted before an allocation.

Bubble: per rank, step time minus busy time; the fraction is total idle over ranks x step time.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Sequence

from solver.errors import PlanError

KINDS = ("F", "B", "I", "W")


@dataclass(frozen=True)
class StageDurations:
    """Per-stage durations in seconds for one micro-batch; boundary s joins stage s and s+1."""
    forward: Sequence[float]
    backward_input: Sequence[float]
    backward_weight: Sequence[float]
    p2p_activation: Sequence[float] = ()   # len stages-1 (or empty = free)
    p2p_gradient: Sequence[float] | None = None  # default: same as p2p_activation

    @classmethod
    def uniform(cls, stages: int, forward: float, backward_input: float, backward_weight: float,
                p2p: float = 0.0) -> "StageDurations":
        return cls([forward] * stages, [backward_input] * stages, [backward_weight] * stages,
                   [p2p] * max(stages - 1, 0))

    def first_stage_backward_in_weight_pass(self) -> "StageDurations":
        """The durations torch 2.13 really spends under split backward (zero-bubble schedules):
        stage 0 has no input gradient to send, so its I action does nothing and its W action runs
        the whole backward (PipelineStage.backward_one_chunk / backward_weight_one_chunk)."""
        bi, bw = list(self.backward_input), list(self.backward_weight)
        if bi:
            bi[0], bw[0] = 0.0, bi[0] + bw[0]
        return StageDurations(self.forward, bi, bw, self.p2p_activation, self.p2p_gradient)


class Interval(NamedTuple):   # NamedTuples, not frozen dataclasses: ~10x cheaper to build
    rank: int
    kind: str          # F, B, I, W
    stage: int
    micro_batch: int
    start: float
    end: float


class Transfer(NamedTuple):
    kind: str          # "activation" (stage -> stage+1) or "gradient" (stage+1 -> stage)
    src_stage: int
    dst_stage: int
    micro_batch: int
    src_rank: int
    dst_rank: int
    start: float
    end: float


@dataclass
class SimulatedSchedule:
    step_time: float
    intervals: list[Interval]
    transfers: list[Transfer]
    stage_rank: dict[int, int]
    busy: dict[int, float]                 # rank -> seconds computing
    bubble_time: float                     # idle seconds summed over ranks
    bubble_fraction: float                 # bubble_time / (ranks * step_time)
    peak_alive: dict[int, int]             # stage -> most micro-batches' activations alive at once
    held_for_weight: dict[int, int]        # stage -> most micro-batches between their I and W
    alive: dict[int, list[tuple[float, float]]] = field(default_factory=dict)  # stage -> [(from, to)]

    @property
    def ranks(self) -> list[int]:
        return sorted(self.busy)

    def idle(self, rank: int) -> float:
        return self.step_time - self.busy[rank]

    def peak_rank_memory(self, per_micro_batch: Mapping[int, float]) -> dict[int, float]:
        """rank -> peak of sum(alive micro-batches x per_micro_batch[stage]) over its stages.

        With interleaving one rank holds several stages whose peaks need not coincide, so the
        rank's peak is taken over time here, not summed from per-stage peaks.
        """
        events: dict[int, list[tuple[float, int, float]]] = {}
        for stage, spans in self.alive.items():
            w = float(per_micro_batch[stage])
            for a, b in spans:
                events.setdefault(self.stage_rank[stage], []).extend([(a, 1, w), (b, 0, -w)])
        return {rank: _peak(ev) for rank, ev in events.items()}


def _peak(events: list[tuple[float, int, float]]) -> float:
    # (time, order, delta): order 0 (a free) sorts before 1 (an allocation) at equal times.
    cur = best = 0.0
    for _t, _o, d in sorted(events):
        cur += d
        best = max(best, cur)
    return best


_CHECKED: dict[int, tuple] = {}   # id(orders) -> (orders, stages, stage_rank): the orders planners reuse, checked once


def _check_orders(orders):
    """Every action once, each stage's micro-batches complete: (stages, stage -> rank). An
    orders object already checked (runtime/pipeline_orders.py caches them) is not checked again."""
    hit = _CHECKED.get(id(orders))
    if hit is not None and hit[0] is orders:
        return hit[1], hit[2]
    seen: dict[tuple[str, int, int], int] = {}
    for rank, acts in orders.items():
        for a in acts:
            kind, stage, mb = a
            if kind not in KINDS:
                raise PlanError(f"pipeline action {a!r} on rank {rank}: kind must be one of {KINDS}")
            if (kind, stage, mb) in seen:
                raise PlanError(f"pipeline action {a!r} appears twice (ranks {seen[(kind, stage, mb)]}, {rank})")
            seen[(kind, stage, mb)] = rank
    stages = sorted({s for _k, s, _m in seen})
    mbs = sorted({m for (k, s, m) in seen if k == "F" and s == 0})
    for s in stages:
        for m in mbs:
            has = {k for k in KINDS if (k, s, m) in seen}
            if "F" not in has or not (has == {"F", "B"} or has == {"F", "I", "W"}):
                raise PlanError(f"stage {s} micro-batch {m} has actions {sorted(has)}; need F and B, or F, I and W")
    stage_rank = {s: r for (k, s, m), r in seen.items()}
    if len(_CHECKED) > 256:
        _CHECKED.clear()
    _CHECKED[id(orders)] = (orders, stages, stage_rank)
    return stages, stage_rank


def _check(orders, durations: StageDurations):
    stages, stage_rank = _check_orders(orders)
    n = len(durations.forward)
    if stages != list(range(n)):
        raise PlanError(f"orders cover stages {stages} but durations are given for {n} stages")
    for name in ("backward_input", "backward_weight"):
        if len(getattr(durations, name)) != n:
            raise PlanError(f"StageDurations.{name} has {len(getattr(durations, name))} entries, need {n}")
    for name in ("p2p_activation", "p2p_gradient"):
        v = getattr(durations, name)
        if v is not None and len(v) not in (0, n - 1):
            raise PlanError(f"StageDurations.{name} has {len(v)} entries, need {n - 1} (one per boundary)")
    return n, stage_rank


def simulate(orders: Mapping[int, Sequence[Sequence]], durations: StageDurations,
             timeline: bool = True) -> SimulatedSchedule:
    """Run the orders under the dependency model in the module docstring.

    ``timeline=False`` leaves ``intervals`` and ``transfers`` empty (a planner pricing many
    candidates needs only the step time, bubble and memory; about half the work at scale).
    """
    n, stage_rank = _check(orders, durations)
    act = list(durations.p2p_activation) or [0.0] * max(n - 1, 0)
    grad = list(durations.p2p_gradient) if durations.p2p_gradient else act

    def xfer(times, s):  # boundary s (stage s <-> s+1); free when both stages share a rank
        return 0.0 if stage_rank[s] == stage_rank[s + 1] else float(times[s])

    costs = {}
    for s in range(n):
        fi, fw = float(durations.backward_input[s]), float(durations.backward_weight[s])
        costs.update({("F", s): float(durations.forward[s]), ("I", s): fi, ("W", s): fw, ("B", s): fi + fw})

    done: dict[tuple[str, int, int], tuple[float, float]] = {}   # action -> (start, end)
    transfers: list[Transfer] = []

    def ready(kind, s, m):
        """(earliest start allowed by dependencies, None) or (None, the missing dependency)."""
        if kind == "F":
            if s == 0:
                return 0.0, None
            prev = done.get(("F", s - 1, m))
            return (None, ("F", s - 1, m)) if prev is None else (prev[1] + xfer(act, s - 1), None)
        if kind == "W":
            i = done.get(("I", s, m))
            return (None, ("I", s, m)) if i is None else (i[1], None)
        f = done.get(("F", s, m))
        if f is None:
            return None, ("F", s, m)
        if s == n - 1:
            return f[1], None
        nxt = done.get(("G", s + 1, m))   # stage s+1's input gradient: its B or I
        return (None, ("G", s + 1, m)) if nxt is None else (max(f[1], nxt[1] + xfer(grad, s)), None)

    # Event-driven: a blocked rank waits on the one dependency it lacks and is woken when that
    # action finishes, so the work is linear in the number of actions.
    pos = {r: 0 for r in orders}
    free_at = {r: 0.0 for r in orders}
    busy = {r: 0.0 for r in orders}
    intervals: list[Interval] = []
    waiting: dict[tuple, list] = {}
    queue = deque(orders)
    while queue:
        r = queue.popleft()
        acts = orders[r]
        while pos[r] < len(acts):
            kind, s, m = acts[pos[r]]
            t, missing = ready(kind, s, m)
            if missing is not None:
                waiting.setdefault(missing, []).append(r)
                break
            start = max(free_at[r], t)
            end = start + costs[(kind, s)]
            done[(kind, s, m)] = (start, end)
            finished = [(kind, s, m)]
            if kind in ("B", "I"):
                done[("G", s, m)] = (start, end)
                finished.append(("G", s, m))
            busy[r] += end - start
            if timeline:
                intervals.append(Interval(r, kind, s, m, start, end))
            free_at[r] = end
            pos[r] += 1
            for key in finished:
                queue.extend(waiting.pop(key, ()))
    if any(pos[r] < len(orders[r]) for r in orders):
        stuck = {r: tuple(orders[r][pos[r]]) for r in orders if pos[r] < len(orders[r])}
        raise PlanError(f"pipeline order deadlocks: each rank's next action waits on another: {stuck}")
    done = {k: v for k, v in done.items() if k[0] != "G"}

    for (kind, s, m), (_a, end) in (done.items() if timeline else ()):
        if kind == "F" and s < n - 1 and stage_rank[s] != stage_rank[s + 1]:
            transfers.append(Transfer("activation", s, s + 1, m, stage_rank[s], stage_rank[s + 1],
                                      end, end + xfer(act, s)))
        if kind in ("B", "I") and s > 0 and stage_rank[s] != stage_rank[s - 1]:
            transfers.append(Transfer("gradient", s, s - 1, m, stage_rank[s], stage_rank[s - 1],
                                      end, end + xfer(grad, s - 1)))

    step = max(free_at.values(), default=0.0)
    bubble = sum(step - b for b in busy.values())
    alive: dict[int, list[tuple[float, float]]] = {s: [] for s in range(n)}
    held: dict[int, list[tuple[float, float]]] = {s: [] for s in range(n)}
    for (kind, s, m), (a, end) in done.items():
        if kind == "F":
            freed = done.get(("B", s, m)) or done[("W", s, m)]
            alive[s].append((a, freed[1]))
        elif kind == "I":
            held[s].append((end, done[("W", s, m)][1]))

    def peaks(spans):
        return {s: int(round(_peak([e for a, b in v for e in ((a, 1, 1.0), (b, 0, -1.0))]))) for s, v in spans.items()}

    return SimulatedSchedule(
        step_time=step, intervals=sorted(intervals, key=lambda i: (i.rank, i.start)),
        transfers=sorted(transfers, key=lambda t: t.start), stage_rank=stage_rank, busy=busy,
        bubble_time=bubble, bubble_fraction=bubble / (len(orders) * step) if step > 0 else 0.0,
        peak_alive=peaks(alive), held_for_weight=peaks(held), alive=alive)
