"""The fused kernels as torch operators (``torch.library.custom_op``), so a traced graph, the
planner's fake and meta tensors and every rank's program treat them like any ATen op:

* ``torch.ops.autopar.rms_norm(x, weight, eps) -> (y, rstd)``: y = x · rsqrt(mean(x²) + eps) · weight
  over the last dim, in fp32 arithmetic, y in ``promote(x.dtype, weight.dtype)``; rstd the fp32
  per-row statistic. Autograd keeps x, the weight and rstd.
* ``torch.ops.autopar.swiglu(gate, up) -> silu(gate) · up``; autograd keeps gate and up. Tagged
  pointwise (elementwise), so a grid program (codegen/grid_local.py) runs it on each rank's blocks.

Each runs its Triton kernel (runtime/kernels/rms_norm.py, swiglu.py) on CUDA tensors, and on CPU
tensors under the Triton interpreter (``TRITON_INTERPRET=1``); anywhere else (a CPU without the
interpreter, meta tensors) the same formula in plain torch. Which one ran is counted by
``runtime.kernels.kernel_stats`` (Triton launches only).
"""
from __future__ import annotations

import torch
from torch import Tensor

from runtime.kernels import available, interpreted


def use_triton(x: Tensor) -> bool:
    """Whether the Triton kernels run on ``x``'s device here."""
    if x.device.type == "cuda":
        return available()
    return x.device.type == "cpu" and interpreted() and available()


# --------------------------------------------------------------------------------------- rms_norm
@torch.library.custom_op("autopar::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if use_triton(x) and weight.dtype in (x.dtype, torch.float32):
        from runtime.kernels.rms_norm import rms_norm_forward
        y, _, rstd = rms_norm_forward(x, weight, eps)
        return y.to(out_dtype), rstd
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    return (xf * rstd.unsqueeze(-1) * weight.float()).to(out_dtype), rstd


@_rms_norm.register_fake
def _(x, weight, eps):
    return (x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype)),
            x.new_empty(x.shape[:-1], dtype=torch.float32))


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    if use_triton(x) and weight.dtype in (x.dtype, torch.float32):
        from runtime.kernels.rms_norm import rms_norm_backward
        dx, dw = rms_norm_backward(dy, x, weight, rstd)
        return dx.to(x.dtype), dw.to(weight.dtype), None
    r = rstd.unsqueeze(-1)
    normed = x.float() * r
    g = dy.float() * weight.float()
    dx = r * (g - normed * (g * normed).mean(-1, keepdim=True))
    dw = (dy.float() * normed).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype), None


torch.library.register_autograd("autopar::rms_norm", _rms_norm_backward, setup_context=_rms_norm_setup)


# ----------------------------------------------------------------------------------------- swiglu
@torch.library.custom_op("autopar::swiglu", mutates_args=(), tags=(torch.Tag.pointwise,))
def _swiglu(gate: Tensor, up: Tensor) -> Tensor:
    if use_triton(gate):
        from runtime.kernels.swiglu import swiglu_forward
        return swiglu_forward(gate, up)
    return torch.nn.functional.silu(gate) * up


@_swiglu.register_fake
def _(gate, up):
    return torch.empty_like(gate)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    if use_triton(gate):
        from runtime.kernels.swiglu import swiglu_backward
        return swiglu_backward(dy, gate, up)
    g = gate.float()
    sig = torch.sigmoid(g)
    d = dy.float()
    return ((d * up.float() * sig * (1 + g * (1 - sig))).to(gate.dtype), (d * g * sig).to(up.dtype))


torch.library.register_autograd("autopar::swiglu", _swiglu_backward, setup_context=_swiglu_setup)

RMS_NORM = torch.ops.autopar.rms_norm.default
SWIGLU = torch.ops.autopar.swiglu.default
