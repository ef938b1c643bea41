"""LayerNorm over a hidden dim that is split across a process group (2D, 2.5D and 3D tensor
parallelism): the row statistics are sums over the group, with their own backward.

Forward (per row, h = full hidden size): mean = all_reduce(sum x)/h, then
var = all_reduce(sum (x - mean)^2)/h (two passes: as exact as the one-process LayerNorm);
x_hat = (x - mean) / sqrt(var + eps). Backward of x_hat:
    dx = (g - mean(g) - x_hat * mean(g * x_hat)) / sqrt(var + eps)
with both means over the full row: one all_reduce of the two stacked row sums.
Per call: 2 all_reduces of [rows] forward, 1 of [2, rows] backward (solver/tp_grid_cost.py).
"""
from __future__ import annotations

import torch

from runtime.grid import all_reduce_sum


class _SplitNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, label, h, eps):
        mean = all_reduce_sum(x.sum(-1), group, label) / h
        xc = x - mean.unsqueeze(-1)
        var = all_reduce_sum((xc * xc).sum(-1), group, label) / h
        rstd = torch.rsqrt(var + eps).unsqueeze(-1)
        x_hat = xc * rstd
        ctx.save_for_backward(x_hat, rstd)
        ctx.group, ctx.label, ctx.h = group, label, h
        return x_hat

    @staticmethod
    def backward(ctx, g):
        x_hat, rstd = ctx.saved_tensors
        sums = all_reduce_sum(torch.stack([g.sum(-1), (g * x_hat).sum(-1)]), ctx.group, ctx.label) / ctx.h
        dx = (g - sums[0].unsqueeze(-1) - x_hat * sums[1].unsqueeze(-1)) * rstd
        return dx, None, None, None, None


def split_layer_norm(x, gamma, beta, group, label: str, h: int, eps: float = 1e-5):
    """LayerNorm of ``x`` (last dim: my block of the hidden dim, full size ``h``) with my blocks
    of ``gamma``/``beta`` (already gathered to the size of x's last dim)."""
    return _SplitNorm.apply(x, group, label, h, eps) * gamma + beta
