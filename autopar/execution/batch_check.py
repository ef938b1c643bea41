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
                             + _REPLAN, collective=True)
    dims = list(batch_dims) if batch_dims is not None else [0] * len(example)
    for i, (x, (shape, dtype), bd) in enumerate(zip(batch, example, dims)):
        if not isinstance(x, torch.Tensor):
            raise ExecutionError(f"step() takes tensors; input {i} is a {type(x).__name__}", collective=True)
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
                                 + _REPLAN, collective=True)


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
                                 f"compiled.batch_rows() names", collective=True)


__all__ = ["check_inputs", "same_global_batch"]


# Ops whose integer argument indexes a table: (argument position of the indices, of the table,
# which dim of the table they index, what to call it). Out-of-range indices raise a bare IndexError
# (CPU) or a device-side assert (CUDA) deep inside the generated program; checked up front instead.
_INDEXED = {
    "aten.embedding.default": (1, 0, 0, "embedding rows (vocabulary size)"),
}
_TARGETED = {   # class targets: (target position, logits position, class dim of the logits)
    "aten.cross_entropy_loss.default": (1, 0, 1),
    "aten.nll_loss.default": (1, 0, 1),
}


def index_bounds(traced) -> list[tuple[int, int, str, int | None]]:
    """(input position, exclusive upper bound, what, ignore_index) for every user input that is used
    directly as embedding indices or class targets in the traced graph."""
    pos = {name: i for i, name in enumerate(traced.input_names)}
    out = []
    for n in traced.gm.graph.nodes:
        if n.op != "call_function":
            continue
        t = str(n.target)
        if t in _INDEXED:
            ii, ti, dim, what = _INDEXED[t]
            idx, table = n.args[ii], n.args[ti]
            if getattr(idx, "name", None) in pos:
                size = int(table.meta["val"].shape[dim])
                out.append((pos[idx.name], size, f"{what} of {traced.module_of(n) or n.name}", None))
        elif t in _TARGETED:
            ti, li, dim = _TARGETED[t]
            tgt, logits = n.args[ti], n.args[li]
            val = getattr(tgt, "meta", {}).get("val")
            if getattr(tgt, "name", None) in pos and val is not None and not val.dtype.is_floating_point:
                classes = int(logits.meta["val"].shape[dim if logits.meta["val"].dim() > 1 else 0])
                ignore = n.args[4] if len(n.args) > 4 else n.kwargs.get("ignore_index", -100)
                out.append((pos[tgt.name], classes, f"classes of the loss {n.name}", int(ignore)))
    return out


def check_index_ranges(batch: tuple, bounds) -> None:
    """Every index input within its table: a clear error naming the input, the bad value and the
    table, instead of IndexError from inside the program."""
    for i, size, what, ignore in bounds:
        x = batch[i]
        if not isinstance(x, torch.Tensor) or x.numel() == 0 or x.is_floating_point():
            continue
        valid = x if ignore is None else x[x != ignore]
        if valid.numel() == 0:
            continue
        lo, hi = int(valid.min()), int(valid.max())
        if lo < 0 or hi >= size:
            bad = hi if hi >= size else lo
            allowed = f"0..{size - 1}" + (f" (or {ignore} to ignore)" if ignore is not None else "")
            raise ExecutionError(f"step() input {i} holds the index {bad}, outside the {size} {what}: valid values "
                                 f"are {allowed}. Check the tokenizer / label mapping against the model's config")
