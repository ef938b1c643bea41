"""Which rank failed inside a step, and why: a record every rank can read without a collective.

Owns this module's use of the job's key-value store (the c10d store behind the default process
group, a TCPStore served by rank 0 or by torchrun's agent), the record's format, the watcher that
wakes when a record appears, and telling which peer processes on this host are gone.

Why a store and not a collective: a rank that fails mid-step leaves its peers blocked in a send, a
receive or a collective with it, so nothing that needs every rank can carry the news. The store is
a separate server every rank already reaches.

- ``job_store()``: the default group's store, through ``ProcessGroup.get_group_store()`` (public, no
  underscore; every rank of the group sees the same keys). ``FailureRecord`` works on clones of it
  (``Store.clone()``: the same keys over a connection of its own), so a blocking wait on one thread
  never shares a socket with c10d's own use of the store or with the other thread.
- ``FailureRecord(store, rank, world, job)``: the record of one compiled model (``job``: a number
  every rank gives the same model, the order of set-up), under ``autopar/failure/{job}``: JSON
  ``{"rank": r, "cause": "...", "seen_by": r'}``. ``publish`` writes it unless one is there already
  (``compare_set``: the first failure wins; a rank's record is written before its error can close its
  connections, so a failure reaches its peers as a closed connection only after its record exists).
  ``read`` returns it or None; ``watch(callback)`` starts a daemon thread that blocks in the store's
  own server-side ``wait`` (no polling, no cost per step) and calls ``callback(record)`` when it appears.
- Every rank registers ``host pid`` at set-up; ``gone_peers()`` lists the ranks on this host whose
  process has exited (a zombie or reaped), so a rank whose peer died hard (``os._exit``, killed, a
  crash: no record) can name it. Ranks on other hosts cannot be checked: the record says so.

Store errors (the server's rank died too) are never raised from here: ``read`` / ``gone_peers`` give
None / [] and ``publish`` returns the caller's own record, so error reporting never fails itself.
"""
from __future__ import annotations

import itertools
import json
import os
import socket
import threading
from datetime import timedelta

import torch.distributed as dist

_PREFIX = "autopar/failure"
_jobs = itertools.count()   # the job number of the next FailureRecord made in this process
# Short: a store that does not answer within this is dead, and reporting must not hang instead.
_STORE_TIMEOUT = timedelta(seconds=10)


def job_store():
    """The store of the default process group: the same keys on every rank."""
    return dist.group.WORLD.get_group_store()


def next_job() -> int:
    """The job number of the next record: every rank sets up its compiled models in the same order
    (set-up is collective), so the n-th model has number n on every rank."""
    return next(_jobs)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` (on this host) still runs: not gone and not a zombie (its files,
    sockets included, are closed once it is a zombie; its parent may not have reaped it yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True   # no /proc: it answered the signal, so it exists


class FailureRecord:
    def __init__(self, store, rank: int, world: int, job: int):
        self.rank, self.world = rank, world
        self.key = f"{_PREFIX}/{job}"
        self._proc_key = f"{_PREFIX}/{job}/proc"
        self._template = store
        self.store = store.clone()
        self.store.set_timeout(_STORE_TIMEOUT)
        self.host = socket.gethostname()
        self.store.set(f"{self._proc_key}/{rank}", f"{self.host} {os.getpid()}")

    # ------------------------------------------------------------------ the record
    def publish(self, rank: int, cause: str) -> dict:
        """Record that ``rank`` failed because of ``cause`` unless a failure is recorded already;
        returns the record that stands (the first one)."""
        mine = {"rank": int(rank), "cause": str(cause)[:4000], "seen_by": self.rank}
        try:
            got = self.store.compare_set(self.key, "", json.dumps(mine))
            return json.loads(got)
        except Exception:   # the store is gone: the caller still reports its own view
            return mine

    def read(self) -> dict | None:
        try:
            if not self.store.check([self.key]):
                return None
            return json.loads(self.store.get(self.key))
        except Exception:
            return None

    def watch(self, callback) -> threading.Thread:
        """A daemon thread that blocks until a record appears, then calls ``callback(record)``
        once. It lives as long as the process (a blocked store wait cannot be cancelled): one
        idle thread and one connection per watched model."""
        store = self._template.clone()

        def run():
            while True:
                try:
                    store.wait([self.key], timedelta(days=1))
                except Exception:
                    try:   # the wait timed out (a day) or the store is gone: which one?
                        store.check([self.key])
                        continue
                    except Exception:
                        return
                try:
                    record = json.loads(store.get(self.key))
                except Exception:
                    return
                callback(record)
                return

        t = threading.Thread(target=run, name=f"autopar-failure-watch-{self.key}", daemon=True)
        t.start()
        return t

    # ------------------------------------------------------------------ which peers are gone
    def gone_peers(self) -> list[int]:
        """Ranks whose process ran on this host and has exited. Peers on other hosts are not
        checked (there is no way to from here)."""
        keys = [f"{self._proc_key}/{r}" for r in range(self.world) if r != self.rank]
        try:
            # every rank registers before set-up's first collective, so normally all are there
            present = keys if self.store.check(keys) else [k for k in keys if self.store.check([k])]
            values = self.store.multi_get(present) if present else []
        except Exception:
            return []
        gone = []
        for k, v in zip(present, values):
            host, pid = v.decode().rsplit(" ", 1)
            if host == self.host and not _alive(int(pid)):
                gone.append(int(k.rsplit("/", 1)[1]))
        return sorted(gone)


__all__ = ["job_store", "next_job", "FailureRecord"]
