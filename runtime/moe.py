"""Mixture-of-experts experts as one opaque operator with static output shape.

``torch.ops.autopar.moe_experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k],
gate_up [E, 2F, H], down [E, O, F], act, expert_offset=0) -> [T, O]`` (O = H unless the down
projection is split on its output dim): for every token t and choice j with expert
e = top_k_index[t, j] - expert_offset in [0, E),
``out[t] += top_k_weights[t, j] * down[e] @ (act(gate) * up)`` with ``gate, up = (gate_up[e] @
hidden[t]).chunk(2)`` (transformers' concatenated [gate; up] layout, ``MixtralExperts``). Choices
whose expert is outside [0, E) contribute nothing: the local experts of an expert-parallel rank
(``expert_offset`` = its first expert), whose output is then a partial sum over the expert axis
(runtime/special.py ``moe_experts_ep`` finds the offset from the rank's coordinates).

Inside, tokens are sorted by expert and each expert runs one matmul pair on its own tokens (data
dependent shapes, which the trace never sees: the fake kernel says [T, O]). Unlike transformers'
static ``batched_mm`` implementation, no per-token copy of the expert weights is made: autograd
keeps only the inputs (O(T * H) activations) and the backward (itself an operator with a fake
kernel) recomputes each expert's intermediate.

``register_transformers()`` registers ``moe_experts_forward`` as transformers' experts
implementation "autopar" (``config._experts_implementation = "autopar"``); experts it cannot run
(biases, no gate, interleaved gate/up, a post-expert norm, a custom gate) fall back to
"batched_mm" with a warning.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

ACTS = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu,
        "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _act_grad(act: str, g: Tensor) -> Tensor:
    """d act(g) / dg (the op's backward runs below autograd: no autograd.grad there)."""
    if act == "silu":
        s = torch.sigmoid(g)
        return s * (1 + g * (1 - s))
    if act == "relu":
        return (g > 0).to(g.dtype)
    if act == "gelu":
        return 0.5 * (1 + torch.erf(g * 0.7071067811865476)) + g * torch.exp(-0.5 * g * g) * 0.3989422804014327
    if act == "gelu_tanh":
        c = 0.7978845608028654
        u = c * (g + 0.044715 * g ** 3)
        th = torch.tanh(u)
        return 0.5 * (1 + th) + 0.5 * g * (1 - th * th) * c * (1 + 3 * 0.044715 * g * g)
    raise ValueError(f"moe_experts: unknown activation {act!r}")


def _routes(top_k_index: Tensor, n_experts: int, expert_offset: int):
    """(slots sorted by local expert, their tokens, tokens per local expert as a list)."""
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1).long() - expert_offset
    slots = ((flat >= 0) & (flat < n_experts)).nonzero().squeeze(1)
    experts = flat[slots]
    order = torch.argsort(experts, stable=True)
    slots, experts = slots[order], experts[order]
    counts = torch.bincount(experts, minlength=n_experts).tolist()
    return slots, slots // k, counts


def _per_expert(top_k_index: Tensor, n_experts: int, expert_offset: int):
    """(local expert, its slots, its tokens) for every expert some token chose, in expert order."""
    slots, tokens, counts = _routes(top_k_index, n_experts, expert_offset)
    start = 0
    for e, c in enumerate(counts):
        if c:
            yield e, slots[start:start + c], tokens[start:start + c]
        start += c


@torch.library.custom_op("autopar::moe_experts", mutates_args=())
def moe_experts(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor, down: Tensor,
                act: str, expert_offset: int = 0) -> Tensor:
    act_fn = ACTS[act]
    n_exp, n_out = gate_up.shape[0], down.shape[1]
    out = torch.zeros(hidden.shape[0], n_out, dtype=torch.float32, device=hidden.device)
    w = top_k_weights.reshape(-1)
    for e, s, t in _per_expert(top_k_index, n_exp, expert_offset):
        gate, up = (hidden.index_select(0, t) @ gate_up[e].t()).chunk(2, dim=-1)
        y = (act_fn(gate) * up) @ down[e].t()
        out.index_add_(0, t, (y * w.index_select(0, s).unsqueeze(-1)).float())
    return out.to(hidden.dtype)


@moe_experts.register_fake
def _(hidden, top_k_index, top_k_weights, gate_up, down, act, expert_offset=0):
    return hidden.new_empty(hidden.shape[0], down.shape[1])


@torch.library.custom_op("autopar::moe_experts_backward", mutates_args=())
def moe_experts_backward(grad: Tensor, hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up: Tensor,
                         down: Tensor, act: str, expert_offset: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    act_fn = ACTS[act]
    n_exp = gate_up.shape[0]
    d_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    d_w = torch.zeros(top_k_weights.numel(), dtype=torch.float32, device=hidden.device)
    d_gate_up = torch.zeros(gate_up.shape, dtype=torch.float32, device=hidden.device)
    d_down = torch.zeros(down.shape, dtype=torch.float32, device=hidden.device)
    w = top_k_weights.reshape(-1)
    for e, s, t in _per_expert(top_k_index, n_exp, expert_offset):
        x = hidden.index_select(0, t)
        gate, up = (x @ gate_up[e].t()).chunk(2, dim=-1)
        a = act_fn(gate)
        h = a * up
        y = h @ down[e].t()
        dy = grad.index_select(0, t).to(y.dtype)
        ws = w.index_select(0, s).to(y.dtype).unsqueeze(-1)
        d_w.index_add_(0, s, (dy * y).sum(-1).float())
        dyw = dy * ws
        d_down[e] = (dyw.t() @ h).float()
        dh = dyw @ down[e]
        d_gu = torch.cat([dh * up * _act_grad(act, gate), dh * a], dim=-1)
        d_gate_up[e] = (d_gu.t() @ x).float()
        d_hidden.index_add_(0, t, (d_gu @ gate_up[e]).float())
    return (d_hidden.to(hidden.dtype), d_w.reshape(top_k_weights.shape).to(top_k_weights.dtype),
            d_gate_up.to(gate_up.dtype), d_down.to(down.dtype))


@moe_experts_backward.register_fake
def _(grad, hidden, top_k_index, top_k_weights, gate_up, down, act, expert_offset):
    return (torch.empty_like(hidden), torch.empty_like(top_k_weights), torch.empty_like(gate_up),
            torch.empty_like(down))


def _setup(ctx, inputs, output):
    hidden, top_k_index, top_k_weights, gate_up, down, act, expert_offset = inputs
    ctx.save_for_backward(hidden, top_k_index, top_k_weights, gate_up, down)
    ctx.act, ctx.expert_offset = act, expert_offset


def _backward(ctx, grad):
    hidden, top_k_index, top_k_weights, gate_up, down = ctx.saved_tensors
    dh, dw, dgu, dd = torch.ops.autopar.moe_experts_backward(grad.contiguous(), hidden, top_k_index, top_k_weights,
                                                             gate_up, down, ctx.act, ctx.expert_offset)
    return dh, None, dw, dgu, dd, None, None


torch.library.register_autograd("autopar::moe_experts", _backward, setup_context=_setup)


# ------------------------------------------------------------------------------ transformers
def _act_name(act_fn) -> str | None:
    name = type(act_fn).__name__
    if name in ("SiLUActivation", "SiLU"):
        return "silu"
    if name in ("ReLU",):
        return "relu"
    if name in ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "GELUPytorchTanh"):
        return "gelu_tanh"
    if name == "GELU":
        return "gelu_tanh" if getattr(act_fn, "approximate", "none") == "tanh" else "gelu"
    if name == "GELUActivation" and getattr(act_fn, "act", None) is F.gelu:
        return "gelu"
    return None


_warned: set = set()


def moe_experts_forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """transformers' experts implementation "autopar": ``torch.ops.autopar.moe_experts``."""
    from transformers.integrations.moe import _default_apply_gate, batched_mm_experts_forward
    act = _act_name(getattr(self, "act_fn", None))
    why = ("biases" if getattr(self, "has_bias", False) else "no gate" if not getattr(self, "has_gate", True)
           else "interleaved gate/up" if not getattr(self, "is_concatenated", True)
           else "a post-expert norm" if getattr(self, "has_post_expert_norm", False)
           else "a custom gate" if getattr(type(self), "_apply_gate", _default_apply_gate) is not _default_apply_gate
           else f"activation {type(getattr(self, 'act_fn', None)).__name__}" if act is None else None)
    if why is not None:
        if type(self).__name__ not in _warned:
            _warned.add(type(self).__name__)
            warnings.warn(f"autopar experts: {type(self).__name__} has {why}; running transformers' batched_mm "
                          f"(per-token copies of the expert weights) instead", stacklevel=2)
        return batched_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    gate_up, down = self.gate_up_proj, self.down_proj
    if getattr(self, "is_transposed", False):
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    return torch.ops.autopar.moe_experts(hidden_states, top_k_index, top_k_weights, gate_up, down, act, 0)


def register_transformers() -> None:
    """Make "autopar" a valid ``config._experts_implementation`` (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface
    ExpertsInterface.register("autopar", moe_experts_forward)
