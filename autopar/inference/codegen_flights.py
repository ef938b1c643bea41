"""Pipeline stages in flight in the continuous-batching engine on autopar's own programs (pp > 1):
``RowFlight`` and ``RowStagesInFlight``, the part of autopar/inference/codegen_iteration.py
``CodegenIterationEngine`` that runs a step as one tick of the stages, as the modules engine's
autopar/inference/iteration_stages.py does with its modules.

Each rank runs its stage's part of the row programs (``RowStageRunner``, a ``StageStepRunner`` of
autopar/inference/codegen_stages.py in flight). The engine keeps ``pp`` micro-batches in flight,
one per stage: ``pp`` virtual engines (``RowFlight``), each owning its own cache block of ``slots``
rows (this rank's layers of it, split as the plans say) with its ``[slots, max_len]`` mask and
written lengths, its running sequences and ``kv_tokens // pp`` of the pool, taking requests from
the engine's one waiting queue. A ``step()`` is one *tick* t:

1. virtual engine t mod pp, whose tokens are known, starts its *turn* at stage 0: it admits
   waiting sequences (oldest first, while one of its rows is free and its pool allows; the first
   that does not fit blocks the ones behind it) into free rows of its block, and its turn's
   forwards are set down, inputs and all: each newcomer's prefill (over every row, only its row
   written: ``rows`` -1 elsewhere), then one decode step of its running rows (free rows and the
   newcomers' at -1);
2. stage s works on the turn of virtual engine (t - s) mod pp, if it has one: each forward takes
   the hidden states stage s - 1 sent in the previous tick (blocking receive), runs, and sends its
   own on with ``isend``; the last stage chooses the turn's tokens from its logits
   (``next_tokens``: greedy or each sequence's seeded sampler);
3. each stage waits for its previous tick's sends (the next stage received them in this tick, so
   no stage waits on the next one within a tick), then the last stage's tokens of the turn it
   finished (virtual engine (t + 1) mod pp) are broadcast over the pipeline, and every rank ends
   that turn: the same tokens appended, the same rows retired (free for the virtual engine's next
   turn), the newcomers that go on joining its running rows.

So a turn is one pass through the stages, pp ticks, and the stages work at once on different
virtual engines; a tick lasts as long as its slowest stage's work (the broadcast joins them). A
newcomer's first token is known only at the end of its turn, so it decodes from its virtual
engine's next turn. Every rank runs the same bookkeeping of all virtual engines and only its own
stage's forwards; ``iterations`` counts the ticks with work, ``overlaps`` those in which two or
more stages worked, a virtual engine's ``turns`` its turns. ``running`` is every virtual engine's
running and admitted sequences; ``abort`` hands back those of the virtual engines themselves (a
tick that fails after its turn admitted sequences does not lose them) and the waiting ones.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from autopar.inference.codegen_rows import row_chunk
from autopar.inference.iteration_stages import begin_tick
from autopar.inference.sequence import Sequence


@dataclass
class RowFlight:
    """One virtual engine (module doc): ``rows[r]`` the sequence owning cache row r (running, or
    admitted by its turn in flight), ``cache`` this rank's blocks of its rows, ``mask`` / ``length``
    their written slots, ``running`` its running sequences; its turn in flight: ``admitted`` (None:
    no turn in flight), ``forwards`` (step length, inputs, step rows read, their sequences) and, on
    the last stage, the ``tokens`` chosen so far. With a chunk budget, ``chunks``: the turn's prompt
    chunks (seq, start, end), and ``filling``: its sequences part-way through their prefill (module
    doc, Chunked prefill). ``turns``: turns it has started."""
    rows: list
    cache: list
    mask: torch.Tensor
    length: torch.Tensor
    running: list = field(default_factory=list)
    admitted: list | None = None
    forwards: list = field(default_factory=list)
    tokens: list = field(default_factory=list)
    turns: int = 0
    chunks: list = field(default_factory=list)
    filling: list = field(default_factory=list)


def _row_of(ve: RowFlight, seq: Sequence) -> int:
    return next(r for r, s in enumerate(ve.rows) if s is seq)


class RowStagesInFlight:
    """``CodegenIterationEngine``'s pp > 1 steps (module doc): ``_new_flights`` sets the virtual
    engines up, ``step`` runs ``_tick``, ``abort`` ``_abort_flights``."""

    def _new_flights(self) -> None:
        self.flights = [RowFlight([None] * self.slots, self.runner.new_cache(),
                                  torch.zeros(self.slots, self.max_len, dtype=torch.long),
                                  torch.zeros(self.slots, dtype=torch.long)) for _ in range(self.pp)]

    def _abort_flights(self) -> list[Sequence]:
        """Empty every virtual engine and forget the sends in flight; returns what was running,
        admitted by a turn in flight or waiting, taken from the virtual engines themselves (not
        only ``running``, set at a tick's end)."""
        out, seen = [], set()
        in_flight = [s for ve in self.flights for s in ve.running + (ve.admitted or []) + ve.filling]
        for seq in self.running + in_flight + self.waiting:
            if id(seq) not in seen:
                seen.add(id(seq))
                out.append(seq)
        self.waiting, self.running = [], []
        self.runner.drop()
        self._new_flights()
        return out

    def _tick(self) -> list[Sequence]:
        """One tick (module doc); returns the sequences that finished."""
        at = begin_tick(self)
        if at is None:
            return []
        mine, end = at
        if mine.admitted is not None:
            self._work(mine)
        self.runner.wait_sends()
        finished = self._end_turn(end) if end.admitted is not None else []
        self.running = [s for ve in self.flights for s in ve.running + (ve.admitted or []) + ve.filling]
        return finished

    def _start_turn(self, ve: RowFlight) -> None:
        """Stage 0's turn of ``ve``: the waiting sequences it admits into its free rows and the
        turn's forwards (their prefills, then the decode of its running rows); no turn when it has
        neither. With a chunk budget (``_start_chunked_turn``): its running rows' decode, then its
        prompt chunks."""
        if self.chunk is not None:
            return self._start_chunked_turn(ve)
        admitted = self._admissions(ve.running)
        if not admitted and not ve.running:
            return
        now = time.perf_counter()
        forwards = []
        every = lambda t: t[None].expand(self.slots, -1).contiguous()   # noqa: E731
        for i, seq in enumerate(admitted):
            seq.admitted = now
            seq.running_at_admission = len(ve.running) + i + 1
            row = ve.rows.index(None)
            ve.rows[row] = seq
            n = len(seq.prompt)
            ve.mask[row] = 0
            ve.mask[row, :n] = 1
            ve.length[row] = n
            ids, pos, slots = row_chunk(torch.tensor(seq.prompt), 0, self.prefill_len)
            rows = torch.full((self.slots,), -1)
            rows[row] = row
            forwards.append((self.prefill_len, (every(ids), every(pos), every(slots), ve.mask.clone(), rows),
                             [row], [seq]))
        if ve.running:
            forwards.append(self._decode_forward(ve))
        ve.admitted, ve.forwards, ve.tokens = admitted, forwards, []
        ve.turns += 1

    def _decode_forward(self, ve: RowFlight) -> tuple:
        """The decode step of ``ve``'s running rows, set down (each at its own next slot; the other
        rows not written), their rows' masks and lengths moved on."""
        order = [_row_of(ve, s) for s in ve.running]
        busy = torch.zeros(self.slots, dtype=torch.bool)
        busy[order] = True
        at = torch.where(busy, ve.length, 0)
        last = torch.zeros(self.slots, dtype=torch.long)
        last[order] = torch.tensor([s.tokens[-1] for s in ve.running])
        held = busy.nonzero().flatten()
        ve.mask[held, ve.length[held]] = 1
        forward = (1, (last[:, None], at[:, None], at[:, None].clone(), ve.mask.clone(),
                       torch.where(busy, torch.arange(self.slots), -1)), order, list(ve.running))
        ve.length[busy] += 1
        return forward

    def _start_chunked_turn(self, ve: RowFlight) -> None:
        """Stage 0's turn of ``ve`` under a chunk budget (module doc, Chunked prefill): the chunks
        ``ChunkedPrefill._chunk_plan`` gives it (its filling sequences' next, then the newcomers'
        first), the turn's forwards its running rows' decode, then one step per chunk over every
        row writing the chunk's row only (a newcomer's row taken at its first chunk); only the
        chunks that end a prompt give a token."""
        admitted, chunks = self._chunk_plan(ve)
        if not chunks and not ve.running:
            return
        forwards = [self._decode_forward(ve)] if ve.running else []
        every = lambda t: t[None].expand(self.slots, -1).contiguous()   # noqa: E731
        for seq, start, end in chunks:
            if start == 0:
                row = ve.rows.index(None)
                ve.rows[row] = seq
                ve.mask[row] = 0
            else:
                row = _row_of(ve, seq)
            ve.mask[row, start:end] = 1
            ve.length[row] = end
            ids, pos, slots = row_chunk(torch.tensor(seq.prompt[start:end]), start, self.prefill_len, self.max_len)
            rows = torch.full((self.slots,), -1)
            rows[row] = row
            last = end == len(seq.prompt)
            forwards.append((self.prefill_len, (every(ids), every(pos), every(slots), ve.mask.clone(), rows),
                             [row] if last else [], [seq] if last else []))
        ve.admitted, ve.chunks, ve.forwards, ve.tokens = admitted, chunks, forwards, []
        ve.turns += 1

    def _work(self, ve: RowFlight) -> None:
        """This stage's forwards of ``ve``'s turn; on the last stage, the turn's tokens chosen."""
        for seq_len, inputs, at, seqs in ve.forwards:
            self.calls[seq_len] += 1
            logits, ve.cache = self.runner.forward(seq_len, inputs, ve.cache)
            if logits is not None and seqs:   # (a chunk that does not end its prompt gives no token)
                ve.tokens += self._pick(logits[at], seqs)

    def _end_turn(self, ve: RowFlight) -> list[Sequence]:
        """``ve``'s turn done on every stage: the last stage's tokens of its newcomers and running
        rows broadcast and appended; finished rows free, the other newcomers join. With a chunk
        budget the newcomers are the prompts whose last chunk ran; the others go on filling."""
        if self.chunk is not None:
            ends = [s for s, _, end in ve.chunks if end == len(s.prompt)]
            seqs = ve.running + ends   # the order of the turn's forwards
            ve.filling = [s for s, _, end in ve.chunks if end < len(s.prompt)]
        else:
            ends = ve.admitted
            seqs = ve.admitted + ve.running   # the order of the turn's forwards
        mine = torch.tensor(ve.tokens, dtype=torch.int64) if self.runner.last else None
        tokens = self.runner.share_tokens(mine, len(seqs)).tolist()
        for seq, token in zip(seqs, tokens):
            self._append(seq, token)
        now = time.perf_counter()
        finished = []
        for seq in ends:
            seq.first = now
        for seq in ve.running + ends:
            if seq.finished:
                seq.done = now
                finished.append(seq)
                ve.rows[_row_of(ve, seq)] = None
        ve.running = [s for s in ve.running + ends if not s.finished]
        ve.admitted, ve.chunks, ve.forwards, ve.tokens = None, [], [], []
        return finished


__all__ = ["RowFlight", "RowStagesInFlight"]
