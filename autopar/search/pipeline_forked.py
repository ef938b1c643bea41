"""The pipelined candidates in forked worker processes (autopar/search/candidate_workers.py).

With more than one core and no ``time_limit``, once the pp=1 search took ``FORK_MIN_SECONDS``, the
candidates of ``pipeline_candidates.Pipelined`` are evaluated in forked workers, a lane per
pipeline degree so that a stage sub-mesh's caches and inner plans are built once
(``run_forked``). A candidate is handed out unless its bound reaches the best step time known at
that moment, and its inner cutoff is that time times p (any plan found bounds it); the plan is
the least step time, the earlier candidate on a tie, as in order. Workers send back step times;
the winner's plan is then fetched from its worker, its candidates rebuilt here (evaluated again
here, with the incumbent its worker had, if that fails). Forking needs Linux and no other Python
thread running (``candidate_workers.can_fork``). ``AUTOPAR_PLAN_WORKERS=1`` plans in one process.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections import deque

from autopar.errors import PlanError
from autopar.search import candidate_workers
from autopar.search.context import CutOff
from autopar.search.outer import Progress

FORK_WORKERS = True   # candidates in forked processes (tests compare it switched off)
FORK_MIN_SECONDS = 1.0   # ... once the search so far took this long (small models: forking costs more)


def fork_workers(pipe, order, best_time) -> int:
    """Worker processes for ``order`` (autopar/search/candidate_workers.py): only without a time
    limit, with two or more pipeline degrees left to search (a lane per degree), and when the
    pp=1 search took ``FORK_MIN_SECONDS`` (inner searches as cheap as a small model's cost
    less than forking)."""
    if not FORK_WORKERS or pipe.kw.get("time_limit") is not None or not candidate_workers.can_fork():
        return 0
    if time.perf_counter() - pipe.t0 < FORK_MIN_SECONDS:
        return 0
    degrees = {c[1] for c in order if c[0] < best_time}
    return min(candidate_workers.worker_count(), len(degrees)) if len(degrees) > 1 else 0


def in_worker(pipe, task):
    """A worker's answer to ("evaluate", candidate) or ("fetch", candidate) (``run_forked``)."""
    kind, args = task
    return remote(pipe, *args) if kind == "evaluate" else detached(pipe, args)


def remote(pipe, p, m, sched, sp, best_time):
    """What a worker sends back for one candidate: ("ok", step time) or ``Pipelined._evaluate``'s other
    answers, the inner searches it ran ({key: cut off?}) and the floors it found. A plan is
    kept until the parent fetches the winner."""
    before, floors = set(pipe.inner_cache), len(pipe.floors)
    pipe.kw = dict(pipe.kw, progress=False)   # one live progress line: the parent's
    out = pipe._evaluate(p, m, sched, sp, best_time)
    new = {k: isinstance(v, CutOff) for k, v in pipe.inner_cache.items() if k not in before}
    if out[0] != "ok":
        return out[0], None, new, pipe.floors[floors:]
    pipe.kept[(p, m, sched, sp)] = out[1:]
    return "ok", out[3]["step_time"], new, pipe.floors[floors:]


def detached(pipe, key):
    """A kept (Result, stats, pipe) that can cross a pipe: its candidates (fx nodes) replaced by
    where the parent finds or rebuilds them, (policy, mesh); None if they are not in the
    shared cache (the parent then evaluates the candidate again)."""
    result, stats, figures = pipe.kept[key]
    for policy, by_mesh in pipe.kw["caches"].candidates.items():
        for mesh, cands in by_mesh.items():
            if cands is result.cands:
                return dataclasses.replace(result, cands=None), stats, figures, (policy, mesh)
    return None


def attached(pipe, got):
    """``detached``'s answer with its candidates found in, or rebuilt into, the shared cache."""
    result, stats, figures, (policy, mesh) = got
    return dataclasses.replace(result, cands=pipe.kw["caches"].candidates_of(pipe.graph, mesh, policy)), stats, figures


def run_forked(pipe, order, workers, best, best_stats, best_pipe, best_time):
    """``run`` with the candidates evaluated in ``workers`` forked processes (module doc,
    workers). Each pipeline degree belongs to one lane (its sub-mesh's caches built once): a
    free lane takes its degrees' next candidate, else adopts the degree whose next candidate
    comes first. A candidate is handed out unless its bound reaches the best step time known
    then, with the inner cutoff of that time; the plan is the least step time, the earlier
    candidate (``order``) on a tie, as in order. The winner's plan is fetched from its worker;
    evaluated again here if that fails, with the incumbent its worker had when it first
    searched that (pp, m), so the same inner plan."""
    start = best_time   # the incumbent's step time (inf: none)
    pipe.workers = max(pipe.workers, workers)
    pruned0 = pipe.pruned
    queues: dict = {}   # pp -> candidate indices, in order
    for i, c in enumerate(order):
        queues.setdefault(c[1], deque()).append(i)
    owner: dict = {}   # pp -> lane
    first_best: dict = {}   # (pp, m, sp) -> the incumbent its inner search was cut off against
    done: dict = {}
    ran_on: dict = {}   # candidate index -> lane
    busy = [None] * workers
    with candidate_workers.Lanes(workers, functools.partial(in_worker, pipe)) as lanes, \
            _progress(pipe, len(order), workers) as bar:
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
                        pipe.pruned += 1
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
                        pipe.pruned += 1
                        continue
                    done[j] = local_answer(pipe, j, order, best_time, first_best)
                    count(pipe, done[j])
                    if done[j][0] == "ok":
                        best_time = min(best_time, done[j][1])
        top_up()
        while any(b is not None for b in busy):
            lane, i, out = lanes.receive()
            if i is None:   # the worker died with its task: that one and its degrees' rest here
                i, busy[lane] = busy[lane], None
                out = local_answer(pipe, i, order, best_time, first_best)
                ran_on.pop(i)
                here([pp for pp, ln in owner.items() if ln == lane])
            busy[lane] = None
            done[i] = out
            if out[0] == "error":
                raise PlanError(f"a planning worker failed on pipelined candidate {order[i][1:]}: "
                                f"{out[1]}\n{out[2]}")
            count(pipe, out)
            if out[0] == "ok":
                best_time = min(best_time, out[1])
            top_up()
            bar.show(len(done) + pipe.pruned - pruned0,
                     f"pipelined candidates {len(done)} evaluated, {pipe.pruned - pruned0} pruned of {len(order)} "
                     f"in {workers} workers, best {best_time:.4g} s", tag="pipeline")
        here(list(queues))   # left only when every worker died
        won = [i for i, out in done.items() if out[0] == "ok" and out[1] == best_time]
        if not won or (best is not None and start <= best_time):
            return best, best_stats, best_pipe
        i = min(won)
        _, p, _, m, sched, sp = order[i]
        got = None
        if i in ran_on and lanes.alive[ran_on[i]]:
            lanes.send(ran_on[i], i, ("fetch", (p, m, sched, sp)))
            _, j, got = lanes.receive()
            got = got if j == i and isinstance(got, tuple) and len(got) == 4 else None
    if got is not None:
        return attached(pipe, got)
    out = pipe._evaluate(p, m, sched, sp, first_best[(p, m, sp)])
    if out[0] != "ok":
        raise PlanError(f"pipelined candidate pp={p}, m={m}, {sched} planned in a worker but not again "
                        f"here ({out[0]}): planning is not deterministic")
    return out[1:]


def count(pipe, out) -> None:
    """A worker's answer in this search's counters."""
    pipe.remote_inner.update(out[2])
    pipe.floors.extend(out[3])
    if out[0] == "ok":
        pipe.tried += 1


def local_answer(pipe, i, order, best_time, first_best):
    """A candidate whose worker died, evaluated here: an answer shaped as a worker's."""
    _, p, _, m, sched, sp = order[i]
    first_best.setdefault((p, m, sp), best_time)
    out = pipe._evaluate(p, m, sched, sp, first_best[(p, m, sp)])
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


__all__ = ["fork_workers", "run_forked", "FORK_WORKERS", "FORK_MIN_SECONDS"]
