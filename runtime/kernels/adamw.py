"""A fused AdamW step as one Triton kernel over flat fp32 tensors: parameter, gradient, exp_avg
and exp_avg_sq, updated in place with torch.optim.AdamW's formulas (decoupled weight decay,
bias corrections 1 - beta^step). ``adamw_reference`` runs torch.optim.AdamW itself
(single-tensor path) on the same tensors.
"""
from __future__ import annotations

import math

import torch

from runtime.kernels import check_device, record_launch

try:
    import triton
    import triton.language as tl
except ImportError:   # the reference still works
    triton = None

BLOCK = 1024


if triton is not None:
    @triton.jit
    def _adamw_step(P, G, M, V, n, lr, beta1, beta2, eps, decay, step_size, bias_correction2_sqrt,
                    BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(P + offs, mask=mask, other=0.0)
        g = tl.load(G + offs, mask=mask, other=0.0)
        m = tl.load(M + offs, mask=mask, other=0.0)
        v = tl.load(V + offs, mask=mask, other=0.0)
        p = p * decay
        m = m + (g - m) * (1.0 - beta1)
        v = v * beta2 + (g * g) * (1.0 - beta2)
        denom = tl.sqrt(v) / bias_correction2_sqrt + eps
        p = p - step_size * (m / denom)
        tl.store(P + offs, p, mask=mask)
        tl.store(M + offs, m, mask=mask)
        tl.store(V + offs, v, mask=mask)


def adamw_step(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               *, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 1e-2, step: int) -> None:
    """One AdamW step in place on ``param``, ``exp_avg`` and ``exp_avg_sq`` (contiguous fp32 of
    one size, ``grad`` too); ``step`` counts this step (1 for the first), as torch.optim's state."""
    check_device(param, grad, exp_avg, exp_avg_sq)
    tensors = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    for name, t in tensors.items():
        if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != param.numel():
            raise ValueError(f"adamw_step: {name} must be contiguous fp32 with {param.numel()} elements "
                             f"(got {t.dtype}, {t.numel()}, contiguous={t.is_contiguous()})")
    if step < 1:
        raise ValueError(f"adamw_step: step {step} < 1")
    beta1, beta2 = betas
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    n = param.numel()
    if n == 0:
        return
    _adamw_step[(triton.cdiv(n, BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, n, float(lr), float(beta1), float(beta2), float(eps),
        float(1 - lr * weight_decay), float(lr / bias_correction1), float(math.sqrt(bias_correction2)),
        BLOCK=BLOCK, num_warps=4)
    record_launch("adamw")


def adamw_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                    *, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                    weight_decay: float = 1e-2, step: int, foreach: bool = False, fused: bool | None = None) -> None:
    """The same step by torch.optim.AdamW (single tensor path by default) on these tensors, in place."""
    p = torch.nn.Parameter(param, requires_grad=True)
    p.grad = grad
    opt = torch.optim.AdamW([p], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                            foreach=foreach, fused=fused)
    opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if fused:
        opt.state[p]["step"] = opt.state[p]["step"].to(param.device)
    opt.step()
