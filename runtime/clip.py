"""Gradient-norm clipping over gradients sharded across process groups.

``clip_grad_norm(grads, max_norm, norm_groups)`` returns the norm of the *whole* (unsharded)
gradient and scales the local pieces in place, matching ``torch.nn.utils.clip_grad_norm_`` on
the unsharded model: local squared norms are summed, all-reduced over every group across which
the gradients are split into disjoint pieces (e.g. the data-parallel group for ZeRO shards, a
tensor-parallel group for weight shards), then square-rooted. The caller must pass each
group over which the pieces are disjoint, and only those: a gradient replicated over a group
must not be summed over it.
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
                   norm_type: float = 2.0, comm_counter: Optional[list] = None) -> Tensor:
    """Clip in place; return the total norm (fp32 scalar, identical on every rank of the groups).

    ``comm_counter``, if given, gets ``("all_reduce", nbytes)`` appended per collective (the
    ZeRO optimizer uses it for its traffic accounting).
    """
    grads = [g for g in grads if g is not None]
    inf = math.isinf(norm_type)
    if norm_type != 2.0 and not inf:
        raise ValueError("clip_grad_norm supports norm_type 2 and inf")
    if inf:
        local = max((g.detach().abs().max().float() for g in grads if g.numel()),
                    default=torch.tensor(0.0))
    else:
        local = sum((torch.dot(g.detach().reshape(-1).float(), g.detach().reshape(-1).float())
                     for g in grads), torch.tensor(0.0))
    acc = local.reshape(1).clone()
    for group in norm_groups:
        dist.all_reduce(acc, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
        if comm_counter is not None:
            comm_counter.append(("all_reduce", acc.numel() * acc.element_size()))
    total = acc[0] if inf else acc[0].sqrt()
    # Same coefficient and clamp as torch.nn.utils.clip_grad_norm_.
    clip_coef = max_norm / (total + 1e-6)
    clip_coef_clamped = torch.clamp(clip_coef, max=1.0)
    for g in grads:
        g.mul_(clip_coef_clamped.to(g.dtype))
    return total


__all__ = ["clip_grad_norm"]
