"""Continuous (iteration-level) batching on a real model: ``IterationEngine`` and its ``step``.

The engine holds up to ``slots`` running sequences (the plan's ``batch_size``) and a queue of
waiting ones (``add``). One ``step()`` is one iteration, as autopar/inference/continuous.py prices
it (with pp > 1, one tick of the stages in flight: autopar/inference/iteration_stages.py):

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

**Chunked prefill** (``prefill_chunk``): autopar/inference/iteration_chunks.py. **Stages in
flight** (pp > 1): autopar/inference/iteration_stages.py. **Ranks, replicas and failures** (rank 0
leading the others in the server): autopar/inference/iteration_ranks.py.
"""
from __future__ import annotations

import inspect
import itertools
import time

import torch
import torch.distributed as dist

from autopar.errors import PlanError
from autopar.inference.engine_inputs import RequestQueue, eos_token_ids
from autopar.inference.iteration_chunks import ChunkedPrefill, check_chunk
from autopar.inference.iteration_stages import StagesInFlight
from autopar.inference.model_shape import causal_lm
from autopar.inference.sequence import IDLE_TIMEOUT, Sequence, step_until_idle
from autopar.inference.vocab_parallel import VocabShard, next_tokens


class IterationEngine(RequestQueue, ChunkedPrefill, StagesInFlight):
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
            check_chunk(slots, prefill_chunk)
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
        self.eos = set(eos_token_ids(self.model))
        try:
            self.device = next(self.model.parameters()).device
        except StopIteration:
            self.device = torch.device("cpu")
        # a prefill needs the last position's logits only (as ``generate`` asks, and as priced)
        keeps = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.last_logits = {"logits_to_keep": 1} if keeps else {}

    @classmethod
    def from_plan(cls, model, plan, weights: str | None = None, collective_timeout=None,
                  backend: str = "modules") -> "IterationEngine":
        """This rank's engine of a plan: the model built (its tp shard, weights read, dtype) as
        ``compile_inference`` builds it, with the plan's slots (per replica), lengths and KV-token
        pool, and this rank's replica and stage (module doc). The tensor-parallel and pipeline groups
        it makes wait ``collective_timeout`` (a timedelta; ``autopar serve`` passes the default
        group's): a rank whose peer fails mid-forward fails after it, never waits for ever; rank 0's
        jobs travel on a group of their own without one (the other ranks wait there, however long
        the server is idle). ``backend="codegen"``: a ``CodegenIterationEngine`` running autopar's
        own generated programs instead of the model's modules (autopar/inference/codegen_iteration.py;
        tp, pp and dp)."""
        if backend == "codegen":
            from autopar.inference.codegen_iteration import CodegenIterationEngine
            return CodegenIterationEngine(model, plan, weights=weights, collective_timeout=collective_timeout)
        if backend != "modules":
            raise PlanError(f'backend={backend!r} is not an iteration engine backend: use "modules" (the model\'s '
                            f'modules, the default) or "codegen" (autopar\'s generated programs)')
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
        if distributed():
            engine.jobs = dist.new_group(timeout=IDLE_TIMEOUT)
        return engine

    # --- requests -----------------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.filling

    def abort(self) -> list[Sequence]:
        """Drop every running and waiting sequence (after a failed step); returns them."""
        if self.flights:
            return self._abort_flights()
        rows = {id(s) for s in self.running}
        out = self.running + [s for s in self.admitting + self.filling if id(s) not in rows] + self.waiting
        self.running, self.admitting, self.waiting, self.filling = [], [], [], []
        self.cache = self.mask = None
        return out

    # --- the iteration ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[Sequence]:
        """One iteration: admit, prefill the admitted, decode the running one token, retire the
        finished; returns the sequences that finished. With pp > 1, one tick
        (autopar/inference/iteration_stages.py)."""
        if self.flights:
            return self._tick()
        if self.chunk is not None:
            return self._chunked_step()
        finished = []
        self.admitting = self._admissions(self.running)
        for seq in self.admitting:
            finished += self._prefilled(seq, self._prefill(seq))
        if self.running:
            self._decode()
            self.iterations += 1
            finished += self._leave(self)
        elif finished:
            self.iterations += 1
        self.admitting = []
        return finished

    def run_until_idle(self) -> list[Sequence]:
        """Step until nothing is running or waiting; the sequences in the order they finished."""
        return step_until_idle(self)

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

    def _prefill(self, seq: Sequence) -> float:
        """``seq``'s prompt prefilled on its own and its first token chosen; returns when."""
        seq.admitted = time.perf_counter()
        seq.running_at_admission = len(self.running) + 1
        logits = self._prefill_forward(seq)
        self._append(seq, self._next_tokens(logits, [seq])[0])
        return time.perf_counter()

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



def distributed() -> bool:
    """More than one process in the default group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


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


__all__ = ["IDLE_TIMEOUT", "IterationEngine", "Sequence", "distributed", "step_until_idle"]
