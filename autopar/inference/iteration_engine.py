"""Continuous (iteration-level) batching on a real model: ``IterationEngine`` and its ``step``.

The engine holds up to ``slots`` running sequences (the plan's ``batch_size``) and a queue of
waiting ones (``add``). One ``step()`` is one iteration, as autopar/inference/continuous.py prices
it (with pp > 1, one tick of the stages in flight: **Stages**):

1. **admit**: waiting sequences join, oldest first, while a slot is free and, when the plan gives
   ``kv_cache_tokens_per_replica``, while the KV-cache tokens the running sequences hold (each its
   prompt plus all the tokens it may generate, from admission) stay within that pool; the first that
   does not fit blocks the ones behind it. Each admitted prompt is prefilled **on its own** (a batch
   of one, no padding) into a fresh cache, the LM head on its last position only (``logits_to_keep``),
   and its first new token sampled; a sequence that wanted
   one token is finished there. Decoding pauses meanwhile.
2. **decode**: one forward step of every running sequence together, each at its own position.
3. **retire**: a sequence that has its ``max_new_tokens``, or has just generated an end-of-sequence
   token of the model's generation config (kept, as ``generate`` keeps it), leaves; its slot is free for the next
   iteration. ``step`` returns the sequences finished in this iteration.

**KV layout.** The running sequences share one batched transformers ``DynamicCache``: row ``i`` of
every layer's keys/values [rows, kv_heads, width, head_dim] is running sequence ``i``'s context,
right-aligned (its tokens are the last ``length`` columns; the columns before are padding) under a
[rows, width] attention mask of the real columns. A decode step feeds each row's last token with
``position_ids`` = that row's own length (so rotary / learned positions are those the sequence would
have alone), ``cache_position`` = the shared width and the mask extended by one column; the cache
appends one column to every row. Admission left-pads the newcomer's prefilled cache (or the running
rows, if its prompt is longer) to the common width and concatenates it as a new row; retirement
drops the row and trims leading columns that are padding in every remaining row. Padded columns are
masked to an exact zero weight, so each sequence's tokens are those of the model's ``generate`` on
its prompt alone (tests/inference/test_iteration_engine.py).

**Cost.** The cache is rows x the longest running context, not the sum of the contexts: a long
sequence running next to short ones makes them carry padding (a paged pool would not); a
``DynamicCache`` grows by concatenation (a copy of the cache per step, as Hugging Face's own
dynamic decoding); admission and retirement copy the cache once more. Prefills run one prompt at a
time. The admission budget is the plan's token pool (the planner's accounting), not these bytes.

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

**Sampling.** Greedy unless a sequence's ``sampling`` has ``temperature`` > 0 (``top_p``,
``top_k``, ``seed``: engine.py ``check_sampling``): each sequence samples from its own
``torch.Generator`` seeded with its ``seed``, after Hugging Face's temperature, top-k and top-p
warpers (unset top_k / top_p: the model's generation config, as its ``generate`` does). Tokens are
chosen from the last position's logits by autopar/inference/vocab_parallel.py ``next_tokens``,
one call for every row of a step, on every rank.

**Vocabulary-parallel head.** With tp > 1 an untied head returns each rank's slice of the
vocabulary (``compile_inference`` builds it so: no gather of the logits); the ranks choose
each row's greedy token by a distributed argmax (2 numbers per row per rank cross the
tensor-parallel group) and a sampled one from a distributed top-k (2 k per row per rank), the
whole last-position row gathered only for sampling with top_k 0. One process (or a tied head,
whole on every rank) runs the same functions on a shard of one, so tp ranks draw the tokens one
process draws (tests/inference/test_vocab_parallel.py). ``vocab_shard.gathered`` counts the
elements gathered.

**Ranks.** With tp > 1 every rank holds its tensor-parallel shard (``from_plan`` builds it as
``compile_inference`` does) and runs the same iterations: on its own, SPMD, when every rank adds
the same requests; in the server, ``LeaderIterations`` (rank 0) decides each iteration's admissions
and broadcasts the requests added since the last step before it, and ``follow_iterations`` (every
other rank) adds those and steps. One broadcast of Python objects per iteration (on a group of
its own, ``engine.jobs``, with no timeout: an idle server's ranks wait there for the next).

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

**Replicas** (dp > 1): replica ``r`` is ranks ``r*tp*pp`` to ``(r+1)*tp*pp - 1``, stage-major (as
``compile_inference`` lays them out) and runs its own engine on its own ``slots`` and KV-token pool.
Rank 0 (replica 0's first rank) checks each new request and assigns it, when it arrives, to the
replica with the fewest requests running or waiting (its own count: those assigned and not yet
answered), ties to the lowest index; the request then waits in that replica's queue only. (The
planner's simulation, autopar/inference/continuous.py, keeps one shared queue that each replica
takes from in arrival order when it has room: there a request never waits on a busy replica while
another has a free slot; here it may, until the requests ahead of it on its replica finish.) Each
iteration every rank of every replica takes part, with nothing to do or not: rank 0 broadcasts the
new requests with their replicas (the same one broadcast), each replica adds its own and steps (an
idle engine's step does nothing), and a gather of Python objects over the world group brings the
finished sequences of every replica's first rank (stage 0, tp rank 0) to rank 0: their tokens, whether they stopped, and
their wait, prefill and decode seconds (rank 0 dates them back from when it received them). A step
that fails on any replica fails the whole iteration: rank 0 raises after the gather, and its
``abort`` empties every replica.

**Failures.** A step that fails on a replica of one rank (tp = pp = 1) fails that iteration's
requests and the replicas go on (above). On a replica of several ranks a failure mid-forward
leaves its peers in a collective the failed rank will never join: the ranks are out of step and
nothing more can run. So there (and whenever a collective itself fails: a peer gone, or the
process group's timeout passed) rank 0 raises ``RanksOutOfStep`` and keeps it (``broken``: every
later ``add`` and ``step`` raises it, nothing more is broadcast; the server answers 503), and a
following rank raises it out of ``follow_iterations`` (its process ends; ``autopar serve`` then
stops). The groups ``from_plan`` builds (tp, pipeline) take the default group's timeout
(``init_process_group(timeout=...)``, ``autopar serve --collective-timeout``, 120 s by default),
not torch's 30 minutes, so a peer waiting in an all-reduce fails within it: never a hang. A step
slower than that timeout (on a replica, or rank 0 waiting in the gather for the slowest) is a
failure too.
"""
from __future__ import annotations

import inspect
import itertools
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from autopar.errors import ExecutionError, PlanError
from autopar.inference.engine import check_sampling
from autopar.inference.model_shape import causal_lm
from autopar.inference.vocab_parallel import VocabShard, next_tokens


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


@dataclass
class VirtualEngine:
    """One micro-batch of a pipelined replica (module doc, Stages): its running sequences (row i of
    ``cache``, this stage's layers, is ``running[i]``) under ``mask``, and its turn in flight:
    ``admitted`` (the sequences it prefills in this turn; None: no turn in flight) with every running
    row decoding one token. With a chunk budget, ``chunks``: the turn's prompt chunks (seq, start,
    end), and ``filling``: the sequence part-way through its prefill (module doc, Chunked prefill).
    ``turns``: turns it has started."""
    running: list = field(default_factory=list)
    cache: object = None
    mask: torch.Tensor | None = None
    admitted: list | None = None
    turns: int = 0
    chunks: list = field(default_factory=list)
    filling: list = field(default_factory=list)


class IterationEngine:
    """Continuous batching of ``model`` (module doc). ``slots``: sequences decoded together (the
    plan's batch_size); ``prompt_len`` / ``max_new_tokens``: the longest prompt and output a
    sequence may have; ``kv_tokens``: the KV-cache token pool admission respects (None: slots only);
    ``prefill_chunk``: tokens an iteration runs, decodes first and prompt chunks in the rest (module
    doc, Chunked prefill; None: each admitted prompt is prefilled whole)."""

    def __init__(self, model, slots: int, prompt_len: int, max_new_tokens: int, kv_tokens: int | None = None,
                 prefill_chunk: int | None = None):
        if slots < 1:
            raise PlanError(f"an iteration engine needs at least one slot, got {slots}")
        if prefill_chunk is not None:
            if not isinstance(prefill_chunk, int) or isinstance(prefill_chunk, bool) or prefill_chunk < 1:
                raise PlanError(f"prefill chunk={prefill_chunk!r} must be a positive integer (tokens an "
                                f"iteration runs)")
            if slots > prefill_chunk:
                raise PlanError(f"{slots} slots are more than the prefill chunk of {prefill_chunk} tokens: each "
                                f"running sequence's decode takes a token of an iteration's budget; use a chunk of "
                                f"at least {slots} tokens or fewer slots")
        self.chunk = prefill_chunk
        self.filling: list[Sequence] = []     # chunked prefill (pp = 1): the sequence part-way through its prefill
        self.most_tokens = 0                  # chunked prefill: the most tokens one iteration (or turn) ran
        self.model = causal_lm(model)
        self.slots, self.prompt_len, self.max_new_tokens = slots, prompt_len, max_new_tokens
        self.kv_tokens = kv_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []     # row i of the cache is running[i]
        self.admitting: list[Sequence] = []   # admitted by the step under way (abort hands them back too)
        self.cache = None
        self.mask: torch.Tensor | None = None   # [rows, width] 1 on real columns
        self.iterations = 0
        self.ids = itertools.count()
        self.replica, self.replicas, self.tp_rank = 0, 1, 0   # from_plan: this rank's place among replicas
        self.stage, self.bounds = 0, None     # from_plan with pp > 1: this rank's stage and its [first, end) layers
        self.replica_ranks = 1                # ranks of one replica (tp x pp)
        self.jobs = None                      # from_plan: the group rank 0's jobs travel on (no collective timeout)
        self.vocab_shard = VocabShard()       # from_plan with tp > 1: this rank's slice of the head's vocabulary
        self.pp, self.flights, self.link = 1, [], None   # from_plan with pp > 1: the virtual engines (Stages)
        self.ticks = self.overlaps = 0        # pp > 1: ticks run; those in which two or more stages worked
        gc = getattr(self.model, "generation_config", None)
        self.default_top_k = getattr(gc, "top_k", None) or 0
        self.default_top_p = getattr(gc, "top_p", None) or 1.0
        eos = getattr(gc, "eos_token_id", None)
        self.eos = set() if eos is None else {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
        try:
            self.device = next(self.model.parameters()).device
        except StopIteration:
            self.device = torch.device("cpu")
        # a prefill needs the last position's logits only (as ``generate`` asks, and as priced)
        keeps = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.last_logits = {"logits_to_keep": 1} if keeps else {}

    @classmethod
    def from_plan(cls, model, plan, weights: str | None = None, collective_timeout=None) -> "IterationEngine":
        """This rank's engine of a plan: the model built (its tp shard, weights read, dtype) as
        ``compile_inference`` builds it, with the plan's slots (per replica), lengths and KV-token
        pool, and this rank's replica and stage (module doc). The tensor-parallel and pipeline groups
        it makes wait ``collective_timeout`` (a timedelta; ``autopar serve`` passes the default
        group's): a rank whose peer fails mid-forward fails after it, never waits for ever; rank 0's
        jobs travel on a group of their own without one (the other ranks wait there, however long
        the server is idle)."""
        from autopar.inference.engine import compile_inference
        built = compile_inference(model, plan=plan, weights=weights, collective_timeout=collective_timeout)
        chunk = plan.predictions.get("prefill_chunk") if plan.predictions.get("batching") == "chunked" else None
        engine = cls(built.model, plan.batch_size, plan.prompt_len, plan.max_new_tokens,
                     plan.predictions.get("kv_cache_tokens_per_replica"), chunk)
        engine.replica, engine.replicas, engine.tp_rank = built.replica, plan.dp, built.tp_rank
        engine.stage, engine.replica_ranks = built.stage, plan.tp * plan.pp
        engine.vocab_shard = built.vocab_shard
        if plan.pp > 1:
            engine.bounds = tuple(plan.stages[built.stage])
            engine._fly(plan.pp, built.stage_link, built.received)
        if _distributed():
            engine.jobs = dist.new_group(timeout=IDLE_TIMEOUT)
        return engine

    def _fly(self, pp: int, link, received) -> None:
        """Run ``pp`` virtual engines in flight (module doc, Stages), each with ``slots`` and
        ``kv_tokens // pp`` of the pool; ``link``: this rank's StageLink (pp_stages.py);
        ``received``: a stage before the last's ReceivedLogits head (None on the last)."""
        self.pp, self.link = pp, link
        self.flights = [VirtualEngine() for _ in range(pp)]
        if self.kv_tokens is not None:
            self.kv_tokens //= pp
        self.vocab = received.vocab if received is not None else None
        self.dtype = self.model.get_input_embeddings().weight.dtype
        link.in_flight = True

    # --- requests -----------------------------------------------------------------------------------

    def check(self, prompt: list[int], max_new_tokens: int) -> None:
        if not prompt:
            raise PlanError("a prompt is empty: give at least one token")
        if len(prompt) > self.prompt_len:
            raise PlanError(f"the prompt is {len(prompt)} tokens, more than the plan's prompt length "
                            f"{self.prompt_len}: plan for longer prompts")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise PlanError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if max_new_tokens > self.max_new_tokens:
            raise PlanError(f"max_new_tokens={max_new_tokens} is more than the plan's {self.max_new_tokens} "
                            f"(its KV cache holds no more)")
        if self.kv_tokens is not None and len(prompt) + max_new_tokens > self.kv_tokens:
            raise PlanError(f"the request needs {len(prompt) + max_new_tokens} KV-cache tokens, more than the "
                            f"plan's pool of {self.kv_tokens}" + (" per micro-batch in flight" if self.pp > 1 else ""))

    def add(self, prompt, max_new_tokens: int, sampling: dict | None = None, tag=None) -> Sequence:
        """Queue a request; it joins at the next ``step`` with room. PlanError for what the plan cannot run."""
        prompt = [int(t) for t in prompt]
        self.check(prompt, max_new_tokens)
        seq = Sequence(prompt, max_new_tokens, check_sampling(sampling), tag, next(self.ids),
                       added=time.perf_counter())
        if seq.sampling:
            seq.generator = torch.Generator(device=self.device).manual_seed(seq.sampling.get("seed", 0))
        self.waiting.append(seq)
        return seq

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.filling

    def abort(self) -> list[Sequence]:
        """Drop every running and waiting sequence (after a failed step); returns them."""
        if self.flights:
            out = self.running + self.waiting
            self.flights = [VirtualEngine() for _ in range(self.pp)]
            self.running, self.waiting = [], []
            self.link.drop()
            return out
        rows = {id(s) for s in self.running}
        out = self.running + [s for s in self.admitting + self.filling if id(s) not in rows] + self.waiting
        self.running, self.admitting, self.waiting, self.filling = [], [], [], []
        self.cache = self.mask = None
        return out

    # --- the iteration ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[Sequence]:
        """One iteration: admit, prefill the admitted, decode the running one token, retire the
        finished; returns the sequences that finished. With pp > 1, one tick (module doc, Stages)."""
        if self.flights:
            return self._tick()
        if self.chunk is not None:
            return self._chunked_step()
        finished = []
        self.admitting = self._admissions(self.running)
        for seq in self.admitting:
            self._prefill(seq)
            if seq.finished:
                seq.done = seq.first
                seq.cache = None   # it never joins the batched cache
                finished.append(seq)
            else:
                self._join(seq)
        if self.running:
            self._decode()
            self.iterations += 1
            now = time.perf_counter()
            keep = []
            for row, seq in enumerate(self.running):
                if seq.finished:
                    seq.done = now
                    finished.append(seq)
                else:
                    keep.append(row)
            if len(keep) < len(self.running):
                self._retire(keep)
        elif finished:
            self.iterations += 1
        self.admitting = []
        return finished

    def run_until_idle(self) -> list[Sequence]:
        """Step until nothing is running or waiting; the sequences in the order they finished."""
        return _run_until_idle(self)

    def _admissions(self, running: list[Sequence], budget: int | None = None) -> list[Sequence]:
        """The waiting sequences that join a batch of ``running`` ones (module doc, admit); with a
        ``budget`` of prompt tokens (chunked prefill), only while some of it is left."""
        held = sum(s.need for s in running)
        out = []
        while self.waiting and len(running) + len(out) < self.slots and (budget is None or budget > 0):
            seq = self.waiting[0]
            if self.kv_tokens is not None and held + seq.need > self.kv_tokens:
                break   # in order: the first that does not fit blocks the ones behind it
            held += seq.need
            out.append(self.waiting.pop(0))
            if budget is not None:
                budget -= len(seq.prompt)
        return out

    # --- chunked prefill ----------------------------------------------------------------------------

    def _chunk_plan(self, batch) -> tuple[list[Sequence], list[tuple]]:
        """The prompt chunks of ``batch``'s next iteration (the engine, or with pp > 1 a
        VirtualEngine's turn; module doc, Chunked prefill): its running rows' decodes take a token
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
        """One iteration under a chunk budget (pp = 1; module doc, Chunked prefill): the chunks
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

    def _leave(self, batch) -> list[Sequence]:
        """After a decode step of ``batch``'s rows: the finished leave (returned)."""
        now = time.perf_counter()
        finished, keep = [], []
        for row, seq in enumerate(batch.running):
            if seq.finished:
                seq.done = now
                finished.append(seq)
            else:
                keep.append(row)
        if len(keep) < len(batch.running):
            self._retire(keep, batch)
        return finished

    def _prefilled(self, seq: Sequence, now: float, batch=None) -> list[Sequence]:
        """``seq`` has its first token: finished there (returned), or it joins ``batch``'s cache."""
        seq.first = now
        if seq.finished:
            seq.done = now
            seq.cache = None
            return [seq]
        self._join(seq, batch)
        return []

    def _next_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """The next token of each of ``seqs`` from its row of last-position logits ([rows, V / tp]:
        this rank's slice of the vocabulary): greedy, or sampled as ``generate`` (module doc)."""
        return next_tokens(logits, [s.sampling for s in seqs], [s.generator for s in seqs], self.vocab_shard,
                           self.default_top_k, self.default_top_p)

    def _new_cache(self):
        """An empty DynamicCache; with pp > 1, one entry per layer, those of the other stages'
        layers pointing at one of this stage's own (pp_stages.py ``share_cache_layers``)."""
        from transformers import DynamicCache
        if self.bounds is None:
            return DynamicCache()
        from autopar.inference.pp_stages import share_cache_layers
        cache = DynamicCache(config=self.model.config)
        share_cache_layers(cache, self.model, self.bounds)
        return cache

    def _prefill(self, seq: Sequence) -> None:
        seq.admitted = time.perf_counter()
        seq.running_at_admission = len(self.running) + 1
        logits = self._prefill_forward(seq)
        self._append(seq, self._next_tokens(logits, [seq])[0])
        seq.first = time.perf_counter()

    def _prefill_forward(self, seq: Sequence) -> torch.Tensor:
        """``seq``'s prompt alone into a fresh cache (``seq.cache``): its last position's logits [1, V]."""
        seq.cache = self._new_cache()
        ids = torch.tensor([seq.prompt], dtype=torch.long, device=self.device)
        return self._forward(input_ids=ids, attention_mask=torch.ones_like(ids), cache=seq.cache,
                             **self.last_logits)[:, -1]

    def _forward(self, cache, **inputs) -> torch.Tensor:
        """The model's logits, ``cache`` (a DynamicCache) updated in place by the step."""
        try:
            out = self.model(**inputs, cache=cache, use_cache=True)
        except TypeError:   # transformers before the ``cache`` argument
            out = self.model(**inputs, past_key_values=cache, use_cache=True)
        return out.logits

    def _join(self, seq: Sequence, batch=None) -> None:
        """The newcomer's prefilled cache becomes the last row of the batched cache (module doc) of
        ``batch``: the engine, or with pp > 1 a VirtualEngine."""
        batch = self if batch is None else batch
        new = seq.cache
        del seq.cache
        n = len(seq.prompt)
        if batch.cache is None:
            batch.cache = new
            batch.mask = torch.ones(1, n, dtype=torch.long, device=self.device)
            batch.running = [seq]
            return
        width = batch.mask.shape[1]
        to = max(width, n)
        for old, add in zip(_own_layers(batch.cache), _own_layers(new)):
            old.keys = torch.cat([_pad_left(old.keys, to), _pad_left(add.keys, to)])
            old.values = torch.cat([_pad_left(old.values, to), _pad_left(add.values, to)])
        row = torch.zeros(1, to, dtype=torch.long, device=self.device)
        row[:, to - n:] = 1
        batch.mask = torch.cat([torch.nn.functional.pad(batch.mask, (to - width, 0)), row])
        batch.running.append(seq)

    def _decode(self) -> None:
        logits, self.mask = self._decode_forward(self)
        for seq, token in zip(self.running, self._next_tokens(logits, self.running)):
            self._append(seq, token)

    def _decode_forward(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of ``batch``'s running rows (its cache grows by a column): their
        last-position logits [rows, V] and the mask extended by that column."""
        rows, width = batch.mask.shape
        ids = torch.tensor([[s.tokens[-1]] for s in batch.running], dtype=torch.long, device=self.device)
        lengths = batch.mask.sum(-1)                       # each row's real tokens: its next position
        mask = torch.cat([batch.mask, batch.mask.new_ones(rows, 1)], dim=1)
        logits = self._forward(input_ids=ids, attention_mask=mask, position_ids=lengths[:, None],
                               cache_position=torch.tensor([width], device=self.device), cache=batch.cache)[:, -1]
        return logits, mask

    def _append(self, seq: Sequence, token: int) -> None:
        seq.tokens.append(token)
        seq.stopped = token in self.eos

    def _retire(self, keep: list[int], batch=None) -> None:
        """Keep the rows ``keep`` of ``batch`` (the engine, or a VirtualEngine) only."""
        batch = self if batch is None else batch
        if not keep:
            batch.cache = batch.mask = None
            batch.running = []
            return
        index = torch.tensor(keep, device=self.device)
        batch.mask = batch.mask[index]
        real = batch.mask.any(0).nonzero()
        start = int(real[0]) if len(real) else batch.mask.shape[1]   # leading padding in every row goes
        batch.mask = batch.mask[:, start:]
        for layer in _own_layers(batch.cache):
            layer.keys = layer.keys[index, :, start:]
            layer.values = layer.values[index, :, start:]
        batch.running = [batch.running[i] for i in keep]

    # --- pipeline stages in flight (pp > 1) ---------------------------------------------------------

    def _tick(self) -> list[Sequence]:
        """One tick (module doc, Stages): the virtual engine whose tokens are known starts its turn
        at stage 0; this rank's stage works on the turn that has reached it; the last stage's
        logits of the turn it finished reach every stage, and that turn ends (every rank chooses
        the same tokens and retires and joins the same rows). Returns the sequences that finished."""
        pp, t = self.pp, self.ticks
        self._start_turn(self.flights[t % pp])
        at = [self.flights[(t - s) % pp] for s in range(pp)]   # the virtual engine at each stage
        working = sum(ve.admitted is not None for ve in at)
        if not working:
            return []
        self.ticks += 1
        self.iterations += 1
        self.overlaps += working > 1
        mine, end = at[self.stage], at[-1]
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

    def _work(self, ve: VirtualEngine) -> torch.Tensor:
        """This stage's forwards of ``ve``'s turn: each newcomer's prefill, one by one, then the
        decode step of its running rows. Their last-position logits [newcomers + rows, V] (read on
        the last stage only). With a chunk budget: the decode step first, then each chunk; the
        logits of the decode rows and of the chunks that end a prompt (``_turn_rows``), or None."""
        if self.chunk is not None:
            out = [self._decode_forward(ve)[0]] if ve.running else []
            for seq, start, end in ve.chunks:
                logits = self._chunk_forward(seq, start, end)
                if end == len(seq.prompt):
                    out.append(logits)
            return torch.cat(out) if out else None
        out = [self._prefill_forward(seq) for seq in ve.admitted]
        if ve.running:
            out.append(self._decode_forward(ve)[0])
        return torch.cat(out)

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
        now = time.perf_counter()
        finished = []
        if ve.running:
            ve.mask = torch.cat([ve.mask, ve.mask.new_ones(len(ve.running), 1)], dim=1)
            keep = []
            for row, seq in enumerate(ve.running):
                if seq.finished:
                    seq.done = now
                    finished.append(seq)
                else:
                    keep.append(row)
            if len(keep) < len(ve.running):
                self._retire(keep, ve)
        for seq in ve.admitted:
            seq.first = now
            if seq.finished:
                seq.done = now
                seq.cache = None
                finished.append(seq)
            else:
                self._join(seq, ve)
        ve.admitted = None
        return finished


class RanksOutOfStep(ExecutionError, RuntimeError):
    """A step failed where the ranks may no longer run the same collectives (a failed step of a
    replica of several ranks, or a failed collective): nothing can be served any more; the server
    answers 503 with this message (server.py); on a following rank ``autopar serve`` (under torchrun
    too) exits with it as its error."""
    http_status = 503


class LeaderIterations:
    """Rank 0's ``IterationEngine`` when the plan has tp ranks or replicas: every ``step`` first
    broadcasts the requests added since the last one, with the replica each was assigned to, so the
    ranks of each replica admit the same requests in the same order and run the same iteration
    (``follow_iterations`` on the other ranks); with replicas it then gathers every replica's
    finished sequences (module doc). Requests are checked on rank 0 (``add`` raises there, and
    nothing is sent). On one process it is the engine itself. ``served[r]``: sequences replica
    ``r`` finished. ``broken``: the RanksOutOfStep after which every ``add`` and ``step`` raises it
    and nothing more is broadcast (module doc, Failures)."""

    def __init__(self, engine: IterationEngine):
        self.engine = engine
        self.replicas = engine.replicas
        self.pending: list[tuple] = []
        self.remote: list[dict] = [{} for _ in range(self.replicas)]   # replica -> id -> Sequence (not 0)
        self.served = [0] * self.replicas
        self.limbo: list[Sequence] = []   # finished in a failed iteration: handed back by abort
        self.ids = itertools.count()
        self.lock = threading.Lock()   # a step in the server's worker thread, stop on its main thread
        self.broken: RanksOutOfStep | None = None

    def __getattr__(self, name):       # running, waiting, iterations, slots, ...
        return getattr(self.engine, name)

    @property
    def idle(self) -> bool:
        return self.engine.idle and not any(self.remote)

    def load(self, replica: int) -> int:
        """Requests assigned to ``replica`` and not yet finished (running or waiting)."""
        if replica == 0:
            return len(self.engine.running) + len(self.engine.filling) + len(self.engine.waiting)
        return len(self.remote[replica])

    def _check_broken(self) -> None:
        if self.broken is not None:
            raise RanksOutOfStep(str(self.broken))

    def _break(self, error: BaseException, what: str) -> RanksOutOfStep:
        self.broken = RanksOutOfStep(
            f"the ranks are out of step after {what} (iteration {self.engine.iterations}) failed: "
            f"{type(error).__name__}: {error}; this server cannot serve any more: restart autopar serve")
        return self.broken

    def add(self, prompt, max_new_tokens: int, sampling: dict | None = None, tag=None) -> Sequence:
        self._check_broken()
        replica = min(range(self.replicas), key=lambda r: (self.load(r), r))
        if replica == 0:
            seq = self.engine.add(prompt, max_new_tokens, sampling, tag)
            self.pending.append((0, seq.prompt, max_new_tokens, sampling, None))
            return seq
        prompt = [int(t) for t in prompt]
        self.engine.check(prompt, max_new_tokens)
        seq = Sequence(prompt, max_new_tokens, check_sampling(sampling), tag, next(self.ids),
                       added=time.perf_counter())
        self.remote[replica][seq.id] = seq
        self.pending.append((replica, seq.prompt, max_new_tokens, sampling, seq.id))
        return seq

    def step(self) -> list[Sequence]:
        with self.lock:
            self._check_broken()
            try:
                _send(("step", self.pending), self.engine.jobs)
            except Exception as e:  # noqa: BLE001 - a failed broadcast: the ranks are out of step
                raise self._break(e, "broadcasting an iteration's requests") from e
            self.pending = []
            error, finished = None, []
            try:
                finished = self.engine.step()
            except Exception as e:  # noqa: BLE001 - rank 0 still takes part in the gather, then raises
                if self.engine.replica_ranks > 1 or collective_error(e):
                    raise self._break(e, "rank 0's step") from e
                error = e
            self.served[0] += len(finished)
            if self.replicas == 1:
                if error is not None:
                    raise error
                return finished
            reports = [None] * dist.get_world_size()
            try:
                dist.gather_object(None, reports, dst=0)
            except Exception as e:  # noqa: BLE001 - a replica's rank failed or is gone
                raise self._break(e, "gathering the replicas' finished sequences") from e
            now = time.perf_counter()
            for report in reports:
                if report is None:
                    continue
                replica, done, failed = report
                for gid, tokens, stopped, wait, prefill, decode, running in done:
                    seq = self.remote[replica].pop(gid)
                    seq.tokens, seq.stopped, seq.running_at_admission = list(tokens), stopped, running
                    seq.done = now
                    seq.first = now - decode
                    seq.admitted = max(seq.first - prefill, seq.added)
                    finished.append(seq)
                    self.served[replica] += 1
                if failed and error is None:
                    error = RuntimeError(f"replica {replica} failed its step: {failed}")
            if error is not None:
                self.limbo = finished   # answered by the abort that follows, with the error
                raise error
            return finished

    def run_until_idle(self) -> list[Sequence]:
        return _run_until_idle(self)

    def abort(self) -> list[Sequence]:
        """Empty every replica (after a failed step; broadcast unless the ranks are out of step);
        returns the sequences dropped."""
        with self.lock:
            if self.broken is None:
                _send(("abort", []), self.engine.jobs)
            self.pending = []
            out = self.engine.abort() + self.limbo
            self.limbo = []
            for seqs in self.remote:
                out += list(seqs.values())
                seqs.clear()
            return out

    def stop(self) -> None:
        with self.lock:
            if self.broken is None:
                _send((STOP, []), self.engine.jobs)


STOP = "stop"
IDLE_TIMEOUT = timedelta(days=365)  # rank 0's jobs: the other ranks wait for the next however long


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _send(job: tuple, group=None) -> None:
    if _distributed():
        dist.broadcast_object_list([job], src=0, group=group)


def collective_error(e: BaseException) -> bool:
    """A failed collective or point-to-point transfer (a peer failed, is gone or timed out)."""
    text = str(e)
    return isinstance(e, dist.DistError) or any(k in text for k in (
        "Connection closed by peer", "Connection reset", "Timed out", "timed out", "Gloo", "gloo"))


def follow_iterations(engine: IterationEngine) -> int:
    """A rank other than 0: add the requests rank 0 broadcasts for this rank's replica and run each
    of its iterations, until it says stop; returns the number of iterations run. With replicas,
    each iteration ends in the gather to rank 0 (this replica's first rank reports its finished
    sequences; the others, nothing). A failed step of a one-rank replica empties this rank's
    engine, as rank 0 empties its own; one of a replica of several ranks (or a failed collective)
    raises RanksOutOfStep: its peers may be waiting in a collective it will never join (module
    doc, Failures)."""
    steps = 0
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=engine.jobs)
        kind, adds = box[0]
        if kind == STOP:
            return steps
        if kind == "abort":
            engine.abort()
            continue
        finished, failed = [], None
        try:
            for replica, prompt, new, sampling, gid in adds:
                if replica == engine.replica:
                    engine.add(prompt, new, sampling, tag=gid)
            finished = engine.step()
        except Exception as e:  # noqa: BLE001 - rank 0 fails the same requests and tells the clients
            engine.abort()
            if engine.replica_ranks > 1 or collective_error(e):
                raise RanksOutOfStep(
                    f"rank {dist.get_rank()} (replica {engine.replica}, stage {engine.stage}, tp rank "
                    f"{engine.tp_rank}) failed in iteration {steps}: {type(e).__name__}: {e}; its replica's ranks "
                    f"may be out of step, so it stops (rank 0 answers 503 from now on)") from e
            failed = f"{type(e).__name__}: {e}"
        steps += 1
        if engine.replicas > 1:
            report = None
            if engine.tp_rank == 0 and engine.stage == 0:
                report = (engine.replica, [(s.tag, s.tokens, s.stopped, s.admitted - s.added, s.first - s.admitted,
                                            max(s.done - s.first, 0.0), s.running_at_admission) for s in finished],
                          failed)
            dist.gather_object(report, None, dst=0)


def _run_until_idle(stepper) -> list[Sequence]:
    """``stepper.step()`` until ``stepper.idle``; the sequences in the order they finished."""
    out = []
    while not stepper.idle:
        out += stepper.step()
    return out


def _own_layers(cache) -> list:
    """The cache's layers, each once (with pp > 1 the other stages' entries point at this stage's)."""
    seen, out = set(), []
    for layer in cache.layers:
        if id(layer) not in seen:
            seen.add(id(layer))
            out.append(layer)
    return out


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, heads, length, dim] zero-padded on the left of its length to ``width``."""
    return torch.nn.functional.pad(t, (0, 0, width - t.shape[2], 0))


__all__ = ["IterationEngine", "LeaderIterations", "RanksOutOfStep", "Sequence", "collective_error",
           "follow_iterations"]
