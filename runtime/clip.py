"""Gradient-norm clipping over gradients sharded across process groups.

``clip_grad_norm(grads, max_norm, norm_groups)`` returns the norm of the *whole* (unsharded)
gradient and scales the local pieces in place, matching ``torch.nn.utils.clip_grad_norm_`` on
the unsharded model: local squared norms are summed, all-reduced over every group across which
the gradients are split into disjoint pieces (e.g. the data-parallel group for ZeRO shards, a
tensor-parallel group for weight shards), then square-rooted. The caller must pass each
group over which the pieces are disjoint, and only those: a gradient replicated over a group
must not be summed over it — unless it is weighted: ``weights`` (one entry per gradient) gives
each gradient, or element ranges ``[(start, end, w), ...]`` of its flattened view, a factor on its
squared norm. A gradient replicated on r ranks of the groups summed over is weighted 1/r, so a
mix of split and replicated tensors (tensor parallel) sums to the exact global norm.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor


@torch.no_grad()
def clip_grad_norm(grads: Iterable[Optional[Tensor]], max_norm: float,
                   norm_groups: Sequence[Optional[dist.ProcessGroup]] = (),
                   norm_type: float = 2.0, comm_counter: Optional[list] = None,
                   weights: Optional[Sequence] = None) -> Tensor:
    """Clip in place; return the total norm (fp32 scalar, identical on every rank of the groups).

    ``comm_counter``, if given, gets ``("all_reduce", nbytes)`` appended per collective (the
    ZeRO optimizer uses it for its traffic accounting).
    """
    grads = [g for g in grads]
    total = grad_norm(grads, norm_groups, norm_type, comm_counter, weights)
    coef = clip_coefficient(total, max_norm)
    for g in grads:
        if g is not None:
            g.mul_(coef.to(g.dtype))
    return total


@torch.no_grad()
def grad_norm(grads: Iterable[Optional[Tensor]], norm_groups: Sequence[Optional[dist.ProcessGroup]] = (),
              norm_type: float = 2.0, comm_counter: Optional[list] = None,
              weights: Optional[Sequence] = None, comm_device: Optional[torch.device] = None) -> Tensor:
    """The whole gradient's norm (``clip_grad_norm``'s, without scaling anything): computed in
    fp32 from gradients of any floating dtype, collectives on the gradients' device (or
    ``comm_device``: host gradients whose collectives need the device, NCCL; then each gradient's
    squared norm is computed where it lives and summed on ``comm_device``, so a list may mix host
    and device gradients)."""
    grads = list(grads)
    weights = [None] * len(grads) if weights is None else list(weights)
    if len(weights) != len(grads):
        raise ValueError(f"clip_grad_norm: {len(weights)} weights for {len(grads)} gradients")
    pairs = [(g, w) for g, w in zip(grads, weights) if g is not None]
    grads = [g for g, _ in pairs]
    device = comm_device if comm_device is not None else grads[0].device if grads else None
    zero = torch.zeros((), device=device)
    inf = math.isinf(norm_type)
    if norm_type != 2.0 and not inf:
        raise ValueError("clip_grad_norm supports norm_type 2 and inf")
    if inf:   # replication does not change a maximum
        local = max((g.detach().abs().max().float().to(device) for g in grads if g.numel()), default=zero)
    else:
        local = sum((_weighted_sq_norm(g, w).to(device) for g, w in pairs), zero)
    acc = local.reshape(1).clone() if comm_device is None else local.reshape(1).to(comm_device, copy=True)
    for group in norm_groups:
        dist.all_reduce(acc, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
        if comm_counter is not None:
            comm_counter.append(("all_reduce", acc.numel() * acc.element_size()))
    return acc[0] if inf else acc[0].sqrt()


def clip_coefficient(total: Tensor, max_norm: float) -> Tensor:
    """The factor ``clip_grad_norm`` scales the gradients by (torch's coefficient and clamp)."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def _weighted_sq_norm(g: Tensor, w) -> Tensor:
    flat = g.detach().reshape(-1).float()
    if w is None or isinstance(w, (int, float)):
        sq = torch.dot(flat, flat)
        return sq if w is None or w == 1 else sq * w
    total = torch.zeros((), device=g.device)
    for a, b, wt in w:
        seg = flat[a:b]
        total = total + torch.dot(seg, seg) * wt
    return total


__all__ = ["clip_grad_norm", "grad_norm", "clip_coefficient"]
