"""Vision Transformer: conv2d patch embedding, class token, learned position embeddings,
pre-LN encoder blocks, linear classifier on the class token.
``forward(images, labels)`` returns the classification cross-entropy."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.models.common import build


@dataclass
class ViTConfig:
    image: int = 32           # square input side in pixels
    patch: int = 8            # square patch side (image must divide by it)
    channels: int = 3
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    num_classes: int = 10
    dropout: float = 0.0
    mlp_ratio: int = 4


class Block(nn.Module):
    def __init__(self, c: ViTConfig):
        super().__init__()
        self.n_head, self.dropout = c.n_head, c.dropout
        self.ln_1 = nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.ln_2 = nn.LayerNorm(c.d_model)
        self.fc = nn.Linear(c.d_model, c.mlp_ratio * c.d_model)
        self.fc_out = nn.Linear(c.mlp_ratio * c.d_model, c.d_model)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.n_head, d // self.n_head).transpose(1, 2)
                   for t in self.qkv(self.ln_1(x)).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, s, d)))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln_2(x)))))


class ViT(nn.Module):
    def __init__(self, c: ViTConfig):
        super().__init__()
        if c.image % c.patch:
            raise ValueError(f"image size {c.image} must be a multiple of patch size {c.patch}")
        self.config = c
        n_patches = (c.image // c.patch) ** 2
        self.patch_embed = nn.Conv2d(c.channels, c.d_model, kernel_size=c.patch, stride=c.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.d_model))
        self.pos = nn.Parameter(torch.randn(1, n_patches + 1, c.d_model) * 0.02)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.num_classes)

    def forward(self, images, labels):
        x = self.patch_embed(images).flatten(2).transpose(1, 2)       # (b, patches, d)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.drop(x + self.pos)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln_f(x[:, 0])), labels)


def vit(*, image=32, patch=8, channels=3, n_layer=2, n_head=4, d_model=64, num_classes=10, batch=8,
        dropout=0.0, device="cpu", seed=0):
    """Tiny ViT (32x32 images, 8x8 patches, 2 layers, d=64)."""
    c = ViTConfig(image=image, patch=patch, channels=channels, n_layer=n_layer, n_head=n_head,
                  d_model=d_model, num_classes=num_classes, dropout=dropout)
    model = build(lambda: ViT(c), device, seed)
    if device == "meta":
        images = torch.empty(batch, channels, image, image, device="meta")
        labels = torch.empty(batch, dtype=torch.long, device="meta")
    else:
        g = torch.Generator().manual_seed(seed + 1)
        images = torch.randn(batch, channels, image, image, generator=g).to(device)
        labels = torch.randint(num_classes, (batch,), generator=g).to(device)
    return model, (images, labels)


def vit_large(*, image=224, patch=16, n_layer=24, n_head=16, d_model=1024, num_classes=1000, batch=64,
              device="meta", **kw):
    """ViT-L/16 shape (Dosovitskiy et al. 2021), meta by default."""
    return vit(image=image, patch=patch, n_layer=n_layer, n_head=n_head, d_model=d_model,
               num_classes=num_classes, batch=batch, device=device, **kw)
