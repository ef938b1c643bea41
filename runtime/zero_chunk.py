"""One ZeRO chunk's layout and buffers (runtime/zero.py ``ShardedOptimizer`` owns the chunks): its
parameters' offsets in one flat buffer padded to a multiple of the data-parallel size, this rank's
shard of it, and which logical tensor each local element belongs to (optimizer segments, norms)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from runtime.optim import Segments
from runtime.optim_groups import TensorHParams


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def total_bytes(tensors) -> int:
    """Bytes of the distinct live storages behind ``tensors`` (None and freed storages: nothing)."""
    seen, n = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:  # freed (resized-to-0) storage: nothing
            seen.add(s.data_ptr())
            n += s.nbytes()
    return n


class Chunk:
    """Layout of one chunk: offsets, padding, this rank's shard; plus its buffers."""

    def __init__(self, params: list[nn.Parameter], world: int, rank: int, dtype: torch.dtype):
        self.params = params
        self.dtype, self.device = dtype, params[0].device
        self.offsets, n = [], 0
        for p in params:
            self.offsets.append(n)
            n += p.numel()
        self.numel = n
        self.padded = -(-n // world) * world
        self.shard = self.padded // world
        self.lo, self.hi = rank * self.shard, (rank + 1) * self.shard
        self.flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        self.master: Optional[Tensor] = None         # fp32 copy (mixed precision, offload): padded or shard
        self.host_grad: Optional[Tensor] = None      # offload: host staging of the gradient piece (working dtype)
        self.shard_param: Optional[Tensor] = None   # stage 3 only
        self.grad_shard: Optional[Tensor] = None    # stages 2, 3 (persistent)
        self.host_acc: Optional[Tensor] = None      # offloaded stages 2, 3: fp32 sum of the streamed shards
        self.state: dict[str, Tensor] = {}
        self.segments: Optional[Segments] = None
        self.views: list = []   # stage 0: (updated slice, state slices, working slice) per parameter
        self.ready: set = set() # ids of params whose gradient arrived since the last reduce (stages 2, 3)
        self.gathered = True    # stage 3: full buffer materialised
        self.shared_group = None  # group its gradient is also summed over (shared_groups)
        self.norm_mask: Optional[Tensor] = None  # LAMB/LARS: 0 for tensors another rank counts
        self.hparams: Optional[TensorHParams] = None  # parameter groups: per tensor id (and padding)
        self.offloaded = False    # offload: master + state on the host, CPU step (offload_fraction)
        self.stream_grads = False # offloaded at stages 2-3: reduced gradient shards streamed to host_acc

    def local_segments(self, sharded: bool) -> Segments:
        """Which logical tensor each element of the local buffer belongs to (padding: own id)."""
        lo, hi = (self.lo, self.hi) if sharded else (0, self.padded)
        pad_id = len(self.params)
        pieces = [(off, off + p.numel(), i) for i, (off, p) in enumerate(zip(self.offsets, self.params))]
        pieces.append((self.numel, self.padded, pad_id))
        bounds, ids = [0], []
        for a, b, i in pieces:
            a, b = max(a, lo), min(b, hi)
            if a < b:
                ids.append(i)
                bounds.append(b - lo)
        return Segments(tuple(bounds), tuple(ids), pad_id + 1)

    def flat_grad(self, free: bool) -> Tensor:
        """Padded flat copy of the chunk's p.grad (zeros for missing); optionally free p.grad."""
        g = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        for p, off in zip(self.params, self.offsets):
            if p.grad is not None:
                g[off:off + p.numel()].copy_(p.grad.reshape(-1))
                if free:
                    p.grad = None
        return g

    def norm_ranges(self, weights: dict, sharded: bool) -> list[tuple[int, int, float]]:
        """(start, end, weight) over the local buffer (the shard when ``sharded``); padding: 0."""
        lo, hi = (self.lo, self.hi) if sharded else (0, self.padded)
        out = []
        for p, off in zip(self.params, self.offsets):
            a, b = max(off, lo), min(off + p.numel(), hi)
            if a < b:
                out.append((a - lo, b - lo, float(weights.get(id(p), 1.0))))
        return out
