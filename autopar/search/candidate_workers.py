"""Forked worker processes for the pipelined candidates (autopar/search/pipeline_forked.py).

A pipelined candidate's inner search (the whole model on one stage's sub-mesh) is seconds of
single-threaded Python on large models, most of their planning, and the candidates are
independent but for the incumbent that prunes them.
With more than one core they run in worker processes forked from the planning process after the
pp=1 search: the traced graph, the candidates and pricing caches are inherited, not pickled;
what crosses a pipe is a candidate's index one way and a step time (or why it has none) back,
and once the search is over the winner's plan (its candidates rebuilt by the planner).

- ``worker_count``: how many (``AUTOPAR_PLAN_WORKERS``, else the cores this process may use, at
  most ``MAX_WORKERS``; 1 or 0 means no workers).
- ``Lanes``: one forked process per lane, each serving ``evaluate(task)`` for the tasks sent to
  it in order. pipeline_forked.py sends every candidate with the same pp to the same lane, so
  one stage sub-mesh's candidates, resharding prices and inner plans are built once.

The workers are forked before any of them starts a thread, and the solver's threads are
stopped first (``solver.ilp.release_threads``): a fork copies no running thread, so a pool or
lock held by one would be dead in the child; for the same reason the planner forks only with no
other Python thread running (``can_fork``). A worker that dies (killed, out of memory) closes
its pipe; ``receive`` reports it and the caller evaluates that lane's tasks itself.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import traceback
from multiprocessing.connection import wait

from solver.ilp import release_threads

WORKERS_ENV = "AUTOPAR_PLAN_WORKERS"
MAX_WORKERS = 4


def worker_count() -> int:
    """Worker processes for the pipelined candidates: ``AUTOPAR_PLAN_WORKERS`` when set and not
    empty (0 or 1: none), else the cores this process may run on, at most ``MAX_WORKERS``."""
    raw = os.environ.get(WORKERS_ENV, "").strip()
    if raw:
        try:
            return max(0, int(raw))
        except ValueError:
            raise ValueError(f"{WORKERS_ENV}={raw!r}: expected a whole number of worker processes "
                             f"(0 or 1: plan in this process only)") from None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        cores = os.cpu_count() or 1
    return min(MAX_WORKERS, cores)


def can_fork() -> bool:
    """Whether forking workers is safe here: Linux (macOS's system libraries do not survive a
    fork), and no other Python thread running (a thread holding a lock, such as a live progress
    line's hold on stderr, would leave it held forever in the child)."""
    return (sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()
            and threading.active_count() == 1)


def _serve(conn, evaluate, inherited) -> None:
    """A worker's loop: (index, task) in, (index, answer) out, until None or the pipe closes.
    ``inherited``: the planner's ends of the pipes, copied by the fork; closed, so that the
    planner's death closes this worker's pipe (else it would wait on it forever)."""
    for end in inherited:
        end.close()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        idx, task = msg
        try:
            out = evaluate(task)
        except BaseException as e:   # noqa: BLE001 - reported to the parent, which re-raises it there
            out = ("error", f"{type(e).__name__}: {e}", traceback.format_exc())
        try:
            conn.send((idx, out))
        except (BrokenPipeError, OSError):
            return


class Lanes:
    """``n`` forked worker processes serving ``evaluate(task)``; tasks run in the order each lane
    receives them. Use as a context manager: the workers are stopped on exit."""

    def __init__(self, n: int, evaluate):
        release_threads()   # no solver thread pool is copied into a child half-alive (module doc)
        ctx = multiprocessing.get_context("fork")
        self.conns, self.procs = [], []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, evaluate, [*self.conns, parent]), daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self.alive = [True] * n

    def send(self, lane: int, idx: int, task) -> None:
        self.conns[lane].send((idx, task))

    def receive(self) -> tuple[int, int | None, object]:
        """(lane, index, answer) of the next task done; (lane, None, None) when that lane's worker
        died (its tasks in flight are lost)."""
        ready = wait([c for c, ok in zip(self.conns, self.alive) if ok])
        conn = ready[0]
        lane = self.conns.index(conn)
        try:
            idx, out = conn.recv()
        except (EOFError, OSError):
            self.alive[lane] = False
            return lane, None, None
        return lane, idx, out

    def close(self, kill: bool = False) -> None:
        """Stop the workers: after their current task, or at once (``kill``: the caller failed)."""
        for conn, ok in zip(self.conns, self.alive):
            if ok and not kill:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
        for proc in self.procs:
            if not kill:
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()

    def __enter__(self):
        return self

    def __exit__(self, kind, *exc):
        self.close(kill=kind is not None)
        return False


__all__ = ["worker_count", "can_fork", "Lanes", "WORKERS_ENV", "MAX_WORKERS"]
