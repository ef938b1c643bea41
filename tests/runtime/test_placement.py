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
