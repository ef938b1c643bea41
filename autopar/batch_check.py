"""Checks of what ``CompiledModel.step`` / ``__call__`` are fed, before anything runs.

A plan (and the per-rank program generated from it) is fixed to the example batch it was made
for: the number of inputs, their shapes (dim 0 aside: the global batch, or this rank's rows)
and dtypes. Anything else would run the wrong program silently (an extra input ignored, a
shorter sequence sliced wrongly), so it is an ``ExecutionError`` that says how to re-plan.

``same_global_batch`` catches the DDP habit of feeding every rank a different batch: autopar's
``step`` takes the GLOBAL batch and each rank reads its own rows, so ranks fed different
batches would train on rows of batches that do not belong together, diverging silently. One
all-gather of a few numbers per rank on the first step is enough to notice.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.errors import ExecutionError

_REPLAN = ("the plan is fixed to the example batch's shapes and dtypes; to train on another shape, "
           "re-plan: autopar.compile(model, cluster, example_inputs=<a batch of that shape>)")


def describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} {tuple(x.shape)}"
    return type(x).__name__


def check_inputs(batch: tuple, example: list[tuple[tuple, torch.dtype]], global_rows: int, local_rows: int,
                 batch_dims=None) -> None:
    """``example``: (shape, dtype) of each example input. Along its batch dim (``batch_dims``, one
    per input: an int, or None for an input that carries no batch; default dim 0) an input may hold
    ``global_rows`` (the global batch) or ``local_rows`` (this rank's ``batch_rows()``)."""
    if len(batch) != len(example):
        raise ExecutionError(f"step() got {len(batch)} inputs ({', '.join(map(describe, batch)) or 'none'}) but the "
                             f"plan was made for {len(example)} ({', '.join(f'{d} {tuple(s)}' for s, d in example)}): "
                             + _REPLAN)
    dims = list(batch_dims) if batch_dims is not None else [0] * len(example)
    for i, (x, (shape, dtype), bd) in enumerate(zip(batch, example, dims)):
        if not isinstance(x, torch.Tensor):
            raise ExecutionError(f"step() takes tensors; input {i} is a {type(x).__name__}")
        ok = x.dtype == dtype and x.dim() == len(shape)
        if ok:
            for d, (got, want) in enumerate(zip(x.shape, shape)):
                allowed = (global_rows, local_rows) if d == bd else (want,)
                ok = ok and got in allowed
        if not ok:
            where = f"dim {bd}" if bd is not None else ""
            rows = (f" with {global_rows} rows (the global batch)" + (
                f" or {local_rows} (this rank's batch_rows())" if local_rows != global_rows else "")
                + f" in {where}") if bd is not None else ""
            raise ExecutionError(f"step() input {i} is {describe(x)}; the plan expects {dtype} {tuple(shape)}{rows}: "
                                 + _REPLAN)


def is_global_batch(batch: tuple, global_rows: int, batch_dims=None) -> bool:
    """Whether every batch-carrying input holds the whole global batch along its batch dim."""
    dims = list(batch_dims) if batch_dims is not None else [0] * len(batch)
    return all(d is None or x.shape[d] == global_rows for x, d in zip(batch, dims))


def _checksums(batch: tuple) -> list[float]:
    """Two numbers per input: its sum and a position-weighted sum (a permutation of rows or a
    different batch changes the second even where the first happens to agree)."""
    out = []
    for x in batch:
        v = x.detach().reshape(-1).to(torch.float64)
        w = torch.arange(v.numel(), device=v.device, dtype=torch.float64).remainder_(1009).add_(1)
        out += [float(v.sum()), float(torch.dot(v, w))]
    return out


def same_global_batch(batch: tuple, is_global: bool, device, rank: int) -> None:
    """Collective over the world: every rank that passed the global batch must have the same one.
    Ranks that passed only their rows (``batch_rows()``) take part but are not compared."""
    sums = _checksums(batch) if is_global else [0.0] * (2 * len(batch))
    mine = torch.tensor([1.0 if is_global else 0.0] + sums, dtype=torch.float64, device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    full = [(r, p[1:]) for r, p in enumerate(parts) if p[0] == 1.0]
    if len(full) < 2:
        return
    r0, ref = full[0]
    for r, p in full[1:]:
        if not torch.allclose(p, ref, rtol=1e-12, atol=0.0):
            raise ExecutionError(f"rank {rank}: ranks {r0} and {r} were given different batches. step() takes the "
                                 f"GLOBAL batch, the same on every rank (each rank reads its own rows of it), not "
                                 f"one batch per rank as with DDP; to load only this rank's rows, pass the rows "
                                 f"compiled.batch_rows() names")


__all__ = ["check_inputs", "same_global_batch"]
