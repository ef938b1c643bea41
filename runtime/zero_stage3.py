"""ZeRO stage 3's parameter gathering, a part of ``ShardedOptimizer`` (runtime/zero.py): a chunk's
full parameters all-gathered from the shards before use (``_gather``), their storage dropped
after (``_free``), and the module hooks that do both around each chunk's forward and backward
(``zero3_hooks``; runtime/context.py's ``zero3_gather`` / ``zero3_free`` call the first two).
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from runtime.zero_chunk import Chunk


class Zero3Gathering:
    """ShardedOptimizer's stage-3 gathering (a mixin: ShardedOptimizer's ``__init__`` sets the
    ``stage``, ``chunks``, ``offload`` and ``_hooks`` it reads)."""

    def _gather(self, c: Chunk) -> None:
        if c.gathered:
            return
        c.flat.untyped_storage().resize_(c.padded * c.flat.element_size())
        # optimizer+params: the host shard goes to the device for the all-gather
        shard = self.offload.to_device(c) if self.offload.holds_params(c) else c.shard_param
        self._all_gather_async(c, shard).wait()
        c.gathered = True

    def _free(self, c: Chunk) -> None:
        # The parameters are views of c.flat: they keep their shapes, their storage goes.
        c.flat.untyped_storage().resize_(0)
        c.gathered = False

    def zero3_hooks(self, modules: Sequence[nn.Module]) -> list:
        """Stage 3: gather chunk i around ``modules[i]``'s forward and backward (runtime/zero.py, Stage 3)."""
        if self.stage != 3:
            raise ValueError("zero3_hooks is for zero_stage 3")
        if len(modules) != len(self.chunks):
            raise ValueError(f"{len(modules)} modules for {len(self.chunks)} chunks")
        handles = []
        for c, m in zip(self.chunks, modules):
            owned = {id(p) for p in m.parameters()}
            if any(id(p) not in owned for p in c.params):
                raise ValueError(f"module {type(m).__name__} does not own all parameters of its chunk")

            def pre(mod, args, c=c):
                self._gather(c)

            def post(mod, args, out, c=c):
                if torch.is_grad_enabled():
                    for t in _tensors(out):
                        if t.requires_grad:
                            t.register_hook(lambda g, c=c: self._gather(c))
                self._free(c)

            handles.append(m.register_forward_pre_hook(pre))
            handles.append(m.register_forward_hook(post))
        self._hooks.extend(handles)
        return handles


def _tensors(out):
    if isinstance(out, Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)
