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
    # rank -> its stages' alive changes in time order, [(stage, +1 | -1)]; None: read off ``alive``
    rank_events: dict | None = None

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
        if self.rank_events is not None:   # a rank's events in its own order are their order in time
            out = {}
            for rank, seq in self.rank_events.items():
                cur = best = 0.0
                for stage, d in seq:
                    cur += d * float(per_micro_batch[stage])
                    best = max(best, cur)
                out[rank] = best
            return {r: v for r, v in out.items() if self.rank_events[r]}
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


class _Program(NamedTuple):
    """One orders object under the dependency model, durations aside (``_compiled``): its actions
    in an order where every action comes after those it waits for; per action its rank's index,
    its cost's index (4 x stage + kind), and up to two actions it waits for (-1: none), each with
    the transfer in between (0: none, or free on one rank; 1 + s: boundary s's activation; n + s:
    its gradient). ``alive`` / ``held``: per stage, (action starting, action ending) each
    micro-batch's span; ``events`` / ``held_events``: per rank, its stages' counts changing in the
    rank's own order ((stage, +1) at an F's start, (stage, -1) at the end of the B or W freeing it;
    held: an I's end to its W's end), their order in time when every action takes time."""
    ranks: list
    acts: list
    rank: list
    cost: list
    dep1: list
    x1: list
    dep2: list
    x2: list
    alive: dict
    held: dict
    events: dict
    held_events: dict


_COMPILED: dict[int, tuple] = {}   # id(orders) -> (orders, _Program)


def _compiled(orders, n: int, stage_rank: dict) -> _Program:
    """The orders' ``_Program``, once per orders object (runtime/pipeline_orders.py caches them)."""
    hit = _COMPILED.get(id(orders))
    if hit is not None and hit[0] is orders:
        return hit[1]
    ranks = list(orders)
    M = 1 + max((m for seq in orders.values() for _k, _s, m in seq), default=0)
    F, B, I, W, G = (k * n * M for k in range(5))   # an action (kind, s, m) is kind's base + s M + m
    base = {"F": F, "B": B, "I": I, "W": W}
    kind_index = {k: i for i, k in enumerate(KINDS)}
    act_x = [0 if stage_rank[s] == stage_rank[s + 1] else 1 + s for s in range(n - 1)]
    grad_x = [0 if stage_rank[s] == stage_rank[s + 1] else n + s for s in range(n - 1)]
    index = [-1] * (5 * n * M)   # action id -> its place in the program
    acts, rank, cost, dep1, x1, dep2, x2 = [], [], [], [], [], [], []
    # Event-driven: a blocked rank waits on the one dependency it lacks and is woken when that
    # action is placed, so the work is linear in the number of actions.
    pos = [0] * len(ranks)
    seqs = [[(base[k], kind_index[k], s, m) for k, s, m in orders[r]] for r in ranks]
    waiting: dict[int, list] = {}
    queue = deque(range(len(ranks)))
    while queue:
        r = queue.popleft()
        seq = seqs[r]
        while pos[r] < len(seq):
            kb, ki, s, m = seq[pos[r]]
            sm = s * M + m
            d1 = d2 = -1
            c1 = c2 = 0
            missing = -1
            if kb == F:   # F(s, m) waits for F(s-1, m) and the activation's transfer
                if s:
                    d1, c1 = index[F + sm - M], act_x[s - 1]
                    if d1 < 0:
                        missing = F + sm - M
            elif kb == W:   # W waits for its I
                d1 = index[I + sm]
                if d1 < 0:
                    missing = I + sm
            else:   # B / I wait for their F and, below the last stage, stage s+1's B or I ("G")
                d1 = index[F + sm]
                if d1 < 0:
                    missing = F + sm
                elif s < n - 1:
                    d2, c2 = index[G + sm + M], grad_x[s]
                    if d2 < 0:
                        missing = G + sm + M
            if missing >= 0:
                waiting.setdefault(missing, []).append(r)
                break
            i = len(acts)
            acts.append((KINDS[ki], s, m))
            rank.append(r)
            cost.append(4 * s + ki)
            dep1.append(d1)
            x1.append(c1)
            dep2.append(d2)
            x2.append(c2)
            index[kb + sm] = i
            pos[r] += 1
            woken = waiting.pop(kb + sm, None)
            if woken:
                queue.extend(woken)
            if kb == B or kb == I:
                index[G + sm] = i
                woken = waiting.pop(G + sm, None)
                if woken:
                    queue.extend(woken)
    if any(pos[r] < len(seqs[r]) for r in range(len(ranks))):
        stuck = {ranks[r]: tuple(orders[ranks[r]][pos[r]]) for r in range(len(ranks)) if pos[r] < len(seqs[r])}
        raise PlanError(f"pipeline order deadlocks: each rank's next action waits on another: {stuck}")
    alive: dict[int, list] = {s: [] for s in range(n)}
    held: dict[int, list] = {s: [] for s in range(n)}
    for i, (kind, s, m) in enumerate(acts):
        sm = s * M + m
        if kind == "F":
            alive[s].append((i, index[B + sm] if index[B + sm] >= 0 else index[W + sm]))
        elif kind == "I":
            held[s].append((i, index[W + sm]))
    events, held_events = rank_alive_changes(orders)
    prog = _Program(ranks, acts, rank, cost, dep1, x1, dep2, x2, alive, held, events, held_events)
    if len(_COMPILED) > 256:
        _COMPILED.clear()
    _COMPILED[id(orders)] = (orders, prog)
    return prog


def rank_alive_changes(orders) -> tuple[dict, dict]:
    """Per rank, its stages' counts of micro-batches alive changing in the rank's own order:
    ``[(stage, +1)]`` at each F (its start), ``[(stage, -1)]`` at the end of the B freeing it (or of
    its W under split backward); and the same for the micro-batches between an I's end and its
    W's end (``held_for_weight``). A rank runs one action at a time, so when every action takes
    time this is their order in time and a simulation's counts (``peak_alive``) follow from the
    orders alone, without the durations (each rank's actions in one pass)."""
    events: dict = {}
    held: dict = {}
    for r, acts in orders.items():
        ev = events[r] = []
        hev = held[r] = []
        for k, s, m in acts:
            if k == "F":
                ev.append((s, 1))
            elif k == "B":
                ev.append((s, -1))
            elif k == "I":
                hev.append((s, 1))
            elif k == "W":   # split backward: no B, its W frees the micro-batch
                hev.append((s, -1))
                ev.append((s, -1))
    return events, held


def peak_alive_counts(orders, n: int) -> dict[int, int]:
    """stage -> most micro-batches alive at once under ``orders`` when every action takes time
    (``rank_alive_changes``): what ``simulate(...).peak_alive`` gives for any positive durations."""
    return _ordered_peaks(rank_alive_changes(orders)[0], n)


def _ordered_peaks(events: dict, n: int) -> dict[int, int]:
    """Each stage's largest count, its rank's changes taken in the rank's order (``_Program``)."""
    best = {s: 0 for s in range(n)}
    for seq in events.values():
        cur: dict[int, int] = {}
        for s, d in seq:
            c = cur[s] = cur.get(s, 0) + d
            if c > best[s]:
                best[s] = c
    return best


def simulate(orders: Mapping[int, Sequence[Sequence]], durations: StageDurations,
             timeline: bool = True) -> SimulatedSchedule:
    """Run the orders under the dependency model in the module docstring.

    ``timeline=False`` leaves ``intervals`` and ``transfers`` empty (a planner pricing many
    candidates needs only the step time, bubble and memory). The dependencies are read once per
    orders object (``_compiled``); each simulation is then one pass over the actions.
    """
    n, stage_rank = _check(orders, durations)
    prog = _compiled(orders, n, stage_rank)
    act = list(durations.p2p_activation) or [0.0] * max(n - 1, 0)
    grad = list(durations.p2p_gradient) if durations.p2p_gradient else act
    xt = [0.0] + [float(a) for a in act] + [float(g) for g in grad]   # transfer codes 1 + s, n + s
    table = []
    for s in range(n):
        fi, fw = float(durations.backward_input[s]), float(durations.backward_weight[s])
        table.extend((float(durations.forward[s]), fi + fw, fi, fw))   # KINDS order: F, B, I, W
    costs = [table[c] for c in prog.cost]
    N, R = len(costs), len(prog.ranks)
    start, end = [0.0] * N, [0.0] * N
    free, busy = [0.0] * R, [0.0] * R
    for i, (r, c, d1, c1, d2, c2) in enumerate(zip(prog.rank, costs, prog.dep1, prog.x1, prog.dep2, prog.x2)):
        t = free[r]   # each action as soon as its rank is free and its inputs exist
        if d1 >= 0:
            e = end[d1] + xt[c1]
            if e > t:
                t = e
        if d2 >= 0:
            e = end[d2] + xt[c2]
            if e > t:
                t = e
        start[i] = t
        free[r] = end[i] = e = t + c
        busy[r] += e - t
    ranks = prog.ranks
    intervals: list[Interval] = []
    transfers: list[Transfer] = []
    if timeline:
        intervals = [Interval(ranks[r], k, s, m, a, b) for (k, s, m), r, a, b in zip(prog.acts, prog.rank, start, end)]
        for (kind, s, m), b in zip(prog.acts, end):
            if kind == "F" and s < n - 1 and stage_rank[s] != stage_rank[s + 1]:
                transfers.append(Transfer("activation", s, s + 1, m, stage_rank[s], stage_rank[s + 1], b,
                                          b + xt[1 + s]))
            if kind in ("B", "I") and s > 0 and stage_rank[s] != stage_rank[s - 1]:
                transfers.append(Transfer("gradient", s, s - 1, m, stage_rank[s], stage_rank[s - 1], b,
                                          b + xt[n + s - 1]))
    step = max(free, default=0.0)
    bubble = sum(step - b for b in busy)
    alive = {s: [(start[a], end[b]) for a, b in v] for s, v in prog.alive.items()}
    positive = min(costs, default=1.0) > 0.0
    if positive:   # every action takes time: a rank's changes come in its own order
        peak_alive, held = _ordered_peaks(prog.events, n), _ordered_peaks(prog.held_events, n)
    else:   # at equal times a free is counted before an allocation
        def peaks(spans):
            return {s: int(round(_peak([e for a, b in v for e in ((a, 1, 1.0), (b, 0, -1.0))])))
                    for s, v in spans.items()}
        peak_alive = peaks(alive)
        held = peaks({s: [(end[a], end[b]) for a, b in v] for s, v in prog.held.items()})
    return SimulatedSchedule(
        step_time=step, intervals=sorted(intervals, key=lambda i: (i.rank, i.start)),
        transfers=sorted(transfers, key=lambda t: t.start), stage_rank=stage_rank,
        busy={ranks[r]: busy[r] for r in range(R)},
        bubble_time=bubble, bubble_fraction=bubble / (len(orders) * step) if step > 0 else 0.0,
        peak_alive=peak_alive, held_for_weight=held, alive=alive, rank_events=prog.events if positive else None)
