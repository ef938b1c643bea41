"""Bucketed data-parallel gradient all-reduce, overlapped with backward.

``GradAllReducer(params, dp_group)`` assigns the parameters, in *reverse* order (the order
backward usually produces their gradients), to buckets of at most ``bucket_bytes`` (a larger
parameter gets a bucket of its own). A post-accumulate-grad hook on each parameter copies its
gradient into the bucket's flat buffer; when a bucket is complete an async ``all_reduce`` is
launched, so communication overlaps the rest of backward. Buckets are always launched in
bucket index order (a complete bucket waits for the earlier ones), so every rank issues the
same collectives in the same order even if hook order differed. ``wait()`` (after backward)
launches what is left (a parameter that got no gradient contributes zeros), waits, averages and
writes the reduced gradients back into ``p.grad``. Bucket buffers exist only between the first
gradient of a step and ``wait()``.

``bytes_sent`` counts, per rank, the bytes of the tensors given to all_reduce (the logical
payload; a ring all-reduce moves 2(n-1)/n of it over the wire).
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn


class _Bucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.offsets = []
        n = 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.dtype = params[0].dtype
        self.buffer: Optional[torch.Tensor] = None
        self.ready = 0
        self.work = None

    def reset(self):
        self.buffer, self.ready, self.work = None, 0, None


class GradAllReducer:
    def __init__(self, params: Sequence[nn.Parameter], dp_group: Optional[dist.ProcessGroup] = None,
                 bucket_bytes: int = 25 * 2 ** 20, average: bool = True):
        self.group = dp_group
        self.world = dist.get_world_size(dp_group)
        self.average = average
        self.bytes_sent = 0
        self.sync = True
        params = [p for p in params if p.requires_grad]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("GradAllReducer: a parameter is listed twice")
        self.buckets: list[_Bucket] = []
        current, size = [], 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            # A new bucket when this one would overflow, or the dtype changes (one flat buffer each).
            if current and (size + nbytes > bucket_bytes or p.dtype != current[0].dtype):
                self.buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self.buckets.append(_Bucket(current))
        self._where = {}
        for bi, b in enumerate(self.buckets):
            for pi, p in enumerate(b.params):
                self._where[id(p)] = (bi, pi)
        self._next_launch = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate into p.grad (gradient accumulation)."""
        old, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = old

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.sync:
            return
        bi, pi = self._where[id(p)]
        b = self.buckets[bi]
        if b.buffer is None:
            b.buffer = torch.zeros(b.numel, dtype=b.dtype)
        off = b.offsets[pi]
        b.buffer[off:off + p.numel()].copy_(p.grad.reshape(-1))
        b.ready += 1
        self._launch_ready()

    def _launch(self, b: _Bucket) -> None:
        if b.buffer is None:
            b.buffer = torch.zeros(b.numel, dtype=b.dtype)
        b.work = dist.all_reduce(b.buffer, group=self.group, async_op=True)
        self.bytes_sent += b.buffer.numel() * b.buffer.element_size()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if b.ready < len(b.params):
                break
            self._launch(b)
            self._next_launch += 1

    @torch.no_grad()
    def wait(self) -> None:
        """Finish every bucket's all_reduce and write the (averaged) gradients into p.grad."""
        if not self.sync:
            return
        for b in self.buckets[self._next_launch:]:
            self._launch(b)
        for b in self.buckets:
            b.work.wait()
            if self.average:
                b.buffer.div_(self.world)
            for p, off in zip(b.params, b.offsets):
                flat = b.buffer[off:off + p.numel()].view(p.shape)
                if p.grad is None:
                    p.grad = flat.clone()
                else:
                    p.grad.copy_(flat)
            b.reset()
        self._next_launch = 0

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


__all__ = ["GradAllReducer"]
