"""Where a rank runs (autopar/execution/placement.py): working dtype and the process-group requirement."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.errors import ExecutionError
from autopar.execution.placement import require_process_group, working_dtype


def test_working_dtype_follows_plan_on_gpu_and_is_fp32_on_cpu():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert working_dtype("bf16", None, gpu) == torch.bfloat16
    assert working_dtype("fp32", None, gpu) == torch.float32
    assert working_dtype("bf16", None, cpu) == torch.float32
    assert working_dtype("fp32", "bf16", cpu) == torch.bfloat16      # asked for: the tested CPU path
    with pytest.raises(ExecutionError, match="precision must be one of"):
        working_dtype("bf16", "fp16", cpu)


def test_no_process_group_and_no_torchrun_environment_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ExecutionError, match="needs an initialised torch.distributed process group"):
        require_process_group(autopar.Cluster.preset("cpu", devices=2))


def test_nccl_cluster_under_torchrun_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)   # the same on a machine with GPUs
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ExecutionError, match="runs on NCCL"):
        require_process_group(autopar.Cluster.preset("dgx-a100", nodes=1))


def test_gpu_group_is_created_with_a_host_backend_too(monkeypatch):
    """Under torchrun on GPUs the group is cpu:gloo,cuda:nccl: set-up reduces host tensors."""
    made = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: made.append(backend))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    require_process_group(autopar.Cluster.preset("dgx-h100", devices=1))
    assert made == ["cpu:gloo,cuda:nccl"]


@pytest.mark.parametrize("backend,ok", [("nccl", False), ("cpu:gloo,cuda:nccl", True), ("gloo", True)])
def test_an_nccl_only_group_is_refused_with_advice(monkeypatch, backend, ok):
    from autopar.execution.placement import check_host_collectives, uses_nccl
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert uses_nccl() == ("nccl" in backend)
    if ok:
        check_host_collectives()
    else:
        with pytest.raises(ExecutionError, match="cpu:gloo,cuda:nccl"):
            check_host_collectives()


def test_a_restarted_torchrun_group_connects_under_its_own_store_prefix(monkeypatch):
    """Issue 30: torchrun's c10d rendezvous shares one TCPStore across restarts, and torch connects
    the workers' group through it unprefixed, so a restarted gloo rank could read a dead attempt's
    address ("connectFullMesh failed ... Connection refused"). Attempt k > 0 gets its own prefix;
    a first attempt, or no agent store, keeps torch's env:// defaults."""
    from datetime import timedelta

    import torch.distributed as dist

    from autopar.execution.placement import restart_safe_store

    server = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(server.port), "RANK": "1", "WORLD_SIZE": "2",
                 "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "r"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert restart_safe_store() == {}
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    kw = restart_safe_store()
    assert kw["rank"] == 1 and kw["world_size"] == 2
    kw["store"].set("0", "addr")
    assert server.get("/autopar/r/attempt_2/0") == b"addr"
    assert not server.check(["0"])
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert restart_safe_store() == {}


_RANK = r"""
import datetime, os, sys, time
import torch, torch.distributed as dist
from autopar.execution.placement import restart_safe_store
rank, port, delay = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
time.sleep(delay)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE="2")
kw = restart_safe_store() or dict(store=dist.TCPStore("127.0.0.1", int(port), 2, is_master=False),
                                   rank=rank, world_size=2)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60), **kw)
x = torch.ones(1)
dist.all_reduce(x)
print("sum", x.item(), flush=True)
os._exit(0)
"""


@pytest.mark.slow
def test_a_restarted_gloo_rank_that_starts_first_connects(tmp_path):
    """Issue 30, deterministically: attempt 0 connects through a shared store (as torchrun's agent
    store); in attempt 1 rank 1 starts 4 s before rank 0. Unprefixed, rank 1 read rank 0's dead
    address ("connectFullMesh failed ... Connection refused"); under its attempt prefix it waits."""
    import os
    import subprocess
    import sys
    from datetime import timedelta

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    root = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    for attempt, delays in enumerate([(0, 0), (4, 0)]):
        env = {**os.environ, "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": str(attempt),
               "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        ps = [subprocess.Popen([sys.executable, str(script), str(r), str(server.port), str(delays[r])], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
        outs = [p.communicate(timeout=240) for p in ps]
        for p, (out, err) in zip(ps, outs):
            assert p.returncode == 0 and "sum 2.0" in out, (attempt, err[-2000:])
