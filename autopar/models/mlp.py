"""A stack of Linear + GELU layers with a classification (cross-entropy) or regression (MSE)
loss. ``forward(x, y)`` returns the scalar loss. The smallest model in the zoo: a first test
for every strategy."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.models.common import build


class MLP(nn.Module):
    def __init__(self, d_in: int, hidden: int, n_layer: int, d_out: int, loss: str, dropout: float):
        super().__init__()
        if loss not in ("ce", "mse"):
            raise ValueError(f"loss must be 'ce' or 'mse', got {loss!r}")
        self.loss = loss
        dims = [d_in] + [hidden] * n_layer
        self.layers = nn.Sequential(*(nn.Sequential(nn.Linear(a, b), nn.GELU(), nn.Dropout(dropout))
                                      for a, b in zip(dims[:-1], dims[1:])))
        self.out = nn.Linear(dims[-1], d_out)

    def forward(self, x, y):
        pred = self.out(self.layers(x))
        return F.cross_entropy(pred, y) if self.loss == "ce" else F.mse_loss(pred, y)


def mlp(*, d_in=32, hidden=64, n_layer=3, d_out=10, loss="ce", batch=16, dropout=0.0, device="cpu", seed=0):
    """Tiny MLP. ``loss="ce"``: y is class indices (batch,); ``"mse"``: y is (batch, d_out)."""
    model = build(lambda: MLP(d_in, hidden, n_layer, d_out, loss, dropout), device, seed)
    if device == "meta":
        x = torch.empty(batch, d_in, device="meta")
        y = (torch.empty(batch, dtype=torch.long, device="meta") if loss == "ce"
             else torch.empty(batch, d_out, device="meta"))
    else:
        g = torch.Generator().manual_seed(seed + 1)
        x = torch.randn(batch, d_in, generator=g)
        y = torch.randint(d_out, (batch,), generator=g) if loss == "ce" else torch.randn(batch, d_out, generator=g)
        x, y = x.to(device), y.to(device)
    return model, (x, y)
