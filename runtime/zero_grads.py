"""The gradients' side of ``ShardedOptimizer`` (runtime/zero.py): each chunk's gradient averaged
over the data group for ``step``. Stage 0 waits for the bucketed all-reduce (runtime/ddp.py);
stage 1 reduce-scatters every chunk at ``step``; stages 2-3 reduce-scatter a chunk as soon as
backward has produced all of its gradient (post-accumulate-grad hooks, ``_on_grad``) and keep the
shard, which offload may stream to the host.
"""
from __future__ import annotations

import torch
from torch import Tensor

from runtime.zero_chunk import Chunk


class GradientReduction:
    """ShardedOptimizer's gradient reduction (a mixin: ShardedOptimizer's ``__init__`` sets the
    ``stage``, ``world``, ``chunks``, ``comm``, ``reducer``, ``offload``, ``stream_grads``,
    ``_chunk_of``, ``_pending`` and ``_per_param`` it reads)."""

    def _on_grad(self, p: Tensor) -> None:
        c = self._chunk_of[id(p)]
        c.ready.add(id(p))
        if len(c.ready) == len(c.params):
            self._reduce_chunk(c)

    def grads_accumulated(self, params) -> None:
        """Stages 2-3: report gradients written into ``p.grad`` without autograd's accumulation
        (so without its post-accumulate-grad hooks), e.g. torch.distributed.pipelining's
        separate weight-gradient pass (zero-bubble schedules). A parameter already reported
        since its chunk's last reduction, or without a gradient, is skipped."""
        if self.stage < 2:
            return
        for p in params:
            c = self._chunk_of.get(id(p))
            if c is not None and p.grad is not None and id(p) not in c.ready:
                self._on_grad(p)

    def _reduce_chunk(self, c: Chunk) -> None:
        flat = c.flat_grad(free=True)  # the full gradient is gone once it is in flight
        work, out = self.comm.reduce_scatter_async(c, flat)
        self._pending.append((c, work, out))
        c.ready.clear()
        if self.stage == 3:
            self._free(c)
        if self.stream_grads:   # the streamed shards reduced before this one go to the host now
            self._pending = self.offload.drain(self._pending, keep=1)

    @torch.no_grad()
    def _finish_backward(self) -> list[Tensor]:
        """Bring every chunk's averaged gradient (full for stage 0, shard otherwise); return them."""
        if self.stage == 0:
            if self.reducer is not None:
                self.reducer.wait()
            if self._per_param:   # the gradients as they are; a missing one counts as zeros
                return [p.grad if p.grad is not None else torch.zeros_like(p) for c in self.chunks
                        for p in c.params]
            return [c.flat_grad(free=False) for c in self.chunks]
        if self.stage == 1:
            pending = [(c, *self.comm.reduce_scatter_async(c, c.flat_grad(free=False))) for c in self.chunks]
            grads = []
            for c, work, out in pending:
                work.wait()
                grads.append(out.div_(self.world) if self.comm.native_reduce_scatter else out.div(self.world))
            return grads
        # Stages 2, 3: chunks not completed by the hooks (a parameter without gradient) go now.
        # (and, to be safe, any gradient written without the hooks: grads_accumulated)
        for c in self.chunks:
            if c.ready or any(p.grad is not None for p in c.params):
                self._reduce_chunk(c)
        self._pending = self.offload.drain(self._pending)   # the offloaded chunks' shards: summed on the host
        for c, work, out in self._pending:
            work.wait()
            c.grad_shard.add_(out)
        self._pending.clear()
        grads = [c.host_acc if c.stream_grads else c.grad_shard for c in self.chunks]
        for g in grads:
            g.div_(self.world)
        return grads
