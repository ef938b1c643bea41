"""Pipelined candidates in forked worker processes (autopar/search/candidate_workers.py,
autopar/search/pipeline_forked.py ``run_forked``): the same plan as in one process, workers that
die or fail, the worker count."""
import json
import os

import pytest

import autopar
from autopar.errors import PlanError
from autopar.frontend.fuse import uses_kernels
from autopar.frontend.trace import trace
from autopar.models import HF_ZOO, ZOO
from autopar.search.candidate_workers import Lanes, worker_count


def _plan_json(plan, *solver_fields_left_out) -> str:
    data = dict(plan.data, solver={k: v for k, v in plan.data["solver"].items() if k not in solver_fields_left_out})
    return json.dumps(data, sort_keys=True, default=str)


def _forced(monkeypatch, workers=2):
    """Workers for every visit of the pipelined candidates, however cheap the model."""
    import autopar.search.pipeline_candidates as PC
    import autopar.search.pipeline_forked as PF
    monkeypatch.setattr(PF, "FORK_MIN_SECONDS", 0.0)
    monkeypatch.setattr(PC, "fork_workers", lambda pipe, order, best_time: workers)


def _small():
    # its pp=1 plan leaves room: three pipelined candidates get searched (hf_llama on cpu x4 had
    # two until inactive dropouts were priced as views; now its pp=1 plan prunes all but one)
    model, batch = HF_ZOO["hf_gpt2"]()
    return model, batch, autopar.Cluster.preset("cpu", devices=8)


def test_forked_candidates_give_the_plan_of_one_process(monkeypatch, capsys):
    import autopar.search.pipeline_forked as PF
    model, batch, cluster = _small()
    monkeypatch.setattr(PF, "FORK_WORKERS", False)
    alone = autopar.plan(model, batch, cluster)
    assert alone.stats["pipeline_workers"] == 0
    monkeypatch.setattr(PF, "FORK_WORKERS", True)
    _forced(monkeypatch)
    capsys.readouterr()
    forked = autopar.plan(model, batch, cluster, verbose=True)
    assert forked.stats["pipeline_workers"] == 2   # the premise: the candidates ran in workers
    assert forked.stats["inner_searches"] == alone.stats["inner_searches"] >= 2
    assert _plan_json(forked, "pruned") == _plan_json(alone, "pruned")   # not pruned: it depends on the lanes' timing
    # the planner's own progress line while the workers run (theirs go to their own stdout)
    assert "[pipeline] pipelined candidates" in capsys.readouterr().out


@pytest.mark.slow
def test_forked_candidates_pipelined_winner_fetched_from_its_worker(monkeypatch):
    """GPT-2 XL on 4 DGX nodes: pipelined candidates over two pipeline degrees (a lane each) and a
    pipelined winner, whose plan crosses back from its worker (its candidates rebuilt here): the
    plan of one process to the last field but the count of pruned candidates."""
    import autopar.search.pipeline_candidates as PC
    import autopar.search.pipeline_forked as PF
    import autopar.search.candidate_workers as CW
    model, batch = ZOO["gpt2_xl"]()
    cluster = autopar.Cluster.preset("dgx-a100", nodes=4)
    graph = trace(model, batch, kernels=uses_kernels("auto", cluster.backend))   # traced once, for both plans
    monkeypatch.setattr(PF, "FORK_MIN_SECONDS", 0.0)
    # two workers whatever the machine (and whatever threads earlier tests in this process left)
    monkeypatch.setattr(CW, "worker_count", lambda: 2)
    monkeypatch.setattr(CW, "can_fork", lambda: True)
    calls = []
    evaluate = PC.Pipelined._evaluate
    monkeypatch.setattr(PC.Pipelined, "_evaluate", lambda self, *a: calls.append(os.getpid()) or evaluate(self, *a))
    forked = autopar.plan(model, batch, cluster, traced=graph)
    assert forked.stats["pipeline_workers"] == 2 and forked.degrees["pp"] > 1
    assert os.getpid() not in calls   # the winner was fetched, not evaluated again here
    monkeypatch.setattr(PF, "FORK_WORKERS", False)
    alone = autopar.plan(model, batch, cluster, traced=graph)
    # every field but the count of pruned candidates: with two lanes it depends on the order their
    # answers arrive in (an incumbent that arrives earlier prunes more; CI saw 13 against 14)
    assert _plan_json(forked, "pruned") == _plan_json(alone, "pruned")


def test_a_worker_that_dies_leaves_its_candidates_to_the_planner(monkeypatch):
    import autopar.search.pipeline_forked as PF
    model, batch, cluster = _small()
    monkeypatch.setattr(PF, "FORK_WORKERS", False)
    alone = autopar.plan(model, batch, cluster)
    monkeypatch.setattr(PF, "FORK_WORKERS", True)
    _forced(monkeypatch)
    planner = os.getpid()
    remote = PF.remote

    def dies(self, *a):
        if os.getpid() != planner:
            os._exit(3)   # killed mid-task, as by the OOM killer
        return remote(self, *a)
    monkeypatch.setattr(PF, "remote", dies)
    forked = autopar.plan(model, batch, cluster)
    assert forked.stats["pipeline_workers"] == 2
    assert _plan_json(forked, "pruned") == _plan_json(alone, "pruned")   # not pruned: it depends on the lanes' timing


def test_a_worker_that_fails_names_the_candidate(monkeypatch):
    import autopar.search.pipeline_candidates as PC
    model, batch, cluster = _small()
    _forced(monkeypatch)
    planner = os.getpid()
    evaluate = PC.Pipelined._evaluate

    def fails(self, *a):
        if os.getpid() != planner:
            raise RuntimeError("boom in a worker")
        return evaluate(self, *a)
    monkeypatch.setattr(PC.Pipelined, "_evaluate", fails)
    with pytest.raises(PlanError, match=r"planning worker failed on pipelined candidate .*boom in a worker"):
        autopar.plan(model, batch, cluster)


def test_lanes_answer_in_order_and_report_a_dead_worker():
    def evaluate(task):
        if task == "die":
            os._exit(1)
        if task == "fail":
            raise ValueError("bad task")
        return task * 2
    with Lanes(2, evaluate) as lanes:
        lanes.send(0, 0, 1)
        lanes.send(0, 1, 2)
        lanes.send(1, 2, "fail")
        got = {}
        while len(got) < 3:
            lane, i, out = lanes.receive()
            got[i] = (lane, out)
        assert got[0] == (0, 2) and got[1] == (0, 4)
        assert got[2][0] == 1 and got[2][1][0] == "error" and "ValueError: bad task" in got[2][1][1]
        lanes.send(1, 3, "die")
        assert lanes.receive() == (1, None, None) and lanes.alive == [True, False]
        lanes.send(0, 4, 5)
        assert lanes.receive() == (0, 4, 10)


def test_worker_count_from_the_environment(monkeypatch):
    monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", "3")
    assert worker_count() == 3
    monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", "0")
    assert worker_count() == 0
    monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", "two")
    with pytest.raises(ValueError, match="AUTOPAR_PLAN_WORKERS='two'"):
        worker_count()
    monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", "")   # as `AUTOPAR_PLAN_WORKERS= cmd` sets it: unset
    assert 1 <= worker_count() <= 4
    monkeypatch.delenv("AUTOPAR_PLAN_WORKERS")
    assert 1 <= worker_count() <= 4


def test_workers_exit_when_the_planner_dies():
    """A worker's pipe closes when the planner is killed (the worker holds no copy of the
    planner's end): it exits instead of waiting forever."""
    import subprocess
    import sys
    import textwrap
    import time
    script = textwrap.dedent("""
        import os, sys, time
        from autopar.search.candidate_workers import Lanes
        lanes = Lanes(2, lambda task: task)
        print(*[p.pid for p in lanes.procs], flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    pids = [int(x) for x in proc.stdout.readline().split()]
    assert len(pids) == 2
    proc.kill()
    proc.wait()
    deadline = time.time() + 20
    alive = pids
    while alive and time.time() < deadline:
        alive = [p for p in alive if _running(p)]
        time.sleep(0.1)
    assert not alive, f"workers {alive} outlived the planner"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"   # a zombie has exited (its parent, init, reaps it)
    except FileNotFoundError:
        return False


def test_no_fork_while_another_thread_runs():
    import threading
    from autopar.search.candidate_workers import can_fork
    # another test in this worker process may have left a thread (a failure record's watcher):
    # then forking is already refused
    assert can_fork() == (threading.active_count() == 1)
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert not can_fork()
    finally:
        stop.set()
        t.join()
