"""Process grids of multi-dimensional tensor parallelism (2D, 2.5D, 3D) and their counted
point-to-group collectives.

A grid is a ``DeviceMesh`` over all ranks, row-major, so coordinates and ranks convert by
arithmetic and every axis group numbers its members by their coordinate on that axis:

    Grid2D(q)        shape (q, q)       rank = i*q + j           axes ("col", "row")
    Grid25D(q, d)    shape (d, q, q)    rank = k*q*q + i*q + j   axes ("depth", "col", "row")
    Grid3D(q)        shape (q, q, q)    rank = x*q*q + y*q + z   axes ("x", "y", "z")

Naming follows the papers: the *row group* of rank (i, j) is its grid row (fixed i, varying j:
the ranks that hold the other column blocks of the same rows), the *column group* its grid column
(fixed j, varying i), the *depth group* the ranks with the same (i, j) in the other stacked
layers. COMM_STATS labels are "row", "col", "depth" (2D/2.5D) and "x", "y", "z" (3D).

``check_*`` validate a grid without a process group (clear ``GridError`` naming the fix);
``broadcast`` / ``reduce`` / ``all_reduce_sum`` are the raw, counted collectives SUMMA needs
(runtime/collectives.py has the all_gather / reduce_scatter ones). Byte convention, per rank and
per call, as in runtime/collectives.py: broadcast and reduce count the tensor, all_reduce the
tensor, all_gather the gathered output, reduce_scatter the unreduced input.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from runtime.collectives import COMM_STATS


class GridError(ValueError):
    """A grid that cannot be built: wrong device count or a dimension that does not divide."""


# ------------------------------------------------------------------ validation (no process group)

def check_2d(world: int, q: int) -> None:
    _positive_int("q", q)
    if world != q * q:
        raise GridError(f"2D tensor parallelism needs q*q processes; got {world} for q={q}"
                        f"{_suggest(world, 2)}")


def check_2p5d(world: int, q: int, d: int) -> None:
    _positive_int("q", q)
    _positive_int("d", d)
    if world != q * q * d:
        hint = f"; with q={q} use d={world // (q * q)}" if world % (q * q) == 0 else ""
        raise GridError(f"2.5D tensor parallelism needs q*q*d processes; got {world} for q={q}, d={d} "
                        f"(q*q*d = {q * q * d}){hint}")


def check_3d(world: int, q: int) -> None:
    _positive_int("q", q)
    if world != q ** 3:
        raise GridError(f"3D tensor parallelism needs q**3 processes; got {world} for q={q}"
                        f"{_suggest(world, 3)}")


def check_divisible(what: str, size: int, parts: int, why: str) -> None:
    """``size`` must split into ``parts`` equal blocks (``why`` names the grid split)."""
    if size % parts:
        raise GridError(f"{what} = {size} does not split evenly into {parts} blocks ({why}); "
                        f"choose a size divisible by {parts}")


def _positive_int(name, v):
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        raise GridError(f"grid dimension {name}={v!r}; expected an integer >= 1")


def _suggest(world: int, power: int) -> str:
    r = round(world ** (1 / power))
    if r ** power == world:
        return f"; use q={r}"
    return (f" ({world} is not a perfect {'square' if power == 2 else 'cube'}; "
            f"closest q={max(1, int(math.floor(world ** (1 / power))))})")


# ------------------------------------------------------------------ grids

class _Grid:
    """A DeviceMesh with named axes; ``group(name)`` is this rank's group along that axis."""

    def __init__(self, shape: tuple[int, ...], names: tuple[str, ...], device: str = "cpu", dp: int = 1):
        """``dp`` > 1: ``dp`` replicas of the grid (data parallelism over them), laid out
        outermost: the DeviceMesh is (dp, *shape) and ``dp_group`` joins the replicas."""
        from torch.distributed.device_mesh import init_device_mesh
        self.shape, self.names = shape, names
        full = ((dp,) if dp > 1 else ()) + tuple(shape)
        self.mesh = init_device_mesh(device, full, mesh_dim_names=(("dp",) if dp > 1 else ()) + tuple(names))
        self.rank = dist.get_rank()
        coords = tuple(int(c) for c in self.mesh.get_coordinate())
        self.dp, self.dp_rank = dp, (coords[0] if dp > 1 else 0)
        self.coords = coords[1:] if dp > 1 else coords
        self._groups = {n: self.mesh.get_group(n) for n in names}
        self.dp_group = self.mesh.get_group("dp") if dp > 1 else None

    def group(self, name: str):
        return self._groups[name]

    def global_rank(self, coords: tuple[int, ...]) -> int:
        r = self.dp_rank
        for c, n in zip(coords, self.shape):
            r = r * n + c
        return r

    def along(self, name: str, c: int) -> int:
        """Global rank of the member with coordinate ``c`` of my group along axis ``name``."""
        coords = list(self.coords)
        coords[self.names.index(name)] = c
        return self.global_rank(tuple(coords))


class _Plane(_Grid):
    """A grid whose last two axes are a q x q SUMMA plane (my coordinates ``i``, ``j``)."""

    def row_src(self, l: int) -> int:
        """Global rank of column ``l`` in my row."""
        return self.along("row", l)

    def col_src(self, l: int) -> int:
        """Global rank of row ``l`` in my column."""
        return self.along("col", l)


class Grid2D(_Plane):
    """q x q grid; rank (i, j) holds block (i, j) of every 2D-split matrix."""

    def __init__(self, q: int, device: str = "cpu", dp: int = 1):
        check_2d(dist.get_world_size() // dp, q)
        super().__init__((q, q), ("col", "row"), device, dp)
        self.q, self.d, self.k = q, 1, 0
        self.i, self.j = self.coords
        self.row_group, self.col_group = self.group("row"), self.group("col")


class Grid25D(_Plane):
    """d stacked q x q grids (Tesseract); layer k runs SUMMA on its own q x q grid."""

    def __init__(self, q: int, d: int, device: str = "cpu", dp: int = 1):
        check_2p5d(dist.get_world_size() // dp, q, d)
        super().__init__((d, q, q), ("depth", "col", "row"), device, dp)
        self.q, self.d = q, d
        self.k, self.i, self.j = self.coords
        self.row_group, self.col_group = self.group("row"), self.group("col")
        self.depth_group = self.group("depth")


class Grid3D(_Grid):
    """q x q x q grid with axes "x", "y", "z"."""

    def __init__(self, q: int, device: str = "cpu", dp: int = 1):
        check_3d(dist.get_world_size() // dp, q)
        super().__init__((q, q, q), ("x", "y", "z"), device, dp)
        self.q = q

    def coord(self, name: str) -> int:
        return self.coords[self.names.index(name)]


# ------------------------------------------------------------------ counted raw collectives

def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def broadcast(x: torch.Tensor | None, shape, dtype, src: int, group, label: str) -> torch.Tensor:
    """Broadcast from global rank ``src`` over ``group``; ``x`` is used on the source only."""
    out = x.contiguous().clone() if dist.get_rank() == src else torch.empty(shape, dtype=dtype)
    COMM_STATS.add(label, "broadcast", _nbytes(out))
    if dist.get_world_size(group) > 1:
        dist.broadcast(out, src=src, group=group)
    return out


def reduce(x: torch.Tensor, dst: int, group, label: str) -> torch.Tensor | None:
    """Sum over ``group`` onto global rank ``dst``; returns the sum there, None elsewhere."""
    buf = x.contiguous().clone()
    COMM_STATS.add(label, "reduce", _nbytes(buf))
    if dist.get_world_size(group) > 1:
        dist.reduce(buf, dst=dst, op=dist.ReduceOp.SUM, group=group)
    return buf if dist.get_rank() == dst else None


def all_reduce_sum(x: torch.Tensor, group, label: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
    buf = x.contiguous().clone()
    COMM_STATS.add(label, "all_reduce", _nbytes(buf))
    if dist.get_world_size(group) > 1:
        dist.all_reduce(buf, op=op, group=group)
    return buf


# ------------------------------------------------------------------ blocks of global tensors

def take(t: torch.Tensor, spec) -> torch.Tensor:
    """The block of ``t`` named by ``spec``: one (index, count) per leading dim of ``t``
    (None = whole dim). Used to shard global tensors and, inverted, to assemble them."""
    for dim, s in enumerate(spec):
        if s is None:
            continue
        idx, n = s
        check_divisible(f"dim {dim}", t.shape[dim], n, "grid block")
        t = torch.chunk(t, n, dim=dim)[idx]
    return t.contiguous()


class _GradOnFirst(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, first):
        ctx.first = first
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return (g if ctx.first else torch.zeros_like(g)), None


def grad_on_first(x: torch.Tensor, first: bool) -> torch.Tensor:
    """Identity; backward: the gradient on the ``first`` rank only, zeros elsewhere. Turns a value
    whose gradient every rank holds whole into one whose gradient is partial over those ranks
    (codegen/grid_replicated.py: a hidden-split value replicated over the token groups)."""
    return _GradOnFirst.apply(x, first)
