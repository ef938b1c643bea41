"""Pipeline stages in flight in the continuous-batching engine (pp > 1): ``VirtualEngine`` and
``StagesInFlight``, the part of autopar/inference/iteration_engine.py ``IterationEngine`` that
runs a step as one tick of the stages.

**Stages** (pp > 1): each rank holds its stage's decoder layers only, the others ``Skip``
(autopar/inference/pp_stages.py, as the static engine), and hooks pass the hidden states from stage
to stage. The replica keeps ``pp`` micro-batches in flight, one per stage, as the planner prices
it (autopar/inference/continuous.py, "Pipeline stages in flight"): ``pp`` virtual engines
(``VirtualEngine``), each with its own running sequences, batched cache of the stage's layers and
mask, ``slots`` and ``kv_tokens // pp`` of the pool, taking requests from the replica's one
waiting queue. A ``step()`` is one *tick* t:

1. virtual engine t mod pp, whose tokens are known, starts its *turn* at stage 0: it admits waiting
   sequences as above (oldest first, the first that does not fit blocking the ones behind it);
2. stage s works on the turn of virtual engine (t - s) mod pp, if it has one: its newcomers'
   prefills one by one, then one decode step of its running rows (the forwards of an iteration
   above, in that order), taking each forward's hidden states from what stage s - 1 sent in the
   previous tick and sending its own on with ``isend`` (pp_stages.py ``StageLink``, in flight);
3. each stage waits for its previous tick's sends (the next stage received them in this tick, so
   no stage waits on the next one within a tick), then the last stage's last-position logits of
   the turn it finished (virtual engine (t + 1) mod pp) are broadcast over the pipeline, and every
   rank ends that turn: the same tokens chosen (``next_tokens``), the same rows retired, the
   newcomers that go on joining the batched cache. Its next turn is the next tick's, at stage 0.

So a virtual engine's turn is one pass through the stages, pp ticks, and the stages work at once
on different virtual engines; a tick lasts as long as its slowest stage's work (the broadcast
joins the stages), so one stage's long prefill holds the others back (which the simulation leaves
out). A newcomer's first token is known only at the end of its turn, so it
decodes from its virtual engine's next turn (with pp = 1 it decodes in the iteration of its
prefill). Every rank runs the same bookkeeping of all virtual engines (rank 0's broadcast requests
added in the same order before each tick) and only its own stage's forwards; ``iterations``
counts the ticks with work, ``overlaps`` those in which two or more stages worked, and a
virtual engine's ``turns`` its turns. ``running`` is every virtual engine's running and admitted
sequences. Each cache (the batched one and a newcomer's prefill) has one entry per layer, those of
other stages' layers pointing at one of the stage's own (``share_cache_layers``), so the lengths
and mask sizes the model reads are right on every stage; joining and retiring rows touch each of
the stage's own layers once.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from autopar.inference.sequence import Sequence


@dataclass
class VirtualEngine:
    """One micro-batch of a pipelined replica (module doc): its running sequences (row i of
    ``cache``, this stage's layers, is ``running[i]``) under ``mask``, and its turn in flight:
    ``admitted`` (the sequences it prefills in this turn; None: no turn in flight) with every running
    row decoding one token. With a chunk budget, ``chunks``: the turn's prompt chunks (seq, start,
    end), and ``filling``: the sequence part-way through its prefill (autopar/inference/iteration_chunks.py).
    ``turns``: turns it has started."""
    running: list = field(default_factory=list)
    cache: object = None
    mask: torch.Tensor | None = None
    admitted: list | None = None
    turns: int = 0
    chunks: list = field(default_factory=list)
    filling: list = field(default_factory=list)


def begin_tick(engine):
    """The start of tick t of ``engine`` (its ``pp`` virtual engines ``flights``, either backend):
    virtual engine t mod pp starts its turn at stage 0 (``engine._start_turn``); returns (the
    virtual engine at this rank's stage, the one at the last stage), or None when no stage has a
    turn to work on; counts the tick in ``ticks`` and ``iterations``, and in ``overlaps`` when two or
    more stages work."""
    pp, t = engine.pp, engine.ticks
    engine._start_turn(engine.flights[t % pp])
    at = [engine.flights[(t - s) % pp] for s in range(pp)]   # the virtual engine at each stage
    working = sum(ve.admitted is not None for ve in at)
    if not working:
        return None
    engine.ticks += 1
    engine.iterations += 1
    engine.overlaps += working > 1
    return at[engine.stage], at[-1]


class StagesInFlight:
    """``IterationEngine``'s pp > 1 steps (module doc): ``_fly`` sets the virtual engines up,
    ``step`` runs ``_tick``, ``abort`` ``_abort_flights``."""

    def _fly(self, pp: int, link, received) -> None:
        """Run ``pp`` virtual engines in flight (module doc), each with ``slots`` and
        ``kv_tokens // pp`` of the pool; ``link``: this rank's StageLink (pp_stages.py);
        ``received``: a stage before the last's ReceivedLogits head (None on the last)."""
        self.pp, self.link = pp, link
        self.flights = [VirtualEngine() for _ in range(pp)]
        if self.kv_tokens is not None:
            self.kv_tokens //= pp
        self.vocab = received.vocab if received is not None else None
        self.dtype = self.model.get_input_embeddings().weight.dtype
        link.in_flight = True

    def _abort_flights(self) -> list[Sequence]:
        """Empty every virtual engine and forget the sends in flight; returns what was running or
        waiting. Taken from the virtual engines themselves, not ``running`` (set at a tick's end):
        a tick that fails after its turn admitted waiting sequences would otherwise lose them,
        their requests never answered."""
        out, seen = [], set()
        in_flight = [s for ve in self.flights
                     for s in ve.running + (ve.admitted or []) + ve.filling + [c[0] for c in ve.chunks]]
        for seq in self.running + in_flight + self.waiting:
            if id(seq) not in seen:
                seen.add(id(seq))
                out.append(seq)
        self.flights = [VirtualEngine() for _ in range(self.pp)]
        self.running, self.waiting = [], []
        self.link.drop()
        return out

    def _tick(self) -> list[Sequence]:
        """One tick (module doc): the virtual engine whose tokens are known starts its turn
        at stage 0; this rank's stage works on the turn that has reached it; the last stage's
        logits of the turn it finished reach every stage, and that turn ends (every rank chooses
        the same tokens and retires and joins the same rows). Returns the sequences that finished."""
        at = begin_tick(self)
        if at is None:
            return []
        mine, end = at
        logits = self._work(mine) if mine.admitted is not None else None
        self.link.wait_sends()
        finished = []
        if end.admitted is not None:
            rows = len(self._turn_rows(end))
            shared = self.link.share_logits(logits, rows, self.vocab, self.dtype, self.device) if rows else None
            finished = self._end_turn(end, shared)
        self.running = [s for ve in self.flights for s in ve.running + (ve.admitted or []) + ve.filling]
        return finished

    def _start_turn(self, ve: VirtualEngine) -> None:
        """Stage 0's turn of ``ve``: the waiting sequences it admits (shared queue, in order), with
        its running rows decoding (with a chunk budget: its prompt chunks); no turn when it has
        neither."""
        if self.chunk is not None:
            ve.admitted, ve.chunks = self._chunk_plan(ve)
            if ve.chunks or ve.running:
                ve.turns += 1
            else:
                ve.admitted = None
            return
        admitted = self._admissions(ve.running)
        now = time.perf_counter()
        for i, seq in enumerate(admitted):
            seq.admitted = now
            seq.running_at_admission = len(ve.running) + i + 1
        if admitted or ve.running:
            ve.admitted = admitted
            ve.turns += 1

    def _work(self, ve: VirtualEngine) -> torch.Tensor | None:
        """This stage's forwards of ``ve``'s turn: each newcomer's prefill, one by one, then the
        decode step of its running rows. Their last-position logits [newcomers + rows, V] on the
        last stage; None on the others (their heads' outputs are placeholders, never read). With a
        chunk budget: the decode step first, then each chunk; the logits of the decode rows and of
        the chunks that end a prompt (``_turn_rows``), or None."""
        if self.chunk is not None:
            out = [self._decode_forward(ve)[0]] if ve.running else []
            for seq, start, end in ve.chunks:
                logits = self._chunk_forward(seq, start, end)
                if end == len(seq.prompt):
                    out.append(logits)
        else:
            out = [self._prefill_forward(seq) for seq in ve.admitted]
            if ve.running:
                out.append(self._decode_forward(ve)[0])
        return torch.cat(out) if out and self.stage == self.pp - 1 else None

    def _turn_rows(self, ve: VirtualEngine) -> list[Sequence]:
        """The sequences whose next token ``ve``'s turn gives, in the order of its logits rows."""
        if self.chunk is not None:
            return ve.running + [s for s, _, end in ve.chunks if end == len(s.prompt)]
        return ve.admitted + ve.running

    def _end_turn(self, ve: VirtualEngine, logits: torch.Tensor | None) -> list[Sequence]:
        """``ve``'s turn done on every stage: its newcomers' first tokens and its rows' next ones
        from ``logits``; finished rows leave, the other newcomers join (their prefilled caches).
        With a chunk budget the newcomers are the prompts whose last chunk ran."""
        seqs = self._turn_rows(ve)
        if seqs:
            for seq, token in zip(seqs, self._next_tokens(logits, seqs)):
                self._append(seq, token)
        if self.chunk is not None:
            finished = []
            if ve.running:
                ve.mask = torch.cat([ve.mask, ve.mask.new_ones(len(ve.running), 1)], dim=1)
                finished += self._leave(ve)
            now = time.perf_counter()
            for seq, _, end in ve.chunks:
                if end == len(seq.prompt):
                    finished += self._prefilled(seq, now, ve)
            ve.filling = [s for s, _, end in ve.chunks if end < len(s.prompt)]
            ve.admitted, ve.chunks = None, []
            return finished
        finished = []
        if ve.running:
            ve.mask = torch.cat([ve.mask, ve.mask.new_ones(len(ve.running), 1)], dim=1)
            finished += self._leave(ve)
        now = time.perf_counter()
        for seq in ve.admitted:
            finished += self._prefilled(seq, now, ve)
        ve.admitted = None
        return finished


__all__ = ["StagesInFlight", "VirtualEngine", "begin_tick"]
