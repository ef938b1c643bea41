"""``Sequence``: one request in a continuous-batching engine (autopar/inference/iteration_engine.py,
codegen_iteration.py): its prompt, the new tokens so far, its sampling, and when each thing
happened; and what both engines share: ``step_until_idle`` and ``IDLE_TIMEOUT``."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch


@dataclass
class Sequence:
    """One request in the engine: its prompt, the new tokens so far, and when things happened."""
    prompt: list[int]
    max_new_tokens: int
    sampling: dict = field(default_factory=dict)
    tag: object = None                    # the caller's (the server's request)
    id: int = 0
    tokens: list[int] = field(default_factory=list)   # new tokens
    added: float = 0.0
    admitted: float = 0.0                 # its prefill started
    first: float = 0.0                    # its first new token
    done: float = 0.0
    running_at_admission: int = 0         # sequences running (itself included) when it joined
    generator: torch.Generator | None = None
    prefilled: int = 0                    # chunked prefill: prompt tokens scheduled into its prefill cache
    chunks: list[int] = field(default_factory=list)   # chunked prefill: the tokens of each chunk it ran

    @classmethod
    def queued(cls, prompt: list[int], max_new_tokens: int, sampling: dict, tag, seq_id: int,
               device="cpu") -> "Sequence":
        """A request as an engine queues it: added now, with its own seeded generator on
        ``device`` when it samples (``sampling`` already checked)."""
        seq = cls(prompt, max_new_tokens, sampling, tag, seq_id, added=time.perf_counter())
        if sampling:
            seq.generator = torch.Generator(device=device).manual_seed(sampling.get("seed", 0))
        return seq

    @property
    def need(self) -> int:
        """KV-cache tokens it holds from admission (prompt plus every token it may generate)."""
        return len(self.prompt) + self.max_new_tokens

    stopped: bool = False                 # it generated an end-of-sequence token

    @property
    def finished(self) -> bool:
        return self.stopped or len(self.tokens) >= self.max_new_tokens

    def timing(self) -> dict:
        """The engine's clock for this sequence, as ``InferenceEngine.last_timing`` is for a batch."""
        return {"prefill_s": self.first - self.admitted, "decode_s": max(self.done - self.first, 0.0),
                "new_tokens": len(self.tokens)}


__all__ = ["Sequence"]


IDLE_TIMEOUT = timedelta(days=365)  # rank 0's jobs: the other ranks wait for the next however long


def step_until_idle(stepper) -> list[Sequence]:
    """``stepper.step()`` until ``stepper.idle``; the sequences in the order they finished."""
    out = []
    while not stepper.idle:
        out += stepper.step()
    return out
