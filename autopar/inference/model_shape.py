"""The dimensions of a decoder the inference planner prices, read off its Hugging Face config.

``ModelShape.of(model)``: layers, hidden, heads, key/value heads, head dim, MLP intermediate,
vocabulary, experts and experts per token (MoE; 1 and 1 for dense models), and the parameter
count split into the decoder layers' and the rest (embeddings, LM head, final norm). Works on
meta-device models (only shapes are read).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from autopar.errors import PlanError


def _first(cfg, *names, default=None):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def causal_lm(model):
    """The Hugging Face causal LM inside ``model``: itself, or what autopar's wrappers hold (the zoo's
    ``.model``, ``from_hf_config``'s (model, inputs) pair)."""
    seen = model
    for _ in range(3):
        if hasattr(seen, "generate") and hasattr(seen, "config") and hasattr(seen, "named_parameters"):
            return seen
        seen = getattr(seen, "model", None)
    raise PlanError(f"{type(model).__name__} is not a Hugging Face causal LM (no .generate and .config): "
                    f"inference plans and runs AutoModelForCausalLM models")


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    experts: int
    experts_per_token: int
    layer_params: int          # all decoder layers together
    other_params: int          # embeddings, LM head, final norm: whole on every rank of their stage
    windows: tuple = ()        # per layer: the sliding window its KV cache keeps, or 0 (every position)
    split_head: int = 0        # parameters of an LM head not tied to the embeddings (vocabulary-parallel
    #                            under tp, autopar/inference/tp_shard.py); 0 when tied

    def cache_positions(self, layer: int, context: int) -> int:
        """Positions layer ``layer``'s KV cache holds for ``context`` tokens (a sliding window keeps
        at most its width, as transformers' static cache allocates it)."""
        w = self.windows[layer] if layer < len(self.windows) else 0
        return min(context, w) if w else context

    @property
    def params(self) -> int:
        return self.layer_params + self.other_params

    def to_json(self) -> dict:
        return dict(asdict(self), params=self.params, windows=list(self.windows))

    @staticmethod
    def of(model) -> ModelShape:
        model = causal_lm(model)
        cfg = model.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        layers = _first(cfg, "num_hidden_layers", "n_layer")
        hidden = _first(cfg, "hidden_size", "n_embd")
        heads = _first(cfg, "num_attention_heads", "n_head")
        if not (layers and hidden and heads):
            raise PlanError(f"{type(model).__name__}'s config lacks the layer count, hidden size or heads")
        kv = _first(cfg, "num_key_value_heads", default=heads)
        head_dim = _first(cfg, "head_dim", default=hidden // heads)
        inter = _first(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)
        vocab = _first(cfg, "vocab_size")
        experts = _first(cfg, "num_local_experts", "num_experts", default=1)
        per_token = _first(cfg, "num_experts_per_tok", default=1) if experts > 1 else 1
        total, in_layers = 0, 0
        seen = set()
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel()
            if ".layers." in f".{name}" or ".h." in f".{name}":
                in_layers += p.numel()
        if in_layers == 0:
            raise PlanError(f"{type(model).__name__}: no decoder layers found among its parameters "
                            f"(expected names with .layers. or .h.)")
        head = getattr(model, "get_output_embeddings", lambda: None)()
        embed = getattr(model, "get_input_embeddings", lambda: None)()
        split = head.weight.numel() if head is not None and embed is not None and head.weight is not embed.weight else 0
        return ModelShape(layers, hidden, heads, kv, head_dim, inter, vocab, experts, per_token,
                          in_layers, total - in_layers, _windows(cfg, layers), split)


def _windows(cfg, layers: int) -> tuple:
    window = getattr(cfg, "sliding_window", None) or 0
    if getattr(cfg, "use_sliding_window", True) is False:
        window = 0
    types = getattr(cfg, "layer_types", None)
    if types and len(types) == layers:
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    return tuple([window] * layers)
