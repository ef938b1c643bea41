"""Activation checkpoint regions at run time: what a generated program's ``checkpoint_region``
call does.

``codegen/checkpoint.py`` outlines the emitted nodes of each checkpointed block instance (its ops,
the reshard collectives between them and its ZeRO-3 gather/free calls) into a sub-GraphModule and
replaces them by one call ``checkpoint_region(body, "blocks.3", *inputs)``. That call runs
``body(*inputs)`` under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: forward keeps
only the inputs (autograd saves nothing inside), backward reruns ``body`` when it first needs one
of the region's saved tensors, then differentiates through the recomputed values.

Why it composes with the rest of the runtime:

- collectives: ``body`` calls the same autograd functions (runtime/collectives.py) in recompute
  as in forward, so forward collectives run again and their conjugates run in backward as without
  checkpointing. Every rank recomputes the same regions in the same order (same program), and
  *early stop* is switched off so a recomputation always runs the whole body: a rank-dependent
  number of saved tensors (e.g. ``make_partial``) can then never make one rank skip a
  collective its peers run;
- ZeRO-3: ``body`` starts with the chunk's ``zero3_gather`` (parameters are gathered again
  before they are recomputed with) and ends with ``zero3_free``, which ``recomputing()`` turns
  off during recomputation: backward right after needs the parameters; the optimizer frees the
  chunk once its gradients are complete;
- dropout: ``preserve_rng_state=True`` restores the RNG state of the forward before recomputing,
  whatever op draws from the global generator.

``STATS`` counts region runs (forward / recompute), so tests can prove that recomputation
happened; ``record_regions()`` lets a measurement see each region's body and inputs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop


@dataclass
class RegionStats:
    forward: int = 0      # region bodies run in forward with autograd recording
    recompute: int = 0    # region bodies rerun by backward
    # region name -> times rerun by backward ("blocks.1", or "blocks.1.attention_core" for a
    # selectively recomputed block: tests check which regions, not only how many, were rerun)
    recomputed: dict = field(default_factory=dict)

    def reset(self) -> None:
        self.forward = self.recompute = 0
        self.recomputed = {}


STATS = RegionStats()
_RECOMPUTING = 0          # depth of recomputations running now (nested regions are not generated)
_LOG: list | None = None  # record_regions(): (name, body, inputs) of each forward region run


def recomputing() -> bool:
    """True while backward reruns a region's body."""
    return _RECOMPUTING > 0


@contextlib.contextmanager
def record_regions():
    """Collect ``(name, body, inputs)`` for every region run in forward inside the block (for
    measurements: the inputs are what a checkpointed region keeps alive for backward)."""
    global _LOG
    prev, _LOG = _LOG, []
    try:
        yield _LOG
    finally:
        _LOG = prev


class _Run:
    """The function handed to torch.utils.checkpoint: its first call is the forward, every
    later one a recomputation (the only other caller is autograd)."""

    def __init__(self, body, name: str):
        self.body, self.name, self.calls = body, name, 0

    def __call__(self, *args):
        global _RECOMPUTING
        self.calls += 1
        if self.calls == 1:
            STATS.forward += 1
            return self.body(*args)
        STATS.recompute += 1
        STATS.recomputed[self.name] = STATS.recomputed.get(self.name, 0) + 1
        _RECOMPUTING += 1
        try:
            return self.body(*args)
        finally:
            _RECOMPUTING -= 1


def checkpoint_region(body, name: str, *args):
    """Run ``body(*args)`` as one activation-checkpoint region (module doc)."""
    if _LOG is not None:
        _LOG.append((name, body, args))
    if not torch.is_grad_enabled():   # evaluation: nothing is saved anyway
        return body(*args)
    with set_checkpoint_early_stop(False):
        return checkpoint(_Run(body, name), *args, use_reentrant=False, preserve_rng_state=True)


__all__ = ["STATS", "RegionStats", "checkpoint_region", "recomputing", "record_regions"]
