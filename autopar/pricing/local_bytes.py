"""Bytes of one rank's block: the item size a tensor has at run time (floating tensors are bf16
under bf16 mixed precision) and the share of a tensor a layout or a strategy leaves on one rank.
Shared by node pricing (autopar/pricing/price.py), saved-activation accounting
(autopar/pricing/saved_roots.py) and edge pricing (autopar/pricing/edge_price.py)."""
from __future__ import annotations

import torch

from autopar.mesh import Mesh
from autopar.rules.candidates import FLOAT_DTYPES
from autopar.rules.layout import Layout
from autopar.rules.strategy import Strategy


def runtime_itemsize(dtype, precision: str) -> int:
    """Bytes per element at run time: floating tensors are bf16 under bf16 mixed precision."""
    if dtype in FLOAT_DTYPES and precision == "bf16":
        return 2
    return torch.empty((), dtype=dtype, device="meta").element_size()


def block_fraction(layout: Layout | None, mesh: Mesh) -> float:
    return 1.0 if layout is None else layout.shard_fraction(mesh.shape)


def letter_fraction(letters: str, strat: Strategy, mesh: Mesh) -> float:
    f = 1.0
    for a, split in enumerate(strat.splits):
        if split is not None and split != "P" and split in letters:
            f /= mesh.shape[a]
    return f
