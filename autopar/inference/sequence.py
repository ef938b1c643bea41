"""``Sequence``: one request in the continuous-batching engine (autopar/inference/iteration_engine.py):
its prompt, the new tokens so far, its sampling, and when each thing happened."""
from __future__ import annotations

from dataclasses import dataclass, field

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
