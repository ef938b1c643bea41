"""What a ``ShardedOptimizer`` (runtime/zero.py) holds, measured and read or written whole: the
bytes of its persistent state on the device (``state_bytes``), the host (``host_bytes``) and NVMe
(``nvme_bytes``), and a chunk's full buffers gathered from the shards or loaded into them
(``full_flat``, ``gather_local``, ``load_flat``, ``full_parameters``: what checkpoints use).
"""
from __future__ import annotations

import torch
from torch import Tensor

from runtime.zero_chunk import Chunk, total_bytes


class StateAccess:
    """ShardedOptimizer's state measured and read or written whole (a mixin: ShardedOptimizer's
    ``__init__`` sets the ``stage``, ``mixed``, ``device``, ``chunks``, ``offload`` and ``comm``
    it reads)."""

    def state_bytes(self) -> dict[str, int]:
        """Bytes held on this rank's device by persistent state, measured on the storages actually
        alive (an offloaded chunk's master and optimizer state are host memory: ``host_bytes``)."""
        params = [c.shard_param if self.stage == 3 and not self.offload.holds_params(c) else c.flat
                  for c in self.chunks]
        if self.stage == 3:
            params += [c.flat for c in self.chunks if c.gathered]  # only if left gathered
        grads = [p.grad for c in self.chunks for p in c.params] + [c.grad_shard for c in self.chunks]
        optim = self._optimizer_tensors([c for c in self.chunks if not c.offloaded])
        return dict(params=total_bytes(params), grads=total_bytes(grads), optimizer=total_bytes(optim))

    @staticmethod
    def _optimizer_tensors(chunks) -> list:
        return [t for c in chunks for t in c.state.values()] + [c.master for c in chunks]

    def host_bytes(self) -> dict[str, int]:
        """Bytes this rank holds in host memory under offload, measured like ``state_bytes``
        (runtime/offload.py ``host_bytes``). All 0 without offload."""
        return self.offload.host_bytes(self.chunks)

    @torch.no_grad()
    def full_flat(self, c: Chunk) -> Tensor:
        """The chunk's full padded parameter buffer in fp32, from the most precise copy held: the
        master under mixed precision (all-gathered from the shards at stages 1-3), else the working
        buffer (gathered at stage 3). Collective over the data group when anything is sharded."""
        if not self.mixed:
            was = c.gathered
            self._gather(c)
            out = c.flat.clone()
            if not was:
                self._free(c)
            return out
        return self.gather_local(c, c.master).clone()

    def gather_local(self, c: Chunk, t: Tensor) -> Tensor:
        """A chunk's buffer of this rank (the padded buffer itself, or its shard at stages 1-3:
        all-gathered over the data group) as the full padded buffer on the device; ``t`` when
        already whole there. A host buffer (offload) goes to the device first, one chunk's piece."""
        return self.comm.gather_local(c, t)

    @torch.no_grad()
    def load_flat(self, c: Chunk, full: Tensor) -> None:
        """Set the chunk's parameters from a full padded fp32 buffer (working copy and master)."""
        if self.offload.indices and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # no copy from the host buffers still in flight
        if self.stage == 3:
            c.shard_param.copy_(full[c.lo:c.hi])
            if c.gathered:
                c.flat.copy_(full)
        else:
            c.flat.copy_(full)
        if c.master is not None:   # mixed precision or offload (a host copy)
            c.master.copy_(full[c.lo:c.hi] if self.stage >= 1 else full)

    @torch.no_grad()
    def full_parameters(self) -> list[Tensor]:
        """Full parameter values, chunk by chunk in parameter order (collective under stage 3)."""
        out = []
        for c in self.chunks:
            was = c.gathered
            self._gather(c)
            out += [p.detach().clone() for p in c.params]
            if not was:
                self._free(c)
        return out

    def nvme_bytes(self) -> dict[str, int]:
        """offload="optimizer-nvme": state bytes read from / written to its files since the last
        ``reset_comm_stats``, and the files' size (runtime/offload.py); all 0 otherwise."""
        return self.offload.nvme_bytes()
