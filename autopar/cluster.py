"""The hardware a plan is made for: devices, links, presets and the YAML cluster file.

This module owns the ``Cluster`` description (and nothing about pricing: that is
``autopar/pricing/cost.py``). It is deliberately torch-free so the planner, the CLI and the solver's
offline tools can load a cluster without importing torch.

A ``Cluster`` is ``nodes`` × ``devices_per_node`` identical devices. Devices inside a node
talk over the intra-node link (NVLink on DGX machines, shared memory for local gloo
processes), devices on different nodes over the inter-node link (InfiniBand). Every value is
in base SI units: FLOP/s, bytes, bytes/s, seconds. Clusters are frozen and hashable (the
cost model caches on them).

YAML cluster file (``examples/cluster.yaml`` is a complete, commented example)::

    name: my-cluster            # optional (default: the preset's name, else "custom")
    preset: dgx-a100            # optional: start from a preset; every field below overrides it
    nodes: 2                    # number of machines
    devices_per_node: 8         # accelerators (or local processes) per machine
    devices: 16                 # optional: total devices; must equal nodes × devices_per_node
    backend: nccl               # nccl (GPUs) | gloo (CPUs)
    device:
      name: A100-SXM4-80GB
      memory: 80GB              # bytes per device: 80GB = 80e9, 80GiB = 80 × 2**30, or an integer
      peak_flops:               # dense FLOP/s per dtype: "312T", "312TFLOPS", 3.12e14, ...
        bf16: 312T
        fp16: 312T              # optional: defaults to bf16
        fp32: 156T
      hbm_bandwidth: 2039GB/s   # device memory bandwidth
      kernel_overhead: 5us      # optional: fixed cost of one kernel launch (default 5us)
    links:
      intra: {bandwidth: 230GB/s, latency: 5us}    # effective (bus) bandwidth per device
      inter: {bandwidth: 200Gb/s, latency: 10us}   # optional when nodes == 1 (then = intra)
    host:                       # optional: what offload prices (without it, offload is not planned)
      memory: 2TB               # host memory per node, shared by its devices
      copy_bandwidth: 12.5GB/s  # host<->device bytes/s per device, per direction, all devices copying
      cpu_bandwidth: 290GB/s    # memory bandwidth an optimizer step on the CPUs reaches, per node
    nvme:                       # optional: what offload="optimizer-nvme" prices (without it, not planned)
      capacity: 15.36TB         # NVMe bytes per node for offloaded optimizer state, shared by its devices
      read_bandwidth: 25GB/s    # sequential read bytes/s of the node's drives together
      write_bandwidth: 12GB/s   # sequential write bytes/s of the node's drives together

Units accepted in strings: bytes ``B kB MB GB TB`` (powers of 1000) and ``KiB MiB GiB TiB``
(powers of 1024); FLOP/s ``k M G T P`` optionally followed by ``FLOPS`` or ``FLOP/s``;
bandwidth ``GB/s`` / ``GBps`` (bytes) and ``Gb/s`` / ``Gbps`` / ``Gbit/s`` (bits, divided by 8);
time ``s ms us µs ns``. A bare number is taken in base units (bytes, FLOP/s, bytes/s, seconds).

Every problem in a cluster description raises ``autopar.errors.ClusterError`` naming the
file, the field path (e.g. ``links.intra.bandwidth``), the bad value and what is expected.
``Cluster.to_dict()`` writes the same schema with plain numbers; ``from_dict(to_dict())`` and
``from_yaml`` after ``to_yaml`` give back an equal cluster.
"""
from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml

from autopar.errors import ClusterError
from autopar.mesh import Mesh, enumerate_meshes
from autopar.profile import Calibration
from autopar.units import QUANTITY_EXAMPLES, parse_quantity, warn_if_implausible

DTYPES = ("bf16", "fp16", "fp32")
BACKENDS = ("nccl", "gloo")
DEFAULT_KERNEL_OVERHEAD = 5e-6   # seconds; typical CUDA launch + tail latency of one kernel


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
    what an fp32 matmul reaches, i.e. TF32 tensor cores on Ampere/Hopper)."""
    name: str
    peak_flops: FrozenMap
    memory_bytes: int
    hbm_bandwidth: float
    kernel_overhead: float = DEFAULT_KERNEL_OVERHEAD

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


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    devices_per_node: int
    device: Device
    intra_link: Link
    inter_link: Link
    backend: str = "nccl"
    calibration: Any = None   # autopar.profile.Calibration (measured rates), or None: see cost.profile_of
    host: Host | None = None   # None: no host described, offload is not planned
    nvme: Nvme | None = None   # None: no NVMe described, offload="optimizer-nvme" is not planned

    def __post_init__(self):
        for what, v in [("nodes", self.nodes), ("devices_per_node", self.devices_per_node)]:
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ClusterError(f"cluster {self.name!r}: {what} = {v!r}; expected an integer >= 1")
        if self.backend not in BACKENDS:
            raise ClusterError(f"cluster {self.name!r}: backend = {self.backend!r}; expected one of {list(BACKENDS)}")

    # ---- basic facts
    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def meshes(self, max_model_axes: int = 2, max_tp: int | None = None) -> list[Mesh]:
        """Every logical mesh (dp × tp[, tp2]) of this cluster's devices."""
        return enumerate_meshes(self.num_devices, self.devices_per_node, max_model_axes, max_tp)

    def describe(self) -> str:
        d = self.device
        return (f"{self.name}: {self.nodes} node(s) × {self.devices_per_node} {d.name} "
                f"({d.peak('bf16') / 1e12:g} TFLOP/s bf16, {d.memory_bytes / 1e9:g} GB, "
                f"{d.hbm_bandwidth / 1e9:g} GB/s), intra {self.intra_link.bandwidth / 1e9:g} GB/s, "
                f"inter {self.inter_link.bandwidth / 1e9:g} GB/s, {self.backend}")

    # ---- presets
    @staticmethod
    def preset(name: str, nodes: int = 1, devices: int | None = None) -> "Cluster":
        """A named cluster with published figures. ``nodes``: machines; ``devices``: devices per
        node (default: the whole node for DGX presets, 2 local processes for ``cpu``)."""
        if name not in PRESETS:
            close = difflib.get_close_matches(str(name), PRESETS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ClusterError(f"unknown cluster preset {name!r}{hint}; known presets: {', '.join(PRESETS)}")
        return PRESETS[name](nodes, devices)

    # ---- serialisation
    def to_dict(self) -> dict:
        """Plain-number form of the YAML schema (embedded in Plan JSON); from_dict inverts it exactly."""
        d = self.device
        return {
            "name": self.name,
            "nodes": self.nodes,
            "devices_per_node": self.devices_per_node,
            "backend": self.backend,
            "device": {
                "name": d.name,
                "memory": int(d.memory_bytes),
                "peak_flops": {k: float(v) for k, v in d.peak_flops.items()},
                "hbm_bandwidth": float(d.hbm_bandwidth),
                "kernel_overhead": float(d.kernel_overhead),
            },
            "links": {
                "intra": {"bandwidth": float(self.intra_link.bandwidth), "latency": float(self.intra_link.latency)},
                "inter": {"bandwidth": float(self.inter_link.bandwidth), "latency": float(self.inter_link.latency)},
            },
            **({"calibration": self.calibration.to_dict()} if self.calibration is not None else {}),
            **({"host": {"memory": int(self.host.memory_bytes), "copy_bandwidth": float(self.host.copy_bandwidth),
                         "cpu_bandwidth": float(self.host.cpu_bandwidth)}} if self.host is not None else {}),
            **({"nvme": {"capacity": int(self.nvme.capacity_bytes), "read_bandwidth": float(self.nvme.read_bandwidth),
                         "write_bandwidth": float(self.nvme.write_bandwidth)}} if self.nvme is not None else {}),
        }

    def with_calibration(self, calibration) -> "Cluster":
        """The same cluster priced with ``calibration``: an autopar.profile.Calibration or
        the path of a calibration profile (YAML, as ``autopar calibrate`` writes)."""
        import dataclasses
        import os
        if isinstance(calibration, (str, os.PathLike)):
            calibration = Calibration.from_yaml(calibration)
        elif calibration is not None and not isinstance(calibration, Calibration):
            raise TypeError(f"with_calibration: expected a Calibration or a profile's path, got "
                            f"{type(calibration).__name__}")
        return dataclasses.replace(self, calibration=calibration)

    @staticmethod
    def from_dict(d: Any, source: str = "<cluster dict>") -> "Cluster":
        """Build from the YAML schema (numbers or human units); ``source`` names it in errors."""
        return _parse(d, source)

    def to_yaml(self, path) -> None:
        text = "# autopar cluster description (schema: autopar/cluster.py)\n"
        text += yaml.safe_dump(self.to_dict(), sort_keys=False)
        Path(path).write_text(text)

    @staticmethod
    def from_yaml(path) -> "Cluster":
        p = Path(path)
        if not p.exists():
            raise ClusterError(f"{p}: cluster file does not exist (give a path to a YAML file, "
                               f"or a preset name: {', '.join(PRESETS)})")
        if not p.is_file():
            raise ClusterError(f"{p}: not a file; expected a YAML cluster description")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ClusterError(f"{p}: invalid YAML: {e}") from None
        except UnicodeDecodeError:
            raise ClusterError(f"{p}: not a text file; expected a YAML cluster description") from None
        return _parse(data, str(p))


# ---------------------------------------------------------------------------------------------
# Presets. Sources:
#  A100: NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOP/s bf16/fp16 dense, 156 TFLOP/s TF32 dense,
#        2,039 GB/s HBM2e, NVLink 600 GB/s per GPU. We use ~230 GB/s, the all-reduce *bus*
#        bandwidth nccl-tests measures on a DGX A100, as the effective intra-node bandwidth
#        (cost.py's ring formulas expect bus bandwidth). DGX A100: 8 × 200 Gb/s HDR InfiniBand
#        (one NIC per GPU) = 25 GB/s per GPU.
#  H100: NVIDIA H100 SXM5 datasheet: 989 TFLOP/s bf16/fp16 dense, 494.5 TFLOP/s TF32 dense
#        (989 is with sparsity), 3,350 GB/s HBM3, NVLink 900 GB/s; ~370 GB/s ring all-reduce
#        bus bandwidth measured (≈480 with NVLink SHARP, not assumed). DGX H100: 8 × 400 Gb/s
#        NDR, ≈48 GB/s per NIC measured.
#  Latencies (5 µs NVLink, 10 µs InfiniBand) are typical small-message NCCL figures.
#  fp32 matmuls on GPUs are priced at TF32 tensor-core rate (torch's allow_tf32 / "high"
#  matmul precision); pure-fp32 CUDA-core rate would be 19.5 (A100) / 67 (H100) TFLOP/s.
# ---------------------------------------------------------------------------------------------

def _check_count(what: str, v, preset: str) -> None:
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        raise ClusterError(f"preset {preset!r}: {what}={v!r}; expected an integer >= 1")


def _positive(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _host(memory: float, copy: float, cpu: float, per_node: int) -> Host:
    return Host(int(memory), copy, cpu, per_node)


def _dgx(name: str, device: Device, intra: Link, inter: Link, host: tuple = None, per_node_max: int = 8,
         what: str = "a DGX node", nvme: tuple = None):
    """A preset whose machines hold ``per_node_max`` GPUs (``devices`` may ask for fewer);
    ``host``: (memory per node, copy bytes/s per device, CPU bytes/s per node); ``nvme``:
    (capacity per node, read bytes/s, write bytes/s of the node's drives)."""
    def make(nodes: int, devices: int | None) -> Cluster:
        _check_count("nodes", nodes, name)
        per_node = per_node_max if devices is None else devices
        _check_count("devices", per_node, name)
        if per_node > per_node_max:
            raise ClusterError(f"preset {name!r}: devices={per_node} is devices per node and {what} has "
                               f"{per_node_max}; use nodes={-(-per_node // per_node_max)} for more GPUs")
        return Cluster(name, nodes, per_node, device, intra, inter, "nccl",
                       host=_host(*host, per_node) if host is not None else None,
                       nvme=Nvme(int(nvme[0]), nvme[1], nvme[2], per_node) if nvme is not None else None)
    return make


def _cpu(nodes: int, devices: int | None) -> Cluster:
    _check_count("nodes", nodes, "cpu")
    if nodes != 1:
        raise ClusterError(f"preset 'cpu' describes local processes on one machine (nodes=1), got nodes={nodes}; "
                           "describe a multi-machine CPU cluster in a YAML file")
    per_node = 2 if devices is None else devices
    _check_count("devices", per_node, "cpu")
    # Rough figures for local gloo processes (tests and demos, not performance predictions):
    # ~50 GFLOP/s per process for any dtype, 4 GiB per process, ~10 GB/s memory bandwidth.
    # Link: facts.md measured a 4 MB gloo all_reduce at 5 ms on 2 processes (2 shared cores),
    # i.e. ~1 GB/s effective; latency ~50 µs per ring step.
    device = Device("cpu", FrozenMap({"bf16": 50e9, "fp16": 50e9, "fp32": 50e9}), 4 * 2**30, 10e9,
                    kernel_overhead=1e-6)
    link = Link(1e9, 5e-5)
    # Host: the same machine's memory (16 GiB assumed for the node) and its ~10 GB/s memory
    # bandwidth, both for "copies" between the two pools and for the CPU optimizer step. NVMe:
    # the machine's local disk (64 GiB for offloaded state, ~1 GB/s each way assumed).
    return Cluster("cpu", 1, per_node, device, link, link, "gloo", host=_host(16 * 2**30, 10e9, 10e9, per_node),
                   nvme=Nvme(64 * 2**30, 1e9, 1e9, per_node))


# TACC Longhorn (the V100 machine of the 2D/2.5D/3D tensor-parallelism papers' 64-GPU runs).
# Every figure and its source: docs/cost-model.md, section "V100 (tacc-longhorn)". In short:
#  - node: IBM POWER9 with 4 × Tesla V100 (Cornell Virtual Workshop, "GPUs on Frontera": Longhorn,
#    Frontera's V100 subsystem until 2022, "100+ IBM nodes, each equipped with 4 NVIDIA Tesla V100s").
#  - V100 SXM2 16 GB: 125 TFLOP/s fp16 tensor cores (NVIDIA, "Programming Tensor Cores in CUDA 9"),
#    15.7 TFLOP/s fp32 CUDA cores (no TF32 on Volta), 16 GB HBM2 at 900 GB/s (OLCF Summit V100 guide).
#    Volta has no bf16: the schema needs a bf16 entry and it mirrors fp16 (price plans in fp16 terms).
#  - NVLink 2.0: 25 GB/s per brick per direction, two bricks between processors = 50 GB/s (OLCF);
#    effective ring bus bandwidth 0.76 × 50 = 38 GB/s, 0.76 being the A100's measured/nominal ratio
#    (229 / 300 GB/s). An estimate: no published nccl-tests curve for this node was found.
#  - InfiniBand EDR 100 Gb/s = 12.5 GB/s per port; two ports per 4-GPU AC922 node assumed (as on
#    Bede's AC922 GPU nodes: one per POWER9 socket, needed for GPUDirect RDMA) = 6.25 GB/s per GPU,
#    × 0.9 of line rate (the A100 preset's ratio) = 5.6 GB/s.
V100_SXM2_16GB = Device("V100-SXM2-16GB", FrozenMap({"bf16": 125e12, "fp16": 125e12, "fp32": 15.7e12}),
                        16_000_000_000, 900e9)


# Hosts (what offload is priced with: autopar/pricing/offload.py). CPU memory bandwidth is taken
# as 70% of the sockets' nominal DRAM bandwidth (a STREAM-like sustained share; an estimate), and
# host<->device copies at the measured 25 GB/s of a PCIe 4.0 x16 link (50 for 5.0; facts.md),
# divided by the GPUs that share one switch uplink. Sources per preset:
#  DGX A100 (80 GB): 2 TB host memory; 2 × AMD EPYC 7742, 8 channels DDR4-3200 = 204.8 GB/s per
#        socket nominal -> 290 GB/s; four PCIe 4.0 switches, two GPUs on each -> 12.5 GB/s per GPU.
#  DGX H100: 2 TB; 2 × Xeon Platinum 8480C, 8 channels DDR5-4800 = 307.2 GB/s per socket -> 430
#        GB/s; PCIe 5.0, two GPUs per switch uplink assumed -> 25 GB/s per GPU.
#  Longhorn AC922: 256 GB per node; NVLink 2.0 between POWER9 and V100 (two bricks, 50 GB/s per
#        direction nominal, x0.76 as the links above, two GPUs per socket -> 19 GB/s per GPU);
#        2 × POWER9, 8 channels DDR4-2666 = 170 GB/s per socket -> 240 GB/s.
#  DGX-2 (the ZeRO-Offload paper's machine: 16 × V100 32 GB, 1.5 TB host memory, 2 × Xeon
#        Platinum 8168): 6 channels DDR4-2666 = 128 GB/s per socket -> 179 GB/s; PCIe 3.0 x16
#        measured ~12 GB/s, two GPUs per switch uplink -> 6 GB/s per GPU; NVSwitch 150 GB/s per
#        direction x0.76 = 114 GB/s bus bandwidth; 8 × EDR 100 Gb/s for 16 GPUs x0.9 = 5.6 GB/s.
# NVMe (what offload="optimizer-nvme" is priced with), only where the drives are published:
#  DGX A100: 4 × 3.84 TB U.2 NVMe internal storage = 15.36 TB (NVIDIA DGX A100 datasheet and user
#        guide, "Internal Storage: 15 TB (4x 3.84 TB) U.2 NVMe drives"; Microway's DGX A100 review:
#        "15TB high-speed NVMe SSD Scratch Space"), PCIe 4.0 drives in RAID 0: ~25 GB/s aggregate
#        sequential read (about 7 GB/s per Gen4 U.2 drive of that class, x4, less RAID overhead; the
#        figure ZeRO-Infinity quotes for a node's aggregate NVMe read) and 12 GB/s write (about
#        3.5 GB/s per drive, x4, x0.85). Estimates from drive data sheets, not measured.
#  Other presets: no NVMe (none published that we could source; describe it in the YAML).
#  Workstation: one RTX 4090 (GeForce RTX 4090 data sheet / Ada whitepaper: 165 TFLOP/s dense
#        bf16 with fp32 accumulate, 82.6 TFLOP/s fp32, 24 GB GDDR6X at 1,008 GB/s) in a PCIe 4.0
#        x16 slot (25 GB/s), 128 GB of dual-channel DDR5-5600 (89.6 GB/s -> 63 GB/s).
V100_SXM3_32GB = Device("V100-SXM3-32GB", FrozenMap({"bf16": 125e12, "fp16": 125e12, "fp32": 15.7e12}),
                        32_000_000_000, 900e9)
RTX_4090 = Device("RTX-4090-24GB", FrozenMap({"bf16": 165e12, "fp16": 165e12, "fp32": 82.6e12}),
                  24_000_000_000, 1008e9)

PRESETS = {
    "dgx-a100": _dgx("dgx-a100",
                     Device("A100-SXM4-80GB", FrozenMap({"bf16": 312e12, "fp16": 312e12, "fp32": 156e12}),
                            80_000_000_000, 2.039e12),
                     Link(230e9, 5e-6), Link(25e9, 1e-5), host=(2e12, 12.5e9, 290e9),
                     nvme=(15.36e12, 25e9, 12e9)),
    "dgx-h100": _dgx("dgx-h100",
                     Device("H100-SXM5-80GB", FrozenMap({"bf16": 989e12, "fp16": 989e12, "fp32": 494.5e12}),
                            80_000_000_000, 3.35e12),
                     Link(370e9, 5e-6), Link(48e9, 1e-5), host=(2e12, 25e9, 430e9)),
    "tacc-longhorn": _dgx("tacc-longhorn", V100_SXM2_16GB, Link(38e9, 5e-6), Link(5.6e9, 1e-5),
                          host=(256e9, 19e9, 240e9), per_node_max=4, what="a Longhorn (IBM AC922) node"),
    "dgx2-v100": _dgx("dgx2-v100", V100_SXM3_32GB, Link(114e9, 5e-6), Link(5.6e9, 1e-5),
                      host=(1.5e12, 6e9, 179e9), per_node_max=16, what="a DGX-2"),
    "workstation-4090": _dgx("workstation-4090", RTX_4090, Link(25e9, 1e-5), Link(25e9, 1e-5),
                             host=(128e9, 25e9, 63e9), per_node_max=1, what="the workstation"),
    "cpu": _cpu,
}


# ---------------------------------------------------------------------------------------------
# Parsing and validation of the YAML / dict schema
# ---------------------------------------------------------------------------------------------

_TOP = ("name", "preset", "nodes", "devices_per_node", "devices", "backend", "device", "links", "calibration", "host",
        "nvme")
_HOST = ("memory", "copy_bandwidth", "cpu_bandwidth")
_NVME = ("capacity", "read_bandwidth", "write_bandwidth")
_DEVICE = ("name", "memory", "peak_flops", "hbm_bandwidth", "kernel_overhead")
_LINKS = ("intra", "inter")
_LINK = ("bandwidth", "latency")


class _Reader:
    """Validation helpers that know the source name, so every error names file and field."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, path: str, msg: str) -> ClusterError:
        where = f"{self.source}: {path}: " if path else f"{self.source}: "
        return ClusterError(where + msg)

    def mapping(self, value, path: str, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> dict:
        if not isinstance(value, dict):
            what = "the file" if not path else "this field"
            raise self.fail(path, f"got {_show(value)}; expected {what} to be a mapping with keys "
                                  f"{', '.join(allowed)}")
        for k in value:
            if k not in allowed:
                close = difflib.get_close_matches(str(k), allowed, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise self.fail(_join(path, str(k)), f"unknown key {k!r}; {hint}allowed keys: {', '.join(allowed)}")
        for k in required:
            if k not in value:
                raise self.fail(_join(path, k), f"missing required field {k!r}")
        return value

    def quantity(self, value, path: str, kind: str, allow_zero: bool = False) -> float:
        try:
            x = parse_quantity(value, kind)
        except ValueError as e:
            raise self.fail(path, f"got {_show(value)}; {e}") from None
        if not math.isfinite(x) or x < 0 or (x == 0 and not allow_zero):
            bound = ">= 0" if allow_zero else "> 0"
            raise self.fail(path, f"got {_show(value)}; expected a value {bound} ({QUANTITY_EXAMPLES[kind]})")
        if x > 0:   # a bare number far out of range is most likely a missing unit (latency: 10)
            plaus = "latency" if kind == "time" else kind
            warn_if_implausible(value, x, plaus, f"{self.source}: {path}")
        return x

    def count(self, value, path: str) -> int:
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or value != int(value) or value < 1):
            raise self.fail(path, f"got {_show(value)}; expected an integer >= 1")
        return int(value)

    def text(self, value, path: str) -> str:
        if not isinstance(value, str) or not value.strip():
            raise self.fail(path, f"got {_show(value)}; expected a non-empty string")
        return value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _show(value) -> str:
    s = repr(value)
    return s if len(s) <= 60 else s[:57] + "..."


def _merge(base: dict, over: dict) -> dict:
    """Deep merge: ``over``'s leaves replace ``base``'s (used for ``preset:`` with overrides)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def _parse(data, source: str) -> Cluster:
    r = _Reader(source)
    r.mapping(data, "", _TOP)
    if "preset" in data:
        name = data["preset"]
        if not isinstance(name, str) or name not in PRESETS:
            close = difflib.get_close_matches(str(name), PRESETS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise r.fail("preset", f"unknown preset {_show(name)}; {hint}known presets: {', '.join(PRESETS)}")
        # validate the overrides' keys before merging so errors point at the user's own fields
        for key, allowed in (("device", _DEVICE), ("links", _LINKS), ("host", _HOST), ("nvme", _NVME)):
            if key in data:
                r.mapping(data[key], key, allowed)
        base = PRESETS[name](1, None).to_dict()
        if "devices" in data and "nodes" not in data:
            if name == "cpu" and "devices_per_node" not in data:
                # the cpu preset is one machine: "devices" is its process count
                base["devices_per_node"] = r.count(data["devices"], "devices")
            else:
                del base["nodes"]   # let the total device count decide the node count
        data = _merge(base, {k: v for k, v in data.items() if k != "preset"})

    r.mapping(data, "", _TOP, required=("devices_per_node", "device", "links"))
    per_node = r.count(data["devices_per_node"], "devices_per_node")
    if "nodes" in data:
        nodes = r.count(data["nodes"], "nodes")
    elif "devices" in data:
        total = r.count(data["devices"], "devices")
        if total % per_node:
            raise r.fail("devices", f"got {total}; expected a multiple of devices_per_node ({per_node}) "
                                    "so every node holds the same number of devices")
        nodes = total // per_node
    else:
        raise r.fail("nodes", "missing required field 'nodes' (or 'devices', the total device count)")
    if "devices" in data:
        total = r.count(data["devices"], "devices")
        if total != nodes * per_node:
            raise r.fail("devices", f"got {total}; expected nodes × devices_per_node = {nodes} × {per_node} "
                                    f"= {nodes * per_node} (devices_per_node must divide the device count)")

    backend = data.get("backend", "nccl")
    if backend not in BACKENDS:
        raise r.fail("backend", f"got {_show(backend)}; expected one of {', '.join(BACKENDS)}")

    dv = r.mapping(data["device"], "device", _DEVICE, required=("memory", "peak_flops", "hbm_bandwidth"))
    pf = r.mapping(dv["peak_flops"], "device.peak_flops", DTYPES, required=("bf16", "fp32"))
    peaks = {k: r.quantity(v, f"device.peak_flops.{k}", "flops") for k, v in pf.items()}
    peaks.setdefault("fp16", peaks["bf16"])   # fp16 and bf16 tensor cores run at the same rate
    memory = r.quantity(dv["memory"], "device.memory", "bytes")
    if memory != int(memory):
        raise r.fail("device.memory", f"got {_show(dv['memory'])}; expected a whole number of bytes")
    device = Device(
        name=r.text(dv.get("name", "device"), "device.name"),
        peak_flops=FrozenMap(peaks),
        memory_bytes=int(memory),
        hbm_bandwidth=r.quantity(dv["hbm_bandwidth"], "device.hbm_bandwidth", "bandwidth"),
        kernel_overhead=r.quantity(dv.get("kernel_overhead", DEFAULT_KERNEL_OVERHEAD), "device.kernel_overhead",
                                   "time", allow_zero=True),
    )

    lk = r.mapping(data["links"], "links", _LINKS, required=("intra",) if nodes == 1 else _LINKS)
    links = {}
    for which in _LINKS:
        if which not in lk:
            continue
        ld = r.mapping(lk[which], f"links.{which}", _LINK, required=_LINK)
        links[which] = Link(r.quantity(ld["bandwidth"], f"links.{which}.bandwidth", "bandwidth"),
                            r.quantity(ld["latency"], f"links.{which}.latency", "time", allow_zero=True))
    links.setdefault("inter", links["intra"])   # single node: never used, kept for a complete record

    name = r.text(data.get("name", "custom"), "name")
    calibration = None
    if "calibration" in data:   # a profile path (relative to the cluster file) or the profile inline
        cv = data["calibration"]
        if isinstance(cv, str):
            p = Path(cv)
            if not p.is_absolute() and source and Path(source).is_file():
                p = Path(source).parent / p
            calibration = Calibration.from_yaml(p)
        elif isinstance(cv, dict):
            calibration = Calibration.from_dict(cv, source)
        else:
            raise r.fail("calibration", f"got {_show(cv)}; expected a profile path (autopar calibrate) or mapping")
    host = None
    if "host" in data:
        hd = r.mapping(data["host"], "host", _HOST, required=_HOST)
        hmem = r.quantity(hd["memory"], "host.memory", "bytes")
        host = Host(int(hmem), r.quantity(hd["copy_bandwidth"], "host.copy_bandwidth", "bandwidth"),
                    r.quantity(hd["cpu_bandwidth"], "host.cpu_bandwidth", "bandwidth"), per_node)
    nvme = None
    if "nvme" in data:
        nd = r.mapping(data["nvme"], "nvme", _NVME, required=_NVME)
        cap = r.quantity(nd["capacity"], "nvme.capacity", "bytes")
        nvme = Nvme(int(cap), r.quantity(nd["read_bandwidth"], "nvme.read_bandwidth", "bandwidth"),
                    r.quantity(nd["write_bandwidth"], "nvme.write_bandwidth", "bandwidth"), per_node)
    return Cluster(name, nodes, per_node, device, links["intra"], links["inter"], backend, calibration, host, nvme)
