"""The parts a cluster is made of: one device (``Device``), a link (``Link``), a node's host side
(``Host``, what offload is priced with) and its NVMe drives (``Nvme``), with the immutable
``FrozenMap`` a device's per-dtype peaks are kept in.

Every value is in base SI units (FLOP/s, bytes, bytes/s, seconds); every part is frozen and
hashable and checks its values when made (a ``ClusterError`` says which). ``DTYPES`` are the
dtypes a device's peaks are given for, ``BACKENDS`` the collective backends a cluster runs.
Torch-free.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Iterator

from autopar.errors import ClusterError

DTYPES = ("bf16", "fp16", "fp32")
BACKENDS = ("nccl", "gloo")
DEFAULT_KERNEL_OVERHEAD = 5e-6   # seconds; typical CUDA launch + tail latency of one kernel


def _positive(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and v > 0


class FrozenMap(Mapping):
    """An immutable, hashable ``str -> float`` mapping (a dict cannot live in a frozen,
    hashable dataclass). Iterates in sorted key order so equal maps look alike."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping | Any = ()):
        pairs = items.items() if isinstance(items, Mapping) else items
        object.__setattr__(self, "_items", tuple(sorted((str(k), v) for k, v in pairs)))

    def __getitem__(self, key):
        for k, v in self._items:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return (k for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other) -> bool:
        if isinstance(other, FrozenMap):
            return self._items == other._items
        if isinstance(other, Mapping):
            return dict(self._items) == dict(other.items())
        return NotImplemented

    def __setattr__(self, name, value):
        raise AttributeError("FrozenMap is immutable")

    def __repr__(self) -> str:
        return f"FrozenMap({dict(self._items)!r})"


@dataclass(frozen=True)
class Device:
    """One accelerator. ``peak_flops`` maps "bf16"/"fp16"/"fp32" to dense FLOP/s (fp32 means
    what an fp32 matmul reaches, i.e. TF32 tensor cores on Ampere/Hopper).

    ``host_layer_overhead`` / ``host_forward_overhead``: seconds of host (Python, dispatch) work
    of one forward of a Hugging Face decoder, per decoder layer and per forward, that the
    inference pricer adds to each iteration (autopar/inference/inference_cost.py, "Host
    overhead"); ``host_synchronous``: whether that work adds to the kernels' time (a CPU runs
    them in the same thread) rather than hiding behind it (a GPU's kernels launch
    asynchronously: max(host, kernels)). 0 and asynchronous by default: unchanged prices.
    ``skinny_gemm_bandwidth`` (bytes/s) / ``skinny_gemm_flops`` (FLOP/s): what a pass of GEMMs of
    few rows over weights that are not in cache reaches (a decode step's projections on a CPU:
    t = bytes / bandwidth + FLOPs / rate), a floor under the inference pricer's roofline for
    GEMMs of fewer than 256 rows; 0 (default): not measured, no floor."""
    name: str
    peak_flops: FrozenMap
    memory_bytes: int
    hbm_bandwidth: float
    kernel_overhead: float = DEFAULT_KERNEL_OVERHEAD
    host_layer_overhead: float = 0.0
    host_forward_overhead: float = 0.0
    host_synchronous: bool = False
    skinny_gemm_bandwidth: float = 0.0
    skinny_gemm_flops: float = 0.0

    def __post_init__(self):
        if not isinstance(self.peak_flops, FrozenMap):
            object.__setattr__(self, "peak_flops", FrozenMap(self.peak_flops))
        missing = [d for d in DTYPES if d not in self.peak_flops]
        if missing:
            raise ClusterError(f"device {self.name!r}: peak_flops lacks {missing}; expected keys {list(DTYPES)}")
        for what, v in [("memory_bytes", self.memory_bytes), ("hbm_bandwidth", self.hbm_bandwidth),
                        *((f"peak_flops.{k}", v) for k, v in self.peak_flops.items())]:
            if not _positive(v):
                raise ClusterError(f"device {self.name!r}: {what} = {v!r}; expected a positive number")
        if not (isinstance(self.kernel_overhead, (int, float)) and self.kernel_overhead >= 0):
            raise ClusterError(f"device {self.name!r}: kernel_overhead = {self.kernel_overhead!r}; "
                               "expected seconds >= 0")
        for what in ("host_layer_overhead", "host_forward_overhead", "skinny_gemm_bandwidth", "skinny_gemm_flops"):
            v = getattr(self, what)
            if not (isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and v >= 0):
                raise ClusterError(f"device {self.name!r}: {what} = {v!r}; expected a finite number >= 0")

    def peak(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype``; a ClusterError names the known dtypes otherwise."""
        try:
            return float(self.peak_flops[dtype])
        except KeyError:
            raise ClusterError(f"device {self.name!r} has no peak_flops for dtype {dtype!r}; "
                               f"known: {sorted(self.peak_flops)}") from None


@dataclass(frozen=True)
class Link:
    """A point-to-point link as seen by one device: effective bandwidth (bytes/s) and latency (s).
    For the intra-node link of a GPU node this is the measured collective *bus* bandwidth."""
    bandwidth: float
    latency: float

    def __post_init__(self):
        if not _positive(self.bandwidth):
            raise ClusterError(f"link bandwidth = {self.bandwidth!r}; expected a positive number of bytes/s")
        if not (isinstance(self.latency, (int, float)) and not isinstance(self.latency, bool)
                and math.isfinite(self.latency) and self.latency >= 0):
            raise ClusterError(f"link latency = {self.latency!r}; expected seconds >= 0")


@dataclass(frozen=True)
class Host:
    """The host side of one node, what offload is priced with (autopar/pricing/offload.py):
    ``memory_bytes`` of host memory per node, shared by ``shared_by`` devices (the node's
    devices_per_node when described); ``copy_bandwidth``: host<->device bytes/s one device gets
    per direction while every device of the node copies (PCIe switches are shared);
    ``cpu_bandwidth``: the memory bandwidth (bytes/s) an optimizer step on the node's CPUs
    reaches with every core, shared by the node's ranks (a CPU optimizer step is memory-bound)."""
    memory_bytes: int
    copy_bandwidth: float
    cpu_bandwidth: float
    shared_by: int = 1

    def __post_init__(self):
        for what, v in [("memory", self.memory_bytes), ("copy_bandwidth", self.copy_bandwidth),
                        ("cpu_bandwidth", self.cpu_bandwidth)]:
            if not _positive(v):
                raise ClusterError(f"host: {what} = {v!r}; expected a positive number")
        if not (isinstance(self.shared_by, int) and not isinstance(self.shared_by, bool) and self.shared_by >= 1):
            raise ClusterError(f"host: shared_by = {self.shared_by!r}; expected an integer >= 1")

    def per_rank(self) -> tuple[float, float]:
        """(host memory bytes, CPU bytes/s) of one rank's share of the node."""
        return self.memory_bytes / self.shared_by, self.cpu_bandwidth / self.shared_by


@dataclass(frozen=True)
class Nvme:
    """The NVMe drives of one node that offload="optimizer-nvme" keeps optimizer state on
    (autopar/pricing/offload.py): ``capacity_bytes`` per node and the drives' sequential
    ``read_bandwidth`` / ``write_bandwidth`` (bytes/s, all drives together), shared by
    ``shared_by`` devices (the node's devices_per_node)."""
    capacity_bytes: int
    read_bandwidth: float
    write_bandwidth: float
    shared_by: int = 1

    def __post_init__(self):
        for what, v in [("capacity", self.capacity_bytes), ("read_bandwidth", self.read_bandwidth),
                        ("write_bandwidth", self.write_bandwidth)]:
            if not _positive(v):
                raise ClusterError(f"nvme: {what} = {v!r}; expected a positive number")
        if not (isinstance(self.shared_by, int) and not isinstance(self.shared_by, bool) and self.shared_by >= 1):
            raise ClusterError(f"nvme: shared_by = {self.shared_by!r}; expected an integer >= 1")

    def per_rank(self) -> tuple[float, float, float]:
        """(capacity bytes, read bytes/s, write bytes/s) of one rank's share of the node's drives."""
        k = self.shared_by
        return self.capacity_bytes / k, self.read_bandwidth / k, self.write_bandwidth / k

