"""Chunked prefill in the continuous-batching engine: ``ChunkedPrefill``, the part of
autopar/inference/iteration_engine.py ``IterationEngine`` that runs an iteration under a budget
of ``prefill_chunk`` tokens.

**Chunked prefill** (``prefill_chunk``: a chunked plan's ``predictions["prefill_chunk"]``, as
autopar/inference/continuous.py ``simulate_chunked`` prices it). An iteration runs at most
``prefill_chunk`` tokens: the running rows' decode step takes one token each, first; the rest of
the budget goes to prompt chunks in arrival order: first the sequence part-way through its
prefill (``filling``), then waiting sequences admitted as above (slots and KV-token pool, counting
the part-way sequence, which holds its slot and its tokens from admission) while budget is left,
each taking as many of its prompt's tokens as remain. Each chunk is a forward of that sequence's
next prompt tokens into its own prefill cache (``seq.cache``, fresh at its first chunk) at their
own positions (``position_ids`` / ``cache_position`` from the tokens before, the mask all of
them), so its last chunk's last-position logits are a whole-prompt prefill's; then the sequence
gets its first token and joins the batched cache, to decode from the next iteration. The
iteration: the chunks planned, the decode step, the finished rows retired, the chunks run.
``seq.chunks`` records the tokens of each chunk a sequence ran, ``most_tokens`` the most one
iteration ran. ``slots`` may not exceed the chunk (each decode takes a token of the budget). With
pp > 1 each virtual engine's turn has its own budget (the turn's decode step, then its chunks, at
every stage; the logits shared at its end are the decode rows' and those of the chunks that end
a prompt). *Known difference:* the planner prices an iteration with chunks as one mixed batch
(inference_cost.py ``Pricer.mixed``: the weights read once for the chunk tokens and the decodes
together); the engine runs the decode step and each chunk as separate forwards, so the weights
are read once per forward.
"""
from __future__ import annotations

import time

import torch

from autopar.errors import PlanError
from autopar.inference.sequence import Sequence


def check_chunk(slots: int, prefill_chunk) -> None:
    """A PlanError unless ``prefill_chunk`` is a positive integer of at least ``slots`` tokens
    (each running sequence's decode takes a token of an iteration's budget)."""
    if not isinstance(prefill_chunk, int) or isinstance(prefill_chunk, bool) or prefill_chunk < 1:
        raise PlanError(f"prefill chunk={prefill_chunk!r} must be a positive integer (tokens an "
                        f"iteration runs)")
    if slots > prefill_chunk:
        raise PlanError(f"{slots} slots are more than the prefill chunk of {prefill_chunk} tokens: each "
                        f"running sequence's decode takes a token of an iteration's budget; use a chunk of "
                        f"at least {slots} tokens or fewer slots")


class ChunkedPrefill:
    """``IterationEngine``'s iterations under a chunk budget (module doc)."""

    def _chunk_plan(self, batch) -> tuple[list[Sequence], list[tuple]]:
        """The prompt chunks of ``batch``'s next iteration (the engine, or with pp > 1 a
        VirtualEngine's turn; module doc): its running rows' decodes take a token
        each of the budget, the sequence part-way through its prefill continues, then waiting
        sequences are admitted while budget is left. Returns (the admitted, the chunks as (seq,
        start, end) of its prompt); each chunk's sequence counts its tokens as scheduled."""
        left = self.chunk - len(batch.running)
        holding = batch.running + batch.filling
        ahead = sum(len(s.prompt) - s.prefilled for s in batch.filling)
        admitted = self._admissions(holding, left - ahead)
        now = time.perf_counter()
        for i, seq in enumerate(admitted):
            seq.admitted = now
            seq.running_at_admission = len(holding) + i + 1
        chunks = []
        for seq in batch.filling + admitted:
            if left <= 0:
                break
            take = min(len(seq.prompt) - seq.prefilled, left)
            chunks.append((seq, seq.prefilled, seq.prefilled + take))
            seq.prefilled += take
            seq.chunks.append(take)
            left -= take
        self.most_tokens = max(self.most_tokens, self.chunk - left)
        return admitted, chunks

    def _chunk_forward(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Prompt tokens [start, end) of ``seq`` into its prefill cache (``seq.cache``, fresh at
        start 0) at their own positions, attending to the ``start`` before: its last position's
        logits [1, V], as a whole-prompt prefill's at that position."""
        if start == 0:
            seq.cache = self._new_cache()
        ids = torch.tensor([seq.prompt[start:end]], dtype=torch.long, device=self.device)
        positions = torch.arange(start, end, device=self.device)
        return self._forward(input_ids=ids, attention_mask=torch.ones(1, end, dtype=torch.long, device=self.device),
                             position_ids=positions[None], cache_position=positions, cache=seq.cache,
                             **self.last_logits)[:, -1]

    def _chunked_step(self) -> list[Sequence]:
        """One iteration under a chunk budget (pp = 1; module doc): the chunks
        planned, the running rows' decode step, the finished rows retired, then each chunk's
        forward; a prompt whose last chunk ran gets its first token and joins the batched cache."""
        self.admitting, chunks = self._chunk_plan(self)
        self.iterations += bool(chunks or self.running)
        finished = []
        if self.running:
            self._decode()
            finished += self._leave(self)
        for seq, start, end in chunks:
            logits = self._chunk_forward(seq, start, end)
            if end == len(seq.prompt):
                self._append(seq, self._next_tokens(logits, [seq])[0])
                finished += self._prefilled(seq, time.perf_counter())
        self.filling = [s for s, _, end in chunks if end < len(s.prompt)]
        self.admitting = []
        return finished


__all__ = ["ChunkedPrefill", "check_chunk"]
