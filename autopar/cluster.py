"""The hardware a plan is made for: the ``Cluster`` and what follows from it (device count, meshes,
a one-line description), with its constructors (``preset``, ``from_dict``, ``from_yaml``) and
writers (``to_dict``, ``to_yaml``).

This module owns the ``Cluster`` description (and nothing about pricing: that is
``autopar/pricing/cost.py``). It is deliberately torch-free so the planner, the CLI and the solver's
offline tools can load a cluster without importing torch. Its parts (device, links, host, NVMe)
are ``autopar/hardware.py``, the presets ``autopar/cluster_presets.py``, the YAML / dict schema
and its checks ``autopar/cluster_schema.py``.

A ``Cluster`` is ``nodes`` × ``devices_per_node`` identical devices. Devices inside a node
talk over the intra-node link (NVLink on DGX machines, shared memory for local gloo
processes), devices on different nodes over the inter-node link (InfiniBand). Every value is
in base SI units: FLOP/s, bytes, bytes/s, seconds. Clusters are frozen and hashable (the
cost model caches on them).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from autopar.cluster_presets import preset_fields
from autopar.cluster_schema import cluster_dict, parse_cluster, read_cluster_file
from autopar.errors import ClusterError
from autopar.hardware import BACKENDS, Device, Host, Link, Nvme
from autopar.mesh import Mesh, enumerate_meshes
from autopar.profile import Calibration


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
        return Cluster(**preset_fields(name, nodes, devices))

    # ---- serialisation
    def to_dict(self) -> dict:
        """Plain-number form of the YAML schema (embedded in Plan JSON); from_dict inverts it exactly."""
        return cluster_dict(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def with_calibration(self, calibration) -> "Cluster":
        """The same cluster priced with ``calibration``: an autopar.profile.Calibration or
        the path of a calibration profile (YAML, as ``autopar calibrate`` writes)."""
        if isinstance(calibration, (str, os.PathLike)):
            calibration = Calibration.from_yaml(calibration)
        elif calibration is not None and not isinstance(calibration, Calibration):
            raise TypeError(f"with_calibration: expected a Calibration or a profile's path, got "
                            f"{type(calibration).__name__}")
        return dataclasses.replace(self, calibration=calibration)

    @staticmethod
    def from_dict(d: Any, source: str = "<cluster dict>") -> "Cluster":
        """Build from the YAML schema (numbers or human units); ``source`` names it in errors."""
        return Cluster(**parse_cluster(d, source))

    def to_yaml(self, path) -> None:
        text = "# autopar cluster description (schema: autopar/cluster_schema.py)\n"
        text += yaml.safe_dump(self.to_dict(), sort_keys=False)
        Path(path).write_text(text)

    @staticmethod
    def from_yaml(path) -> "Cluster":
        return Cluster(**read_cluster_file(path))
