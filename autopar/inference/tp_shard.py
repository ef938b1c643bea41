"""Megatron tensor parallelism of a Hugging Face causal LM for generation, from the model's own plan.

Which module splits how comes from the model, not from per-architecture code here: Hugging Face
configs publish their tensor-parallel plan (``config.base_model_tp_plan``: module patterns with
styles such as ``colwise``, ``rowwise``, ``packed_colwise``). GPT-2's config has none, so
``EXTRA_PLANS`` gives its (Conv1D: weights stored [in, out]; ``c_attn`` packs q, k and v).

``shard_for_tp(model, rank, tp, all_reduce)`` slices every parameter the plan names in place:

- ``colwise``: the output features (each rank its heads, or its part of the MLP's intermediate);
  ``packed_colwise`` splits each packed half (gate and up) the same way, ``packed_colwise3`` each
  third (q, k, v);
- ``rowwise``: the input features; the module's output is then a partial sum, all-reduced over the
  tensor-parallel group by a forward hook, with the bias (kept whole) added once after the sum.
  A ``rowwise`` parameter (Mixtral's expert ``down_proj``) is sliced on its input dim and its owning
  module (``moe_tp_experts``) all-reduces.

The config is then rewritten to the rank's local head counts (attention reshapes with -1 and its
cache is allocated from the config), so the model runs its own forward and ``generate`` on local
heads. Embeddings, norms and routers stay whole. The LM head, when not tied to the embeddings
and tp divides the vocabulary, is vocabulary-parallel (``colwise_gather_output``: each rank its
rows of the vocabulary) and its output goes through the caller's ``all_gather`` hook: the engines
keep each rank's slice of the logits for a distributed argmax / top-k
(autopar/inference/vocab_parallel.py) and gather them whole only to sample with Hugging Face's
``generate`` (autopar/inference/engine.py). A tied head stays whole.
"""
from __future__ import annotations

import fnmatch

import torch
from torch import nn

from autopar.errors import PlanError

# Plans for configs that publish none (pattern under the base model -> style).
EXTRA_PLANS = {
    "gpt2": {"h.*.attn.c_attn": "packed_colwise3", "h.*.attn.c_proj": "rowwise",
             "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"},
}
STYLES = ("colwise", "rowwise", "packed_colwise", "packed_colwise3", "moe_tp_experts", "colwise_gather_output")


def tp_plan(model) -> dict[str, str]:
    """The model's tensor-parallel plan as full module paths -> style."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        raise PlanError(f"{type(model).__name__} has no Hugging Face config: the generation engine runs "
                        f"Hugging Face causal LMs (AutoModelForCausalLM)")
    plan = getattr(cfg, "base_model_tp_plan", None) or EXTRA_PLANS.get(getattr(cfg, "model_type", ""))
    if not plan:
        raise PlanError(f"{type(model).__name__} ({getattr(cfg, 'model_type', '?')}) publishes no tensor-parallel "
                        f"plan (config.base_model_tp_plan): run it with tp=1")
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    out = {(f"{prefix}.{k}" if base is not None else k): v for k, v in plan.items()}
    head = getattr(model, "get_output_embeddings", lambda: None)()
    embed = getattr(model, "get_input_embeddings", lambda: None)()
    if head is not None and embed is not None and head.weight is not embed.weight:
        # the vocabulary-parallel head: each rank its rows of the vocabulary, logits gathered
        out.update((k, v) for k, v in (getattr(type(model), "_tp_plan", None) or {"lm_head": "colwise_gather_output"}
                                       ).items() if v == "colwise_gather_output")
    return out


def _is_conv1d(module) -> bool:
    return type(module).__name__ == "Conv1D"   # transformers.pytorch_utils.Conv1D: weight [in, out]


def _pieces(shape, dim: int, rank: int, tp: int, parts: int = 1) -> list[tuple]:
    """Index tuples of this rank's 1/tp of each of ``parts`` equal packed pieces along ``dim``
    (concatenated along ``dim`` they are the rank's shard)."""
    size = shape[dim] // parts
    if size * parts != shape[dim] or size % tp:
        raise PlanError(f"a dim of {shape[dim]} does not split into {parts} x tp={tp} equal parts")
    n = size // tp
    out = []
    for k in range(parts):
        idx = [slice(None)] * len(shape)
        idx[dim] = slice(k * size + rank * n, k * size + (rank + 1) * n)
        out.append(tuple(idx))
    return out


def read_own(tensor_of):
    """The default reader: slices of the model's own tensors (``tensor_of(fqn)``)."""
    def read(fqn: str, pieces: list[tuple], dim: int) -> torch.Tensor:
        t = tensor_of(fqn)
        return torch.cat([t[i] for i in pieces], dim=dim).clone() if len(pieces) > 1 else t[pieces[0]].clone()
    return read


def _set(module, name: str, value: torch.Tensor) -> None:
    setattr(module, name, nn.Parameter(value, requires_grad=False))


def _reduce_hook(all_reduce, bias):
    def hook(module, args, out):
        first = out[0] if isinstance(out, tuple) else out
        all_reduce(first)
        if bias is not None:
            first.add_(bias)
        return out
    return hook


def _gather_hook(all_gather):
    def hook(module, args, out):
        return all_gather(out)
    return hook


def shard_for_tp(model, rank: int, tp: int, all_reduce, read=None, all_gather=None) -> dict[str, str]:
    """Slice ``model`` in place for rank ``rank`` of ``tp``; ``all_reduce(t)`` sums ``t`` in place over
    the tensor-parallel group. ``read(fqn, pieces, dim)`` gives the rank's shard of the tensor at
    ``fqn`` (``pieces``: index tuples concatenated along ``dim``); default: the model's own tensors.
    ``all_gather(t)``: the vocabulary-parallel head's logits ``t`` (this rank's slice of the last
    dim) as the caller wants them: concatenated over the group in rank order, or the slice as is
    (without it the head stays whole).
    Parameters left on the meta device (a model built without weights) are then read whole.
    Returns the module paths sharded, with their styles."""
    params = dict(model.named_parameters(remove_duplicate=False))
    if read is None:
        read = read_own(lambda fqn: params[fqn].data)
    done = _shard(model, rank, tp, all_reduce, read, all_gather) if tp > 1 else {}
    filled = {}   # tied aliases stay one tensor
    for fqn, p in model.named_parameters(remove_duplicate=False):
        if p.is_meta:
            if id(p) not in filled:
                filled[id(p)] = nn.Parameter(read(fqn, [tuple(slice(None) for _ in p.shape)], 0), requires_grad=False)
            owner, _, name = fqn.rpartition(".")
            setattr(model.get_submodule(owner), name, filled[id(p)])
    return done


def _shard(model, rank: int, tp: int, all_reduce, read, all_gather) -> dict[str, str]:
    cfg = model.config
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head")
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if heads % tp or kv % tp:
        raise PlanError(f"tp={tp} must divide the attention heads ({heads}) and the key/value heads ({kv}); "
                        f"use a tp dividing both")
    plan = tp_plan(model)
    modules = dict(model.named_modules())
    done = {}
    for path, module in modules.items():
        style = next((s for pat, s in plan.items() if fnmatch.fnmatchcase(path, pat)), None)
        params = {f"{path}.{n}": n for n, _ in module.named_parameters(recurse=False)}
        param_styles = {n: next((s for pat, s in plan.items() if fnmatch.fnmatchcase(full, pat)), None)
                        for full, n in params.items()}
        if style is None and not any(param_styles.values()):
            continue
        if style not in (None, *STYLES):
            raise PlanError(f"{path}: tensor-parallel style {style!r} is not supported (supported: {STYLES})")
        if isinstance(module, nn.Linear) or _is_conv1d(module):
            out_dim, in_dim = (1, 0) if _is_conv1d(module) else (0, 1)
            parts = {"packed_colwise": 2, "packed_colwise3": 3}.get(style, 1)
            w = f"{path}.weight"
            if style == "colwise_gather_output" and (all_gather is None or module.weight.shape[0] % tp):
                continue   # the head stays whole: no gather given, or tp does not divide the vocabulary
            if style == "colwise_gather_output":
                _set(module, "weight", read(w, _pieces(module.weight.shape, out_dim, rank, tp), out_dim))
                module.register_forward_hook(_gather_hook(all_gather))
            elif style in ("colwise", "packed_colwise", "packed_colwise3"):
                _set(module, "weight", read(w, _pieces(module.weight.shape, out_dim, rank, tp, parts), out_dim))
                if module.bias is not None:
                    _set(module, "bias", read(f"{path}.bias", _pieces(module.bias.shape, 0, rank, tp, parts), 0))
            elif style == "rowwise":
                _set(module, "weight", read(w, _pieces(module.weight.shape, in_dim, rank, tp), in_dim))
                bias = None
                if module.bias is not None:
                    bias = read(f"{path}.bias", [tuple(slice(None) for _ in module.bias.shape)], 0)
                if bias is not None and _is_conv1d(module):   # Conv1D always adds a bias: zero here, whole after
                    _set(module, "bias", torch.zeros_like(bias))
                else:
                    module.bias = None
                module.register_forward_hook(_reduce_hook(all_reduce, bias))
            if isinstance(module, nn.Linear):
                module.out_features, module.in_features = module.weight.shape
            else:
                module.nf = module.weight.shape[1]
            done[path] = style
            continue
        for name, pstyle in param_styles.items():   # packed expert weights [E, 2F, H] / [E, H, F]
            if pstyle is None:
                continue
            shape, full = getattr(module, name).shape, f"{path}.{name}"
            if pstyle == "packed_colwise":
                _set(module, name, read(full, _pieces(shape, 1, rank, tp, 2), 1))
            elif pstyle in ("colwise",):
                _set(module, name, read(full, _pieces(shape, 1, rank, tp), 1))
            elif pstyle == "rowwise":
                _set(module, name, read(full, _pieces(shape, len(shape) - 1, rank, tp), len(shape) - 1))
            else:
                raise PlanError(f"{path}.{name}: tensor-parallel style {pstyle!r} is not supported for a parameter")
            done[f"{path}.{name}"] = pstyle
        if style == "moe_tp_experts":
            module.register_forward_hook(_reduce_hook(all_reduce, None))
            done[path] = style
    _localize_config(model, tp, heads, kv)
    return done


def _localize_config(model, tp: int, heads: int, kv: int) -> None:
    """The config and attention modules on this rank's heads (head_dim kept)."""
    cfg = model.config
    hidden = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd")
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    for name in ("num_attention_heads", "n_head"):
        if getattr(cfg, name, None) is not None:
            setattr(cfg, name, heads // tp)
    if getattr(cfg, "num_key_value_heads", None) is not None:
        cfg.num_key_value_heads = kv // tp
    try:
        cfg.head_dim = head_dim
    except AttributeError:
        pass
    for m in model.modules():   # GPT-2's attention keeps its split size and head count
        if hasattr(m, "split_size") and hasattr(m, "num_heads") and hasattr(m, "c_attn"):
            m.num_heads = m.num_heads // tp
            m.split_size = m.split_size // tp
            m.embed_dim = m.embed_dim // tp
