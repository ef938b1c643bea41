"""A rank that fails inside a pipeline schedule gives every rank an ``ExecutionError`` naming it,
with no hang (autopar/execution/step_guard.py, runtime/failure_record.py): GPT-2 under pp=2 on two
gloo processes, rank 1 (the last stage) failing in its second step.

The premise is asserted in each: the plan pipelines (pp=2, the schedule pinned, each rank one
stage of two), each rank runs its stage under the schedule, and the failure happens mid-schedule
(rank 1 ran two micro-batches of the step, rank 0 more than two, before it). Times are bounded far
below the process group's timeout (``PG_TIMEOUT``): a rank that learnt of its peer's failure only
from gloo's timeout would miss the bound."""
from __future__ import annotations

import functools
import os
import time

import pytest
import torch

import autopar
from autopar.errors import ExecutionError
from autopar.models import ZOO
from runtime.launch import LocalLaunchError, run_local

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops

pytestmark = pytest.mark.slow

M = 4             # micro-batches
PG_TIMEOUT = 30   # seconds: gloo's timeout in these tests; every error must come far sooner
FAST = 10         # seconds: the bound on how long a rank takes to report a peer's failure
BROKEN = "stage 1 breaks on purpose"


@functools.lru_cache(maxsize=None)
def _plan_json(schedule: str, n_layer: int = 2) -> str:
    model, batch = ZOO["gpt2"](n_layer=n_layer)
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2), precision="fp32",
                        constraints={"pp": 2, "pp_schedule": schedule, "num_micro_batches": M})
    assert plan.degrees["pp"] == 2 and plan.degrees["pp_schedule"] == schedule and plan.world_size == 2
    return plan.to_json()


def _compiled(rank, world, plan_json, n_layer=2):
    model, batch = ZOO["gpt2"](n_layer=n_layer)
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), optimizer="sgd", lr=0.05)
    assert cm.pp == 2 and cm.stage == rank and cm.runner.calls == 0   # this rank runs one stage's part
    cm.step(*batch)   # a good step first: the schedule runs (its metadata pass included)
    assert cm.runner.calls > 0
    return cm, batch


def _break_stage_1(cm):
    """Rank 1's stage raises before its third forward from now: mid-schedule, two micro-batches in."""
    start = cm.runner.calls
    seen = {}

    def hook(module, args):
        if cm.runner.calls - start >= 2:
            seen["calls"] = cm.runner.calls - start
            raise ValueError(BROKEN)
    for mod in cm.runner.modules:
        mod.register_forward_pre_hook(hook)
    return start, seen


def _fail_in_step(rank, world, plan_json, n_layer, forward_only=False, stay_alive=0.0):
    cm, batch = _compiled(rank, world, plan_json, n_layer)
    start = cm.runner.calls
    if rank == 1:
        start, seen = _break_stage_1(cm)
    t0 = time.monotonic()
    try:
        cm(*batch) if forward_only else cm.step(*batch)
        return {"error": None}
    except Exception as e:
        out = {"type": type(e).__name__, "error": str(e), "seconds": time.monotonic() - t0,
               "at": time.time(), "calls": cm.runner.calls - start}
    t1 = time.monotonic()
    try:   # the model is unusable now, on every rank: a clear error, not a hang
        cm.step(*batch)
    except Exception as e:
        out["again"] = (type(e).__name__, str(e), time.monotonic() - t1)
    if rank == 1:
        out["failed_at_call"] = seen.get("calls")
        time.sleep(stay_alive)   # a rank that caught its error and carries on: its process stays
        out["alive_until"] = time.time()
    return out


def _check_named(res, what, stage=1):
    r0, r1 = res
    for r in res:
        assert r["type"] == "ExecutionError", r
        assert r["seconds"] < FAST, r
        kind, msg, seconds = r["again"]
        assert kind == "ExecutionError" and "cannot run again" in msg and seconds < 1, r["again"]
    assert r1["failed_at_call"] == 2 and r1["calls"] == 2   # two micro-batches of this step ran on stage 1
    assert r0["calls"] > 2, r0                              # stage 0 was further on: mid-schedule
    # the user's error, then PyTorch's wrapper naming the stage (interleaved: rank 1 runs stages 1 and 3)
    cause = f"ValueError: {BROKEN} (raised in: [Stage {stage}] failed to run forward)"
    assert r1["error"] == f"rank 1: {what} failed: {cause}", r1["error"]
    assert r0["error"] == f"rank 0: {what} failed because rank 1 failed: {cause}", r0["error"]


@pytest.mark.parametrize("schedule, n_layer, stage", [("1f1b", 2, 1), ("gpipe", 2, 1), ("interleaved-1f1b", 4, 3)])
def test_a_rank_raising_inside_the_schedule_is_named_on_every_rank(schedule, n_layer, stage):
    t0 = time.monotonic()
    res = run_local(_fail_in_step, 2, args=(_plan_json(schedule, n_layer), n_layer), timeout=120,
                    pg_timeout=PG_TIMEOUT)
    _check_named(res, "pipeline step", stage)
    assert time.monotonic() - t0 < 60


def test_a_failed_rank_that_carries_on_does_not_hold_up_its_peer():
    """Rank 1 catches its error and stays alive (its connections stay open, so gloo would keep
    rank 0 waiting until its timeout): rank 0 learns of the failure from rank 1's record at once."""
    stay = 15.0
    t0 = time.monotonic()
    res = run_local(_fail_in_step, 2, args=(_plan_json("1f1b"), 2, False, stay), timeout=120,
                    pg_timeout=PG_TIMEOUT)
    _check_named(res, "pipeline step")
    r0, r1 = res
    assert r0["seconds"] < 5 and r0["at"] < r1["alive_until"] - 5, (r0, r1)   # while rank 1 still ran
    assert time.monotonic() - t0 < 60


def test_a_rank_failing_in_a_pipelined_forward_is_named_on_every_rank():
    res = run_local(_fail_in_step, 2, args=(_plan_json("gpipe"), 2, True), timeout=120, pg_timeout=PG_TIMEOUT)
    _check_named(res, "pipelined forward")


def _killed_in_backward(rank, world, plan_json):
    cm, batch = _compiled(rank, world, plan_json)
    if rank == 1:   # dies hard in the next backward: no exception, no record
        list(cm.params.values())[-1].register_hook(lambda g: os._exit(3))
    t0 = time.monotonic()
    try:
        cm.step(*batch)
    except ExecutionError as e:   # reported with its time (run_local shows only the failing ranks)
        raise RuntimeError(f"ExecutionError after {time.monotonic() - t0:.1f} s: {e}") from e
    return "finished"


def test_a_rank_dying_hard_in_backward_gives_its_peer_an_error_naming_it():
    import re

    t0 = time.monotonic()
    with pytest.raises(LocalLaunchError) as ei:
        run_local(_killed_in_backward, 2, args=(_plan_json("1f1b"),), timeout=120, pg_timeout=PG_TIMEOUT)
    msg = str(ei.value)
    assert "rank 1 exited with code 3" in msg, msg
    m = re.search(r"rank 0: RuntimeError: ExecutionError after ([0-9.]+) s: rank 0: pipeline step failed because "
                  r"rank 1 failed: its process is gone and reported no cause", msg)
    assert m and float(m.group(1)) < FAST, msg
    assert time.monotonic() - t0 < 60


def _same_store(rank, world):
    import torch.distributed as dist

    from runtime.failure_record import job_store

    store = job_store()
    if rank == 1:
        store.set("autopar/test/key", "from rank 1")
    dist.barrier()
    return store.get("autopar/test/key").decode()


def test_every_rank_reaches_the_same_job_store():
    assert run_local(_same_store, 2, timeout=60) == ["from rank 1", "from rank 1"]
