"""The data group's collectives on ZeRO's flat chunks (runtime/zero.py): reduce-scatter of a
chunk's gradient, all-gather of its parameter shards, and their traffic log.

``bytes`` logged per collective (``log``: (kind, bytes)): the tensor handed to it, i.e. the full
padded flat buffer for reduce_scatter (its input) and all_gather (its output). Where the backend
has no reduce_scatter (probed once at construction; older gloo builds), it is replaced by an
all_reduce of the same flat buffer plus a local slice, and logged as ``all_reduce``: the same
payload bytes, but a ring all-reduce moves twice what a reduce-scatter would over the wire. A
group of ONE rank runs no collective at all and logs nothing.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.zero_chunk import Chunk, nbytes

reduce_scatter_fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Done:
    """The work of a collective over a group of one: nothing to wait for."""

    def wait(self) -> bool:
        return True


DONE = Done()


class ChunkComm:
    """Collectives of one data group (``group`` None: the world) on chunks' flat buffers."""

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device):
        self.group, self.device = group, device
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.log: list[tuple[str, int]] = []
        self.native_reduce_scatter = self.probe_reduce_scatter()

    def global_rank(self, group_rank: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def probe_reduce_scatter(self) -> bool:
        # Every rank runs the same probe, so all take the same branch afterwards.
        if self.world == 1:
            return True   # no collective is ever issued
        try:
            reduce_scatter_fn(torch.zeros(1, device=self.device), torch.zeros(self.world, device=self.device),
                              group=self.group)
            return True
        except (RuntimeError, NotImplementedError, AttributeError):
            return False

    def reduce_scatter_async(self, c: Chunk, flat: Tensor):
        """Start summing ``flat`` over the group; returns (work, tensor holding this rank's shard
        once the work is done)."""
        if self.world == 1:
            return DONE, flat
        if self.native_reduce_scatter:
            out = torch.empty(c.shard, dtype=flat.dtype, device=flat.device)
            work = reduce_scatter_fn(out, flat, group=self.group, async_op=True)
            self.log.append(("reduce_scatter", nbytes(flat)))
            return work, out
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self.log.append(("all_reduce", nbytes(flat)))
        return work, flat[c.lo:c.hi]

    def all_gather_async(self, c: Chunk, shard: Tensor):
        """Start filling ``c.flat`` with every rank's shard (a group of one: a local copy)."""
        if self.world == 1:
            if shard.data_ptr() != c.flat.data_ptr():
                c.flat.copy_(shard)
            return DONE
        self.log.append(("all_gather", nbytes(c.flat)))
        return all_gather_fn(c.flat, shard, group=self.group, async_op=True)

    def gather_local(self, c: Chunk, t: Tensor) -> Tensor:
        """A chunk's buffer of this rank (the padded buffer itself, or its shard: all-gathered over
        the group) as the full padded buffer on the device; ``t`` when already whole there."""
        src = t if t.device == self.device else t.to(self.device)
        if t.numel() == c.padded:
            return src
        out = torch.empty(c.padded, dtype=t.dtype, device=self.device)
        all_gather_fn(out, src.contiguous(), group=self.group)
        return out


__all__ = ["ChunkComm", "DONE"]
