"""The cluster description's schema, both ways: ``parse_cluster`` checks a YAML / dict description
and gives the Cluster's fields (keyword arguments of ``autopar.cluster.Cluster``),
``read_cluster_file`` does so for a YAML file, and ``cluster_dict`` writes the fields back in the
same schema with plain numbers.

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
      # optional, inference pricing only (hardware.Device; `cpu` preset: calibrate_forward.py):
      # host_layer_overhead: 0.65ms   host_forward_overhead: 1.1ms   host_synchronous: true
      # skinny_gemm_bandwidth: 2.5GB/s   skinny_gemm_flops: 12G
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
from pathlib import Path
from typing import Any

import yaml

from autopar.cluster_presets import PRESETS
from autopar.errors import ClusterError
from autopar.hardware import BACKENDS, DEFAULT_KERNEL_OVERHEAD, DTYPES, Device, FrozenMap, Host, Link, Nvme
from autopar.profile import Calibration
from autopar.units import QUANTITY_EXAMPLES, parse_quantity, warn_if_implausible

_TOP = ("name", "preset", "nodes", "devices_per_node", "devices", "backend", "device", "links", "calibration", "host",
        "nvme")
_HOST = ("memory", "copy_bandwidth", "cpu_bandwidth")
_NVME = ("capacity", "read_bandwidth", "write_bandwidth")
_HOST_PRICES = {"host_layer_overhead": "time", "host_forward_overhead": "time", "skinny_gemm_bandwidth": "bandwidth",
                "skinny_gemm_flops": "flops"}   # Device fields for the inference pricer, 0 by default
_DEVICE = ("name", "memory", "peak_flops", "hbm_bandwidth", "kernel_overhead", *_HOST_PRICES, "host_synchronous")
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


def _flag(r: _Reader, value, path: str) -> bool:
    if not isinstance(value, bool):
        raise r.fail(path, f"got {_show(value)}; expected true or false")
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


def parse_cluster(data: Any, source: str) -> dict:
    """The Cluster's fields from a description in the schema above (numbers or human units);
    ``source`` (a file name, or e.g. "<cluster dict>") names it in every error."""
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
        base = cluster_dict(**PRESETS[name](1, None))
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
        **{k: r.quantity(dv[k], f"device.{k}", kind, allow_zero=True) for k, kind in _HOST_PRICES.items() if k in dv},
        host_synchronous=_flag(r, dv.get("host_synchronous", False), "device.host_synchronous"),
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
    return dict(name=name, nodes=nodes, devices_per_node=per_node, device=device, intra_link=links["intra"],
                inter_link=links["inter"], backend=backend, calibration=calibration, host=host, nvme=nvme)

def cluster_dict(name: str, nodes: int, devices_per_node: int, device: Device, intra_link: Link, inter_link: Link,
                 backend: str = "nccl", calibration: Calibration | None = None, host: Host | None = None,
                 nvme: Nvme | None = None) -> dict:
    """A cluster's fields in the schema above with plain numbers (embedded in Plan JSON);
    ``parse_cluster`` reads it back to the same fields."""
    d = device
    return {
        "name": name,
        "nodes": nodes,
        "devices_per_node": devices_per_node,
        "backend": backend,
        "device": {
            "name": d.name,
            "memory": int(d.memory_bytes),
            "peak_flops": {k: float(v) for k, v in d.peak_flops.items()},
            "hbm_bandwidth": float(d.hbm_bandwidth),
            "kernel_overhead": float(d.kernel_overhead),
            **{k: float(getattr(d, k)) for k in _HOST_PRICES if getattr(d, k)},
            **({"host_synchronous": True} if d.host_synchronous else {}),
        },
        "links": {
            "intra": {"bandwidth": float(intra_link.bandwidth), "latency": float(intra_link.latency)},
            "inter": {"bandwidth": float(inter_link.bandwidth), "latency": float(inter_link.latency)},
        },
        **({"calibration": calibration.to_dict()} if calibration is not None else {}),
        **({"host": {"memory": int(host.memory_bytes), "copy_bandwidth": float(host.copy_bandwidth),
                     "cpu_bandwidth": float(host.cpu_bandwidth)}} if host is not None else {}),
        **({"nvme": {"capacity": int(nvme.capacity_bytes), "read_bandwidth": float(nvme.read_bandwidth),
                     "write_bandwidth": float(nvme.write_bandwidth)}} if nvme is not None else {}),
    }


def read_cluster_file(path) -> dict:
    """The Cluster's fields from a YAML cluster file; a ClusterError names the file otherwise."""
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
    return parse_cluster(data, str(p))
