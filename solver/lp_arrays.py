"""The sharding ILP as plain arrays: columns (bounds, integrality) as integer indices, rows as
sparse index/value lists or numpy blocks, the objective as (index, coefficient) arrays, and the
built model's bookkeeping (``_Model``). solver/ilp.py builds these; solver/backends.py passes them
to HiGHS directly or converts them to PuLP for CBC. Torch-free."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


_BINARY, _CONTINUOUS = "binary", "continuous"


class _Var:
    """A column's name and value, as ``_LP.variables()`` lists them (tests, debugging)."""
    __slots__ = ("index", "name", "varValue")

    def __init__(self, index: int, name: str, value=None):
        self.index, self.name, self.varValue = index, name, value


class _LP:
    """The model as arrays: columns (bounds, integrality) are integer indices, rows are sparse
    (added one by one or as numpy blocks), the objective is (index, coefficient) arrays. Passed
    to HiGHS directly (``highspy``: no per-variable Python object anywhere, which was most of
    the time of a solve through PuLP), or converted to a PuLP problem for CBC (``_to_pulp``)."""

    def __init__(self, name: str):
        self.name = name
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[bool] = []
        self.names: list = []              # a str per column, or (prefix, shape, first index) per block
        self.rows: list = []               # (index list, value list, lower, upper) one by one
        self.row_blocks: list = []         # (index array r x L, value array r x L, lower, upper)
        self.obj_idx: list[np.ndarray] = []
        self.obj_val: list[np.ndarray] = []
        self.values: np.ndarray | None = None   # column values after a solve
        self.solver_model = None           # _HighsFigures of the last HiGHS solve

    @property
    def num_cols(self) -> int:
        return len(self.lower)

    def var(self, name: str, low=None, up=None, binary: bool = False) -> int:
        self.lower.append(0.0 if binary else (-math.inf if low is None else float(low)))
        self.upper.append(1.0 if binary else (math.inf if up is None else float(up)))
        self.integer.append(binary)
        self.names.append(name)
        return len(self.lower) - 1

    def block(self, prefix: str, shape: tuple, low: float, up: float, binary: bool = False) -> np.ndarray:
        """``prod(shape)`` columns at once; returns their indices shaped ``shape``."""
        n = int(np.prod(shape))
        first = len(self.lower)
        self.lower.extend([low] * n)
        self.upper.extend([up] * n)
        self.integer.extend([binary] * n)
        self.names.extend([(prefix, shape, first)] * n)
        return np.arange(first, first + n).reshape(shape)

    def row(self, terms, sense: str, rhs: float, name: str = "") -> None:
        self.rows.append(([int(v) for v, _ in terms], [float(w) for _, w in terms],
                          float(rhs) if sense in ("EQ", "GE") else -math.inf,
                          float(rhs) if sense in ("EQ", "LE") else math.inf))

    def row_block(self, idx: np.ndarray, val: np.ndarray, lower: float, upper: float) -> None:
        """Rows of equal length: ``idx``/``val`` are (rows x terms) arrays."""
        if idx.size:
            self.row_blocks.append((idx, val, lower, upper))

    def set_objective(self, terms) -> None:
        self.obj_idx = [np.array([int(v) for v, _ in terms], dtype=np.int64)]
        self.obj_val = [np.array([float(w) for _, w in terms], dtype=float)]

    def add_objective(self, idx: np.ndarray, val: np.ndarray) -> None:
        self.obj_idx.append(np.asarray(idx, dtype=np.int64).ravel())
        self.obj_val.append(np.asarray(val, dtype=float).ravel())

    def cost(self) -> np.ndarray:
        c = np.zeros(self.num_cols)
        for i, v in zip(self.obj_idx, self.obj_val):
            np.add.at(c, i, v)
        return c

    def matrix(self):
        """Row-wise CSR arrays (start, index, value) and the row bounds."""
        starts, idx, val, lo, up = [0], [], [], [], []
        n = 0
        for i, v, a, b in self.rows:
            idx.append(np.asarray(i, dtype=np.int64))
            val.append(np.asarray(v, dtype=float))
            n += len(i)
            starts.append(n)
            lo.append(a)
            up.append(b)
        start_parts = [np.asarray(starts, dtype=np.int64)]
        for bi, bv, a, b in self.row_blocks:
            r, L = bi.shape
            idx.append(bi.ravel())
            val.append(bv.ravel())
            start_parts.append(n + L * np.arange(1, r + 1, dtype=np.int64))
            n += r * L
            lo.extend([a] * r)
            up.extend([b] * r)
        cat = lambda parts, dt: np.concatenate(parts).astype(dt) if parts else np.zeros(0, dtype=dt)  # noqa: E731
        return (np.concatenate(start_parts), cat(idx, np.int64), cat(val, float),
                np.asarray(lo, dtype=float), np.asarray(up, dtype=float))

    def name_of(self, i: int) -> str:
        nm = self.names[i]
        if isinstance(nm, str):
            return nm
        prefix, shape, first = nm
        return prefix + "_" + "_".join(str(int(k)) for k in np.unravel_index(i - first, shape))

    def variables(self) -> list[_Var]:
        vals = self.values
        return [_Var(i, self.name_of(i), None if vals is None else float(vals[i])) for i in range(self.num_cols)]


def _var(lp: _LP, name: str, low=None, up=None, cat=_CONTINUOUS) -> int:
    return lp.var(name, low, up, binary=cat == _BINARY)


@dataclass
class _Model:
    lp: _LP
    x: list[np.ndarray]             # per node: column index of each strategy
    c: list                        # per group: column index, or bool when forced
    offset: float = 0.0            # objective constant (seconds) removed before scaling
    scale: float = 1.0             # scaled objective = (true objective - offset) * scale
    infeasible: bool = False       # a variable-free memory row is already violated
    cbc_objective: float | None = None   # scaled objective of the last CBC solve (for ``_bound``)
    start: list | None = None      # per node: a strategy to start from (HiGHS only), or None
