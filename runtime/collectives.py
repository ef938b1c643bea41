"""Collectives over one process group, as autograd Functions that carry their conjugates.

Blocks are contiguous pieces of one tensor dim, in group-rank order (group rank i holds block i).
``dist.new_group(ranks)`` numbers a group's members in sorted order, and every mesh-axis group
lists its ranks in increasing axis coordinate, so group rank == coordinate on that axis.

Gradient convention (Megatron-style): the gradient of a replicated value is full and identical
on every rank, the gradient of a partial-sum value is replicated, the gradient of a split value
is split the same way. Where a replicated value feeds a computation that differs across ranks,
its gradients come back partial; ``copy`` (identity forward, all_reduce backward) marks that, and
``all_gather(..., partial_grad=True)`` fuses all_gather + copy (reduce_scatter backward).

    forward                       backward
    all_reduce (sum)              identity
    copy (identity)               all_reduce
    all_gather(dim)               reduce_scatter(dim)   (partial_grad=True, the default)
                                  slice(dim)            (partial_grad=False)
    reduce_scatter(dim)           all_gather(dim)
    all_to_all(split, cat)        all_to_all(cat, split)
    slice(dim)                    all_gather(dim)
    make_partial                  identity              (group rank 0 keeps x, the others hold 0)

Every collective's bytes are added to ``COMM_STATS`` under the caller's label (a mesh axis name),
forward and backward both, with the shared nbytes convention: per rank, the larger buffer
(all_reduce: the tensor; all_gather: the gathered output; reduce_scatter: the unreduced input;
all_to_all: the local tensor).

Only public torch.distributed calls that exist in torch 2.5-2.13 are used: list-based
``all_gather`` / ``all_to_all`` / ``reduce_scatter`` and ``all_reduce``. gloo has no
reduce_scatter in older releases, so on gloo it runs as all_reduce + local slice (counted as a
reduce_scatter: the plan prices the algorithm NCCL would run).
"""
from __future__ import annotations

import threading
from collections import defaultdict

import torch
import torch.distributed as dist


class CommStats:
    """Bytes per rank moved by collectives, keyed by label (and by (label, kind))."""

    def __init__(self):
        self._lock = threading.Lock()
        self._bytes: dict[str, int] = defaultdict(int)
        self._by_kind: dict[tuple[str, str], int] = defaultdict(int)
        self._calls: dict[tuple[str, str], int] = defaultdict(int)

    def add(self, label: str, kind: str, nbytes: int) -> None:
        with self._lock:
            self._bytes[label] += int(nbytes)
            self._by_kind[(label, kind)] += int(nbytes)
            self._calls[(label, kind)] += 1

    def reset(self) -> None:
        with self._lock:
            self._bytes.clear()
            self._by_kind.clear()
            self._calls.clear()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._bytes)

    def snapshot_by_kind(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._by_kind)

    def calls(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._calls)


COMM_STATS = CommStats()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _size(group) -> int:
    return dist.get_world_size(group)


def _blocks(x: torch.Tensor, n: int, dim: int) -> list[torch.Tensor]:
    if x.shape[dim] % n:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split evenly over {n} ranks")
    return [b.contiguous() for b in torch.chunk(x, n, dim=dim)]


# ------------------------------------------------------------------ raw collectives (no autograd)

def _raw_all_reduce(x, group, label):
    out = x.contiguous().clone()
    COMM_STATS.add(label, "all_reduce", _nbytes(out))
    if _size(group) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def _raw_all_gather(x, dim, group, label):
    return start_all_gather(x, dim, group, label).wait()


class PendingGather:
    """An all-gather started with ``start_all_gather``: ``wait()`` returns the gathered tensor once
    the transfer is done (compute issued in between overlaps it; ``_raw_all_gather`` waits at once)."""

    def __init__(self, work, parts: list[torch.Tensor], dim: int):
        self.work, self.parts, self.dim = work, parts, dim

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return torch.cat(self.parts, dim=self.dim) if len(self.parts) > 1 else self.parts[0]


def start_all_gather(x: torch.Tensor, dim: int, group, label: str) -> PendingGather:
    """An all-gather along ``dim`` issued asynchronously (no autograd), counted as one all_gather."""
    n = _size(group)
    x = x.contiguous()
    COMM_STATS.add(label, "all_gather", _nbytes(x) * n)
    if n == 1:
        return PendingGather(None, [x.clone()], dim)
    parts = [torch.empty_like(x) for _ in range(n)]
    return PendingGather(dist.all_gather(parts, x, group=group, async_op=True), parts, dim)


def _raw_reduce_scatter(x, dim, group, label):
    n = _size(group)
    me = dist.get_rank(group)
    COMM_STATS.add(label, "reduce_scatter", _nbytes(x))
    if n == 1:
        return x.contiguous().clone()
    blocks = _blocks(x, n, dim)
    if dist.get_backend(group) == "gloo":
        # gloo lacks reduce_scatter before torch 2.6: reduce everything, keep a copy of my block.
        # A copy, not a view: a view of a leading-dim block keeps the whole reduced buffer alive
        # in whatever saves it (n times what the plan prices, and what NCCL's output holds:
        # Hugging Face Bloom under Megatron-SP saved 6-7% more than planned)
        full = x.contiguous().clone()
        dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group)
        return _blocks(full, n, dim)[me].clone()
    out = torch.empty_like(blocks[me])
    dist.reduce_scatter(out, blocks, op=dist.ReduceOp.SUM, group=group)
    return out


def _raw_all_to_all(x, split_dim, cat_dim, group, label):
    n = _size(group)
    COMM_STATS.add(label, "all_to_all", _nbytes(x))
    if n == 1:
        return x.contiguous().clone()
    send = _blocks(x, n, split_dim)
    recv = [torch.empty_like(b) for b in send]
    dist.all_to_all(recv, send, group=group)
    return torch.cat(recv, dim=cat_dim)


def _raw_slice(x, dim, group):
    n = _size(group)
    return _blocks(x, n, dim)[dist.get_rank(group)] if n > 1 else x.clone()


# ------------------------------------------------------------------ autograd Functions

class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, label):
        return _raw_all_reduce(x, group, label)

    @staticmethod
    def backward(ctx, g):
        return g, None, None


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, label):
        ctx.group, ctx.label = group, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _raw_all_reduce(g, ctx.group, ctx.label), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, label, partial_grad):
        ctx.dim, ctx.group, ctx.label, ctx.partial_grad = dim, group, label, partial_grad
        return _raw_all_gather(x, dim, group, label)

    @staticmethod
    def backward(ctx, g):
        if ctx.partial_grad:
            gx = _raw_reduce_scatter(g, ctx.dim, ctx.group, ctx.label)
        else:
            gx = _raw_slice(g, ctx.dim, ctx.group)
        return gx, None, None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, label):
        ctx.dim, ctx.group, ctx.label = dim, group, label
        return _raw_reduce_scatter(x, dim, group, label)

    @staticmethod
    def backward(ctx, g):
        return _raw_all_gather(g, ctx.dim, ctx.group, ctx.label), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split_dim, cat_dim, group, label):
        ctx.split_dim, ctx.cat_dim, ctx.group, ctx.label = split_dim, cat_dim, group, label
        return _raw_all_to_all(x, split_dim, cat_dim, group, label)

    @staticmethod
    def backward(ctx, g):
        return _raw_all_to_all(g, ctx.cat_dim, ctx.split_dim, ctx.group, ctx.label), None, None, None, None


class _Slice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, label):
        ctx.dim, ctx.group, ctx.label = dim, group, label
        return _raw_slice(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _raw_all_gather(g, ctx.dim, ctx.group, ctx.label), None, None, None


class _MakePartial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return x.clone() if dist.get_rank(group) == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        return g, None


# ------------------------------------------------------------------ public functions

def all_reduce(x: torch.Tensor, group, label: str) -> torch.Tensor:
    """Sum over the group (partial -> replicated); backward: identity."""
    return _AllReduce.apply(x, group, label)


def copy(x: torch.Tensor, group, label: str) -> torch.Tensor:
    """Identity into a region whose grads are partial; backward: all_reduce."""
    return _Copy.apply(x, group, label)


def all_gather(x: torch.Tensor, dim: int, group, label: str, partial_grad: bool = True) -> torch.Tensor:
    """Concatenate the group's blocks along ``dim``. Backward: reduce_scatter when the output's
    grads are partial over the group (default), else a local slice."""
    return _AllGather.apply(x, dim, group, label, partial_grad)


def reduce_scatter(x: torch.Tensor, dim: int, group, label: str) -> torch.Tensor:
    """Sum over the group and keep my block of ``dim``; backward: all_gather."""
    return _ReduceScatter.apply(x, dim, group, label)


def all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, group, label: str) -> torch.Tensor:
    """Split ``split_dim`` into blocks sent to each group rank, concatenate the received blocks
    along ``cat_dim``; backward: the reverse all_to_all."""
    return _AllToAll.apply(x, split_dim, cat_dim, group, label)


def slice_block(x: torch.Tensor, dim: int, group, label: str) -> torch.Tensor:
    """Keep my block of ``dim`` (free); backward: all_gather."""
    return _Slice.apply(x, dim, group, label)


def make_partial(x: torch.Tensor, group) -> torch.Tensor:
    """Replicated -> partial sum (group rank 0 keeps x, the others hold zeros); backward: identity."""
    return _MakePartial.apply(x, group)
