"""The optimizer step of ``ShardedOptimizer`` (runtime/zero.py): the averaged gradients summed
over ``shared_groups``, clipped, and stepped chunk by chunk on the device or, offloaded, on the
host (runtime/offload.py), each updated shard all-gathered back at stages 1-2.

Gradient clipping (``grad_clip``) computes the norm of the whole model's gradient: local squared
norms, each parameter weighted by ``norm_weights`` (1/r for a parameter replicated on r ranks of
``extra_norm_groups``, e.g. a bias every tensor-parallel rank holds whole), summed over the data
group (shards) and over ``extra_norm_groups``.

LAMB and LARS scale each tensor's update by a ratio of its WHOLE norms (of the weight and of the
update or gradient), whatever the tensor is split on. The local squared norms (per tensor, from
the chunk's Segments: a flat ZeRO shard never mixes two tensors in one norm) are summed over the
data group when the chunk is sharded (stages 1-3: the shards hold disjoint pieces) and over
``tensor_norm_groups`` (the groups a plan's model axes form: tensor-parallel blocks are disjoint
pieces too). A rank holding a replica of a block that another rank of those groups also holds
(a norm weight every tensor-parallel rank holds whole) lists the parameter in
``tensor_norm_skip``: its norms count 0 there, so every block counts exactly once.

A chunk may also be replicated OUTSIDE the data group (``shared_groups``: id(param) -> process
group, e.g. a tied embedding and output head held by the first and the last pipeline stage, each
stage with its own data group): at stages 2-3 its reduced gradient shard is then all-reduced
(summed) over that group before the update, so every copy takes the same step. Its parameters
must form a chunk of their own with the same layout on every member of the group (same
parameters, same data-group size and rank), so the shards line up. Stages 0-1 keep full
``p.grad`` until ``step()``; the caller sums those before it (runtime/pipeline.py
``sum_tied_grads``). Bytes: ``shared_bytes``, not in ``bytes_sent`` (another group).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from runtime.clip import clip_coefficient, grad_norm
from runtime.offload import HOST
from runtime.zero_chunk import Chunk, nbytes


class OptimizerStep:
    """ShardedOptimizer's step (a mixin: ShardedOptimizer's ``__init__`` sets the ``opt``,
    ``stage``, ``world``, ``group``, ``chunks``, ``offload``, ``mixed``, ``grad_clip``,
    ``extra_norm_groups``, ``tensor_norm_groups``, ``norm_weights`` and ``_per_param`` it reads)."""

    def _tensor_norm_reducer(self, c: Chunk):
        """LAMB/LARS: the callable summing a chunk's [k, tensors] local squared norms into the
        whole tensors' (module doc), or None when this rank holds every tensor whole."""
        groups = ([self.group] if self.stage >= 1 and self.world > 1 else []) + list(self.tensor_norm_groups)
        if not groups:
            return None

        def reduce(t: Tensor) -> None:
            if c.norm_mask is not None:
                t.mul_(c.norm_mask)
            # Offload: norms of host tensors; the collective runs on the device's (NCCL: CUDA).
            x = t if t.device == self.device else t.to(self.device)
            for g in groups:
                dist.all_reduce(x, group=g)
                self.comm_log.append(("all_reduce", nbytes(x)))
            if x is not t:
                t.copy_(x)
        return reduce

    def _norm_weights(self) -> list:
        """Clipping weights, one entry per gradient ``_finish_backward`` returns."""
        if self._per_param:
            return [self.norm_weights.get(id(p)) for c in self.chunks for p in c.params]
        return [c.norm_ranges(self.norm_weights, sharded=self.stage >= 1) for c in self.chunks]

    @torch.no_grad()
    def step(self) -> None:
        grads = self._finish_backward()
        if self.stage >= 2:
            for c, g in zip(self.chunks, grads):
                if c.shared_group is not None:   # a copy outside the data group (module doc)
                    if g.device != self.device:   # a streamed host shard: the collective on the device
                        d = g.to(self.device)
                        dist.all_reduce(d, group=c.shared_group)
                        g.copy_(d)
                    else:
                        dist.all_reduce(g, group=c.shared_group)
                    self.shared_bytes += nbytes(g)
        # the chunk of each gradient entry (stage 0 elementwise: one entry per parameter)
        owners = [c for c in self.chunks for _ in c.params] if self._per_param else list(self.chunks)
        if self.mixed:   # the device optimizer (and the norm) work in fp32: upcast the working-dtype
            # gradients (an offloaded chunk's are upcast on the host, after the copy)
            grads = [g if c.offloaded else g.float() for g, c in zip(grads, owners)]
        coef = None
        if self.grad_clip is not None:
            # The norm (and its collectives) on the device: per entry where it lives, summed there.
            groups = ([] if self.stage == 0 or self.world == 1 else [self.group]) + list(self.extra_norm_groups)
            self.last_grad_norm = grad_norm(grads, groups, comm_counter=self.comm_log, weights=self._norm_weights(),
                                            comm_device=self.device)
            dev_coef = clip_coefficient(self.last_grad_norm, self.grad_clip)
            for g, c in zip(grads, owners):   # clip_grad_norm's scaling, on the device's fp32 gradients
                if not c.offloaded:
                    g.mul_(dev_coef.to(g.dtype))
            # offloaded: the scaling on the host's fp32 upcast, the same product as the device's
            # (mixed precision scales the upcast too, not the working-dtype gradient)
            if self.offloaded_chunks:
                coef = dev_coef.to(HOST)
        self.step_count += 1
        if self._per_param:   # the entries of each chunk
            it = iter(grads)
            grads = [[next(it) for _ in c.params] for c in self.chunks]
        works = []
        gather = None
        if self.stage in (1, 2) and self.world > 1:   # an offloaded shard is back: its all-gather
            def gather(c):
                works.append(self._all_gather_async(c, c.flat[c.lo:c.hi].clone()))
        self.offload.step(self.chunks, grads, coef, self._per_param,
                          lambda c, g: self._device_update(c, g, works), self._host_step, gather)
        for w in works:
            w.wait()
        for c in self.chunks:   # averaged and consumed: the next backward accumulates anew
            if c.grad_shard is not None:
                c.grad_shard.zero_()
            if c.host_acc is not None:
                c.host_acc.zero_()

    def _device_update(self, c: Chunk, g, works: list) -> None:
        """The device step of a chunk not offloaded (``g``: its gradient, or at stage 0 with an
        elementwise optimizer its parameters' gradients); stages 1-2 start its all-gather."""
        if self._per_param:
            for i, ((param, state, working), pg) in enumerate(zip(c.views, g)):
                hp = None if c.hparams is None else c.hparams.entry(i)
                self.opt.step(param, pg.reshape(-1), state, self.step_count, hparams=hp)
                if working is not None:
                    working.copy_(param)
            return
        if self.mixed:
            param = c.master
        elif self.stage == 0:
            param = c.flat
        elif self.stage == 3:
            param = c.shard_param
        else:
            param = c.flat[c.lo:c.hi]
        self.opt.step(param, g, c.state, self.step_count, segments=c.segments, hparams=c.hparams,
                      reduce_sq_norms=self._tensor_norm_reducer(c) if self.opt.needs_segments else None)
        if self.mixed and self.stage == 0:
            c.flat.copy_(param)
        elif self.mixed and self.stage == 3:
            c.shard_param.copy_(param)
        elif self.mixed and self.world == 1:   # stages 1, 2 over a group of one: no all-gather
            c.flat[c.lo:c.hi].copy_(param)
        if self.stage in (1, 2) and self.world > 1:
            works.append(self._all_gather_async(c, param.to(self.dtype) if self.mixed else param.clone()))

    def _host_step(self, c: Chunk, param: Tensor, grad: Tensor, state: dict, index: Optional[int]) -> None:
        """The optimizer's step of an offloaded chunk on the host (runtime/offload.py): the whole
        local buffer (``index`` None) or, stage 0 elementwise, parameter ``index``'s slice."""
        if index is not None:
            hp = None if c.hparams is None else c.hparams.entry(index)
            self.opt.host_step(param, grad, state, self.step_count, hparams=hp)
            return
        self.opt.host_step(param, grad, state, self.step_count, segments=c.segments, hparams=c.hparams,
                           reduce_sq_norms=self._tensor_norm_reducer(c) if self.opt.needs_segments else None)
