"""Every rank runs each ``generate`` the server asks rank 0 for (static batching).

The engine is SPMD: all ranks of the plan call ``generate`` together. The HTTP server lives on
rank 0 only, so ``LeaderGenerate`` (rank 0) broadcasts each batch (token ids, attention mask,
tokens wanted) to the others before running it, and ``follow`` (every other rank) waits for those
broadcasts and runs the same call, until rank 0 broadcasts the stop job when the server shuts
down. On one process both are plain calls.

The broadcasts travel on ``jobs`` (a group without a timeout: idle ranks wait there however long
the server is idle). A failed batch that may leave the ranks out of step (``several``: a replica of
several ranks, whose peers may be inside a collective; or a failed collective) is a RanksOutOfStep:
rank 0 keeps it and raises it for every later batch (the server answers 503), and a following rank
stops with it. Any other failed batch is that batch's own: rank 0 reports it and both keep serving.
"""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from autopar.inference.iteration_engine import distributed
from autopar.inference.iteration_ranks import RanksOutOfStep, collective_error

STOP = "stop"


class LeaderGenerate:
    """Rank 0's ``generate``: the same call on every rank, one batch at a time."""

    def __init__(self, engine, jobs=None, several: bool = False):
        self.engine, self.jobs, self.several = engine, jobs, several
        self.lock = threading.Lock()
        self.broken: RanksOutOfStep | None = None

    def __call__(self, input_ids: torch.Tensor, max_new_tokens: int, attention_mask: torch.Tensor,
                 sampling: dict | None = None):
        with self.lock:
            if self.broken is not None:
                raise RanksOutOfStep(str(self.broken))
            try:
                if distributed():
                    dist.broadcast_object_list([("generate", input_ids, int(max_new_tokens), attention_mask,
                                                 sampling)], src=0, group=self.jobs)
                return self.engine.generate(input_ids, max_new_tokens, attention_mask=attention_mask,
                                            sampling=sampling)
            except Exception as e:  # noqa: BLE001 - classified: the batch's failure, or the server's
                if not (distributed() and (self.several or collective_error(e))):
                    raise
                self.broken = RanksOutOfStep(f"the ranks are out of step after a batch failed: {type(e).__name__}: "
                                             f"{e}; this server cannot serve any more: restart autopar serve")
                raise self.broken from e

    def stop(self) -> None:
        with self.lock:
            if distributed() and self.broken is None:
                dist.broadcast_object_list([(STOP, None, 0, None, None)], src=0, group=self.jobs)


def follow(engine, jobs=None, several: bool = False) -> int:
    """A rank other than 0: run every batch rank 0 broadcasts until it says stop; returns the
    number of batches run (RanksOutOfStep where a failed batch may leave the ranks out of step)."""
    runs = 0
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=jobs)
        kind, input_ids, new, mask, sampling = box[0]
        if kind == STOP:
            return runs
        try:
            engine.generate(input_ids, new, attention_mask=mask, sampling=sampling)
        except Exception as e:  # noqa: BLE001 - rank 0 reports a batch's own failure to the client; keep serving
            if several or collective_error(e):
                raise RanksOutOfStep(f"rank {dist.get_rank()} failed in batch {runs}: {type(e).__name__}: {e}; the "
                                     f"ranks may be out of step, so it stops (rank 0 answers 503 from now on)") from e
        runs += 1
