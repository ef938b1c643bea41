"""Tracing a model whose tensors are on several devices as if they were on one.

``accelerate.init_empty_weights()`` (and autopar's own meta models built that way) leave the
parameters on the meta device and the buffers real: a Llama-style model that multiplies by its
real rotary tables in ``forward`` then fails to trace ("Expected all tensors to be on the same
device, meta and cpu"). Only shapes and dtypes matter to the trace, so while it runs every real
parameter, buffer and input is swapped for a meta tensor of the same shape and dtype (ties kept:
one meta copy per real tensor) and put back afterwards: the model the caller holds, and what
execution reads from it (the real buffers), are unchanged.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn


def devices_of(model: nn.Module, inputs: tuple) -> set[str]:
    """The device types of the model's parameters and buffers and of the tensor inputs."""
    tensors = [*model.parameters(), *model.buffers(), *(t for t in inputs if isinstance(t, torch.Tensor))]
    return {t.device.type for t in tensors}


def _meta_like(t: torch.Tensor, memo: dict) -> torch.Tensor:
    if id(t) not in memo:
        m = torch.empty_like(t, device="meta")
        if isinstance(t, nn.Parameter):
            m = nn.Parameter(m, requires_grad=t.requires_grad)
        memo[id(t)] = m
    return memo[id(t)]


@contextmanager
def on_meta_when_mixed(model: nn.Module, inputs: tuple):
    """Yields the inputs to trace with: as given when the model and inputs are on one device;
    when some are on meta and others are real, meta copies of the inputs, with the model's real
    parameters and buffers swapped for meta copies until the block exits (module doc)."""
    devices = devices_of(model, inputs)
    if "meta" not in devices or len(devices) == 1:
        yield inputs
        return
    memo: dict = {}
    swapped = []   # (module, attribute name, original tensor)
    for mod in model.modules():
        own = [*mod.named_parameters(recurse=False), *mod.named_buffers(recurse=False)]
        for name, t in own:
            if t.device.type != "meta":
                swapped.append((mod, name, t))
                setattr(mod, name, _meta_like(t, memo))   # nn.Module.__setattr__ keeps it a parameter / buffer
    try:
        yield tuple(_meta_like(t, memo) if isinstance(t, torch.Tensor) and t.device.type != "meta" else t
                    for t in inputs)
    finally:
        for mod, name, t in reversed(swapped):
            setattr(mod, name, t)
