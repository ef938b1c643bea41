"""Every rank runs each ``generate`` the server asks rank 0 for.

The engine is SPMD: all ranks of the plan call ``generate`` together. The HTTP server lives on
rank 0 only, so ``LeaderGenerate`` (rank 0) broadcasts each batch (token ids, attention mask,
tokens wanted) to the others before running it, and ``follow`` (every other rank) waits for those
broadcasts and runs the same call, until rank 0 broadcasts the stop job when the server shuts
down. On one process both are plain calls.
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist

STOP = "stop"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class LeaderGenerate:
    """Rank 0's ``generate``: the same call on every rank, one batch at a time."""

    def __init__(self, engine):
        self.engine = engine
        self.lock = threading.Lock()

    def __call__(self, input_ids: torch.Tensor, max_new_tokens: int, attention_mask: torch.Tensor,
                 sampling: dict | None = None):
        with self.lock:
            if _distributed():
                dist.broadcast_object_list([("generate", input_ids, int(max_new_tokens), attention_mask, sampling)],
                                           src=0)
            return self.engine.generate(input_ids, max_new_tokens, attention_mask=attention_mask, sampling=sampling)

    def stop(self) -> None:
        with self.lock:
            if _distributed():
                dist.broadcast_object_list([(STOP, None, 0, None, None)], src=0)


def follow(engine) -> int:
    """A rank other than 0: run every batch rank 0 broadcasts until it says stop; returns the
    number of batches run."""
    runs = 0
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        kind, input_ids, new, mask, sampling = box[0]
        if kind == STOP:
            return runs
        try:
            engine.generate(input_ids, new, attention_mask=mask, sampling=sampling)
        except Exception:  # noqa: BLE001 - rank 0 reports the same failure to the client; keep serving
            pass
        runs += 1
