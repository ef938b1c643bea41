"""A step that fails on one rank ends with an ``ExecutionError`` naming that rank on every rank, never a hang.

``StepGuard`` owns how ``CompiledModel.step`` and ``compiled(*inputs)`` run their communicating part
and what happens when it fails:

- The rank where an exception escapes the step records "rank r failed: <type>: <message>" in the
  job's store (runtime/failure_record.py; the first failure wins) and raises
  ``ExecutionError("rank r: <what> failed: <cause>")``.
- A peer learns of it either from its own communication failing (the failed rank's process exited
  and its connections closed) or, under pipelining, from the record itself, and raises
  ``ExecutionError("rank p: <what> failed because rank r failed: <cause>")``. A peer whose partner
  died hard (``os._exit``, killed: no record) names the ranks on its host whose process is gone.
- After a failure the compiled model refuses to run again (its ranks' communication stopped at
  different points): ``ExecutionError("... cannot run again ...")`` instead of a hang.

Why a worker thread under pipelining (``watch=True``). A rank that fails may stay alive (its user
catches the error and carries on), and then its peers stay blocked in a pipeline receive or a
collective with it: gloo only fails such a wait when the other process's sockets close or the
process group's timeout (30 minutes by default) expires. Gloo's ``ProcessGroup.abort()`` and
``shutdown()`` do not close the connections (tried on torch 2.13: the peer waits until the failed
process exits), destroying the group closes them only once the last reference to it is gone (the
schedule's stages, the device mesh, the exception's own frames hold some), and a blocked
``Work.wait()`` cannot be interrupted from Python. So every rank runs the step on a worker thread
of its own and waits on a queue that two things can fill: the step's result or exception, and the
record of a failed peer (the store watcher). A peer's failure thus ends the wait at once; the worker
stays in the abandoned step until its communication with the failed rank fails (that rank's process
exits, or the process group's timeout). The model is not used again; at interpreter exit the
process waits for such a step to end (``_let_abandoned_steps_end``: Python 3.11 would otherwise
abort the process when it stops the worker thread inside PyTorch's C++).

Without pipelining (``watch=False``) the step runs on the caller's thread, as before: its failures
are named the same way, but a peer that stays alive after failing is noticed at the process
group's timeout.

The worker runs the step under the caller's grad mode (``compiled(*inputs)`` is ``no_grad``) and on
the caller's current CUDA device (per thread: NCCL and PipelineStage use it); other thread-local
state of the caller (autocast, saved-tensor hooks around ``step``) does not reach it.
A pipelined model keeps two idle daemon threads (worker, watcher) and two store connections for
the life of the process.
"""
from __future__ import annotations

import atexit
import queue
import sys
import threading
import time

import torch

from autopar.errors import ExecutionError
from runtime.failure_record import FailureRecord

# How a lost peer shows up in gloo's errors (then it is worth waiting a moment for its record, or
# for its process to be seen gone, before blaming ourselves).
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "ECONNRESET", "EPIPE")
_GRACE = 1.0   # seconds: how long a rank that lost a peer waits for the peer's record / death to show

# Steps a failed peer made this rank give up on while its worker still ran them (their "done" events).
_abandoned: list[threading.Event] = []


@atexit.register
def _let_abandoned_steps_end() -> None:
    """At exit, wait until every given-up step has ended on its worker thread. Python 3.11 ends a
    daemon thread that runs into the interpreter's finalization with ``pthread_exit``, which
    aborts the process when the thread is inside PyTorch's C++ (backward, a gloo wait): seen as
    "terminate called without an active exception". The step ends soon: its communication with the
    failed rank fails once that rank's process exits, or at the process group's timeout. (Forked
    ``multiprocessing`` children skip atexit, and their exit skips finalization too.)"""
    for done in _abandoned:
        if not done.wait(1.0):
            print("autopar: waiting for this rank's unfinished step to end before exiting: its communication "
                  "with the failed rank ends when that rank's process exits, or at the process group's timeout",
                  file=sys.stderr, flush=True)
            done.wait()


def describe(error: BaseException) -> str:
    """"<type>: <message>" of the exception at the root of ``error``'s explicit cause chain, then the
    first line of each exception wrapping it: PyTorch's pipeline stage re-raises a stage's error as
    ``RuntimeError("[Stage 1] failed to run forward: <its arguments>")`` from it, and the user's
    error is the cause worth naming."""
    chain = [error]
    while chain[-1].__cause__ is not None and len(chain) < 8:
        chain.append(chain[-1].__cause__)
    root = chain[-1]
    text = f"{type(root).__name__}: {root}"
    outer = [ln.strip().rstrip(":") for e in chain[:-1] for ln in str(e).strip().splitlines()[:1]]
    outer = [w for w in outer if w]
    return text + (f" (raised in: {'; '.join(outer)})" if outer else "")


class StepGuard:
    def __init__(self, record: FailureRecord, rank: int, watch: bool):
        self.record, self.rank, self.watch = record, rank, watch
        self.failed: str | None = None        # why this compiled model cannot run again
        self._peer: dict | None = None        # a peer's failure record, from the watcher
        self._lock = threading.Lock()
        self._waiting: queue.Queue | None = None   # the queue the current step's caller waits on
        if watch:
            self._jobs: queue.Queue = queue.Queue()
            threading.Thread(target=self._work, name="autopar-step", daemon=True).start()
            record.watch(self._on_record)

    # ------------------------------------------------------------------ threads
    def _work(self):
        while True:
            body, grad, cuda, out, done = self._jobs.get()
            try:
                if cuda is not None:   # the current CUDA device is per thread: the caller's rank's GPU
                    torch.cuda.set_device(cuda)
                with torch.set_grad_enabled(grad):
                    out.put((True, body()))
            except BaseException as e:   # everything reaches the caller's thread, which decides
                out.put((False, e))
            done.set()
            del body, out, done

    def _on_record(self, record: dict):
        with self._lock:
            self._peer = record
            waiting = self._waiting
        if waiting is not None:
            waiting.put((None, record))

    # ------------------------------------------------------------------ running a step
    def check_usable(self) -> None:
        if self.failed is not None:
            raise ExecutionError(f"rank {self.rank}: this compiled model cannot run again after a failed step "
                                 f"({self.failed}); its ranks stopped communicating at different points: "
                                 f"restart the job (or re-create the process group and compile again)")

    def run(self, body, what: str):
        """``body()`` (a step's communicating part) under this guard; ``what`` names it in errors
        ("pipeline step", "training step", "forward")."""
        self.check_usable()
        if not self.watch:
            try:
                return body()
            except ExecutionError as e:
                if e.collective:   # every rank raised it alike: nobody waits, the model is fine
                    raise
                self._fail(e, what)
            except Exception as e:
                self._fail(e, what)
            except BaseException:   # interrupted mid-step: the ranks are out of step now
                self.failed = f"a {what} was interrupted"
                raise
        waiting: queue.Queue = queue.Queue()
        with self._lock:
            peer = self._peer
            self._waiting = waiting if peer is None else None
        if peer is not None:   # a peer failed since the last step: do not start communicating
            self._fail(None, what, peer)
        done = threading.Event()
        cuda = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self._jobs.put((body, torch.is_grad_enabled(), cuda, waiting, done))
        try:
            ok, value = waiting.get()
        except BaseException:
            self.failed = f"a {what} was interrupted"
            _abandoned.append(done)
            raise
        finally:
            with self._lock:
                self._waiting = None
        if ok:
            return value
        if ok is None:   # the watcher: a peer failed; our worker may be blocked on it, leave it be
            _abandoned.append(done)
            self._fail(None, what, value)
        if isinstance(value, ExecutionError) and value.collective:
            raise value
        self._fail(value, what)

    def _fail(self, error: BaseException | None, what: str, record: dict | None = None):
        """Record (unless a peer's record stands), mark the model unusable, raise the ExecutionError."""
        me = self.rank
        local = describe(error) if error is not None else None
        if record is None:
            record = self.record.read()
        if record is None and local is not None and any(k in local for k in _LOST_PEER):
            # Our communication failed: a peer's record may be about to appear (if it failed and
            # exited before we got here, it is there already), or its process is gone without one.
            deadline = time.monotonic() + _GRACE
            while record is None:
                gone = self.record.gone_peers()
                if gone:
                    names = ", ".join(map(str, gone))
                    record = self.record.publish(gone[0], f"its process is gone and reported no cause (killed, "
                                                          f"crashed, or exited outside a step; gone on this host: "
                                                          f"rank {names}); rank {me} saw {local}")
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
                record = self.record.read()
        if record is None:
            record = self.record.publish(me, local)
        if record["rank"] == me and record.get("seen_by") == me:
            msg = f"rank {me}: {what} failed: {local}"
        else:
            msg = f"rank {me}: {what} failed because rank {record['rank']} failed: {record['cause']}"
        self.failed = msg
        raise ExecutionError(msg) from error


__all__ = ["StepGuard"]
