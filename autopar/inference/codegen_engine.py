"""The static engine on autopar's own programs: ``compile_inference(..., backend="codegen")``.

``CodegenEngine`` runs an InferencePlan's generation through autopar/inference/codegen_step.py
instead of the model's own modules: the model's prefill and decode steps over an explicit KV
cache (``CacheStep``) are traced and planned by autopar's training planner with the plan's ``tp``
pinned (Megatron strategies), lowered to this rank's codegen programs and run by a
``StepRunner`` holding this rank's parameter and cache blocks; with ``pp > 1`` by a
``StageStepRunner`` (autopar/inference/codegen_stages.py) running this rank's stage of them.

- **Shapes.** The steps are planned for the InferencePlan's ``batch_size``, one prefill program of
  ``prompt_len`` slots (prompts are left-padded to it; 2 slots for a one-token plan) and the decode
  program, over a cache of ``prompt_len + max_new_tokens`` positions: the cache the InferencePlan
  prices, so ``kv_cache_bytes()`` equals ``plan.kv_cache_bytes_per_rank`` (under ``pp``, the
  largest stage's: a stage of fewer layers holds its layers' share). Fewer prompts than the batch
  are padded with copies of the first, as the modules engine does.
- **Stages.** With ``pp > 1`` the steps are planned on one stage's ``tp`` ranks and cut at the
  InferencePlan's ``stages`` (layers per stage); rank ``s * tp + l`` of a replica is tp position
  ``l`` of stage ``s``, the hidden states go point to point to the next stage, and the last
  stage's tokens are broadcast, so every rank returns the same tokens.
- **Replicas.** With ``dp > 1`` replica ``r`` is ranks ``r * tp * pp`` to ``(r + 1) * tp * pp - 1``,
  stage-major inside it, as the modules engine lays them out: every replica runs the same step
  plans (one stage's ``tp`` ranks at the plan's ``batch_size``, a replica's batch;
  ``kv_cache_bytes_per_rank`` is a rank of one replica's) on its own process groups
  (``runtime.context.setup`` given the replicas' stages as its ``pp * dp`` stages, so every axis
  group stays inside one stage of one replica; with ``pp > 1`` its own pipeline groups, one per
  tp position, carry its last stage's tokens, ``pipe_group``), decodes its share of the rows
  (``-(-rows // dp)``, in order), and the new tokens are all-gathered so every rank returns the
  whole batch.
- **Plans.** Every rank traces the steps itself (deterministic); rank 0 alone runs the planner and
  broadcasts each plan as JSON, so every rank lowers the same plans.
- **Weights.** The model's own tensors, or with ``weights=DIR`` (a Hugging Face safetensors checkpoint
  or a ``compiled.save`` training checkpoint: engine_inputs.py ``checkpoint_reader``) each rank's
  parameter blocks are read from the checkpoint block by block; a model built on the meta
  device is then given empty storage to trace over (its rotary buffers computed).
- **Dtype.** The model is cast in place to the plan's dtype (fp32, bf16 or fp16), as the modules
  backend casts it (``cast_to_plan``); the steps are traced, planned (the planner's precision: bf16
  for both 16-bit dtypes) and run in it and the cache blocks held in it, so ``kv_cache_bytes()``
  prices as the plan does. A 16-bit step's reductions (the row-parallel matmuls' all-reduces at
  tp > 1) round in another order than the whole model's, so its logits may differ from the
  modules backend's in the last bf16 bits.
- **Tokens.** The prompt followed by the new tokens on every rank, rows stopping at the
  generation config's end-of-sequence tokens (padded with 0) and generation ending once every
  row has, as Hugging Face's ``generate``. With ``tp > 1`` the plan chooses the LM
  head vocabulary-parallel, as the modules backend's: a step's logits output is planned in any
  layout but a partial sum (autopar/rules/candidates.py), so a column-parallel head on its
  replicated input (no communication) prices below a row-parallel one and its reduction. The
  programs then return each rank's ``V / tp`` slice of the last position's logits
  (``codegen_step.logits_split``), from which autopar/inference/vocab_parallel.py chooses the
  tokens over the tp group (``runner.vocab_shard``): greedy gathers 2 numbers per row per rank
  (the global argmax), sampling (``sampler``: temperature, top-k, top-p, seed) the top-k
  candidates (2 k per row per rank; top_k 0: the whole rows), drawing from a seeded generator the
  tokens the modules backend's sampled ``generate`` draws with that seed. Logits a plan leaves in
  another layout (not split over the vocabulary) the programs gather whole (a shard of one), as
  with one process or pipeline stages: the same tokens.
- **Sliding windows.** A window at least the cache's length never slides: its layers are full
  attention and run (``codegen_step.full_cache_config``); a shorter window is refused.

What this backend refuses, with the backend that runs it: dtypes other than fp32, bf16 and fp16,
generation-config settings that process whole rows of logits (e.g. ``repetition_penalty``) or sample with other
warpers (``min_p``, ``typical_p``, ...), caches whose sliding window is shorter than the cache (or
other ring-buffer layers), and steps whose
plan does not hold the cache the InferencePlan priced per rank (a fused qkv projection the steps
do not split by heads leaves the planned cache whole on every rank). GPT-2's own fused ``c_attn``
runs split by heads: the step traces a view of the model with q, k and v as three projections and
its parameter blocks are read from the fused tensors (autopar/inference/fused_qkv.py).
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from autopar.errors import PlanError
from autopar.inference.codegen_stages import StageStepRunner
from autopar.inference.codegen_step import (STEP_DTYPES, CacheStep, PlannedStep, StepRunner, full_cache_config,
                                            plan_cache_step, trace_cache_step)
from autopar.inference.engine_inputs import (WHOLE_ROW_SETTINGS, check_request, check_sampling, checkpoint_reader,
                                             eos_token_ids, fill_buffers, pipeline_group, plan_ranks)
from autopar.inference.fused_qkv import mapped_read
from autopar.inference.inference_plan import InferencePlan
from autopar.inference.model_shape import causal_lm
from autopar.inference.vocab_parallel import VocabShard, sample_rows

MODULES = 'backend="modules" (the default)'


def step_cluster(plan: InferencePlan, cluster):
    """The cluster the steps are planned on: ``cluster`` (or the InferencePlan's named preset)
    cut to one node of ``plan.tp`` devices, the mesh the programs run on."""
    from autopar.cluster import Cluster
    if cluster is None:
        name = plan.cluster.get("name")
        try:
            cluster = Cluster.preset(name, devices=plan.tp)
        except Exception as e:
            raise PlanError(f'backend="codegen" plans its steps on the plan\'s cluster {name!r}, which is not a '
                            f"preset ({e}): give compile_inference cluster=") from None
    if cluster.num_devices != plan.tp:
        cluster = dataclasses.replace(cluster, nodes=1, devices_per_node=plan.tp)
    return cluster


def check_codegen_plan(plan: InferencePlan) -> None:
    """A clear error for what the codegen backend cannot run yet, naming what would (both its
    engines run data-parallel replicas of tp x pp ranks)."""
    if plan.pp > 1 and len(plan.stages) != plan.pp:
        raise PlanError(f"the plan has pp={plan.pp} but {len(plan.stages)} stages of layers: plan it again "
                        f"(autopar.plan_inference)")
    if plan.dtype not in STEP_DTYPES:
        raise PlanError(f'backend="codegen" runs {", ".join(STEP_DTYPES)} (the plan is {plan.dtype}): plan with '
                        f"one of them or use {MODULES}")


def cast_to_plan(model, plan: InferencePlan) -> None:
    """``model`` cast in place to the plan's dtype (``STEP_DTYPES``), as the modules backend casts
    it: its steps are traced, planned and run in that dtype, its cache blocks held in it."""
    model.to(STEP_DTYPES[plan.dtype][0])


def meta_to_storage(model) -> None:
    """A model built on the meta device given empty storage on the CPU (its values are read from
    a checkpoint) with its non-persistent buffers (rotary tables) computed."""
    from autopar.execution.weights import fill_meta_buffers
    filled = fill_meta_buffers(model)
    model.to_empty(device="cpu")
    fill_buffers(model, filled)


# sampling settings of a generation config besides temperature, top-k and top-p, at their neutral
# values: away from them Hugging Face's sampled generate runs warpers this backend does not
OTHER_WARPERS = {"min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None,
                 "renormalize_logits": False, "watermarking_config": None}
# Hugging Face's defaults where neither the options nor the model's generation config set one
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


def sampler(model, options: dict):
    """``sample(logits [B, V / shard.size], shard) -> [B]`` tokens as Hugging Face's sampled
    ``generate`` draws them (the modules backend's): temperature, top-k and top-p (``options``,
    else the model's generation config, else Hugging Face's defaults) warp the fp32 logits, then
    ``torch.multinomial`` over their softmax, from a generator seeded with ``options["seed"]``
    (default 0), one draw per row of the batch per step (``vocab_parallel.sample_rows``: from
    each rank's vocabulary slice, 2 k numbers per row per rank cross the group)."""
    gc = getattr(model, "generation_config", None)
    odd = sorted(k for k, v in OTHER_WARPERS.items() if gc is not None and getattr(gc, k, v) not in (v, None))
    if odd:
        raise PlanError(f'backend="codegen" samples with temperature, top_k and top_p only; the model\'s '
                        f"generation config sets {odd}: use {MODULES}")

    def value(key):
        for v in (options.get(key), getattr(gc, key, None), SAMPLING_DEFAULTS[key]):
            if v is not None:
                return v

    temperature, top_k, top_p = value("temperature"), value("top_k"), value("top_p")
    generator = torch.Generator().manual_seed(options.get("seed", 0))

    def sample(logits: torch.Tensor, shard: VocabShard) -> torch.Tensor:
        return sample_rows(logits, shard, temperature, top_k, top_p, generator)

    return sample


class CodegenEngine:
    """``InferenceEngine``'s interface (``generate``, ``kv_cache_bytes``, ``last_timing``) on a
    ``StepRunner`` (module doc). ``collective_timeout`` (a timedelta): how long the programs'
    collectives wait for a peer (runtime.context.setup's groups; the default group's when None)."""

    backend = "codegen"

    def __init__(self, model, plan: InferencePlan, weights: str | None = None, cluster=None,
                 collective_timeout=None):
        check_codegen_plan(plan)
        self.plan = plan
        self.world, self.rank = plan_ranks(plan)
        self.replica, self.local = divmod(self.rank, plan.tp * plan.pp)   # replicas: consecutive rank groups
        self.model = causal_lm(model)
        self.prefill = max(plan.prompt_len, 2)
        self.max_len = plan.prompt_len + plan.max_new_tokens
        try:
            full_cache_config(self.model.config, self.max_len)
        except NotImplementedError as e:
            raise PlanError(f'backend="codegen": {type(self.model).__name__}\'s cache of {self.max_len} positions '
                            f"(prompt_len + max_new_tokens) has {e}: plan for at most the window's positions or "
                            f"use {MODULES}") from None
        cast_to_plan(self.model, plan)   # first: the checkpoint's blocks are read in the parameters' dtypes
        self.read = checkpoint_reader(self.model, weights) if weights is not None else None
        if any(p.is_meta for p in self.model.parameters()):
            if self.read is None:
                raise PlanError("the model's parameters are on the meta device: give weights=DIR (a Hugging Face "
                                "safetensors checkpoint directory or a compiled.save() directory), or build "
                                "the model with its weights")
            meta_to_storage(self.model)
            cast_to_plan(self.model, plan)   # the buffers computed
        self.model.eval()
        self.step = CacheStep(self.model)
        steps = self.planned_steps(step_cluster(plan, cluster))
        if self.world > 1:   # the programs' process groups (one process: no collectives)
            from runtime import context as RC
            # every replica's stages laid out as setup's stages: every axis group stays in one
            RC.setup(steps[1].plan.mesh, pp=plan.pp * plan.dp, timeout=collective_timeout)
        # GPT-2's split q, k, v blocks read from its fused c_attn (fused_qkv.py)
        read = mapped_read(None if self.read is None else (lambda fqn, sl: self.read(fqn, [sl], 0)),
                           self.step.qkv_columns)
        if plan.pp > 1:
            unit_stage = [k for k, (a, b) in enumerate(plan.stages) for _ in range(a, b)]
            self.runner = StageStepRunner(self.step, steps, self.rank, plan.pp, unit_stage, read=read,
                                          offset=self.replica * plan.tp * plan.pp,
                                          group=self.pipe_group(collective_timeout))
            layers = unit_stage.count(self.runner.stage)
            largest = max(b - a for a, b in plan.stages)
        else:
            self.runner = StepRunner(self.step, steps, self.local, read=read)
            layers = largest = 1
        held = self.runner.cache_bytes()
        priced = plan.kv_cache_bytes_per_rank * layers // largest   # the largest stage's, per layer x this stage's
        if priced and held != priced:
            stage = f"stage {self.runner.stage}'s {layers} layer(s), " if plan.pp > 1 else ""
            raise PlanError(f'backend="codegen": the planned steps hold {held} bytes of KV cache per rank, the '
                            f"InferencePlan priced {priced} ({stage}its kv heads split tp={plan.tp} ways): the "
                            f"steps' plan does not split {type(self.model).__name__}'s cache on its heads (layouts "
                            f"{sorted({str(lay) for lay in self.runner.cache_layouts})}); use {MODULES}")
        self.last_timing: dict = {}

    def pipe_group(self, timeout):
        """With replicas (``dp > 1``), this rank's pipeline group of its replica: every replica's
        group of each tp position created on every rank in one order (``dist.new_group`` is
        collective); None otherwise (the runner takes setup's ``pp_group``)."""
        if self.plan.dp == 1:
            return None
        return pipeline_group(self.plan, self.replica, self.local % self.plan.tp, timeout)

    def planned_steps(self, cluster) -> dict[int, PlannedStep]:
        """The decode and prefill steps, traced here and planned on rank 0 (module doc)."""
        from autopar.plans.plan import Plan
        lengths = (1, self.prefill)
        traced = {s: trace_cache_step(self.step, self.plan.batch_size, s, self.max_len) for s in lengths}
        texts = [None] * len(lengths)
        if self.rank == 0:
            texts = [plan_cache_step(self.step, self.plan.batch_size, s, self.max_len, cluster, traced=traced[s],
                                     constraints={"tp": self.plan.tp, "dp": 1}, policy="megatron",
                                     precision=STEP_DTYPES[self.plan.dtype][1]).plan.to_json()
                     for s in lengths]
        if self.world > 1:
            dist.broadcast_object_list(texts, src=0)
        return {s: PlannedStep(traced[s], Plan.from_json(t)) for s, t in zip(lengths, texts)}

    def kv_cache_bytes(self) -> int:
        """Bytes of this rank's cache blocks (the plan's layout of the cache)."""
        return self.runner.cache_bytes()

    def check(self, input_ids: torch.Tensor, max_new_tokens: int) -> None:
        check_request(self.plan, input_ids, max_new_tokens)

    def check_generation_config(self) -> None:
        gc = getattr(self.model, "generation_config", None)
        odd = sorted(k for k, v in WHOLE_ROW_SETTINGS.items() if gc is not None and getattr(gc, k, v) not in (v, None))
        if odd:
            raise PlanError(f'backend="codegen" runs no logits processors over whole rows; the model\'s generation '
                            f"config sets {odd}: use {MODULES}")

    def eos_ids(self) -> tuple:
        return eos_token_ids(self.model)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, attention_mask: torch.Tensor | None = None,
                 sampling: dict | None = None):
        """The continuation of left-padded prompts: [batch, prompt + new tokens] on every rank.
        Greedy, unless ``sampling`` gives ``temperature`` > 0 (with optional ``top_p``, ``top_k`` and
        ``seed``): the tokens the modules backend draws with that seed (``sampler``)."""
        input_ids = torch.as_tensor(input_ids, dtype=torch.long)
        self.check(input_ids, max_new_tokens)
        options = check_sampling(sampling)
        self.check_generation_config()
        sample = sampler(self.model, options) if options else None
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        attention_mask = torch.as_tensor(attention_mask, dtype=torch.long)
        prompts, share = input_ids, -(-input_ids.shape[0] // self.plan.dp)   # this replica's rows (module doc)
        input_ids, attention_mask = (t[self.replica * share:(self.replica + 1) * share] for t in (input_ids,
                                                                                                 attention_mask))
        rows = input_ids.shape[0]
        if rows == 0:   # a replica past the last row: nothing to decode, its peers' rows gathered
            self.last_timing = {"prefill_s": 0.0, "decode_s": 0.0, "new_tokens": 0}
            return self.gathered(prompts, None)
        pad = self.plan.batch_size - rows
        ids, mask = input_ids, attention_mask
        if pad > 0:   # the programs are planned for the plan's batch: fill it
            ids = torch.cat([ids, ids[:1].expand(pad, -1)])
            mask = torch.cat([mask, mask[:1].expand(pad, -1)])
        stamps: list = []
        start = time.perf_counter()
        new = self.runner.generate(ids, mask, max_new_tokens, eos=self.eos_ids(), pad=0, stamps=stamps, sample=sample)
        first = stamps[0] if stamps else time.perf_counter()
        self.last_timing = {"prefill_s": first - start, "decode_s": stamps[-1] - first if len(stamps) > 1 else 0.0,
                            "new_tokens": len(stamps)}
        return self.gathered(prompts, new[:rows])

    def gathered(self, prompts: torch.Tensor, new: torch.Tensor | None) -> torch.Tensor:
        """``prompts`` followed by every replica's new tokens (this replica's ``new``, [rows, n]; None
        without rows), on every rank: a replica whose rows all stopped early is padded with 0."""
        if self.plan.dp > 1:
            parts = [None] * self.world
            dist.all_gather_object(parts, (self.replica, self.local, new))
            pieces = [t for r, local, t in sorted(parts, key=lambda p: p[0]) if local == 0 and t is not None]
            width = max(t.shape[1] for t in pieces)
            new = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=0) for t in pieces])
        return torch.cat([prompts, new], 1)
