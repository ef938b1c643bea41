"""Fused optimizer steps as Triton kernels over flat fp32 pieces, for SGD (momentum, dampening,
Nesterov, coupled weight decay), LAMB and LARS, with runtime/optim.py's formulas:

* ``sgd_step``: one kernel, ``g + wd p`` into the momentum buffer (the first step copies it, as
  torch.optim.SGD), ``p -= lr d`` with ``d`` the buffer or its Nesterov form.
* ``lamb_direction``: one kernel updating both moments and writing the update direction
  ``u = m_hat / (sqrt(v_hat) + eps) + wd p``; the caller sums the per-tensor norms of ``p`` and
  ``u`` (across ranks where the tensor is split) and ``lamb_apply`` then does ``p -= lr r u``
  with the tensor's trust ratio ``r``.
* ``lars_step``: after the norms of ``p`` and ``g``, one kernel with the tensor's scale
  ``s = lr local_lr``: ``buf = momentum buf + s (g + wd p)``, ``p -= buf``.

The trust ratios stay per tensor, so ``lamb_apply`` and ``lars_step`` run on one tensor's piece
at a time (runtime/optim.py calls them per segment). Launches count as the families "sgd",
"lamb" and "lars" (runtime.kernels.kernel_stats).
"""
from __future__ import annotations

import torch

from runtime.kernels import check_device, record_launch

try:
    import triton
    import triton.language as tl
except ImportError:   # runtime/optim.py's torch path still works
    triton = None

BLOCK = 1024


if triton is not None:
    @triton.jit
    def _sgd_step(P, G, B, n, lr, momentum, dampening, weight_decay, HAS_MOMENTUM: tl.constexpr,
                  FIRST: tl.constexpr, NESTEROV: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(P + offs, mask=mask, other=0.0)
        g = tl.load(G + offs, mask=mask, other=0.0)
        g = g + weight_decay * p
        d = g
        if HAS_MOMENTUM:
            if FIRST:
                buf = g
            else:
                buf = tl.load(B + offs, mask=mask, other=0.0) * momentum + (1.0 - dampening) * g
            tl.store(B + offs, buf, mask=mask)
            if NESTEROV:
                d = g + momentum * buf
            else:
                d = buf
        tl.store(P + offs, p - lr * d, mask=mask)

    @triton.jit
    def _lamb_direction(P, G, M, V, U, n, beta1, beta2, bias_correction1, bias_correction2, eps, weight_decay,
                        BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(P + offs, mask=mask, other=0.0)
        g = tl.load(G + offs, mask=mask, other=0.0)
        m = tl.load(M + offs, mask=mask, other=0.0) * beta1 + (1.0 - beta1) * g
        v = tl.load(V + offs, mask=mask, other=0.0) * beta2 + (1.0 - beta2) * g * g
        u = (m / bias_correction1) / (tl.sqrt(v / bias_correction2) + eps) + weight_decay * p
        tl.store(M + offs, m, mask=mask)
        tl.store(V + offs, v, mask=mask)
        tl.store(U + offs, u, mask=mask)

    @triton.jit
    def _scaled_sub(P, U, n, scale, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(P + offs, mask=mask, other=0.0)
        u = tl.load(U + offs, mask=mask, other=0.0)
        tl.store(P + offs, p - scale * u, mask=mask)

    @triton.jit
    def _lars_step(P, G, B, n, scale, momentum, weight_decay, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(P + offs, mask=mask, other=0.0)
        g = tl.load(G + offs, mask=mask, other=0.0)
        buf = tl.load(B + offs, mask=mask, other=0.0) * momentum + scale * (g + weight_decay * p)
        tl.store(B + offs, buf, mask=mask)
        tl.store(P + offs, p - buf, mask=mask)


def _check(name: str, param: torch.Tensor, *others: torch.Tensor | None) -> None:
    check_device(param, *others)
    for t in (param, *others):
        if t is not None and (t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != param.numel()):
            raise ValueError(f"{name}: every tensor must be contiguous fp32 with {param.numel()} elements "
                             f"(got {t.dtype}, {t.numel()}, contiguous={t.is_contiguous()})")


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


def sgd_step(param, grad, momentum_buffer, *, lr: float, momentum: float = 0.0, dampening: float = 0.0,
             weight_decay: float = 0.0, nesterov: bool = False, first: bool = False) -> None:
    """One SGD step in place (``momentum_buffer`` None without momentum; ``first``: the buffer
    takes the gradient, as torch.optim.SGD's first step)."""
    _check("sgd_step", param, grad, momentum_buffer)
    if param.numel() == 0:
        return
    has = momentum != 0
    _sgd_step[_grid(param.numel())](param, grad, momentum_buffer if has else param, param.numel(), float(lr),
                                    float(momentum), float(dampening), float(weight_decay), HAS_MOMENTUM=has,
                                    FIRST=bool(first), NESTEROV=bool(nesterov), BLOCK=BLOCK, num_warps=4)
    record_launch("sgd")


def lamb_direction(param, grad, exp_avg, exp_avg_sq, out, *, betas: tuple[float, float], eps: float,
                   weight_decay: float, bias_correction1: float, bias_correction2: float) -> None:
    """Both moments updated in place and the update direction written to ``out`` (module doc)."""
    _check("lamb_direction", param, grad, exp_avg, exp_avg_sq, out)
    if param.numel() == 0:
        return
    _lamb_direction[_grid(param.numel())](param, grad, exp_avg, exp_avg_sq, out, param.numel(), float(betas[0]),
                                          float(betas[1]), float(bias_correction1), float(bias_correction2),
                                          float(eps), float(weight_decay), BLOCK=BLOCK, num_warps=4)
    record_launch("lamb")


def lamb_apply(param, update, scale: float) -> None:
    """``param -= scale * update`` in place (scale: the learning rate times the trust ratio)."""
    _check("lamb_apply", param, update)
    if param.numel() == 0:
        return
    _scaled_sub[_grid(param.numel())](param, update, param.numel(), float(scale), BLOCK=BLOCK, num_warps=4)
    record_launch("lamb")


def lars_step(param, grad, momentum_buffer, *, scale: float, momentum: float, weight_decay: float) -> None:
    """``buf = momentum buf + scale (g + wd p)``, ``p -= buf``, in place (module doc)."""
    _check("lars_step", param, grad, momentum_buffer)
    if param.numel() == 0:
        return
    _lars_step[_grid(param.numel())](param, grad, momentum_buffer, param.numel(), float(scale), float(momentum),
                                     float(weight_decay), BLOCK=BLOCK, num_warps=4)
    record_launch("lars")
