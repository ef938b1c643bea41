"""Cross-entropy on logits whose class dim is split over a process group: the classifier of 2D,
2.5D and 3D tensor parallelism, where the logits stay split (tokens over one grid direction,
classes over another) and are never gathered.

Forward, per token: the row max (all_reduce MAX), the sum of exponentials and the target's
logit (all_reduce SUM; only the rank owning the target class contributes it) over ``group``;
the per-token loss is then complete and identical on every member of ``group``. Backward is
local: (softmax - onehot) on my class block, times the incoming per-token gradient - so a caller
that sums the per-token losses on every member gets each member's logit gradient exactly.
Three all_reduces of [my tokens] per call, none in backward (solver/tp_grid_cost.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from runtime.grid import all_reduce_sum


class _SplitCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, start, group, label):
        row_max = all_reduce_sum(logits.max(dim=-1).values, group, label, op=dist.ReduceOp.MAX)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = all_reduce_sum(exp.sum(dim=-1), group, label)
        inside = (target >= start) & (target < start + logits.shape[-1])
        local_t = (target - start).masked_fill(~inside, 0)
        t_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * inside.to(logits.dtype)
        t_logit = all_reduce_sum(t_logit, group, label)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_t, inside)
        return sum_exp.log() - t_logit

    @staticmethod
    def backward(ctx, g):
        softmax, local_t, inside = ctx.saved_tensors
        grad = softmax.clone()
        grad[torch.arange(grad.shape[0]), local_t] -= inside.to(grad.dtype)
        return grad * g.unsqueeze(-1), None, None, None, None


def split_cross_entropy(logits: torch.Tensor, target: torch.Tensor, block: int, group, label: str) -> torch.Tensor:
    """Per-token cross-entropy of ``logits`` [tokens, C/p] holding class block ``block`` of the
    group's p blocks, ``target`` [tokens] global class ids; returns [tokens] (replicated over
    ``group``)."""
    return _SplitCE.apply(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                          block * logits.shape[-1], group, label)
