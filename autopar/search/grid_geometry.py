"""The 2D (SUMMA), 2.5D (Tesseract) and 3D tensor-parallel grids the pins allow: the tp_mode /
tp_shape constraints checked (``check_grid_constraints``) and the grid configurations of a
cluster (``grid_geometries``: dp replicas of a grid, a micro-batch count, a ZeRO stage).
autopar/search/grid_price.py prices them, autopar/search/grid_search.py chooses among them."""
from __future__ import annotations

import math

from autopar.errors import ConstraintError
from autopar.frontend.batching import batch_size, graph_batch_dims, input_shapes
from codegen.grid_layout import GRID_MODES, Geometry
from runtime.grid import GridError, check_2d, check_2p5d, check_3d

TP_MODES = ("1d", "2d-reshard") + GRID_MODES


def check_grid_constraints(constraints: dict) -> None:
    """A grid mode's pinned tp / tp_shape is a grid that mode can build (q x q, q x q x d,
    q x q x q). The per-key checks and the contradictions between keys are autopar/constraints.py's."""
    mode = constraints.get("tp_mode")
    if mode not in GRID_MODES:
        return
    shape = constraints.get("tp_shape")
    if shape is not None:
        check_world(mode, math.prod(shape), shape)
    elif "tp" in constraints:
        check_world(mode, constraints["tp"], None)


def check_world(mode: str, tp: int, shape) -> None:
    """A grid of ``tp`` devices (and its shape, when pinned) that the mode can build."""
    try:
        if mode == "2d":
            q = shape[0] if shape else round(tp ** 0.5)
            if shape is not None and (len(shape) != 2 or shape[0] != shape[1]):
                raise GridError(f"2D tensor parallelism runs on a q x q grid: tp_shape must be [q, q], "
                                f"got {list(shape)}")
            check_2d(tp, q)
        elif mode == "2.5d":
            if shape is None:
                if not any(tp % (q * q) == 0 and tp // (q * q) >= 1 for q in range(2, int(tp ** 0.5) + 1)):
                    raise GridError(f"2.5D tensor parallelism needs q*q*d devices with q >= 2; {tp} is not")
                return
            if len(shape) != 3 or shape[0] != shape[1]:
                raise GridError(f"2.5D tensor parallelism runs on q x q x d: tp_shape must be [q, q, d], "
                                f"got {list(shape)}")
            check_2p5d(tp, shape[0], shape[2])
        else:
            q = shape[0] if shape else round(tp ** (1 / 3))
            if shape is not None and (len(shape) != 3 or len(set(shape)) != 1):
                raise GridError(f"3D tensor parallelism runs on q x q x q: tp_shape must be [q, q, q], "
                                f"got {list(shape)}")
            check_3d(tp, q)
    except GridError as e:
        raise ConstraintError(f"constraint tp_mode={mode!r}: {e}") from None


def grid_geometries(num_devices: int, constraints: dict, batch: int | None = None) -> list[Geometry]:
    """The grid configurations the pins allow: dp replicas (outermost) of a 2D / 2.5D / 3D grid,
    with the pinned micro-batch count (``num_micro_batches``, or ``micro_batch_size`` rows per
    replica given ``batch``), else one micro-batch (best_grid tries more when that does not fit)."""
    mode = constraints.get("tp_mode")
    if mode is not None and mode not in GRID_MODES:
        return []
    zero = constraints.get("zero", 0)
    pins_ok = (zero in (0, 1, 2)
               and constraints.get("checkpoint", "none") in ("none", None)
               and constraints.get("sp", 1) == 1 and constraints.get("sp_mode") is None)
    if mode is None and constraints.get("num_micro_batches", 1) != 1:
        # A micro-batch count pinned without a grid mode: the grid modes stay out, as before they
        # ran micro-batches. The pipelined search's inner searches (autopar/search/pipeline.py)
        # pin the count this way, and a grid plan cannot be cut into pipeline stages.
        return []
    out = []
    for dp in range(1, num_devices + 1):
        if num_devices % dp or constraints.get("dp", dp) != dp or (zero >= 1 and dp == 1):
            continue     # ZeRO-1/2 shard the optimizer state (and gradients) over the grid's dp replicas: dp > 1
        nm = constraints.get("num_micro_batches", 1)
        if "micro_batch_size" in constraints and batch is not None:
            rows = dp * constraints["micro_batch_size"]
            if batch % rows:
                continue
            nm = batch // rows
        tp = num_devices // dp
        for q in range(2, tp + 1):
            if q * q == tp:
                out.append(Geometry("2d", q, 1, dp, nm, zero))
            if q ** 3 == tp:
                out.append(Geometry("3d", q, 1, dp, nm, zero))
            for d in range(2, tp + 1):
                if q * q * d == tp:
                    out.append(Geometry("2.5d", q, d, dp, nm, zero))
    out = [g for g in out if (mode is None or g.mode == mode)
           and ("tp_shape" not in constraints or list(constraints["tp_shape"]) == g.tp_shape)
           and constraints.get("tp", g.world) == g.world]
    if out and not pins_ok:
        if mode is not None:
            raise ConstraintError(f"constraint tp_mode={mode!r} runs with zero=0, 1 or 2 (optimizer state, and "
                                  f"with 2 gradients, sharded over the grid's dp replicas), no activation "
                                  f"checkpointing and no sequence parallelism in this version; drop the other pins")
        return []
    if mode is not None and not out:
        if zero not in (0, 1, 2):
            raise ConstraintError(f"constraint tp_mode={mode!r} runs with zero=0, 1 or 2 (optimizer state, and with 2 "
                                  f"gradients, sharded over the grid's dp replicas), not zero={zero}; "
                                  f"drop the other pins")
        if zero >= 1 and grid_geometries(num_devices, dict(constraints, zero=0), batch):
            # the grids the other pins allow all have dp = 1
            raise ConstraintError(f"constraints tp_mode={mode!r} and zero={zero} need dp > 1: ZeRO shards the "
                                  f"optimizer state over the data-parallel replicas of the grid; "
                                  f"pin dp > 1 or drop zero")
        if "micro_batch_size" in constraints and batch is not None:
            raise ConstraintError(f"constraint micro_batch_size={constraints['micro_batch_size']} "
                                  f"with tp_mode={mode!r}: "
                                  f"no data-parallel degree the pins allow on {num_devices} devices makes dp x "
                                  f"micro_batch_size divide the batch of {batch}")
        tp = constraints.get("tp", num_devices // constraints.get("dp", 1))
        check_world(mode, tp, constraints.get("tp_shape"))   # the grid's own message first
        raise ConstraintError(f"constraint tp_mode={mode!r} cannot be met on {num_devices} devices"
                              + (f" with tp_shape={list(constraints['tp_shape'])}" if "tp_shape" in constraints else "")
                              + ": 2d needs q*q devices, 2.5d q*q*d, 3d q*q*q (q >= 2)")
    return out


def grid_batch(graph) -> int:
    """The global batch the grid programs split (rows of the traced inputs)."""
    return batch_size(input_shapes(graph), graph_batch_dims(graph))


__all__ = ["TP_MODES", "check_grid_constraints", "grid_geometries", "grid_batch"]
