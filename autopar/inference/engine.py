"""The generation engine: ``compile_inference(model, cluster, plan)`` and ``engine.generate``.

Every rank of the plan holds its tensor-parallel shard of the model (autopar/inference/tp_shard.py)
and a KV cache preallocated once for the plan's batch and lengths (a transformers ``StaticCache``
on the rank's local key/value heads: ``plan.kv_cache_bytes_per_rank``). ``generate`` is SPMD:
every rank calls it with the same prompts; data-parallel replicas (``plan.dp``, consecutive groups
of ``tp`` ranks) each decode their share of the rows; every rank returns the whole batch, prompt
followed by the new tokens, greedy. Decoding is the model's own ``generate`` loop over the sharded
modules, whose row-parallel outputs are all-reduced over the replica's tensor-parallel group.

The LM head is vocabulary-parallel when it is not tied to the embeddings (each rank its rows of the
vocabulary); a tied head stays whole. A split head returns each rank's slice of the logits
(``head_logits``, its forward hook): greedy ``generate`` picks each row's token by a distributed
argmax (autopar/inference/vocab_parallel.py ``GreedyOfSlices``, a logits processor of Hugging
Face's ``generate``: 2 numbers per row per rank cross the tensor-parallel group, not the
vocabulary), and the continuous-batching engine (autopar/inference/iteration_engine.py) chooses
its tokens from the slices the same way (``vocab_shard``). Sampling here keeps Hugging Face's
warpers and seeded stream on whole logits: for a sampled ``generate`` the hook all-gathers them
([rows, seq, V], ``gather_last_dim``). With ``pp > 1`` each stage holds
its layers and passes hidden states on (autopar/inference/pp_stages.py); replicas are then
consecutive groups of tp x pp ranks, stage-major within.
``compile_inference(..., backend="codegen")`` runs a plan's generation through autopar's own
per-rank programs instead (autopar/inference/codegen_engine.py); this module's ``InferenceEngine``
is the default, ``backend="modules"``.
``last_timing`` holds the last call's measured prefill (time to the first new token) and decode
seconds, which the server's load test compares with the plan's TTFT and TPOT.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from autopar.errors import PlanError
from autopar.inference.engine_inputs import (WHOLE_ROW_SETTINGS, check_request, check_sampling, checkpoint_reader,
                                             drop_parameters, fill_buffers, pipeline_group, plan_ranks)
from autopar.inference.inference_plan import InferencePlan
from autopar.inference.model_shape import causal_lm
from autopar.inference.pp_stages import ReceivedLogits, connect_stages, keep_stage_layers, share_cache_layers
from autopar.inference.tp_shard import shard_for_tp
from autopar.inference.vocab_parallel import GreedyOfSlices, VocabShard

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class _Clock:
    """A transformers streamer that timestamps the prompt and each new token."""

    def __init__(self):
        self.stamps = []

    def put(self, value):
        self.stamps.append(time.perf_counter())

    def end(self):
        pass


class InferenceEngine:
    def __init__(self, model, plan: InferencePlan, weights: str | None = None, collective_timeout=None):
        self.plan = plan
        self.whole_logits = False   # a split head's logits all-gathered (a sampled generate), else its slice
        self.world, self.rank = plan_ranks(plan)
        self.model = causal_lm(model)
        self.read = checkpoint_reader(self.model, weights) if weights is not None else None
        if self.read is None and any(p.is_meta for p in self.model.parameters()):
            raise PlanError("the model's parameters are on the meta device: give weights=DIR (a Hugging Face "
                            "safetensors checkpoint directory or a compiled.save() directory), or build the "
                            "model with its weights")
        if self.read is not None:
            drop_parameters(self.model)   # every value from the checkpoint, each rank its blocks
        # replicas: consecutive groups of tp x pp ranks; in a replica, stage-major (module doc)
        tp, pp = plan.tp, plan.pp
        self.replica, within = divmod(self.rank, tp * pp)
        self.stage, self.tp_rank = divmod(within, tp)
        self.group = self.pipe_group = None
        if tp > 1:
            for r, s in ((r, s) for r in range(plan.dp) for s in range(pp)):
                g = dist.new_group([r * tp * pp + s * tp + t for t in range(tp)], timeout=collective_timeout)
                if (r, s) == (self.replica, self.stage):
                    self.group = g
        pipe_ranks = [self.replica * tp * pp + s * tp + self.tp_rank for s in range(pp)]
        if pp > 1:
            self.pipe_group = pipeline_group(plan, self.replica, self.tp_rank, collective_timeout)
            keep_stage_layers(self.model, tuple(plan.stages[self.stage]))
        self.sharded = shard_for_tp(self.model, self.tp_rank, tp,
                                    lambda t: dist.all_reduce(t, group=self.group), read=self.read,
                                    all_gather=self.head_logits)
        split = "colwise_gather_output" in self.sharded.values()
        self.vocab_shard = VocabShard(self.tp_rank, tp, self.group) if split else VocabShard()
        self.received = None   # a stage before the last: the head receiving the last stage's logits
        self.stage_link = None   # pp > 1: the stage hooks' link (pp_stages.py)
        if pp > 1:
            self.stage_link = connect_stages(self.model, self.stage, [tuple(b) for b in plan.stages], pipe_ranks,
                                             self.pipe_group)
            received = self.model.get_output_embeddings()
            if isinstance(received, ReceivedLogits):
                self.received = received
                received.vocab //= self.vocab_shard.size   # its tp rank's slice of the last stage's logits
        fill_buffers(self.model)
        self.model.eval().to(DTYPES.get(plan.dtype, torch.float32))
        from transformers import StaticCache
        self.cache = StaticCache(config=self.model.config, max_cache_len=plan.prompt_len + plan.max_new_tokens)
        if pp > 1:
            share_cache_layers(self.cache, self.model, tuple(plan.stages[self.stage]))
        self.last_timing: dict = {}
        self.cache_batch = None

    def head_logits(self, t: torch.Tensor) -> torch.Tensor:
        """A split head's output: this rank's slice, or gathered whole with ``whole_logits``."""
        return self.gather_last_dim(t) if self.whole_logits else t

    def gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s last dim concatenated over this replica's tensor-parallel group, in rank order."""
        parts = [torch.empty_like(t) for _ in range(self.plan.tp)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def kv_cache_bytes(self) -> int:
        """Bytes of this rank's KV cache (allocated at the first generate, for the plan's batch)."""
        layers = {id(layer): layer for layer in self.cache.layers}.values()   # pp: shared entries once
        return sum(t.numel() * t.element_size() for layer in layers
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if t is not None)

    def check(self, input_ids: torch.Tensor, max_new_tokens: int) -> None:
        check_request(self.plan, input_ids, max_new_tokens)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, attention_mask: torch.Tensor | None = None,
                 sampling: dict | None = None):
        """The continuation of left-padded prompts: [batch, prompt + max_new_tokens] on every rank.
        Greedy, unless ``sampling`` gives ``temperature`` > 0 (with optional ``top_p``, ``top_k`` and
        ``seed``): every rank of a replica then draws the same tokens from the same seeded stream, so
        the result is what one process sampling with that seed draws."""
        input_ids = torch.as_tensor(input_ids, dtype=torch.long)
        self.check(input_ids, max_new_tokens)
        self.sampling = check_sampling(sampling)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        rows = input_ids.shape[0]
        share = -(-rows // self.plan.dp)
        lo, hi = min(self.replica * share, rows), min((self.replica + 1) * share, rows)
        mine = None
        clock = _Clock()
        start = time.perf_counter()
        if hi > lo:
            mine = self._generate_rows(input_ids[lo:hi], attention_mask[lo:hi], max_new_tokens, clock)
        if self.plan.dp > 1:
            parts = [None] * self.world
            dist.all_gather_object(parts, (self.replica, self.stage + self.tp_rank, mine))
            pieces = [t for _, t in sorted((r, t) for r, first, t in parts if first == 0 and t is not None)]
            width = max(t.shape[1] for t in pieces)   # a replica whose rows all stopped early is narrower
            out = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=0) for t in pieces])
        else:
            out = mine
        stamps = clock.stamps
        first = stamps[1] if len(stamps) > 1 else time.perf_counter()
        self.last_timing = {"prefill_s": first - start, "decode_s": (stamps[-1] - first) if len(stamps) > 2 else 0.0,
                            "new_tokens": max(len(stamps) - 1, 0)}
        return out

    def _generate_rows(self, ids, mask, max_new_tokens, clock):
        rows = ids.shape[0]
        pad = self.plan.batch_size - rows     # the cache is allocated for the plan's batch: fill it
        if pad > 0:
            ids = torch.cat([ids, ids[:1].expand(pad, -1)])
            mask = torch.cat([mask, mask[:1].expand(pad, -1)])
        self.cache.reset()
        sample = dict(self.sampling)
        seed = sample.pop("seed", 0)
        from transformers import LogitsProcessorList
        whole = bool(sample) or self._processed_scores()
        self._whole_logits(whole)
        greedy = {} if whole or self.vocab_shard.size == 1 else {
            "logits_processor": LogitsProcessorList([GreedyOfSlices(self.vocab_shard)])}
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                out = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                          do_sample=bool(sample), **sample, cache=self.cache, pad_token_id=0,
                                          streamer=clock, **greedy)
        finally:
            self._whole_logits(False)
        return out[:rows]

    WHOLE_ROW_SETTINGS = WHOLE_ROW_SETTINGS   # engine_inputs.py

    def _processed_scores(self) -> bool:
        """Whether the model's generation config asks greedy ``generate`` for processors over whole
        rows of logits (``WHOLE_ROW_SETTINGS`` away from their neutral values): then the split head's
        logits are gathered whole, as for sampling, instead of the distributed argmax."""
        gc = getattr(self.model, "generation_config", None)
        return gc is not None and any(getattr(gc, k, v) not in (v, None) for k, v in self.WHOLE_ROW_SETTINGS.items())

    def _whole_logits(self, whole: bool) -> None:
        """A split head's logits all-gathered (``whole``) or this rank's slice, on every stage."""
        self.whole_logits = whole
        if self.received is not None:
            vocab = self.model.config.vocab_size
            self.received.vocab = vocab if whole else vocab // self.vocab_shard.size


BACKENDS = ("modules", "codegen")


def compile_inference(model, cluster=None, plan: InferencePlan | None = None, weights: str | None = None,
                      collective_timeout=None, backend: str = "modules", **plan_options):
    """The engine for ``model`` under ``plan`` (an InferencePlan, or a file written by
    ``autopar plan-inference``); without one, ``plan_inference(model, cluster=cluster, **plan_options)``
    plans it (``example_prompt`` and ``max_new_tokens`` then required). ``weights``: a checkpoint
    directory each rank reads only its shards from, every parameter's value taken from it: a
    Hugging Face safetensors directory (``save_pretrained``) or a training checkpoint written by
    ``compiled.save(DIR)`` (autopar/execution/weights.py ``open_weights``; a zoo wrapper's
    ``model.`` prefix is mapped); the model may then be built on the meta device, e.g.
    ``autopar.models.from_hf_config``. A directory that is neither is an ExecutionError. ``collective_timeout`` (a
    timedelta): how long the tensor-parallel and pipeline groups' collectives wait for a peer
    (torch's default when None; ``autopar serve --collective-timeout``). ``backend``: "modules" (this
    module's ``InferenceEngine``: the model's own modules, sliced) or "codegen" (a ``CodegenEngine``,
    autopar/inference/codegen_engine.py: the steps planned and lowered to autopar's own programs;
    tp, pp, and dp replicas of them, fp32 / bf16 / fp16, greedy or sampled; planned here, it pins
    fp32 on a gloo cluster unless the options say otherwise)."""
    if backend not in BACKENDS:
        raise PlanError(f"backend={backend!r} is not known; use one of {', '.join(map(repr, BACKENDS))}")
    if isinstance(plan, str):
        plan = InferencePlan.load(plan)
    if plan is None:
        from autopar.inference.planner import plan_inference
        if cluster is None:
            raise PlanError("compile_inference needs a plan or a cluster to plan for")
        if backend == "codegen" and cluster.backend == "gloo":   # plan for what it runs: fp32 on gloo
            plan_options.setdefault("dtype", "fp32")
        plan = plan_inference(causal_lm(model), cluster=cluster, **plan_options)
    elif plan_options:
        raise PlanError(f"{sorted(plan_options)}: planning options are for compile_inference without a plan")
    if backend == "codegen":
        from autopar.inference.codegen_engine import CodegenEngine
        return CodegenEngine(model, plan, weights, cluster, collective_timeout=collective_timeout)
    return InferenceEngine(model, plan, weights, collective_timeout)
