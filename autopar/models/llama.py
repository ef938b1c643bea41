"""LLaMA-style decoder: RMSNorm, rotary position embeddings, SwiGLU MLP, grouped-query
attention (n_kv_heads < n_heads), untied output head. ``forward(idx, targets)`` returns the
scalar cross-entropy loss."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.models.common import build, example_tokens


@dataclass
class LlamaConfig:
    n_layer: int = 2
    n_head: int = 4
    n_kv_heads: int = 2       # key/value heads shared by groups of n_head // n_kv_heads queries
    d_model: int = 64
    ffn_hidden: int = 176     # SwiGLU hidden size (LLaMA: about 8/3 * d_model, rounded)
    vocab: int = 256
    seq: int = 16
    dropout: float = 0.0
    rope_theta: float = 10000.0
    eps: float = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self):
        # torch's convention (as nn.LayerNorm): lets compile(weights="init") rebuild it on meta.
        nn.init.ones_(self.weight)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(seq: int, head_dim: int, theta: float):
    """cos/sin tables of shape (seq, head_dim // 2), one row per position."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    # x: (b, heads, s, head_dim); rotate each (even, odd) pair by the position's angle.
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class Block(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.c = c
        hd = c.d_model // c.n_head
        self.attn_norm = RMSNorm(c.d_model, c.eps)
        self.wq = nn.Linear(c.d_model, c.n_head * hd, bias=False)
        self.wk = nn.Linear(c.d_model, c.n_kv_heads * hd, bias=False)
        self.wv = nn.Linear(c.d_model, c.n_kv_heads * hd, bias=False)
        self.wo = nn.Linear(c.n_head * hd, c.d_model, bias=False)
        self.ffn_norm = RMSNorm(c.d_model, c.eps)
        self.w1 = nn.Linear(c.d_model, c.ffn_hidden, bias=False)   # gate
        self.w3 = nn.Linear(c.d_model, c.ffn_hidden, bias=False)   # up
        self.w2 = nn.Linear(c.ffn_hidden, c.d_model, bias=False)   # down
        self.drop = nn.Dropout(c.dropout)

    def attn(self, x, cos, sin):
        b, s, _ = x.shape
        c, hd = self.c, self.c.d_model // self.c.n_head
        q = self.wq(x).view(b, s, c.n_head, hd).transpose(1, 2)
        k = self.wk(x).view(b, s, c.n_kv_heads, hd).transpose(1, 2)
        v = self.wv(x).view(b, s, c.n_kv_heads, hd).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # GQA: each kv head serves n_head // n_kv_heads query heads.
        rep = c.n_head // c.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=c.dropout if self.training else 0.0)
        return self.wo(y.transpose(1, 2).reshape(b, s, c.n_head * hd))

    def forward(self, x, cos, sin):
        x = x + self.drop(self.attn(self.attn_norm(x), cos, sin))
        h = self.ffn_norm(x)
        return x + self.drop(self.w2(F.silu(self.w1(h)) * self.w3(h)))


class Llama(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        if c.n_head % c.n_kv_heads:
            raise ValueError(f"n_head={c.n_head} must be a multiple of n_kv_heads={c.n_kv_heads}")
        self.config = c
        self.tok = nn.Embedding(c.vocab, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.norm = RMSNorm(c.d_model, c.eps)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        cos, sin = rotary_tables(c.seq, c.d_model // c.n_head, c.rope_theta)
        # Non-persistent buffers: derived from the config, not part of a checkpoint.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def reset_buffers(self):
        """Recompute the RoPE tables (autopar calls this for buffers left on the meta device)."""
        c = self.config
        cos, sin = rotary_tables(c.seq, c.d_model // c.n_head, c.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, idx, targets):
        s = idx.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def llama(*, n_layer=2, n_head=4, n_kv_heads=2, d_model=64, ffn_hidden=176, vocab=256, seq=16,
          batch=8, dropout=0.0, device="cpu", seed=0):
    """Tiny LLaMA (2 layers, d=64, 4 query / 2 kv heads): fast on CPU."""
    c = LlamaConfig(n_layer=n_layer, n_head=n_head, n_kv_heads=n_kv_heads, d_model=d_model,
                    ffn_hidden=ffn_hidden, vocab=vocab, seq=seq, dropout=dropout)
    model = build(lambda: Llama(c), device, seed)
    return model, example_tokens(batch, seq, vocab, device, seed, n=2)


def llama_7b(*, n_layer=32, n_head=32, n_kv_heads=32, d_model=4096, ffn_hidden=11008, vocab=32000,
             seq=4096, batch=8, device="meta", **kw):
    """LLaMA-7B shape (Touvron et al. 2023: 6.7B parameters, full multi-head attention; pass
    n_kv_heads=8 for grouped-query attention), meta by default."""
    return llama(n_layer=n_layer, n_head=n_head, n_kv_heads=n_kv_heads, d_model=d_model,
                 ffn_hidden=ffn_hidden, vocab=vocab, seq=seq, batch=batch, device=device, **kw)
