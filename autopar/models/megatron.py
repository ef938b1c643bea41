"""One Megatron-LM transformer layer (Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", Fig. 2 / Section 4): pre-LN, QKV linear, attention written out as
matmul -> scale -> causal mask -> softmax -> dropout -> matmul (Megatron's non-flash path) or
as one ``scaled_dot_product_attention`` call, output projection, dropout, residual, LN, 4h MLP
with GeLU, dropout, residual. ``forward(x)`` returns ``layer(x).mean()``: the mean saves nothing
for backward, so the saved activations of a step are exactly the layer's.

Used to check the activation-memory model at full scale on meta tensors
(tests/pricing/test_activation_memory_full_scale.py, benchmarks/bench_activation_memory.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.models.common import build


class MegatronLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, attention: str = "explicit", dropout: float = 0.1):
        super().__init__()
        if attention not in ("explicit", "sdpa"):
            raise ValueError(f"attention must be 'explicit' or 'sdpa', got {attention!r}")
        self.heads, self.attention, self.p = heads, attention, dropout
        self.ln_1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln_2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.fc_out = nn.Linear(4 * hidden, hidden)

    def attn(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(h // self.heads))
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
            y = torch.matmul(F.dropout(probs, self.p, self.training), v)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))

    def forward(self, x):
        x = x + F.dropout(self.attn(self.ln_1(x)), self.p, self.training)
        x = x + F.dropout(self.fc_out(F.gelu(self.fc(self.ln_2(x)))), self.p, self.training)
        return x.mean()


def megatron_layer(*, hidden=6144, heads=64, seq=2048, batch=1, attention="explicit", dropout=0.1,
                   dtype=torch.float32, device="meta", seed=0):
    """One layer of the 22B shape of Korthikanti et al. (h 6144, 64 heads, s 2048) by default, on
    meta; returns (model, (x,)) with x of shape (batch, seq, hidden). Whether x needs a gradient
    does not change what the layer saves (its first users, ln_1 and the residual add, save the
    same either way)."""
    model = build(lambda: MegatronLayer(hidden, heads, attention, dropout), device, seed).to(dtype)
    if device == "meta":
        x = torch.empty(batch, seq, hidden, device="meta", dtype=dtype)
    else:
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(batch, seq, hidden, generator=g).to(dtype)
    return model, (x,)
