"""Logical device meshes: a reshaping of a cluster's devices into 1 to 3 named axes.

Devices are numbered node-major (rank = node * devices_per_node + local index) and the mesh
is laid over them row-major, so the last axis varies fastest and stays inside a node as long
as it can. For each axis we record how many of its ranks share a node (``intra``) and how many
nodes it spans (``inter``): collectives on an axis with inter > 1 are priced hierarchically
(intra-node link first, then the inter-node link; see ``autopar/pricing/cost.py``).

Axis names carry the axis' role: names starting with ``dp`` are data axes (they split the
batch dimension and hold replicas of parameters, sharded by ZeRO); every other axis is a model
axis on which the ILP chooses freely how each op is split (``tp``, ``tp2``, ...).
"""
from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class AxisPlacement:
    size: int
    stride: int      # rank distance between neighbours on this axis
    intra: int       # ranks of one axis group that share a node
    inter: int       # nodes one axis group spans (size == intra * inter)


@dataclass(frozen=True)
class Mesh:
    shape: tuple[int, ...]
    names: tuple[str, ...]
    devices_per_node: int

    def __post_init__(self):
        if len(self.shape) != len(self.names):
            raise ValueError(f"mesh shape {self.shape} and names {self.names} differ in length")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis(self, name: str) -> int:
        return self.names.index(name)

    def is_data_axis(self, axis: int) -> bool:
        return self.names[axis].startswith("dp")

    def data_axes(self) -> tuple[int, ...]:
        return tuple(a for a in range(self.ndim) if self.is_data_axis(a))

    def model_axes(self) -> tuple[int, ...]:
        return tuple(a for a in range(self.ndim) if not self.is_data_axis(a))

    def degree(self, prefix: str) -> int:
        return math.prod(s for s, n in zip(self.shape, self.names) if n.startswith(prefix))

    def placement(self, axis: int) -> AxisPlacement:
        """How one axis' groups sit on nodes: the worst group decides (the most nodes spanned),
        so an axis whose groups straddle node boundaries is never priced as intra-node."""
        return _placement(self, axis)

    def _compute_placement(self, axis: int) -> AxisPlacement:
        size = self.shape[axis]
        stride = math.prod(self.shape[axis + 1:])
        if size == 1:
            return AxisPlacement(1, stride, 1, 1)
        dpn = self.devices_per_node
        inter = 1
        for group in self.axis_groups(axis):
            inter = max(inter, len({r // dpn for r in group}))
        intra = max(1, size // inter)
        return AxisPlacement(size, stride, intra, inter)

    def coords(self, rank: int) -> tuple[int, ...]:
        out = []
        for s in reversed(self.shape):
            out.append(rank % s)
            rank //= s
        return tuple(reversed(out))

    def rank(self, coords: tuple[int, ...]) -> int:
        r = 0
        for c, s in zip(coords, self.shape):
            r = r * s + c
        return r

    def axis_groups(self, axis: int) -> list[list[int]]:
        """Ranks of every process group along ``axis`` (each group varies only that coordinate)."""
        groups = []
        others = [range(s) if a != axis else range(1) for a, s in enumerate(self.shape)]
        for base in itertools.product(*others):
            group = []
            for i in range(self.shape[axis]):
                c = list(base)
                c[axis] = i
                group.append(self.rank(tuple(c)))
            groups.append(group)
        return groups

    def describe(self) -> str:
        return " × ".join(f"{n}={s}" for n, s in zip(self.names, self.shape))

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "names": list(self.names), "devices_per_node": self.devices_per_node}

    @staticmethod
    def from_json(d: dict) -> "Mesh":
        return Mesh(tuple(d["shape"]), tuple(d["names"]), d["devices_per_node"])


@functools.lru_cache(maxsize=4096)
def _placement(mesh: Mesh, axis: int) -> AxisPlacement:
    return mesh._compute_placement(axis)


def _factorizations(n: int, k: int) -> list[tuple[int, ...]]:
    if k == 1:
        return [(n,)]
    out = []
    for d in range(1, n + 1):
        if n % d == 0:
            out.extend((d,) + rest for rest in _factorizations(n // d, k - 1))
    return out


def enumerate_meshes(num_devices: int, devices_per_node: int, max_model_axes: int = 2,
                     max_tp: int | None = None) -> list[Mesh]:
    """Every (dp, tp[, tp2]) reshaping of the devices. Model axes are innermost so they stay
    inside a node when they fit; ``max_tp`` bounds the product of model axes (default: one node)."""
    max_tp = max_tp or devices_per_node
    meshes = [Mesh((num_devices,), ("dp",), devices_per_node)]
    for k in range(1, max_model_axes + 1):
        for f in _factorizations(num_devices, k + 1):
            model = f[1:]
            if any(m == 1 for m in model) or math.prod(model) > max_tp:
                continue
            names = ("dp", "tp") + tuple(f"tp{i + 2}" for i in range(k - 1))
            meshes.append(Mesh(f, names, devices_per_node))
    return meshes
