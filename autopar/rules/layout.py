"""Tensor layouts on an N-D device mesh.

A Layout says, for each tensor dimension, the ordered tuple of mesh axes it is split over
(empty tuple = replicated along that dimension), plus the mesh axes over which the tensor is
a partial sum. Splits are contiguous blocks: splitting a dim of size 8 over axes (0, 1) of
sizes (2, 2) gives rank (i, j) the block i*2 + j of size 2 (the first axis is the outer one).

This one form covers data parallel (batch dim split over the data axis), Megatron 1D
(weight dims split over a model axis), ZeRO and multi-axis splits. Resharding between two
layouts lives in ``autopar/pricing/reshard.py``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Layout:
    dims: tuple[tuple[int, ...], ...]
    partial: tuple[int, ...] = ()

    # Layouts key the pricing's caches (reshard plans and traffic per layout pair: hundreds of
    # thousands of lookups per planning); the generated hash is a Python call per lookup
    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.dims, self.partial)))

    def __hash__(self) -> int:
        return self._hash

    @staticmethod
    def replicated(ndim: int) -> "Layout":
        return Layout(tuple(() for _ in range(ndim)))

    @staticmethod
    def shard(ndim: int, splits: dict[int, tuple[int, ...]], partial: tuple[int, ...] = ()) -> "Layout":
        """Layout with tensor dim d split over the mesh axes ``splits[d]``."""
        return Layout(tuple(tuple(splits.get(d, ())) for d in range(ndim)), tuple(sorted(partial)))

    @property
    def ndim(self) -> int:
        return len(self.dims)

    def axes_used(self) -> set[int]:
        used = {a for axes in self.dims for a in axes}
        return used | set(self.partial)

    def is_replicated(self) -> bool:
        return not self.partial and all(not axes for axes in self.dims)

    def split_factor(self, dim: int, mesh_shape: tuple[int, ...]) -> int:
        f = 1
        for a in self.dims[dim]:
            f *= mesh_shape[a]
        return f

    def normalized(self, mesh_shape) -> "Layout":
        """The layout with mesh axes of size 1 dropped: splitting over them (or being partial
        over them) is nothing, so two layouts that differ only there are the same on a rank."""
        keep = lambda a: mesh_shape[a] > 1  # noqa: E731
        return Layout(tuple(tuple(a for a in axes if keep(a)) for axes in self.dims),
                      tuple(sorted(a for a in self.partial if keep(a))))

    def local_shape(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of one rank's block (shapes must divide evenly; planners only pick such layouts)."""
        return tuple(s // self.split_factor(d, mesh_shape) for d, s in enumerate(shape))

    def shard_fraction(self, mesh_shape: tuple[int, ...]) -> float:
        f = 1
        for d in range(self.ndim):
            f *= self.split_factor(d, mesh_shape)
        return 1.0 / f

    def describe(self, axis_names: tuple[str, ...] | None = None) -> str:
        """Compact text form: ``S(0)[dp] S(2)[tp] P[tp]``; ``R`` for replicated."""
        name = (lambda a: axis_names[a]) if axis_names else str
        parts = [f"S({d})[{','.join(name(a) for a in axes)}]" for d, axes in enumerate(self.dims) if axes]
        if self.partial:
            parts.append(f"P[{','.join(name(a) for a in self.partial)}]")
        return " ".join(parts) if parts else "R"

    def to_json(self) -> dict:
        return {"dims": [list(a) for a in self.dims], "partial": list(self.partial)}

    @staticmethod
    def from_json(d: dict) -> "Layout":
        return Layout(tuple(tuple(a) for a in d["dims"]), tuple(d.get("partial", ())))


def memory_order(val) -> tuple[int, ...] | None:
    """``val``'s dims from outermost to innermost in memory (by decreasing stride), when that is
    not their order (a transposed or permuted view, e.g. attention's q of shape (b, h, s, d)
    laid out (b, s, h, d)); None for a value already in order, a broadcast (stride 0) one, or a
    non-tensor. Dims of size 1 do not count. Reshards keep such a value in this order
    (codegen/reshard_calls.py), and the memory model replays them so (pricing/saved_copies.py)."""
    import torch

    if not isinstance(val, torch.Tensor) or val.ndim < 2 or val.layout != torch.strided:
        return None
    big = [d for d in range(val.ndim) if val.shape[d] > 1]
    if any(val.stride(d) == 0 for d in big):
        return None
    order = tuple(sorted(range(val.ndim), key=lambda d: (-val.stride(d), d)))
    if [d for d in order if d in big] == big:
        return None
    return order
