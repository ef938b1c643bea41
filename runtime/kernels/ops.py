"""The fused kernels as torch operators (``torch.library.custom_op``), so a traced graph, the
planner's fake and meta tensors and every rank's program treat them like any ATen op:

* ``torch.ops.autopar.rms_norm(x, weight, eps) -> y``: y = x · rsqrt(mean(x²) + eps) · weight over
  the last dim, in fp32 arithmetic, y in ``promote(x.dtype, weight.dtype)``. Autograd keeps x and
  the weight; the backward kernel recomputes each row's rstd from x, which it reads anyway. One
  output, so no getitem sits between the norm and its readers (where a plan could move a gather
  away from the linear that regathers it under Megatron-SP).
* ``torch.ops.autopar.swiglu(gate, up) -> silu(gate) · up``; autograd keeps gate and up. Tagged
  pointwise (elementwise), so a grid program (codegen/grid_local.py) runs it on each rank's blocks.
* ``torch.ops.autopar.layer_norm(x, weight, bias, eps) -> y``: LayerNorm over the last dim in fp32
  arithmetic, y in x's dtype. Autograd keeps x and the weight (the backward recomputes each row's
  mean and rstd from x, which it reads anyway) and returns dx, dweight and dbias. One output, as
  ATen's layer_norm: no getitem between the norm and its readers.
* ``torch.ops.autopar.geglu(gate, up, approximate) -> gelu(gate, approximate) · up`` (approximate
  "none" or "tanh", as torch's gelu); autograd keeps gate and up. Tagged pointwise.

Each runs its Triton kernel (runtime/kernels/rms_norm.py, swiglu.py, layer_norm.py, geglu.py) on
CUDA tensors, and on CPU
tensors under the Triton interpreter (``TRITON_INTERPRET=1``); anywhere else (a CPU without the
interpreter, meta tensors) the same formula in plain torch. Which one ran is counted by
``runtime.kernels.kernel_stats`` (Triton launches only).
"""
from __future__ import annotations

import math

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
def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if use_triton(x) and weight.dtype in (x.dtype, torch.float32):
        from runtime.kernels.rms_norm import rms_norm_forward
        return rms_norm_forward(x, weight, eps)[0].to(out_dtype)
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(out_dtype)


@_rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_norm_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    if use_triton(x) and weight.dtype in (x.dtype, torch.float32):
        from runtime.kernels.rms_norm import rms_norm_backward
        dx, dw = rms_norm_backward(dy, x, weight, None, eps=ctx.eps)   # rstd recomputed in the kernel
        return dx.to(x.dtype), dw.to(weight.dtype), None
    r = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + ctx.eps)
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

# ------------------------------------------------------------------------------------- layer_norm
@torch.library.custom_op("autopar::layer_norm", mutates_args=())
def _layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    if use_triton(x) and weight.dtype in (x.dtype, torch.float32) and bias.dtype in (x.dtype, torch.float32):
        from runtime.kernels.layer_norm import layer_norm_forward
        return layer_norm_forward(x, weight, bias, eps)
    xhat, _ = _layer_norm_xhat(x, eps)
    return (xhat * weight.float() + bias.float()).to(x.dtype)


def _layer_norm_xhat(x: Tensor, eps: float):
    xf = x.float()
    xc = xf - xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return xc * rstd, rstd


@_layer_norm.register_fake
def _(x, weight, bias, eps):
    return torch.empty_like(x)


def _layer_norm_setup(ctx, inputs, output):
    x, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.bias_dtype = eps, bias.dtype


def _layer_norm_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    if use_triton(x) and weight.dtype in (x.dtype, torch.float32) and ctx.bias_dtype in (x.dtype, torch.float32):
        from runtime.kernels.layer_norm import layer_norm_backward
        dx, dw, db = layer_norm_backward(dy, x, weight, ctx.eps)
        return dx.to(x.dtype), dw.to(weight.dtype), db.to(ctx.bias_dtype), None
    xhat, r = _layer_norm_xhat(x, ctx.eps)
    d = dy.float()
    g = d * weight.float()
    dx = r * (g - xhat * (g * xhat).mean(-1, keepdim=True) - g.mean(-1, keepdim=True))
    dw = (d * xhat).reshape(-1, x.shape[-1]).sum(0)
    db = d.reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype), db.to(ctx.bias_dtype), None


torch.library.register_autograd("autopar::layer_norm", _layer_norm_backward, setup_context=_layer_norm_setup)


# ------------------------------------------------------------------------------------------ geglu
@torch.library.custom_op("autopar::geglu", mutates_args=(), tags=(torch.Tag.pointwise,))
def _geglu(gate: Tensor, up: Tensor, approximate: str) -> Tensor:
    if use_triton(gate):
        from runtime.kernels.geglu import geglu_forward
        return geglu_forward(gate, up, approximate)
    return torch.nn.functional.gelu(gate, approximate=approximate) * up


@_geglu.register_fake
def _(gate, up, approximate):
    return torch.empty_like(gate)


def _geglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.approximate = inputs[2]


def _geglu_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    if use_triton(gate):
        from runtime.kernels.geglu import geglu_backward
        return (*geglu_backward(dy, gate, up, ctx.approximate), None)
    g = gate.float()
    if ctx.approximate == "tanh":
        k = math.sqrt(2 / math.pi)
        t = torch.tanh(k * (g + 0.044715 * g ** 3))
        y = 0.5 * g * (1 + t)
        dgelu = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * k * (1 + 3 * 0.044715 * g * g)
    else:
        cdf = 0.5 * (1 + torch.erf(g / math.sqrt(2)))
        y = g * cdf
        dgelu = cdf + g * torch.exp(-0.5 * g * g) / math.sqrt(2 * math.pi)
    d = dy.float()
    return (d * up.float() * dgelu).to(gate.dtype), (d * y).to(up.dtype), None


torch.library.register_autograd("autopar::geglu", _geglu_backward, setup_context=_geglu_setup)

RMS_NORM = torch.ops.autopar.rms_norm.default
SWIGLU = torch.ops.autopar.swiglu.default
LAYER_NORM = torch.ops.autopar.layer_norm.default
GEGLU = torch.ops.autopar.geglu.default


# ----------------------------------------------------------------------------------------- rotary
# ``torch.ops.autopar.rotary(x, cos, sin) -> x * cos + rotate_half(x) * sin`` (Hugging Face's
# rotary position embedding over the last dim; cos and sin broadcast to x). Autograd keeps cos and
# sin, and x only where cos or sin needs a gradient (the backward is the transposed rotation of dy).
@torch.library.custom_op("autopar::rotary", mutates_args=())
def _rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    if use_triton(x):
        from runtime.kernels.rotary import rotary_forward
        return rotary_forward(x, cos, sin)
    from runtime.kernels.rotary import rotary_reference
    return rotary_reference(x, cos, sin)


@_rotary.register_fake
def _(x, cos, sin):
    return torch.empty_like(x, dtype=torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype))


def _rotary_setup(ctx, inputs, output):
    x, cos, sin = inputs
    ctx.tables_need_grad = (cos.requires_grad, sin.requires_grad)
    ctx.x_dtype = x.dtype
    ctx.save_for_backward(x if any(ctx.tables_need_grad) else None, cos, sin)


def _rotary_backward(ctx, dy):
    from runtime.kernels.rotary import rotate_half, sum_to, table_grads
    x, cos, sin = ctx.saved_tensors
    if use_triton(dy):
        from runtime.kernels.rotary import rotary_backward
        dx = rotary_backward(dy, cos, sin, ctx.x_dtype)
    else:   # the transposed rotation: dy * cos + rotate_half^T(dy * sin), rotate_half^T = -rotate_half
        dx = (dy * cos - rotate_half(dy * sin)).to(ctx.x_dtype)
        dx = sum_to(dx, dy.shape)
    dc, ds = table_grads(dy, x, cos, sin, *ctx.tables_need_grad) if x is not None else (None, None)
    return dx, dc, ds


torch.library.register_autograd("autopar::rotary", _rotary_backward, setup_context=_rotary_setup)

ROTARY = torch.ops.autopar.rotary.default


# ----------------------------------------------------------------------------- rotary_interleaved
# ``torch.ops.autopar.rotary_interleaved(x, cos, sin)``: GPT-J / Meta Llama's rotary (the zoo's
# Llama): each pair (x[2i], x[2i + 1]) rotated by cos[..., i], sin[..., i] (tables of width d/2
# broadcasting to x[..., ::2]). Saves as autopar.rotary: cos and sin, x only for their gradients.
@torch.library.custom_op("autopar::rotary_interleaved", mutates_args=())
def _rotary_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    if use_triton(x):
        from runtime.kernels.rotary import rotary_forward
        return rotary_forward(x, cos, sin, interleaved=True)
    from runtime.kernels.rotary import rotary_interleaved_reference
    return rotary_interleaved_reference(x, cos, sin)


@_rotary_interleaved.register_fake
def _(x, cos, sin):   # contiguous, as the stack + flatten it replaces
    return x.new_empty(x.shape, dtype=torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype))


def _rotary_interleaved_backward(ctx, dy):
    from runtime.kernels.rotary import interleaved_table_grads
    x, cos, sin = ctx.saved_tensors
    if use_triton(dy):
        from runtime.kernels.rotary import rotary_backward
        dx = rotary_backward(dy, cos, sin, ctx.x_dtype, interleaved=True)
    else:   # the transposed rotation of each pair
        d1, d2 = dy[..., 0::2], dy[..., 1::2]
        dx = torch.stack((d1 * cos + d2 * sin, d2 * cos - d1 * sin), dim=-1).flatten(-2).to(ctx.x_dtype)
    dc, ds = interleaved_table_grads(dy, x, cos, sin, *ctx.tables_need_grad) if x is not None else (None, None)
    return dx, dc, ds


torch.library.register_autograd("autopar::rotary_interleaved", _rotary_interleaved_backward,
                                setup_context=_rotary_setup)

ROTARY_INTERLEAVED = torch.ops.autopar.rotary_interleaved.default


# ---------------------------------------------------------------------------------------- softmax
# ``torch.ops.autopar.softmax(x) -> y``: softmax over the last dim in fp32 arithmetic, y in x's
# dtype (explicit attention's scores after the model's mask). Autograd keeps y only. Named
# "softmax" so autopar/rules/attention_core.py still finds the attention core's anchor in it.
@torch.library.custom_op("autopar::softmax", mutates_args=())
def _softmax(x: Tensor) -> Tensor:
    if use_triton(x):
        from runtime.kernels.softmax import softmax_forward
        return softmax_forward(x)
    return torch.softmax(x.float(), dim=-1).to(x.dtype)


@_softmax.register_fake
def _(x):
    return torch.empty_like(x)


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _softmax_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    if use_triton(y):
        from runtime.kernels.softmax import softmax_backward
        return softmax_backward(dy, y)
    yf, df = y.float(), dy.float()
    return (yf * (df - (df * yf).sum(-1, keepdim=True))).to(y.dtype)


torch.library.register_autograd("autopar::softmax", _softmax_backward, setup_context=_softmax_setup)

SOFTMAX = torch.ops.autopar.softmax.default


# ------------------------------------------------------------------------------------ dropout_add
# ``torch.ops.autopar.dropout_add(x, residual, p, train) -> residual + dropout(x, p)`` (x and
# residual of one shape). Tagged ``nondeterministic_seeded`` like aten.dropout, so a rank's
# program runs it inside ``runtime.rng.seeded`` (codegen/per_rank.py): its mask comes from a seed
# drawn from the generator that wrapper seeds per (position, op, block). The mask is Philox of
# (seed, flat index) (runtime/kernels/dropout_add.py), not torch's dropout stream, the same in
# the kernel and in the plain-torch body. Autograd keeps the seed only. Inactive (p == 0 or
# train False) it is residual + x and draws nothing. A CompositeImplicitAutograd op (its body an
# autograd Function): a custom_op's autograd cannot see a seed drawn inside it.
_LIB = torch.library.Library("autopar", "FRAGMENT")
_LIB.define("dropout_add(Tensor x, Tensor residual, float p, bool train) -> Tensor",
            tags=(torch.Tag.nondeterministic_seeded,))


def _dropout_add(x: Tensor, residual: Tensor, p: float, train: bool) -> Tensor:
    if not train or p == 0.0:
        return residual + x
    from runtime.kernels.dropout_add import DropoutAddFunction, draw_seed
    kernels = use_triton(x) and x.device == residual.device
    return DropoutAddFunction.apply(x, residual, float(p), draw_seed(x.device), kernels)


_LIB.impl("dropout_add", _dropout_add, "CompositeImplicitAutograd")

DROPOUT_ADD = torch.ops.autopar.dropout_add.default


# --------------------------------------------------------------------------- linear_cross_entropy
# ``torch.ops.autopar.linear_cross_entropy(hidden, weight, targets, ignore_index, reduction) -> loss``:
# cross_entropy(hidden @ weight.T, targets) of hidden [N, D], weight [V, D], targets [N] (class ids),
# ``reduction`` as ATen's (1 mean over the targets that are not ``ignore_index``, 2 sum), a 0-d loss
# in hidden's dtype, without the [N, V] logits (runtime/kernels/linear_cross_entropy.py: chunked;
# both gradients computed in the forward, so autograd keeps grad_hidden [N, D] and grad_weight
# [V, D], nothing of the logits). A CompositeImplicitAutograd op (its body the kernel's autograd
# Function, which must see which inputs need a gradient); anywhere the kernel cannot run (a CPU
# without the interpreter, fake and meta tensors) the plain-torch reference. The vocabulary-
# parallel form (weight split over a model axis) is runtime/special.py's vocab_parallel_lce.
_LIB.define("linear_cross_entropy(Tensor hidden, Tensor weight, Tensor targets, int ignore_index=-100, "
            "int reduction=1) -> Tensor")

LCE_REDUCTIONS = {1: "mean", 2: "sum"}


def _is_fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake
    return t.is_meta or is_fake(t)


class _LinearCrossEntropyMeta(torch.autograd.Function):
    """Meta / fake tensors: the kernel's shapes and what it keeps for backward (grad_hidden,
    grad_weight; the saved-activation probes measure programs on meta tensors)."""

    @staticmethod
    def forward(ctx, hidden, weight):
        dh = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        dw = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        ctx.save_for_backward(dh, dw)
        return hidden.new_empty(())

    @staticmethod
    def backward(ctx, g):
        dh, dw = ctx.saved_tensors
        return (None if dh is None else dh * g), (None if dw is None else dw * g)


def linear_cross_entropy_meta(hidden: Tensor, weight: Tensor) -> Tensor:
    return _LinearCrossEntropyMeta.apply(hidden, weight)


def _linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int = -100,
                          reduction: int = 1) -> Tensor:
    red = LCE_REDUCTIONS.get(int(reduction))
    if red is None:
        raise ValueError(f"autopar.linear_cross_entropy: reduction {reduction!r} not supported (1 mean, 2 sum)")
    from runtime.kernels import linear_cross_entropy as LCE
    if _is_fake(hidden) or _is_fake(weight):
        return linear_cross_entropy_meta(hidden, weight)
    if use_triton(hidden) and hidden.device == weight.device:
        return LCE.linear_cross_entropy(hidden, weight, targets, int(ignore_index), red)
    return LCE.linear_cross_entropy_reference(hidden, weight.to(hidden.dtype), targets, int(ignore_index), red)


_LIB.impl("linear_cross_entropy", _linear_cross_entropy, "CompositeImplicitAutograd")

LINEAR_CROSS_ENTROPY = torch.ops.autopar.linear_cross_entropy.default
