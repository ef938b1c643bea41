"""Continuous batching on autopar's own programs: ``CodegenIterationEngine``, what
``IterationEngine.from_plan(..., backend="codegen")`` returns.

It has the interface the server's continuous path uses of an ``IterationEngine``
(autopar/inference/iteration_engine.py, iteration_ranks.py, batcher.py): ``add`` / ``check`` /
``step`` / ``abort`` / ``run_until_idle`` / ``idle``, the ``running`` / ``waiting`` / ``filling``
sequences, ``slots`` / ``prompt_len`` / ``max_new_tokens`` / ``kv_tokens``, and this rank's place
(``replica``, ``replicas``, ``tp_rank``, ``stage``, ``replica_ranks``, ``jobs``), so
``LeaderIterations`` / ``follow_iterations`` drive it unchanged. The model's modules never run:

- **Programs.** A ``RowCacheStep`` (autopar/inference/codegen_rows.py) is traced on every rank and
  planned on rank 0 (the plans broadcast as JSON) with the plan's ``tp`` pinned (Megatron
  strategies), at two shapes: the decode step over all ``slots`` rows, and a prefill of
  ``max(prompt_len, 2)`` tokens over one row of the cache (a chunked plan: a chunk of
  ``max(min(prompt_len, prefill_chunk), 2)`` tokens, below). A ``RowRunner`` holds this rank's
  programs, parameter blocks and cache blocks.
- **Stages** (``pp > 1``): the steps are planned on one stage's ``tp`` ranks and cut at the plan's
  ``stages`` (``RowStageRunner``, a ``StageStepRunner`` of codegen_stages.py over the row step's
  inputs: rank ``s * tp + l`` of a replica is tp position ``l`` of stage ``s``, the hidden states go point
  to point to the next stage, and the last stage's tokens are broadcast so every rank appends the
  same tokens). The prefill step is then planned over every row of the cache (only the admitted
  row written: ``rows`` -1 elsewhere).
  The stages work in flight, as the modules engine's: ``pp`` virtual engines, each with its own
  cache block of ``slots`` rows and ``kv_tokens // pp`` of the pool, one turn per stage at a time,
  a ``step`` one tick of the stages (autopar/inference/codegen_flights.py).
- **Replicas** (``dp > 1``): replica ``r`` is ranks ``r * tp * pp`` to ``(r + 1) * tp * pp - 1``,
  stage-major inside it, as the modules engine lays them out (and the static engine,
  codegen_engine.py): every replica runs the same step plans (planned once, on rank 0, for one
  stage's ``tp`` ranks) on its own process groups (``runtime.context.setup`` given the replicas'
  stages as its ``pp * dp`` stages, so every axis group stays inside one stage of one replica; with
  ``pp > 1`` its own pipeline groups, ``engine_inputs.pipeline_group``, carry its last stage's
  tokens) and holds its own ``slots`` rows and KV-token pool (``kv_cache_tokens_per_replica``). The
  engine of a rank is its replica's: which replica serves a request, and the gather of the
  replicas' finished sequences, are ``LeaderIterations`` / ``follow_iterations``'s
  (iteration_ranks.py), as for the modules engine.
- **Cache.** One fixed block per layer, ``[slots, kv_heads, prompt_len + max_new_tokens,
  head_dim]`` split on the kv heads as the plans say; a sequence owns one row of it from admission
  to retirement, its token ``i`` at slot ``i`` (position ``i``), under a ``[slots, max_len]`` mask of
  its written slots (with pp > 1, one block, mask and set of rows per virtual engine). Nothing is
  joined, trimmed or copied on admission or retirement. The model is cast in place to the plan's
  dtype (fp32, bf16 or fp16: ``codegen_engine.cast_to_plan``), the steps traced, planned and run
  in it and the cache blocks held in it.
- **Iteration** (pp = 1; with pp > 1 a step is one tick of the stages in flight, each virtual
  engine's turn these forwards but for the newcomers' decode, which waits for its next turn). As
  ``IterationEngine``'s: admit (oldest first, while a row is free and the KV-token
  pool allows), prefill each admitted prompt alone into its row (``row_chunk``: the prompt at slots
  ``0 .. n-1``, the padding writing the slots after it, which its next tokens overwrite) and choose
  its first token, then one decode step over every row (free rows at ``rows`` -1: not written), then
  retire the finished (their rows free at the next iteration).
- **Chunked prefill** (a ``batching="chunked"`` plan: ``prefill_chunk`` tokens an iteration). As the
  modules engine's (autopar/inference/iteration_chunks.py, whose ``ChunkedPrefill._chunk_plan`` and
  ``_chunked_step`` run here on this engine's ``_chunk_forward`` / ``_decode`` / ``_leave`` /
  ``_prefilled``): the running rows' decode takes a token each of the budget, the rest goes to
  prompt chunks, first the sequences part-way through their prefill (``filling``), then waiting
  sequences admitted (rows and pool, counting the filling ones, which hold their rows from their
  first chunk) while budget is left. Each chunk is one step of the chunk program over the
  sequence's row (``row_chunk``: its tokens at their own slots and positions, attending to the
  slots before; the padding writes the slots after them, or the cache's last slot past its end,
  which later tokens overwrite); after its last chunk the sequence's first token is chosen from
  that step's logits, and it decodes from the next iteration. With pp > 1 each virtual engine's
  turn has its own budget: its rows' decode, then its chunks, each a step over every row with
  only the chunk's row written (codegen_flights.py); only the chunks that end a prompt give tokens.
- **Tokens.** With ``tp > 1`` the plan chooses the LM head vocabulary-parallel, as
  ``IterationEngine``'s (codegen_engine.py's module doc, Tokens): the programs return each rank's
  ``V / tp`` slice of the logits (``codegen_step.logits_split``) and ``vocab_parallel.next_tokens``
  chooses over the tp group (``vocab_shard``, the runner's): greedy 2 numbers per row per rank,
  top-k sampling 2 k, whole rows for top_k 0, each sequence sampling from its seeded generator,
  the same on every rank (under pp the last stage's ranks, over its tp group; its tokens are then
  broadcast). Logits a plan leaves in another layout are gathered whole in the programs (a shard
  of one), as with one process.

Refused (PlanError, naming what runs it): dtypes other
than fp32, bf16 and fp16, and steps whose plans do not split the cache on its kv heads (a fused
qkv projection autopar/inference/fused_qkv.py does not split; GPT-2's own it splits by heads)
(``backend="modules"`` runs them all); and, as the modules engine refuses it, a prefill chunk
smaller than the slots. ``collective_timeout`` (a timedelta) is the
programs' groups' timeout (``runtime.context.setup(..., timeout=)``; the default group's when None);
the jobs group has none, as ``IterationEngine``'s.
"""
from __future__ import annotations

import itertools
import time

import torch
import torch.distributed as dist

from autopar.errors import PlanError
from autopar.inference.codegen_engine import MODULES, cast_to_plan, check_codegen_plan, meta_to_storage, step_cluster
from autopar.inference.codegen_flights import RowStagesInFlight
from autopar.inference.codegen_rows import N_ROW_INPUTS, RowCacheStep, RowRunner, plan_row_step, row_chunk, \
    trace_row_step
from autopar.inference.codegen_stages import StageStepRunner
from autopar.inference.codegen_step import STEP_DTYPES, PlannedStep, full_cache_config
from autopar.inference.engine_inputs import WHOLE_ROW_SETTINGS, RequestQueue, checkpoint_reader, eos_token_ids, \
    pipeline_group, plan_ranks
from autopar.inference.fused_qkv import mapped_read
from autopar.inference.iteration_chunks import ChunkedPrefill, check_chunk
from autopar.inference.model_shape import causal_lm
from autopar.inference.sequence import IDLE_TIMEOUT, Sequence, step_until_idle
from autopar.inference.vocab_parallel import VocabShard, next_tokens


class RowStageRunner(StageStepRunner):
    """One rank's stage of a RowCacheStep's programs: a ``StageStepRunner`` whose cache dtype is
    read past the row step's inputs (``rows`` included)."""

    def __init__(self, step, steps, rank, pp, unit_stage=None, read=None, offset=0, group=None):
        super().__init__(step, steps, rank, pp, unit_stage, read, offset=offset, group=group)
        first = self.programs[1].input_names[N_ROW_INPUTS]   # the first cache tensor (not ``rows``)
        self.dtype = next(n for n in steps[1].traced.gm.graph.nodes if n.name == first).meta["val"].dtype


def check_iteration_plan(plan) -> None:
    """A clear error for the plans this engine does not run, naming what does."""
    if plan.predictions.get("batching") == "chunked":   # a chunk of at least one token per slot
        check_chunk(plan.batch_size, plan.predictions.get("prefill_chunk"))
    check_codegen_plan(plan)


class CodegenIterationEngine(RequestQueue, ChunkedPrefill, RowStagesInFlight):
    """Continuous batching of an InferencePlan on this rank's codegen programs (module doc)."""

    backend = "codegen"

    def __init__(self, model, plan, weights: str | None = None, cluster=None, collective_timeout=None):
        check_iteration_plan(plan)
        self.plan = plan
        self.world, self.rank = plan_ranks(plan)
        # this rank's place, as IterationEngine.from_plan gives it: replica r is a consecutive block
        # of tp x pp ranks, stage-major inside it (module doc, Replicas)
        self.replicas = plan.dp
        self.replica, self.local = divmod(self.rank, plan.tp * plan.pp)
        self.stage, self.tp_rank = divmod(self.local, plan.tp)
        self.model = causal_lm(model)
        self.slots, self.prompt_len, self.max_new_tokens = plan.batch_size, plan.prompt_len, plan.max_new_tokens
        self.kv_tokens = plan.predictions.get("kv_cache_tokens_per_replica")
        # chunked prefill (module doc, Chunked prefill): an iteration's (or a turn's) token budget, and the
        # prefill program's length that of the longest chunk (a prompt's tokens at most)
        self.chunk = plan.predictions.get("prefill_chunk") if plan.predictions.get("batching") == "chunked" else None
        self.most_tokens = 0   # chunked prefill: the most tokens one iteration ran
        self.prefill_len = max(plan.prompt_len if self.chunk is None else min(plan.prompt_len, self.chunk), 2)
        self.pp = plan.pp
        if self.pp > 1 and self.kv_tokens is not None:
            self.kv_tokens //= self.pp   # each virtual engine's (module doc, Stages)
        self.ticks = self.overlaps = 0   # pp > 1: ticks run; those in which two or more stages worked
        self.max_len = plan.prompt_len + plan.max_new_tokens
        try:
            full_cache_config(self.model.config, self.max_len)
        except NotImplementedError as e:
            raise PlanError(f'backend="codegen": {type(self.model).__name__}\'s cache of {self.max_len} positions '
                            f"has {e}: use {MODULES}") from None
        gc = getattr(self.model, "generation_config", None)
        odd = sorted(k for k, v in WHOLE_ROW_SETTINGS.items() if gc is not None and getattr(gc, k, v) not in (v, None))
        if odd:
            raise PlanError(f'backend="codegen" runs no logits processors over whole rows; the model\'s generation '
                            f"config sets {odd}: use {MODULES}")
        cast_to_plan(self.model, plan)   # first: the checkpoint's blocks are read in the parameters' dtypes
        read = checkpoint_reader(self.model, weights) if weights is not None else None
        if any(p.is_meta for p in self.model.parameters()):
            if read is None:
                raise PlanError("the model's parameters are on the meta device: give weights=DIR (a Hugging Face "
                                "safetensors checkpoint directory or a compiled.save() directory), or build "
                                "the model with its weights")
            meta_to_storage(self.model)
            cast_to_plan(self.model, plan)   # the buffers computed
        self.model.eval()
        self.step_module = RowCacheStep(self.model)
        steps = self.planned_steps(step_cluster(plan, cluster))
        if self.world > 1:   # the programs' process groups
            from runtime import context as RC
            # every replica's stages laid out as setup's stages: every axis group stays in one
            RC.setup(steps[1].plan.mesh, pp=plan.pp * plan.dp, timeout=collective_timeout)
        # GPT-2's split q, k, v blocks read from its fused c_attn (fused_qkv.py)
        blocks = mapped_read(None if read is None else (lambda fqn, sl: read(fqn, [sl], 0)),
                             self.step_module.qkv_columns)
        try:   # a runner refuses steps whose plans hold the cache in different layouts
            if plan.pp > 1:
                unit_stage = [k for k, (a, b) in enumerate(plan.stages) for _ in range(a, b)]
                group = None if plan.dp == 1 else pipeline_group(plan, self.replica, self.tp_rank, collective_timeout)
                self.runner = RowStageRunner(self.step_module, steps, self.rank, plan.pp, unit_stage, read=blocks,
                                             offset=self.replica * plan.tp * plan.pp, group=group)
                self.runner.in_flight = True
            else:
                self.runner = RowRunner(self.step_module, steps, self.local, read=blocks)
        except ValueError as e:
            raise PlanError(f'backend="codegen" cannot run {type(self.model).__name__}\'s planned row steps: {e}; '
                            f"use {MODULES}") from None
        if plan.tp > 1 and self.runner.cache_bytes() * plan.tp != self.runner.whole_cache_bytes():
            raise PlanError(f'backend="codegen": the planned row steps do not split {type(self.model).__name__}\'s '
                            f"cache on its kv heads tp={plan.tp} ways (this rank would hold "
                            f"{self.runner.cache_bytes()} of its {self.runner.whole_cache_bytes()} bytes, layouts "
                            f"{sorted({str(lay) for lay in self.runner.cache_layouts})}), more than the plan priced; "
                            f"use {MODULES}")
        self.calls = {s: 0 for s in steps}       # program runs per step length (1: decode)
        self.replica_ranks = plan.tp * plan.pp
        self.vocab_shard = getattr(self.runner, "vocab_shard", None) or VocabShard()   # module doc, Tokens
        self.jobs = None
        if self.world > 1:
            self.jobs = dist.new_group(timeout=IDLE_TIMEOUT)
        self.default_top_k = getattr(gc, "top_k", None) or 0
        self.default_top_p = getattr(gc, "top_p", None) or 1.0
        self.eos = set(eos_token_ids(self.model))
        self.ids = itertools.count()
        self.waiting: list[Sequence] = []
        self.filling: list[Sequence] = []        # chunked prefill: the sequences part-way through their prefill
        self.admitting: list[Sequence] = []
        self.iterations = 0
        self._reset()

    def _reset(self) -> None:
        self.running: list[Sequence] = []
        if self.pp > 1:   # the virtual engines' rows (codegen_flights.py)
            self._new_flights()
            return
        self.filling = []
        self.rows: list[Sequence | None] = [None] * self.slots     # cache row -> its sequence (running or filling)
        self.cache = self.runner.new_cache()
        self.mask = torch.zeros(self.slots, self.max_len, dtype=torch.long)
        self.length = torch.zeros(self.slots, dtype=torch.long)    # each row's written slots

    def planned_steps(self, cluster) -> dict[int, PlannedStep]:
        """The decode step (all rows) and the prefill step (one row of the cache), traced here and
        planned on rank 0 (module doc)."""
        from autopar.plans.plan import Plan
        # length -> step rows (pp > 1: the prefill over all rows, as the stages' tokens are [slots])
        shapes = {1: self.slots, self.prefill_len: self.slots if self.pp > 1 else 1}
        traced = {s: trace_row_step(self.step_module, b, s, self.max_len, self.slots) for s, b in shapes.items()}
        texts = [None] * len(shapes)
        if self.rank == 0:
            texts = [plan_row_step(self.step_module, b, s, self.max_len, cluster, traced=traced[s],
                                   cache_rows=self.slots, constraints={"tp": self.plan.tp, "dp": 1},
                                   policy="megatron", precision=STEP_DTYPES[self.plan.dtype][1]).plan.to_json()
                     for s, b in shapes.items()]
        if self.world > 1:
            dist.broadcast_object_list(texts, src=0)
        return {s: PlannedStep(traced[s], Plan.from_json(t), N_ROW_INPUTS) for s, t in zip(shapes, texts)}

    def kv_cache_bytes(self) -> int:
        return self.runner.cache_bytes() * (self.pp if self.pp > 1 else 1)

    # --- requests -----------------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running and not self.filling

    def abort(self) -> list[Sequence]:
        """Drop every running and waiting sequence (after a failed step); returns them."""
        if self.pp > 1:
            return self._abort_flights()
        held = {id(s) for s in self.running}
        out = self.running + [s for s in self.admitting + self.filling if id(s) not in held] + self.waiting
        self.waiting, self.admitting = [], []
        self._reset()
        return out

    def run_until_idle(self) -> list[Sequence]:
        return step_until_idle(self)

    # --- the iteration ------------------------------------------------------------------------------

    def _forward(self, seq_len: int, *inputs) -> torch.Tensor:
        """The length-``seq_len`` step: its last-position logits (this rank's vocabulary slice)."""
        self.calls[seq_len] += 1
        logits, *self.cache = self.runner.run(seq_len, *inputs, *self.cache)
        return logits

    def _run(self, seq_len: int, seqs: list[Sequence], at: list[int], *inputs) -> list[int]:
        """The length-``seq_len`` step; the next token of each of ``seqs`` (step rows ``at``)."""
        return self._pick(self._forward(seq_len, *inputs)[at], seqs)

    def _pick(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        return next_tokens(logits, [s.sampling for s in seqs], [s.generator for s in seqs], self.vocab_shard,
                           self.default_top_k, self.default_top_p)

    def _append(self, seq: Sequence, token: int) -> None:
        seq.tokens.append(token)
        seq.stopped = token in self.eos

    def _prefill(self, seq: Sequence) -> bool:
        """``seq``'s prompt alone into a free row, its first token chosen; False if it finished there."""
        seq.admitted = time.perf_counter()
        seq.running_at_admission = len(self.running) + 1
        row = self.rows.index(None)
        n = len(seq.prompt)
        self.mask[row] = 0
        self.mask[row, :n] = 1
        self.length[row] = n
        ids, pos, slots = row_chunk(torch.tensor(seq.prompt), 0, self.prefill_len)
        token = self._run(self.prefill_len, [seq], [0], ids[None], pos[None], slots[None],
                          self.mask[row:row + 1].clone(), torch.tensor([row]))[0]   # a step over this row
        self._append(seq, token)
        seq.first = time.perf_counter()
        if seq.finished:
            seq.done = seq.first
            return False
        self.rows[row] = seq
        self.running.append(seq)
        return True

    def _row_of(self, seq: Sequence) -> int:
        return next(r for r, s in enumerate(self.rows) if s is seq)

    def _decode(self) -> None:
        """One token of every running row, each at its own next slot; free rows (and those of
        sequences part-way through a chunked prefill) not written."""
        busy = torch.zeros(self.slots, dtype=torch.bool)
        busy[[self._row_of(s) for s in self.running]] = True
        at = torch.where(busy, self.length, 0)
        last = torch.tensor([s.tokens[-1] if s is not None and busy[r] else 0 for r, s in enumerate(self.rows)])
        held = busy.nonzero().flatten()
        self.mask[held, self.length[held]] = 1
        order = [self._row_of(s) for s in self.running]
        tokens = self._run(1, self.running, order, last[:, None], at[:, None], at[:, None].clone(), self.mask.clone(),
                           torch.where(busy, torch.arange(self.slots), -1))
        self.length[busy] += 1
        for seq, token in zip(self.running, tokens):
            self._append(seq, token)

    # --- chunked prefill (pp = 1): ChunkedPrefill._chunked_step's parts on the cache rows ---------------

    def _chunk_forward(self, seq: Sequence, start: int, end: int) -> torch.Tensor:
        """Prompt tokens [start, end) of ``seq`` into its cache row (a free row taken at start 0) at
        their own slots and positions, attending to the ``start`` before: its last position's
        logits [1, V / tp], as a whole-prompt prefill's at that position."""
        if start == 0:
            row = self.rows.index(None)
            self.rows[row] = seq
            self.mask[row] = 0
        else:
            row = self._row_of(seq)
        self.mask[row, start:end] = 1
        self.length[row] = end
        ids, pos, slots = row_chunk(torch.tensor(seq.prompt[start:end]), start, self.prefill_len, self.max_len)
        return self._forward(self.prefill_len, ids[None], pos[None], slots[None], self.mask[row:row + 1].clone(),
                             torch.tensor([row]))

    def _next_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        return self._pick(logits, seqs)

    def _prefilled(self, seq: Sequence, now: float) -> list[Sequence]:
        """``seq`` has its first token (after its last chunk): finished there (returned, its row
        free), or it runs from the next iteration."""
        seq.first = now
        if seq.finished:
            seq.done = now
            self.rows[self._row_of(seq)] = None
            return [seq]
        self.running.append(seq)
        return []

    def _leave(self, batch) -> list[Sequence]:
        """After a decode step: the finished running sequences leave (returned), their rows free."""
        now = time.perf_counter()
        finished = [s for s in self.running if s.finished]
        for seq in finished:
            seq.done = now
            self.rows[self._row_of(seq)] = None
        self.running = [s for s in self.running if not s.finished]
        return finished

    @torch.no_grad()
    def step(self) -> list[Sequence]:
        """One iteration: admit, prefill the admitted, decode the running one token, retire the
        finished; returns the sequences that finished. With pp > 1, one tick of the stages in
        flight (codegen_flights.py)."""
        if self.pp > 1:
            return self._tick()
        finished = []
        if self.chunk is not None:
            return self._chunked_step()   # iteration_chunks.py, on the methods below (module doc)
        self.admitting = self._admissions(self.running)
        for seq in self.admitting:
            if not self._prefill(seq):
                finished.append(seq)
        if self.running:
            self._decode()
            self.iterations += 1
            now = time.perf_counter()
            for seq in [s for s in self.running if s.finished]:
                seq.done = now
                finished.append(seq)
                self.rows[self._row_of(seq)] = None
            self.running = [s for s in self.running if not s.finished]
        elif finished:
            self.iterations += 1
        self.admitting = []
        return finished


__all__ = ["CodegenIterationEngine", "check_iteration_plan"]
