"""The failure record (runtime/failure_record.py) and the step guard (autopar/execution/step_guard.py)
on one process: a TCPStore served in this process stands in for the job's store, and several
``FailureRecord``s on it for several ranks. The multi-process behaviour (pipelined ranks failing on
gloo) is tests/execution/test_pipeline_failures.py."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from autopar.errors import ExecutionError
from autopar.execution.step_guard import StepGuard, describe
from runtime.failure_record import FailureRecord


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10), wait_for_workers=False)


def test_the_first_failure_recorded_stands(store):
    r0, r1 = FailureRecord(store, 0, 2, job=7), FailureRecord(store, 1, 2, job=7)
    assert r0.read() is None
    assert r1.publish(1, "ValueError: first") == {"rank": 1, "cause": "ValueError: first", "seen_by": 1}
    assert r0.publish(0, "RuntimeError: second")["rank"] == 1   # the first one stands
    assert r0.read()["cause"] == "ValueError: first"
    assert FailureRecord(store, 0, 2, job=8).read() is None       # another compiled model's record


def test_the_watcher_wakes_when_a_peer_records(store):
    r0, r1 = FailureRecord(store, 0, 2, job=1), FailureRecord(store, 1, 2, job=1)
    seen, woke = [], threading.Event()
    r0.watch(lambda rec: (seen.append(rec), woke.set()))
    time.sleep(0.2)
    assert not woke.is_set()
    r1.publish(1, "boom")
    assert woke.wait(5) and seen[0]["rank"] == 1


def test_peers_whose_process_is_gone_are_named(store):
    """A peer registers its host and pid; once that process has exited (reaped, or a zombie its
    parent has not reaped yet) it is gone. The live peer is not."""
    import os

    reaped = subprocess.Popen([sys.executable, "-c", "pass"])
    reaped.wait()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:   # exited, not reaped: a zombie
        with open(f"/proc/{zombie.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.05)
    me = FailureRecord(store, 0, 4, job=3)
    FailureRecord(store, 1, 4, job=3)   # this process: alive
    for rank, pid in ((2, reaped.pid), (3, zombie.pid)):
        store.set(f"autopar/failure/3/proc/{rank}", f"{me.host} {pid}")
    assert me.gone_peers() == [2, 3]
    store.set("autopar/failure/3/proc/3", f"another-host {os.getpid() + 10**6}")   # cannot be checked
    assert me.gone_peers() == [2]
    zombie.wait()


def test_describe_names_the_root_cause():
    try:
        try:
            raise ValueError("stage 1 breaks")
        except ValueError as e:
            raise RuntimeError("\n   [Stage 1] failed to run forward:\n   args: (...)") from e
    except RuntimeError as e:
        assert describe(e) == "ValueError: stage 1 breaks (raised in: [Stage 1] failed to run forward)"
    assert describe(KeyError("k")) == "KeyError: 'k'"


def test_a_failing_step_names_its_rank_and_the_model_refuses_to_run_again(store):
    guard = StepGuard(FailureRecord(store, 1, 2, job=11), 1, watch=False)
    assert guard.run(lambda: 3.0, "training step") == 3.0

    def bad():
        raise ValueError("bad tensor")
    with pytest.raises(ExecutionError, match=r"^rank 1: training step failed: ValueError: bad tensor$"):
        guard.run(bad, "training step")
    assert FailureRecord(store, 0, 2, job=11).read()["rank"] == 1   # every rank can read it
    with pytest.raises(ExecutionError, match="rank 1: this compiled model cannot run again .*bad tensor"):
        guard.run(lambda: 3.0, "training step")


def test_an_error_every_rank_raises_alike_is_not_a_failure(store):
    guard = StepGuard(FailureRecord(store, 0, 2, job=12), 0, watch=True)

    def alike():
        raise ExecutionError("the batch has 3 rows", collective=True)
    with pytest.raises(ExecutionError, match="^the batch has 3 rows$"):
        guard.run(alike, "pipeline step")
    assert guard.run(lambda: 2.0, "pipeline step") == 2.0
    assert FailureRecord(store, 1, 2, job=12).read() is None


def test_a_peer_failure_ends_a_step_blocked_on_it(store):
    """The worker stands for a rank blocked in a receive from a peer that failed and stays alive:
    the peer's record ends the caller's wait at once, naming it; the model then refuses to run."""
    guard = StepGuard(FailureRecord(store, 0, 2, job=13), 0, watch=True)
    release = threading.Event()
    peer = FailureRecord(store, 1, 2, job=13)
    threading.Timer(0.3, lambda: peer.publish(1, "ValueError: hook broke")).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(ExecutionError, match=r"^rank 0: pipeline step failed because rank 1 failed: "
                                                 r"ValueError: hook broke$"):
            guard.run(lambda: release.wait(60), "pipeline step")
        assert time.monotonic() - t0 < 5
        with pytest.raises(ExecutionError, match="cannot run again"):
            guard.run(lambda: 1.0, "pipelined forward")
    finally:
        release.set()   # the abandoned step ends (interpreter exit waits for it)


def test_the_worker_runs_under_the_callers_grad_mode(store):
    import torch

    guard = StepGuard(FailureRecord(store, 0, 1, job=14), 0, watch=True)
    assert guard.run(torch.is_grad_enabled, "pipeline step") is True
    with torch.no_grad():
        assert guard.run(torch.is_grad_enabled, "pipelined forward") is False
