"""Special algorithms for ops whose split dimension needs more than a reshard: the vocabulary
dimension of an embedding table and of the cross-entropy's logits (Megatron-style).

Both take the mesh axes the vocabulary is split over (contiguous blocks, first axis outer, as in
autopar/rules/layout.py) and find this rank's block from the execution context (runtime/context.py).

- ``vocab_parallel_embedding(weight, indices, padding_idx, axes)``: my block of the table holds rows
  [start, start + V_local); indices outside it read row 0 and are zeroed, so the output is a
  PARTIAL SUM over ``axes`` (the plan's output layout says so; a later reshard all-reduces).
  ``padding_idx`` keeps aten.embedding's meaning: the row is read, it gets no gradient.
- ``vocab_parallel_cross_entropy(logits, target, axes, ...)``: logits split on the class dim;
  forward all-reduces the row max (MAX), the sum of exponentials (SUM) and the target's logit
  (SUM) over ``axes``; the loss is complete (replicated over ``axes``). Backward is local:
  softmax - onehot on my block, scaled by the incoming gradient.

- ``moe_experts_ep(hidden, top_k_index, top_k_weights, gate_up, down, act, expert_offset, axes)``:
  runtime/moe.py's experts with the experts split over ``axes``; my block's experts only, the
  output a PARTIAL SUM over ``axes`` (expert parallelism; a later reshard reduces it).

Bytes go to ``COMM_STATS`` under the axis name, kind "all_reduce".
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from runtime import context
from runtime import moe  # noqa: F401  (registers torch.ops.autopar.moe_experts)
from runtime.collectives import COMM_STATS


def _block(axes: tuple[int, ...]) -> tuple[int, int]:
    """(my block index, number of blocks) for a dim split over ``axes`` (first axis outer)."""
    ctx = context.current()
    idx, n = 0, 1
    for a in axes:
        idx = idx * ctx.mesh.shape[a] + ctx.coords[a]
        n *= ctx.mesh.shape[a]
    return idx, n


def _all_reduce_(t: torch.Tensor, axes, op) -> torch.Tensor:
    ctx = context.current()
    for a in axes:
        COMM_STATS.add(ctx.labels[a], "all_reduce", t.numel() * t.element_size())
        if ctx.mesh.shape[a] > 1:
            dist.all_reduce(t, op=op, group=ctx.groups[a])
    return t


def vocab_parallel_embedding(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1,
                             scale_grad_by_freq: bool = False, sparse: bool = False, *,
                             axes: tuple[int, ...]) -> torch.Tensor:
    """Embedding with the table's rows split over ``axes``; returns a partial sum over them."""
    if scale_grad_by_freq or sparse:
        raise NotImplementedError("vocab-parallel embedding: scale_grad_by_freq / sparse are not supported")
    block, _ = _block(tuple(axes))
    v_local = weight.shape[0]
    start = block * v_local
    outside = (indices < start) | (indices >= start + v_local)
    local = (indices - start).masked_fill(outside, 0)
    # padding_idx as aten.embedding has it: the forward READS the padding row (it is not zero once a
    # tied decoder has updated it); only its gradient is dropped. The owner of the row passes its
    # local index; the other ranks zero those positions below anyway.
    local_pad = None
    if padding_idx is not None and padding_idx >= 0 and start <= padding_idx < start + v_local:
        local_pad = padding_idx - start
    out = torch.nn.functional.embedding(local, weight, padding_idx=local_pad)
    # Zero the rows other ranks own: multiply (not index) so backward puts no gradient there.
    return out * (~outside).unsqueeze(-1).to(out.dtype)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, axes, reduction, ignore_index):
        block, _ = _block(axes)
        v_local = logits.shape[-1]
        start = block * v_local
        x = logits.float()
        row_max = x.max(dim=-1).values
        _all_reduce_(row_max, axes, dist.ReduceOp.MAX)
        shifted = x - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        _all_reduce_(sum_exp, axes, dist.ReduceOp.SUM)
        valid = target != ignore_index
        inside = (target >= start) & (target < start + v_local) & valid
        local_t = (target - start).masked_fill(~inside, 0)
        t_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * inside.to(x.dtype)
        _all_reduce_(t_logit, axes, dist.ReduceOp.SUM)
        loss = (sum_exp.log() - t_logit) * valid.to(x.dtype)
        count = valid.sum()
        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, local_t, inside, valid, count)
        ctx.reduction, ctx.in_dtype = reduction, logits.dtype
        if reduction == 0:
            return loss.to(logits.dtype)
        total = loss.sum()
        if reduction == 1:
            total = total / count
        return total.to(logits.dtype)

    @staticmethod
    def backward(ctx, g):
        softmax, local_t, inside, valid, count = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= inside.to(grad.dtype)
        if ctx.reduction == 0:
            scale = g.float() * valid.to(grad.dtype)
        else:
            scale = g.float() * valid.to(grad.dtype)
            if ctx.reduction == 1:
                scale = scale / count
        grad = grad * scale.unsqueeze(-1)
        return grad.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, weight=None, reduction: int = 1,
                                 ignore_index: int = -100, label_smoothing: float = 0.0, *,
                                 axes: tuple[int, ...]) -> torch.Tensor:
    """aten.cross_entropy_loss with the class dim (dim 1) of ``logits`` split over ``axes``."""
    if weight is not None or label_smoothing:
        raise NotImplementedError("vocab-parallel cross-entropy supports neither class weights nor "
                                  "label smoothing; plan with the vocabulary replicated")
    if logits.dim() > 2:
        # (N, C, d1, ...) -> (N * d1 * ..., C): the class dim last, rows flattened.
        logits = logits.movedim(1, -1).reshape(-1, logits.shape[1])
        target = target.reshape(-1)
    return _VocabParallelCE.apply(logits, target, tuple(axes), int(reduction), int(ignore_index))


def vocab_parallel_lce(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                       reduction: int = 1, *, axes: tuple[int, ...]) -> torch.Tensor:
    """autopar.linear_cross_entropy (runtime/kernels/ops.py) with the weight's rows (the vocabulary)
    split over ``axes``: my block is rows [block * V_local, (block + 1) * V_local). The loss is
    complete on every rank; hidden's gradient is a PARTIAL SUM over ``axes`` (the program's conjugate
    all-reduces it). The kernel over one axis' group; the plain-torch form (this block's logits,
    vocab-parallel cross-entropy) where the kernel cannot run or the vocabulary spans several axes."""
    from runtime.kernels import linear_cross_entropy as LCE
    from runtime.kernels import ops as KO
    axes = tuple(axes)
    red = KO.LCE_REDUCTIONS.get(int(reduction))
    if red is None:
        raise ValueError(f"vocab-parallel linear_cross_entropy: reduction {reduction!r} not supported (1, 2)")
    block, _ = _block(axes)
    if KO._is_fake(hidden) or KO._is_fake(weight):
        return KO.linear_cross_entropy_meta(hidden, weight)
    if len(axes) == 1 and KO.use_triton(hidden) and hidden.device == weight.device:
        ctx = context.current()
        COMM_STATS.add(ctx.labels[axes[0]], "all_reduce", 3 * 4 * hidden.shape[0])
        return LCE.linear_cross_entropy(hidden, weight, targets, int(ignore_index), red,
                                        process_group=ctx.groups[axes[0]], vocab_start=block * weight.shape[0],
                                        reduce_grad_hidden=False)
    logits = hidden @ weight.to(hidden.dtype).t()
    return vocab_parallel_cross_entropy(logits, targets, None, int(reduction), int(ignore_index), axes=axes)


def moe_experts_ep(hidden, top_k_index, top_k_weights, gate_up, down, act, expert_offset=0, *, axes):
    """runtime/moe.py's experts with the experts split in contiguous blocks over ``axes``: this rank
    runs its block (offset = block index × local experts) and returns a partial sum over ``axes``."""
    block, _ = _block(tuple(axes))
    return torch.ops.autopar.moe_experts(hidden, top_k_index, top_k_weights, gate_up, down, act,
                                         expert_offset + block * gate_up.shape[0])


ALGORITHMS = {"vocab_parallel_embedding": vocab_parallel_embedding,
              "vocab_parallel_ce": vocab_parallel_cross_entropy,
              "vocab_parallel_lce": vocab_parallel_lce,
              "moe_experts_ep": moe_experts_ep}

__all__ = ["vocab_parallel_embedding", "vocab_parallel_cross_entropy", "vocab_parallel_lce", "moe_experts_ep",
           "ALGORITHMS"]
