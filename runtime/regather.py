"""A linear whose input arrives all-gathered, saving the gathered input's shard for backward and
gathering it again there (Korthikanti et al. 2022, section 4.2.2: under sequence parallelism
Megatron-LM keeps the sequence-parallel layer-norm output Y_i^s, not the all-gathered Y, and
re-all-gathers Y in backward for the weight gradient).

Without it a column-parallel linear entering a tensor-parallel region saves the whole gathered
sequence (sbh bytes in 16-bit) where the closed form TP+SP sbh/t(34 + 5as/h) counts sbh/t: one
extra all-gather per such linear in backward buys (t-1)/t of its saved input.

``linear_keeping_shard(full, shard, weight, bias, dim=, axis=)`` is an autograd function: forward
``F.linear(full, weight, bias)``, saving ``shard`` and ``weight`` (so ``saved_tensors_hooks``,
and the planner's measurement with them, see what it keeps); backward starts the all-gather of
``shard`` asynchronously, computes the input gradient meanwhile, and takes the gathered input
(``zigzag``: put back in sequence order, as load-balanced ring attention's axis gathers) for
the weight gradient. ``full``'s gradient flows back through the forward all-gather node as
before (its reduce-scatter); ``shard`` gets none from here.

The planner prices exactly this (autopar/pricing/regather.py): the extra all-gather on the edge
into such a linear, and the linear's saved input as the shard. A linear inside a fully
recomputed (checkpointed) block is emitted as a plain linear: recomputation already rebuilds
the gathered input, and nothing of the block is saved between forward and backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime import collectives as C
from runtime import context as RC
from runtime import sp_exec as SX


class _LinearKeepingShard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, full, shard, weight, bias, dim, axis, zigzag):
        ctx.save_for_backward(shard, weight)
        ctx.gather = (dim, axis, zigzag, bias is not None)
        return F.linear(full, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        shard, weight = ctx.saved_tensors
        dim, axis, zigzag, has_bias = ctx.gather
        grad_full = grad_w = grad_b = None
        pending = None
        if ctx.needs_input_grad[2]:
            # the regather runs while the input gradient's GEMM computes (as in Megatron-LM)
            pending = C.start_all_gather(shard, dim, *RC.group_of(axis))
        if ctx.needs_input_grad[0]:
            grad_full = grad.matmul(weight)
        if pending is not None:
            full = pending.wait()
            if zigzag:
                full = SX.unzigzag(full, dim, axis=axis)
            grad_w = grad.reshape(-1, grad.shape[-1]).t().matmul(full.reshape(-1, full.shape[-1]))
        if has_bias and ctx.needs_input_grad[3]:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0)
        return grad_full, None, grad_w, grad_b, None, None, None


def linear_keeping_shard(full: torch.Tensor, shard: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, *, dim: int, axis: int,
                         zigzag: bool = False) -> torch.Tensor:
    """``F.linear(full, weight, bias)``; ``full`` is ``shard`` all-gathered along ``dim`` over mesh
    ``axis``. Backward all-gathers ``shard`` again instead of keeping ``full``."""
    if not torch.is_grad_enabled():
        return F.linear(full, weight, bias)
    return _LinearKeepingShard.apply(full, shard.detach(), weight, bias, dim, axis, zigzag)
