"""Layouts of 2D (SUMMA), 2.5D (Tesseract) and 3D tensor parallelism, torch-free: which block of
every tensor a rank holds, per mode.

An activation ``[tokens..., hidden]`` is split twice: its token dim into ``tok_parts`` blocks
(2D: q, 2.5D: d*q, 3D: q*q; contiguous blocks of the leading batch dim, so a rank always holds
whole sequences) and its hidden dim into q blocks. In 2D / 2.5D there is one activation layout
(``"p"``: tokens over the column [and depth] group, hidden over the row group). In 3D a layout is
the axes triple ``L = (am, ak, an)`` of the linear it feeds (runtime/matmul3d.py): tokens block
``am*q + an`` of q^2, hidden block ``ak``; a linear maps L to ``swap(L)`` = (am, an, ak), so a
transformer alternates two layouts and residual adds stay local.

``Geometry`` names, for a mode and grid shape, the part counts (planning, no process group) and,
given a rank's grid coordinates, the block indices (execution). With ``nm`` micro-batches a rank
runs the program once per micro-batch: the coordinate "mb" picks the micro-batch (a contiguous
slice of the batch), inside which the tokens split over dp and the grid as above.
"""
from __future__ import annotations

from dataclasses import dataclass

GRID_MODES = ("2d", "2.5d", "3d")
AXES_3D = ("x", "y", "z")


@dataclass(frozen=True)
class Geometry:
    mode: str            # "2d" | "2.5d" | "3d"
    q: int
    d: int = 1           # 2.5D depth (1 otherwise)
    dp: int = 1          # data-parallel replicas of the grid (outermost; they split the batch)
    nm: int = 1          # micro-batches per step (each a contiguous slice of the batch, run in turn)
    zero: int = 0        # ZeRO stage over the dp replicas (1: optimizer state sharded over dp)

    # ---- grid shape, as runtime/grid.py builds it
    @property
    def names(self) -> tuple[str, ...]:
        return {"2d": ("col", "row"), "2.5d": ("depth", "col", "row"), "3d": AXES_3D}[self.mode]

    @property
    def shape(self) -> tuple[int, ...]:
        q = self.q
        return {"2d": (q, q), "2.5d": (self.d, q, q), "3d": (q, q, q)}[self.mode]

    @property
    def world(self) -> int:
        out = 1
        for s in self.shape:
            out *= s
        return out

    @property
    def tp_shape(self) -> list[int]:
        return [self.q, self.q] + ([self.d] if self.mode == "2.5d" else [self.q] if self.mode == "3d" else [])

    # ---- layouts
    @property
    def L0(self):
        return AXES_3D if self.mode == "3d" else "p"

    def swap(self, L):
        return (L[0], L[2], L[1]) if self.mode == "3d" else L

    @property
    def devices(self) -> int:
        return self.world * self.dp

    @property
    def mesh_names(self) -> tuple[str, ...]:
        return (("dp",) if self.dp > 1 else ()) + self.names

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return ((self.dp,) if self.dp > 1 else ()) + self.shape

    @property
    def grid_tok_parts(self) -> int:
        return {"2d": self.q, "2.5d": self.d * self.q, "3d": self.q * self.q}[self.mode]

    @property
    def batch_parts(self) -> int:
        """Slices of the batch one rank's micro-batch comes from: micro-batches x dp replicas."""
        return self.nm * self.dp

    @property
    def tok_parts(self) -> int:
        """Token blocks of the whole batch: micro-batches, then dp replicas, then the grid's
        token split (a rank runs block (mb, dp, grid) of micro-batch mb)."""
        return self.grid_tok_parts * self.dp * self.nm

    def hid_group(self, L) -> str:
        """The group (COMM_STATS label) that splits the hidden dim of layout L."""
        return L[1] if self.mode == "3d" else "row"

    def tok_groups(self, L) -> list[tuple[str, int]]:
        """(label, size) of the groups that split the tokens of layout L."""
        if self.mode == "3d":
            return [(L[0], self.q), (L[2], self.q)]
        return [("col", self.q)] + ([("depth", self.d)] if self.mode == "2.5d" else [])

    # ---- block indices of a rank (coords: dict axis name -> coordinate)
    def tok_block(self, L, c: dict) -> tuple[int, int]:
        if self.mode == "3d":
            i, n = c[L[0]] * self.q + c[L[2]], self.q * self.q
        elif self.mode == "2.5d":
            i, n = c["depth"] * self.q + c["col"], self.d * self.q
        else:
            i, n = c["col"], self.q
        return (c.get("mb", 0) * self.dp + c.get("dp", 0)) * n + i, n * self.dp * self.nm

    def hid_block(self, L, c: dict) -> tuple[int, int]:
        return (c[L[1]] if self.mode == "3d" else c["row"]), self.q

    def coords_of(self, rank: int) -> dict:
        out, r = {"dp": rank // self.world}, rank % self.world
        for n, s in zip(reversed(self.names), reversed(self.shape)):
            out[n] = r % s
            r //= s
        return out

    # ---- parameter block specs (runtime/grid.take) of the stored global tensor
    def weight_spec(self, L, c):
        q = self.q
        if self.mode == "3d":
            am, ak, an = L
            return ((c[ak], q), (c[an] * q + c[am], q * q))
        return ((c["col"], q), (c["row"], q))

    def vector_spec(self, L, c):
        """A linear's bias (input layout L) - or, with L = swap(x's layout), a LayerNorm vector."""
        q = self.q
        if self.mode == "3d":
            am, ak, an = L
            return ((c[an] * q * q + c[am] * q + c[ak], q ** 3),)
        return ((c["row"] * q + c["col"], q * q),)

    def table_spec(self, L, c):
        q = self.q
        if self.mode == "3d":
            am, ak, an = L
            return (None, (c[ak] * q * q + c[am] * q + c[an], q ** 3))
        return (None, (c["row"] * q + c["col"], q * q))

    def table_parts(self) -> int:
        return self.q ** 3 if self.mode == "3d" else self.q * self.q


def geometry_of(tp_mode: str, tp_shape, dp: int = 1, nm: int = 1, zero: int = 0) -> Geometry:
    if tp_mode == "2.5d":
        return Geometry("2.5d", tp_shape[0], tp_shape[2], dp, nm, zero)
    return Geometry(tp_mode, tp_shape[0], 1, dp, nm, zero)
