"""Where and in what precision a rank runs: the process group (created from the torchrun
environment with the cluster's backend when none exists), the rank's device (NCCL: its GPU; gloo:
the CPU) and the working dtype (the plan's precision on a GPU, fp32 on the CPU unless asked).

On GPUs the group is ``cpu:gloo,cuda:nccl``: training collectives run on NCCL, and set-up's
collectives over small host tensors (shapes, value ranges, checks) on gloo. A group a user
created with NCCL alone is refused with that advice, since NCCL cannot reduce host tensors."""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.errors import ExecutionError


def require_process_group(cluster=None):
    """The default process group; under torchrun, created here with the cluster's backend."""
    import os

    if dist.is_available() and dist.is_initialized():
        return
    if dist.is_available() and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        backend = getattr(cluster, "backend", "gloo")
        if backend == "nccl":
            if not torch.cuda.is_available():
                raise ExecutionError(f"cluster {getattr(cluster, 'name', '?')!r} runs on NCCL (GPUs) but this machine "
                                     f"has no CUDA device: use Cluster.preset('cpu', devices=N) to run on the CPU "
                                     f"(gloo), or initialise a gloo process group yourself")
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(GPU_BACKENDS if backend == "nccl" else backend, **restart_safe_store())
        return
    raise ExecutionError("autopar.compile needs an initialised torch.distributed process group: "
                         "run under torchrun or runtime.launch.run_local (for one process, "
                         "dist.init_process_group('gloo', rank=0, world_size=1))")


GPU_BACKENDS = "cpu:gloo,cuda:nccl"


def restart_safe_store() -> dict:
    """Keyword arguments for ``init_process_group`` that keep a restarted torchrun worker group off
    the keys of the group before it (issue 30).

    torchrun's c10d rendezvous shares one TCPStore across restarts (``TORCHELASTIC_USE_AGENT_STORE``)
    and torch connects the workers' group through it without a per-attempt prefix: the group's keys
    (each gloo rank's listening address, ...) of a dead attempt are still there. A restarted rank that
    asks for a peer's address before the peer has published its new one reads the dead process's
    and fails ("Gloo connectFullMesh failed ... Connection refused"); a loaded machine, where the
    restarted ranks start seconds apart, hits it often. Here the group of attempt
    ``TORCHELASTIC_RESTART_COUNT`` lives under its own prefix, so only live addresses are read.
    Nothing changes outside a restarted agent-store torchrun run (empty: torch's env:// defaults)."""
    import os
    from datetime import timedelta

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or attempt in (None, "", "0"):
        return {}
    if not ("MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ):
        return {}
    from torch.distributed.constants import default_pg_timeout

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timedelta(seconds=default_pg_timeout.total_seconds()))
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return {"store": dist.PrefixStore(f"/autopar/{run}/attempt_{attempt}", store), "rank": rank, "world_size": world}


def uses_nccl(group=None) -> bool:
    """Whether ``group`` (default: the world) runs its CUDA collectives on NCCL."""
    return "nccl" in str(dist.get_backend(group))


def check_host_collectives() -> None:
    """A GPU group must also reduce host tensors (set-up does): NCCL alone cannot."""
    backend = str(dist.get_backend())
    if "nccl" in backend and "gloo" not in backend:
        raise ExecutionError(f"the process group runs NCCL only ({backend!r}); autopar's set-up also exchanges "
                             f"small host tensors: create it with dist.init_process_group({GPU_BACKENDS!r}) "
                             f"(or let autopar.compile create it from the torchrun environment)", collective=True)


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def run_device() -> torch.device:
    """NCCL: this rank's GPU (the current CUDA device, set from LOCAL_RANK); otherwise the CPU."""
    if uses_nccl():
        import os

        if "LOCAL_RANK" in os.environ:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def working_dtype(plan_precision: str, requested, device: torch.device) -> torch.dtype:
    """``requested`` ("fp32" | "bf16") if given; else the plan's precision on a GPU, fp32 on the CPU."""
    if requested is not None:
        if requested not in _DTYPES:
            raise ExecutionError(f"precision must be one of {sorted(_DTYPES)}, got {requested!r}")
        return _DTYPES[requested]
    return _DTYPES.get(plan_precision, torch.float32) if device.type == "cuda" else torch.float32

