"""Bucketed data-parallel gradient all-reduce, overlapped with backward.

``GradAllReducer(params, dp_group)`` assigns the parameters, in *reverse* order (the order
backward usually produces their gradients), to buckets: the first (the last layers' gradients,
ready first) of at most ``first_bucket_bytes`` (1 MiB, like DDP), the others of at most
``bucket_bytes`` (a larger parameter gets a bucket of its own). A post-accumulate-grad hook on
each parameter copies its gradient into the bucket's flat buffer and makes ``p.grad`` a view of
that buffer; when a bucket is complete an async ``all_reduce`` is launched, so communication
overlaps the rest of backward. Buckets are always launched in bucket index order (a complete
bucket waits for the earlier ones), so every rank issues the same collectives in the same order
even if hook order differed. ``wait()`` (after backward) launches what is left (a parameter that
got no gradient contributes zeros), waits and averages the buffers in place: every ``p.grad`` is
then a view of its (reduced) bucket, with no copy back. The reducer drops its reference to the
buffers in ``wait()``; they live on as long as the ``p.grad`` views do (until ``zero_grad``).

A data group of ONE rank has nothing to reduce: no hooks, no buckets, no collectives, and
``wait()`` does nothing (the gradients autograd produced are already the result).

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
        self.device = params[0].device
        self.buffer: Optional[torch.Tensor] = None
        self.arrived = [False] * len(params)
        self.ready = 0
        self.work = None

    def view(self, pi: int) -> torch.Tensor:
        p, off = self.params[pi], self.offsets[pi]
        return self.buffer[off:off + p.numel()].view(p.shape)

    def reset(self):
        self.buffer, self.ready, self.work = None, 0, None
        self.arrived = [False] * len(self.params)


class GradAllReducer:
    def __init__(self, params: Sequence[nn.Parameter], dp_group: Optional[dist.ProcessGroup] = None,
                 bucket_bytes: int = 25 * 2 ** 20, average: bool = True,
                 first_bucket_bytes: int = 2 ** 20, grad_scale: Optional[dict] = None):
        """``grad_scale``: id(param) -> factor s; the result is then s * sum / W (s * sum without
        averaging): the same as multiplying the gradient by s before the reduction, in the
        in-place pass that averages (s == W: no pass at all, the sum is the result)."""
        self.group = dp_group
        self.grad_scale = {k: float(v) for k, v in (grad_scale or {}).items() if v != 1}
        self.world = dist.get_world_size(dp_group)
        self.average = average
        self.bytes_sent = 0
        self.sync = True
        params = [p for p in params if p.requires_grad]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("GradAllReducer: a parameter is listed twice")
        self.buckets: list[_Bucket] = []
        self._handles = []
        self._next_launch = 0
        self._where = {}
        if self.world == 1:
            return   # nothing to reduce over a group of one (module doc)
        current, size = [], 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            cap = min(first_bucket_bytes, bucket_bytes) if not self.buckets else bucket_bytes
            # A new bucket when this one would overflow, or the dtype changes (one flat buffer each).
            if current and (size + nbytes > cap or p.dtype != current[0].dtype or p.device != current[0].device):
                self.buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self.buckets.append(_Bucket(current))
        for bi, b in enumerate(self.buckets):
            for pi, p in enumerate(b.params):
                self._where[id(p)] = (bi, pi)
            b.scales = [self.grad_scale.get(id(p), 1.0) for p in b.params]
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate into p.grad (gradient accumulation)."""
        old, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = old

    @torch.no_grad()
    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.sync:
            return
        bi, pi = self._where[id(p)]
        b = self.buckets[bi]
        if b.arrived[pi]:
            return
        if b.buffer is None:
            b.buffer = torch.empty(b.numel, dtype=b.dtype, device=b.device)
        view = b.view(pi)
        view.copy_(p.grad)
        p.grad = view          # the gradient lives in the bucket from now on: no copy back
        b.arrived[pi] = True
        b.ready += 1
        self._launch_ready()

    @torch.no_grad()
    def _launch(self, b: _Bucket) -> None:
        if b.buffer is None:
            b.buffer = torch.empty(b.numel, dtype=b.dtype, device=b.device)
        for pi, p in enumerate(b.params):   # no hook this backward: whatever p.grad holds, or zeros
            if not b.arrived[pi]:
                view = b.view(pi)
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad)
                p.grad = view
                b.arrived[pi] = True
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
        """Finish every bucket's all_reduce; average in place (p.grad are views of the buckets)."""
        if not self.sync or not self.buckets:
            return
        for b in self.buckets[self._next_launch:]:
            self._launch(b)
        for b in self.buckets:
            b.work.wait()
            self._finish(b)
            b.reset()
        self._next_launch = 0

    def _finish(self, b: _Bucket) -> None:
        """In place: buffer = scale * buffer (/ W when averaging), one pass per run of equal scales."""
        w = self.world if self.average else 1
        i, n = 0, len(b.params)
        while i < n:
            j, s = i, b.scales[i]
            while j < n and b.scales[j] == s:
                j += 1
            if s != w:   # s == w: scale * sum / W is the sum itself
                end = b.offsets[j - 1] + b.params[j - 1].numel()
                seg = b.buffer[b.offsets[i]:end]
                if s != 1:
                    seg.mul_(s)
                if w != 1:
                    seg.div_(w)
            i = j

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


__all__ = ["GradAllReducer"]
