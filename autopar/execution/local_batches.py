"""This rank's part of a step's batch: which rows of the global batch it reads, and its inputs
per micro-batch. The functions take the CompiledModel (autopar/execution/compiled.py), whose
``batch_rows``, ``_local_micro_batches`` and ``_check_batch`` call them.

Rows are indices along each input's batch dim (the plan's ``batch_dims``; an input without one
goes whole to every micro-batch). ``step`` takes the GLOBAL batch or just this rank's rows
(``batch_rows()``), checked against the example batch and, on the first step, for the same
global batch on every rank (autopar/execution/batch_check.py). Only this rank's rows go to its
device, floating inputs in the working dtype (the program's).
"""
from __future__ import annotations

import torch

from autopar.errors import ExecutionError


def batch_rows(cm) -> list[int]:
    """Indices along the batch dim (the plan's ``batch_dims``) of the global batch this rank
    reads, micro-batch by micro-batch."""
    cm._need_ready()
    prog = cm.program
    if prog.takes_whole_batch:   # every rank reads the whole batch (codegen/grid_rank_program.py)
        return list(range(cm.global_batch))
    bm = cm.global_batch // cm.nm
    lay, d = next(((l, d) for l, d in zip(prog.input_layouts, cm.batch_dims) if d is not None), (None, None))
    rows = []
    for m in range(cm.nm):
        sl = _block_of(lay, bm, prog.mesh_shape, prog.coords, d) if lay is not None and lay.dims else slice(0, bm)
        rows.extend(range(m * bm + sl.start, m * bm + sl.stop))
    return rows


def local_micro_batches(cm, batch) -> list[tuple]:
    """Per micro-batch this rank's part of every input: cut along the input's batch dim (an
    input without one goes whole to every micro-batch). A program that takes the whole batch
    gets it with each micro-batch's index."""
    prog = cm.program
    to = lambda x: x.to(cm.device, dtype=cm.dtype if x.is_floating_point() else x.dtype)  # noqa: E731
    if prog.takes_whole_batch:
        return [tuple(to(x) for x in batch) + (m,) for m in range(cm.nm)]
    bm = cm.global_batch // cm.nm
    n_local = len(batch_rows(cm)) // cm.nm
    out = [[] for _ in range(cm.nm)]
    for x, lay, d in zip(batch, prog.input_layouts, cm.batch_dims):
        if not isinstance(x, torch.Tensor):
            raise ExecutionError(f"step() takes tensors, got {type(x).__name__}", collective=True)
        if d is None:
            for m in range(cm.nm):
                out[m].append(x)
        elif x.dim() > d and x.shape[d] == cm.global_batch:
            for m in range(cm.nm):
                xm = x.narrow(d, m * bm, bm)
                if lay.dims and lay.dims[d]:
                    sl = _block_of(lay, bm, prog.mesh_shape, prog.coords, d)
                    xm = xm.narrow(d, sl.start, sl.stop - sl.start)
                out[m].append(xm)
        elif x.dim() > d and x.shape[d] == n_local * cm.nm:   # just my rows (batch_rows())
            for m in range(cm.nm):
                out[m].append(x.narrow(d, m * n_local, n_local))
        else:
            got = x.shape[d] if x.dim() > d else f"no dim {d} in shape {tuple(x.shape)}"
            raise ExecutionError(f"step() got a batch of {got} rows along the batch dim {d}; the plan is for a "
                                 f"global batch of {cm.global_batch} (or this rank's {n_local * cm.nm} rows)",
                                 collective=True)
    # Only this rank's rows go to its device; floating inputs in the working dtype (the program's).
    to = lambda x: x.to(cm.device, dtype=cm.dtype if x.is_floating_point() else x.dtype)  # noqa: E731
    return [tuple(to(x) for x in o) for o in out]


def check_batch(cm, batch) -> None:
    """Inputs against the example batch; on the first call, the same global batch on every
    rank (autopar/execution/batch_check.py)."""
    from autopar.execution.batch_check import check_index_ranges, check_inputs, index_bounds, is_global_batch, \
        same_global_batch

    local = len(batch_rows(cm))
    check_inputs(batch, cm._example, cm.global_batch, local, cm.batch_dims)
    if not hasattr(cm, "_index_bounds"):
        cm._index_bounds = index_bounds(cm.traced)
    check_index_ranges(batch, cm._index_bounds)
    if not cm._batch_compared:
        cm._batch_compared = True
        same_global_batch(batch, is_global_batch(batch, cm.global_batch, cm.batch_dims), cm.device,
                          cm.rank)


def _block_of(lay, n, mesh_shape, coords, dim: int = 0) -> slice:
    """My rows of a dim ``dim`` of ``n`` rows split per ``lay``."""
    idx, k = 0, 1
    for a in lay.dims[dim]:
        idx = idx * mesh_shape[a] + coords[a]
        k *= mesh_shape[a]
    step = n // k
    return slice(idx * step, (idx + 1) * step)
