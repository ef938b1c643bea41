"""BERT-style encoder: token + learned position embeddings, post-LN blocks with bidirectional
attention, masked-language-model head tied to the token embedding.
``forward(idx, labels)`` returns the MLM cross-entropy (labels of -100 are ignored)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.models.common import build, example_tokens


@dataclass
class BertConfig:
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    vocab: int = 256
    seq: int = 16
    dropout: float = 0.0
    mlp_ratio: int = 4
    eps: float = 1e-12


def _init_weights(m: nn.Module):
    # GPT-2/BERT init: N(0, 0.02) weights, zero biases. PyTorch's default N(0, 1) embedding
    # init would make the tied head's initial logits (and loss) huge.
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


class Block(nn.Module):
    """Post-LN: x = LN(x + attn(x)); x = LN(x + mlp(x)), as in the original BERT."""

    def __init__(self, c: BertConfig):
        super().__init__()
        self.n_head, self.dropout = c.n_head, c.dropout
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln_1 = nn.LayerNorm(c.d_model, eps=c.eps)
        self.fc = nn.Linear(c.d_model, c.mlp_ratio * c.d_model)
        self.fc_out = nn.Linear(c.mlp_ratio * c.d_model, c.d_model)
        self.ln_2 = nn.LayerNorm(c.d_model, eps=c.eps)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.n_head, d // self.n_head).transpose(1, 2)
                   for t in self.qkv(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        x = self.ln_1(x + self.drop(self.proj(y.transpose(1, 2).reshape(b, s, d))))
        return self.ln_2(x + self.drop(self.fc_out(F.gelu(self.fc(x)))))


class Bert(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab, c.d_model)
        self.pos = nn.Embedding(c.seq, c.d_model)
        self.emb_ln = nn.LayerNorm(c.d_model, eps=c.eps)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.mlm_dense = nn.Linear(c.d_model, c.d_model)
        self.mlm_ln = nn.LayerNorm(c.d_model, eps=c.eps)
        self.decoder = nn.Linear(c.d_model, c.vocab)
        self.decoder.weight = self.tok.weight   # tied, as in BERT
        self.apply(_init_weights)

    def forward(self, idx, labels):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.emb_ln(self.tok(idx) + self.pos(pos)))
        for block in self.blocks:
            x = block(x)
        logits = self.decoder(self.mlm_ln(F.gelu(self.mlm_dense(x))))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)


def bert(*, n_layer=2, n_head=4, d_model=64, vocab=256, seq=16, batch=8, dropout=0.0,
         device="cpu", seed=0):
    """Tiny BERT. Labels: 15% of positions carry the token id, the rest -100 (ignored)."""
    c = BertConfig(n_layer=n_layer, n_head=n_head, d_model=d_model, vocab=vocab, seq=seq, dropout=dropout)
    model = build(lambda: Bert(c), device, seed)
    idx, labels = example_tokens(batch, seq, vocab, device, seed, n=2)
    if device != "meta":
        g = torch.Generator().manual_seed(seed + 1)
        keep = torch.rand(batch, seq, generator=g) < 0.15
        keep[:, 0] = True   # at least one label per row, so the loss is never NaN
        labels = torch.where(keep, labels, torch.full_like(labels, -100))
    return model, (idx, labels)


def bert_large(*, n_layer=24, n_head=16, d_model=1024, vocab=30528, seq=512, batch=32, device="meta", **kw):
    """BERT-large shape (Devlin et al. 2019; vocab 30522 padded to 30528), meta by default."""
    return bert(n_layer=n_layer, n_head=n_head, d_model=d_model, vocab=vocab, seq=seq, batch=batch,
                device=device, **kw)
