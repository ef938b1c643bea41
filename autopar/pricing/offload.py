"""What offloading the optimizer costs one rank: host bytes, copies and the CPU step.

``offload="optimizer"`` (ZeRO-Offload's design, as runtime/offload.py runs it): the fp32 master
weights and the optimizer state of the rank's ZeRO shard live in host memory and the optimizer
steps there. Per step, each chunk's averaged gradient piece goes device -> host in the working
dtype, the CPU upcasts it, steps the master, and the result cast to the working dtype goes
host -> device. The runtime pipelines the three over chunks (chunk i+1 copied while chunk i
steps), so a step costs about the largest of the three; priced per parameter as that maximum,
which is at least the pipelined time when one of the three dominates every chunk (the usual
case: the CPU step) and never less than it by more than the pipeline's fill.

Bytes per element of the offloaded shard:

    device   params (working)  grads (working; ZeRO 2-3: none)   optimizer 0
    host     master 4 + optimizer state (memory.STATE_BYTES) + gradients: a staging copy in the
             working dtype, and (ZeRO 2-3, streamed as backward reduces them) their fp32 sum 4
             ("optimizer+params", ZeRO-3: + the parameter shard, working; the device holds none)

The CPU step moves what the runtime's host step moves (``host_step_bytes_per_element``: AdamW and
Adam run torch's fused CPU kernel, each tensor read once and the updated ones written once, 28
bytes per element; the others their torch ops, cost.optimizer_bytes_per_element; plus the
gradient's upcast and the master's cast back under mixed precision), at the node's CPU memory
bandwidth shared by its ranks (cluster.Host). Copies run at the host
link's bandwidth per device while every device copies. A calibration profile's measured host
figures replace the Host's (``host_rates``).

``offload="optimizer-nvme"`` (ZeRO-Infinity's split of the optimizer offload): the optimizer
state lives in files on the node's NVMe (cluster.Nvme), the fp32 master and the staging on the
host. Each step reads and writes the whole state (``STATE_BYTES`` per element each way) at the
rank's share of the drives' read and write bandwidth; the runtime streams it chunk by chunk
through a buffer of one chunk's state, so the I/O pipelines with the CPU step and the copies like
them: the step costs the largest of the four, plus one chunk's I/O start (``NVME_LATENCY``) that
keeps it strictly slower than the same offload kept in host memory. The state must fit the rank's
share of the NVMe capacity (``nvme_budget``); the host keeps master 4 + staging (+ 4 streamed)
per element. ``"optimizer+params-nvme"`` (ZeRO-3): the same, with ZeRO-3's parameter shards on
the host as under "optimizer+params" (ZeRO-Infinity's offload of both).
Torch-free.
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.cluster import Cluster
from autopar.errors import ConstraintError
from autopar.pricing.cost import MIXED_CAST_BYTES, optimizer_bytes_per_element, profile_of
from autopar.pricing.memory import STATE_BYTES, check_optimizer, check_precision

OFFLOAD_MODES = ("none", "optimizer", "optimizer+params", "optimizer-nvme", "optimizer+params-nvme")
PARAM_MODES = ("optimizer+params", "optimizer+params-nvme")   # ZeRO-3's parameter shards on the host too
NVME_MODES = ("optimizer-nvme", "optimizer+params-nvme")      # the optimizer state on the node's NVMe
# a plan's predictions["offload"] byte counts (held, per step), which scale with the offloaded share
OFFLOAD_BYTES = ("host_bytes", "d2h_bytes", "h2d_bytes", "nvme_bytes")


# runtime/optim.py host_step: torch's fused CPU Adam(W) reads param, grad, exp_avg and exp_avg_sq
# once and writes param, exp_avg and exp_avg_sq once (fp32)
HOST_FUSED_STEP_BYTES = {"adamw": 28, "adam": 28}


def working_bytes(precision: str) -> int:
    return 2 if check_precision(precision) == "bf16" else 4


def host_step_bytes_per_element(optimizer: str, precision: str) -> int:
    """Bytes the offloaded optimizer's host step moves per element (module doc)."""
    step = HOST_FUSED_STEP_BYTES.get(optimizer) or optimizer_bytes_per_element(optimizer, "fp32")
    return step + (0 if check_precision(precision) == "fp32" else MIXED_CAST_BYTES)


@dataclass(frozen=True)
class OffloadPrice:
    """One rank's offload of ``numel`` shard elements for one step."""
    host_bytes: float     # master + state + gradient staging on the host
    d2h_bytes: float      # gradients to the host
    h2d_bytes: float      # updated parameters back
    cpu_seconds: float    # the optimizer step on the CPU
    copy_seconds: float   # the larger of the two copies
    seconds: float        # what the step costs: the largest of the three (pipelined over chunks)
    gather_h2d_bytes: float = 0.0   # "optimizer+params": the parameter shard copied up for each gather
    gather_seconds: float = 0.0     # ... and its time (not overlapped: the gathers are not prefetched)
    nvme_bytes: float = 0.0         # "optimizer-nvme": the optimizer state held on NVMe (read and written per step)
    nvme_seconds: float = 0.0       # ... its read plus its write at the rank's share of the drives


def host_bytes_per_element(optimizer: str, precision: str, streamed: bool = False, nvme: bool = False) -> int:
    """Host bytes one offloaded shard element holds: fp32 master, optimizer state (not with
    ``nvme``: on the drives), the gradient staging buffer (working dtype) and, ``streamed``, the
    fp32 sum of the streamed shards."""
    check_optimizer(optimizer)
    return 4 + (0 if nvme else STATE_BYTES[optimizer]) + working_bytes(precision) + (4 if streamed else 0)


def host_rates(cluster: Cluster) -> tuple[float, float]:
    """(host<->device copy bytes/s per device, CPU optimizer-step bytes/s per rank) offload is
    priced with: the cluster's calibration profile's measured figures where it has them
    (``autopar calibrate``: profile.Calibration ``host_copy_bandwidth``, ``host_cpu_bandwidth``),
    else its Host's. A measured CPU figure is already one rank's (one process's step timed while
    every process of the calibration stepped at once), so it is used as it is; the Host's
    ``cpu_bandwidth`` is the node's and is divided by its ``shared_by`` ranks. The cluster must
    describe a host."""
    host = cluster.host
    cal = profile_of(cluster)
    copy = getattr(cal, "host_copy_bandwidth", None) or host.copy_bandwidth
    cpu = getattr(cal, "host_cpu_bandwidth", None) or host.per_rank()[1]
    return copy, cpu


# Seconds to start one host<->device copy (a cudaMemcpyAsync launch plus the PCIe round trip)
COPY_LATENCY = 10e-6
# Seconds to start one chunk's NVMe read or write (an NVMe command's ~10-100 us device latency
# plus a system call; the pipeline's fill)
NVME_LATENCY = 100e-6


def offload_price(numel: float, optimizer: str, precision: str, cluster: Cluster, zero: int = 0,
                  micro_batches: int = 1, fixed: float = 0.0, params: bool = False, nvme: bool = False) -> OffloadPrice:
    """The step's offload work for ``numel`` elements of one rank's optimizer shard. ZeRO 2-3
    stream each micro-batch's reduced gradient shard to the host as backward produces it (the
    device keeps no gradient shard: ``streamed``); ZeRO 0-1 copy the step's gradient once.
    ``fixed``: the step's fixed host cost per tensor (the same op dispatches as on the device:
    cost.optimizer_step_time of one element), added to the pipelined time with two copy starts.
    ``params`` ("optimizer+params", ZeRO-3): the working-dtype parameter shard lives on the host
    too; the step writes it there (no copy back) and each of the 2 x micro-batches gathers
    (forward and backward) copies it up first. ``nvme`` ("optimizer-nvme"): the optimizer state
    on the cluster's NVMe, read and written each step (module doc)."""
    host = cluster.host
    if host is None:
        raise ConstraintError(f"cluster {cluster.name!r} describes no host (memory, host<->device copy bandwidth, "
                              f"CPU bandwidth): offload cannot be priced; add a `host:` section to the cluster "
                              f"(examples/cluster.yaml) or use a preset that has one")
    streamed = zero >= 2
    w = working_bytes(precision)
    copy_rate, cpu_rate = host_rates(cluster)
    cpu = numel * host_step_bytes_per_element(optimizer, precision) / cpu_rate
    d2h = numel * w * (micro_batches if streamed else 1)
    h2d = 0.0 if params else numel * w
    copy = max(d2h, h2d) / copy_rate
    held = numel * (host_bytes_per_element(optimizer, precision, streamed, nvme) + (w if params else 0))
    gather = 2 * micro_batches * numel * w if params else 0.0
    disk = io = 0.0
    if nvme:
        if cluster.nvme is None:
            raise ConstraintError(f"cluster {cluster.name!r} describes no NVMe (capacity, read and write bandwidth): "
                                  f"offload='optimizer-nvme' cannot be priced; add an `nvme:` section to the cluster "
                                  f"(examples/cluster.yaml) or use a preset that has one")
        _, read, write = cluster.nvme.per_rank()
        disk = numel * STATE_BYTES[optimizer]
        io = disk / read + disk / write
    slowest = max(cpu, copy, io) + (NVME_LATENCY if nvme else 0.0)
    return OffloadPrice(held, d2h, h2d + gather, cpu, copy, slowest + fixed + 2 * COPY_LATENCY,
                        gather, gather / copy_rate + (2 * micro_batches * COPY_LATENCY if params else 0.0), disk, io)


def host_budget(cluster: Cluster) -> float:
    """Host memory bytes one rank may hold (its share of the node's)."""
    return cluster.host.per_rank()[0] if cluster.host is not None else 0.0


def nvme_budget(cluster: Cluster) -> float:
    """NVMe bytes one rank may hold (its share of the node's drives)."""
    return cluster.nvme.per_rank()[0] if cluster.nvme is not None else 0.0
