"""The ranks of a continuous-batching server stepping together: ``LeaderIterations`` (rank 0),
``follow_iterations`` (every other rank) and ``RanksOutOfStep``, around the engine of
autopar/inference/iteration_engine.py.

**Ranks.** With tp > 1 every rank holds its tensor-parallel shard (``from_plan`` builds it as
``compile_inference`` does) and runs the same iterations: on its own, SPMD, when every rank adds
the same requests; in the server, ``LeaderIterations`` (rank 0) decides each iteration's admissions
and broadcasts the requests added since the last step before it, and ``follow_iterations`` (every
other rank) adds those and steps. One broadcast of Python objects per iteration (on a group of
its own, ``engine.jobs``, with no timeout: an idle server's ranks wait there for the next).

**Replicas** (dp > 1): replica ``r`` is ranks ``r*tp*pp`` to ``(r+1)*tp*pp - 1``, stage-major (as
``compile_inference`` lays them out) and runs its own engine on its own ``slots`` and KV-token pool.
Rank 0 (replica 0's first rank) checks each new request and assigns it, when it arrives, to the
replica with the fewest requests running or waiting (its own count: those assigned and not yet
answered), ties to the lowest index; the request then waits in that replica's queue only. (The
planner's simulation, autopar/inference/continuous.py, keeps one shared queue that each replica
takes from in arrival order when it has room: there a request never waits on a busy replica while
another has a free slot; here it may, until the requests ahead of it on its replica finish.) Each
iteration every rank of every replica takes part, with nothing to do or not: rank 0 broadcasts the
new requests with their replicas (the same one broadcast), each replica adds its own and steps (an
idle engine's step does nothing), and a gather of Python objects over the world group brings the
finished sequences of every replica's first rank (stage 0, tp rank 0) to rank 0: their tokens, whether they stopped, and
their wait, prefill and decode seconds (rank 0 dates them back from when it received them). A step
that fails on any replica fails the whole iteration: rank 0 raises after the gather, and its
``abort`` empties every replica.

**Failures.** A step that fails on a replica of one rank (tp = pp = 1) fails that iteration's
requests and the replicas go on (above). On a replica of several ranks a failure mid-forward
leaves its peers in a collective the failed rank will never join: the ranks are out of step and
nothing more can run. So there (and whenever a collective itself fails: a peer gone, or the
process group's timeout passed) rank 0 raises ``RanksOutOfStep`` and keeps it (``broken``: every
later ``add`` and ``step`` raises it, nothing more is broadcast; the server answers 503), and a
following rank raises it out of ``follow_iterations`` (its process ends; ``autopar serve`` then
stops). The groups ``from_plan`` builds (tp, pipeline) take the default group's timeout
(``init_process_group(timeout=...)``, ``autopar serve --collective-timeout``, 120 s by default),
not torch's 30 minutes, so a peer waiting in an all-reduce fails within it: never a hang. A step
slower than that timeout (on a replica, or rank 0 waiting in the gather for the slowest) is a
failure too.
"""
from __future__ import annotations

import itertools
import threading
import time

import torch.distributed as dist

from autopar.errors import ExecutionError
from autopar.inference.engine import check_sampling
from autopar.inference.iteration_engine import IterationEngine, distributed
from autopar.inference.sequence import Sequence, step_until_idle


class RanksOutOfStep(ExecutionError, RuntimeError):
    """A step failed where the ranks may no longer run the same collectives (a failed step of a
    replica of several ranks, or a failed collective): nothing can be served any more; the server
    answers 503 with this message (server.py); on a following rank ``autopar serve`` (under torchrun
    too) exits with it as its error."""
    http_status = 503


class LeaderIterations:
    """Rank 0's ``IterationEngine`` when the plan has tp ranks or replicas: every ``step`` first
    broadcasts the requests added since the last one, with the replica each was assigned to, so the
    ranks of each replica admit the same requests in the same order and run the same iteration
    (``follow_iterations`` on the other ranks); with replicas it then gathers every replica's
    finished sequences (module doc). Requests are checked on rank 0 (``add`` raises there, and
    nothing is sent). On one process it is the engine itself. ``served[r]``: sequences replica
    ``r`` finished. ``broken``: the RanksOutOfStep after which every ``add`` and ``step`` raises it
    and nothing more is broadcast (module doc, **Failures**)."""

    def __init__(self, engine: IterationEngine):
        self.engine = engine
        self.replicas = engine.replicas
        self.pending: list[tuple] = []
        self.remote: list[dict] = [{} for _ in range(self.replicas)]   # replica -> id -> Sequence (not 0)
        self.served = [0] * self.replicas
        self.limbo: list[Sequence] = []   # finished in a failed iteration: handed back by abort
        self.ids = itertools.count()
        self.lock = threading.Lock()   # a step in the server's worker thread, stop on its main thread
        self.broken: RanksOutOfStep | None = None

    def __getattr__(self, name):       # running, waiting, iterations, slots, ...
        return getattr(self.engine, name)

    @property
    def idle(self) -> bool:
        return self.engine.idle and not any(self.remote)

    def load(self, replica: int) -> int:
        """Requests assigned to ``replica`` and not yet finished (running or waiting)."""
        if replica == 0:
            return len(self.engine.running) + len(self.engine.filling) + len(self.engine.waiting)
        return len(self.remote[replica])

    def _check_broken(self) -> None:
        if self.broken is not None:
            raise RanksOutOfStep(str(self.broken))

    def _break(self, error: BaseException, what: str) -> RanksOutOfStep:
        self.broken = RanksOutOfStep(
            f"the ranks are out of step after {what} (iteration {self.engine.iterations}) failed: "
            f"{type(error).__name__}: {error}; this server cannot serve any more: restart autopar serve")
        return self.broken

    def add(self, prompt, max_new_tokens: int, sampling: dict | None = None, tag=None) -> Sequence:
        self._check_broken()
        replica = min(range(self.replicas), key=lambda r: (self.load(r), r))
        if replica == 0:
            seq = self.engine.add(prompt, max_new_tokens, sampling, tag)
            self.pending.append((0, seq.prompt, max_new_tokens, sampling, None))
            return seq
        prompt = [int(t) for t in prompt]
        self.engine.check(prompt, max_new_tokens)
        seq = Sequence(prompt, max_new_tokens, check_sampling(sampling), tag, next(self.ids),
                       added=time.perf_counter())
        self.remote[replica][seq.id] = seq
        self.pending.append((replica, seq.prompt, max_new_tokens, sampling, seq.id))
        return seq

    def step(self) -> list[Sequence]:
        with self.lock:
            self._check_broken()
            try:
                _send(("step", self.pending), self.engine.jobs)
            except Exception as e:  # noqa: BLE001 - a failed broadcast: the ranks are out of step
                raise self._break(e, "broadcasting an iteration's requests") from e
            self.pending = []
            error, finished = None, []
            try:
                finished = self.engine.step()
            except Exception as e:  # noqa: BLE001 - rank 0 still takes part in the gather, then raises
                if self.engine.replica_ranks > 1 or collective_error(e):
                    raise self._break(e, "rank 0's step") from e
                error = e
            self.served[0] += len(finished)
            if self.replicas == 1:
                if error is not None:
                    raise error
                return finished
            reports = [None] * dist.get_world_size()
            try:
                dist.gather_object(None, reports, dst=0)
            except Exception as e:  # noqa: BLE001 - a replica's rank failed or is gone
                raise self._break(e, "gathering the replicas' finished sequences") from e
            now = time.perf_counter()
            for report in reports:
                if report is None:
                    continue
                replica, done, failed = report
                for gid, tokens, stopped, wait, prefill, decode, running in done:
                    seq = self.remote[replica].pop(gid)
                    seq.tokens, seq.stopped, seq.running_at_admission = list(tokens), stopped, running
                    seq.done = now
                    seq.first = now - decode
                    seq.admitted = max(seq.first - prefill, seq.added)
                    finished.append(seq)
                    self.served[replica] += 1
                if failed and error is None:
                    error = RuntimeError(f"replica {replica} failed its step: {failed}")
            if error is not None:
                self.limbo = finished   # answered by the abort that follows, with the error
                raise error
            return finished

    def run_until_idle(self) -> list[Sequence]:
        return step_until_idle(self)

    def abort(self) -> list[Sequence]:
        """Empty every replica (after a failed step; broadcast unless the ranks are out of step);
        returns the sequences dropped."""
        with self.lock:
            if self.broken is None:
                _send(("abort", []), self.engine.jobs)
            self.pending = []
            out = self.engine.abort() + self.limbo
            self.limbo = []
            for seqs in self.remote:
                out += list(seqs.values())
                seqs.clear()
            return out

    def stop(self) -> None:
        with self.lock:
            if self.broken is None:
                _send((STOP, []), self.engine.jobs)


STOP = "stop"


def _send(job: tuple, group=None) -> None:
    if distributed():
        dist.broadcast_object_list([job], src=0, group=group)


def collective_error(e: BaseException) -> bool:
    """A failed collective or point-to-point transfer (a peer failed, is gone or timed out)."""
    text = str(e)
    return isinstance(e, dist.DistError) or any(k in text for k in (
        "Connection closed by peer", "Connection reset", "Timed out", "timed out", "Gloo", "gloo"))


def follow_iterations(engine: IterationEngine) -> int:
    """A rank other than 0: add the requests rank 0 broadcasts for this rank's replica and run each
    of its iterations, until it says stop; returns the number of iterations run. With replicas,
    each iteration ends in the gather to rank 0 (this replica's first rank reports its finished
    sequences; the others, nothing). A failed step of a one-rank replica empties this rank's
    engine, as rank 0 empties its own; one of a replica of several ranks (or a failed collective)
    raises RanksOutOfStep: its peers may be waiting in a collective it will never join (module
    doc, Failures)."""
    steps = 0
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=engine.jobs)
        kind, adds = box[0]
        if kind == STOP:
            return steps
        if kind == "abort":
            engine.abort()
            continue
        finished, failed = [], None
        try:
            for replica, prompt, new, sampling, gid in adds:
                if replica == engine.replica:
                    engine.add(prompt, new, sampling, tag=gid)
            finished = engine.step()
        except Exception as e:  # noqa: BLE001 - rank 0 fails the same requests and tells the clients
            engine.abort()
            if engine.replica_ranks > 1 or collective_error(e):
                raise RanksOutOfStep(
                    f"rank {dist.get_rank()} (replica {engine.replica}, stage {engine.stage}, tp rank "
                    f"{engine.tp_rank}) failed in iteration {steps}: {type(e).__name__}: {e}; its replica's ranks "
                    f"may be out of step, so it stops (rank 0 answers 503 from now on)") from e
            failed = f"{type(e).__name__}: {e}"
        steps += 1
        if engine.replicas > 1:
            report = None
            if engine.tp_rank == 0 and engine.stage == 0:
                report = (engine.replica, [(s.tag, s.tokens, s.stopped, s.admitted - s.added, s.first - s.admitted,
                                            max(s.done - s.first, 0.0), s.running_at_admission) for s in finished],
                          failed)
            dist.gather_object(report, None, dst=0)


__all__ = ["LeaderIterations", "RanksOutOfStep", "STOP", "collective_error", "follow_iterations"]
