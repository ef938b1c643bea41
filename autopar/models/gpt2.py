"""GPT-2 / GPT-3 style decoder: learned position embeddings, pre-LN blocks, causal SDPA,
GELU MLP, head tied to the token embedding. ``forward(idx, targets)`` returns the scalar
cross-entropy loss, so the traced graph is the whole training forward."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.models.common import build, example_tokens


@dataclass
class GPTConfig:
    n_layer: int = 2          # number of transformer blocks
    n_head: int = 4           # attention heads (d_model must divide by it)
    d_model: int = 64         # hidden size
    vocab: int = 256          # vocabulary size (GPT-2's 50257 is padded to 50304 for tiling)
    seq: int = 16             # context length = size of the position table
    dropout: float = 0.0      # dropout after attention/MLP and on embeddings
    mlp_ratio: int = 4        # MLP hidden = mlp_ratio * d_model
    attention: str = "sdpa"   # "sdpa" (fused) | "explicit": matmul, causal mask, softmax, dropout (Megatron-LM)


def _init_weights(m: nn.Module):
    # GPT-2/BERT init: N(0, 0.02) weights, zero biases. PyTorch's default N(0, 1) embedding
    # init would make the tied head's initial logits (and loss) huge.
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = c.n_head, c.dropout
        self.ln_1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln_2 = nn.LayerNorm(c.d_model)
        self.fc = nn.Linear(c.d_model, c.mlp_ratio * c.d_model)
        self.fc_out = nn.Linear(c.mlp_ratio * c.d_model, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.explicit = c.attention == "explicit"
        if self.explicit:
            self.attn_drop = nn.Dropout(c.dropout)
            self.register_buffer("mask", torch.ones(c.seq, c.seq, dtype=torch.bool).tril(), persistent=False)

    def attn(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        # (b, s, d) -> (b, heads, s, head_dim)
        q, k, v = (t.view(b, s, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.explicit:   # as Megatron-LM without fused attention: scores, mask, softmax, dropout
            att = (q @ k.transpose(-2, -1)) * (1.0 / (d // self.n_head) ** 0.5)
            att = att.masked_fill(~self.mask[:s, :s], float("-inf"))
            y = self.attn_drop(F.softmax(att, dim=-1)) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln_2(x)))))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.wte = nn.Embedding(c.vocab, c.d_model)
        self.wpe = nn.Embedding(c.seq, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        self.head.weight = self.wte.weight   # tied: one tensor, two FQNs
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module):
        # A method (as in Hugging Face models) so a meta-device GPT can replay it per module
        # (autopar/execution/weights.py, compile(weights="init")).
        _init_weights(module)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def gpt(*, n_layer=2, n_head=4, d_model=64, vocab=256, seq=16, batch=8, dropout=0.0,
        device="cpu", seed=0, attention="sdpa"):
    """A GPT of any shape and an example (idx, targets) batch (``attention="explicit"``:
    matmul/softmax/dropout attention instead of fused SDPA)."""
    c = GPTConfig(n_layer=n_layer, n_head=n_head, d_model=d_model, vocab=vocab, seq=seq, dropout=dropout,
                  attention=attention)
    model = build(lambda: GPT(c), device, seed)
    return model, example_tokens(batch, seq, vocab, device, seed, n=2)


def gpt2(**kw):
    """Tiny GPT-2 (2 layers, d=64, 4 heads, vocab 256, seq 16, batch 8): fast on CPU."""
    return gpt(**kw)


# Published GPT-2 shapes (Radford et al. 2019), vocab 50257 padded to 50304.
_GPT2 = {"small": (12, 12, 768), "medium": (24, 16, 1024), "large": (36, 20, 1280), "xl": (48, 25, 1600)}


def _published(size):
    n_layer, n_head, d_model = _GPT2[size]

    def factory(**kw):
        args = dict(n_layer=n_layer, n_head=n_head, d_model=d_model, vocab=50304, seq=1024,
                    batch=8, device="meta")
        args.update(kw)
        return gpt(**args)
    factory.__name__ = f"gpt2_{size}"
    factory.__doc__ = f"GPT-2 {size} ({n_layer} layers, d={d_model}, {n_head} heads), meta by default."
    return factory


gpt2_small, gpt2_medium, gpt2_large, gpt2_xl = (_published(s) for s in ("small", "medium", "large", "xl"))


def gpt3(*, n_layer=96, d_model=12288, n_head=96, seq=2048, batch=1536, vocab=50304, device="meta", **kw):
    """GPT-3 175B shape (Brown et al. 2020), on the meta device by default."""
    return gpt(n_layer=n_layer, d_model=d_model, n_head=n_head, seq=seq, batch=batch, vocab=vocab,
               device=device, **kw)
