"""Random ops (dropout and friends) in per-rank programs: which ranks share a mask.

A random op of the traced graph (dropout, native_dropout, SDPA with dropout_p > 0, bernoulli,
rand_like, ...) runs on this rank's block of its output. Two ranks that hold REPLICAS of that
block (the same block on a model axis where the tensor is replicated) must draw the same mask,
or the replicas diverge silently; ranks holding different blocks (split over a model axis, or
different rows over a data axis) must draw independent masks. Each such op therefore runs under a
generator seeded by

    (base seed, position, op index, block)

- base seed: drawn on rank 0 from torch's default generator at set-up and broadcast
  (``broadcast_seed``), so ``torch.manual_seed`` before ``autopar.compile`` fixes a run;
- position: a counter ticked once per program call (one micro-batch forward), taken as the
  program's first node, so a region recomputed in backward (activation checkpointing) sees the
  same value and draws the same mask again;
- op index: the node's position in the traced graph (the same on every rank);
- block: ``((mesh axis, my coordinate), ...)`` over the axes the op's output is split over; axes
  where it is replicated are left out, which is what makes replicas agree.

The op itself is torch's own (its kernel, its autograd formula); only the generator state it
reads is fixed, inside ``torch.random.fork_rng`` so the user's global random stream is untouched.
This module does not import autopar.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

_STATE = {"seed": 0, "position": 0}


def broadcast_seed(device) -> int:
    """Collective over the world: rank 0's draw from the default generator, on every rank."""
    t = (torch.randint(0, 2 ** 62, (1,), dtype=torch.int64) if dist.get_rank() == 0
         else torch.zeros(1, dtype=torch.int64))
    t = t.to(device)
    dist.broadcast(t, src=0)
    set_seed(int(t.item()))
    return _STATE["seed"]


def set_seed(seed: int) -> None:
    _STATE["seed"] = int(seed)
    _STATE["position"] = 0


def tick() -> int:
    """A new position: one per program call (see the module doc)."""
    _STATE["position"] += 1
    return _STATE["position"]


def derive(position: int, op: int, block: tuple) -> int:
    """The generator seed of one random op on one block (63 bits)."""
    text = f"{_STATE['seed']}|{position}|{op}|{tuple(block)}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def _device_of(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, torch.device):
            return a
    return torch.device("cpu")


def seeded(fn, position: int, op: int, block: tuple, /, *args, **kwargs):
    """``fn(*args, **kwargs)`` with the generator of its device seeded by ``derive``."""
    seed = derive(position, op, block)
    device = _device_of(args, kwargs)
    devices = [device] if device.type not in ("cpu", "meta") else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        if devices:
            torch.get_device_module(device.type).manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
        return fn(*args, **kwargs)


__all__ = ["broadcast_seed", "set_seed", "tick", "derive", "seeded"]
