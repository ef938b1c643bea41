"""Helpers shared by the zoo's model files: deterministic construction, example token inputs."""
from __future__ import annotations

from typing import Callable

import torch

from autopar.errors import PlanError


def build(ctor: Callable[[], torch.nn.Module], device: str, seed: int) -> torch.nn.Module:
    """Construct a model on ``device`` with a deterministic init. The global RNG state is
    restored afterwards so building a model does not perturb the caller's randomness."""
    if device not in ("cpu", "meta"):
        raise PlanError(f"device must be 'cpu' or 'meta', got {device!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            return ctor()


def example_tokens(batch: int, seq: int, vocab: int, device: str, seed: int, n: int = 2) -> tuple:
    """``n`` int64 token tensors of shape (batch, seq). On meta nothing is allocated; each
    tensor is a distinct object (torch.export dedups an input passed twice)."""
    if device == "meta":
        return tuple(torch.empty(batch, seq, dtype=torch.long, device="meta") for _ in range(n))
    g = torch.Generator().manual_seed(seed + 1)
    return tuple(torch.randint(vocab, (batch, seq), generator=g) for _ in range(n))
