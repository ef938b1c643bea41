"""A Hugging Face causal LM's prefill and decode steps run as autopar's own per-rank programs:
traced by ``autopar.frontend.trace.trace_step``, planned by ``autopar.plan``, lowered by
``codegen.per_rank.generate_step``, with the KV cache as explicit state each rank holds only its
block of. The static engine runs through it under ``compile_inference(..., backend="codegen")``
(autopar/inference/codegen_engine.py); by default the engines (engine.py, iteration_engine.py) run
the model's own modules sliced by tp_shard.py.

- ``CacheStep(lm)``: one prefill or decode step over a preallocated cache given as explicit
  tensors, returning the last position's logits and the updated cache; the cache write traces to
  an out-of-place ``aten.index_copy`` (rule: autopar/rules/ops_cache.py), so the traced step
  mutates nothing and the new cache is an ordinary output. GPT-2's fused qkv projection is traced
  as three (autopar/inference/fused_qkv.py), so a tp plan splits its cache by heads.
- ``empty_cache(lm, batch, max_len)``: the whole zero cache k_0, v_0, k_1, ... (one process), in
  the model's dtype: a step is traced, planned and run in the dtype of the model it is given
  (``STEP_DTYPES``: an InferencePlan's dtype, the model's cast to it, the planner's precision).
- ``step_inputs`` / ``trace_cache_step`` / ``plan_cache_step``: a step's example inputs, its
  trace, and its trace and plan (``PlannedStep``) for one (batch, length) shape.
- ``StepRunner``: one rank's programs (a prefill per padded prompt length, the decode step), its
  parameter blocks and its cache blocks, allocated in the layout the plan gives the cache;
  ``generate`` runs greedy generation over a left-padded batch (stopping rows at end-of-sequence
  tokens as Hugging Face's ``generate`` does). Its parameter blocks are the model's, or read from
  a checkpoint block by block (``read``).

The cost model prices a step as a training step whose parameters are all frozen (no gradient or
optimizer); the strategies are what matter here. Pipeline stages of these steps are
autopar/inference/codegen_stages.py's; no data parallelism or mixed precision (a bf16 model's step
runs in bf16 throughout, as its modules do). ``NewTokens`` chooses each step's tokens from the
logits: the argmax, or a sampler the caller gives, over the runner's ``vocab_shard``. A step's
outputs are planned as values, in any layout but never partial sums (autopar/rules/candidates.py:
the reduction is priced where it runs), so under tp the planner itself chooses a column
(vocabulary)-parallel LM head on its replicated input, with no communication, over a row-parallel
one whose partial logits must be reduced. Where the plan returns the logits as each tp rank's
vocabulary slice (``logits_split``) ``StepRunner`` keeps them so (its ``vocab_shard`` that slice);
otherwise they are gathered whole inside the programs and the shard is of one.
"""
from __future__ import annotations

import copy
import math
import time
import types
from dataclasses import dataclass

import torch
import torch.nn as nn

from autopar.api import plan as make_plan
from autopar.frontend.trace import TracedGraph, trace_step
from autopar.inference.fused_qkv import fold_cat_split, split_fused_qkv
from autopar.inference.vocab_parallel import VocabShard, greedy_tokens
from autopar.rules.layout import Layout
from codegen.per_rank import generate_step

N_STEP_INPUTS = 4   # input_ids, position_ids, cache_position, attention_mask; then the cache tensors


def _functional_update(layer, key_states, value_states, *args, **kwargs):
    """StaticLayer.update without the in-place writes: ``index_copy`` (out of place) at
    ``cumulative_length`` (here the step's first cache position, a graph input), so the traced
    step is functional and the updated cache is an ordinary output instead of a mutated input."""
    pos = torch.arange(key_states.shape[-2], device=key_states.device) + layer.cumulative_length
    layer.keys = layer.keys.index_copy(2, pos, key_states)
    layer.values = layer.values.index_copy(2, pos, value_states)
    return layer.keys, layer.values


def full_cache_config(config, max_len: int):
    """The config a StaticCache of ``max_len`` positions is built from so that every layer keeps
    every position in its own slot: ``config`` itself, or, where its sliding window is at least
    ``max_len`` positions (the window never slides, so those layers attend to everything, as full
    attention), a copy without the window. Raises NotImplementedError, with the reason, when some
    layer's cache would still be a ring buffer (a window shorter than the cache, chunked attention)."""
    from transformers import StaticCache

    window = getattr(config, "sliding_window", None)
    if window is not None and window >= max_len:
        config = copy.copy(config)
        config.sliding_window = None
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = ["full_attention" if t == "sliding_attention" else t for t in config.layer_types]
    ring = sorted({type(layer).__name__ for layer in StaticCache(config=config, max_cache_len=max_len).layers}
                  - {"StaticLayer"})
    if ring:
        why = (f"a sliding window of {window} positions, shorter than the cache's {max_len}" if window is not None
               else "not full attention")
        raise NotImplementedError(f"cache layers {ring} ({why}): a ring buffer, where CacheStep writes every "
                                  f"position to its own slot")
    return config


class CacheStep(nn.Module):
    """One prefill or decode step of a Hugging Face causal LM over a preallocated KV cache given
    as explicit tensors::

        forward(input_ids [B, S], position_ids [B, S], cache_position [S], attention_mask [B, max_len],
                k_0, v_0, k_1, v_1, ...)  ->  (logits of the last position [B, V], k_0', v_0', ...)

    each cache tensor ``[B, kv_heads, max_len, head_dim]``, returned with slots ``cache_position``
    written. The cache is a transformers StaticCache whose layers hold the input tensors and write
    with ``index_copy``; the model builds its attention mask from ``attention_mask`` (1 on the
    slots holding real tokens, left padding 0) and ``cache_position`` over all ``max_len`` slots,
    and ``position_ids`` are each row's own positions, so one traced program serves every step of
    its (B, S) shape: S = 1 is the decode program, S = a padded prompt length a prefill program.
    All rows write the same slots: a left-padded batch, as engine.py's ``generate`` runs. Models
    whose cache has sliding-window layers (Mistral) run only when the window is at least the
    cache (``full_cache_config``); otherwise they are refused: their slots are a ring buffer.
    ``lm`` is traced through ``fused_qkv.split_fused_qkv``'s view (GPT-2's fused qkv as three
    projections, ``qkv_columns`` mapping their parameters to the model's); ``lm`` is unchanged."""

    n_inputs = N_STEP_INPUTS   # inputs before the cache tensors

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm, self.qkv_columns = split_fused_qkv(lm)   # GPT-2's fused qkv as q, k, v (fused_qkv.py)
        self.n_layers = lm.config.num_hidden_layers

    def forward(self, input_ids, position_ids, cache_position, attention_mask, *kv):
        from transformers import StaticCache

        try:
            config = full_cache_config(self.lm.config, kv[0].shape[2])
        except NotImplementedError as e:
            raise NotImplementedError(f"{type(self.lm).__name__}: {e}") from None
        cache = StaticCache(config=config, max_cache_len=kv[0].shape[2])
        for i, layer in enumerate(cache.layers):
            layer.keys, layer.values = kv[2 * i], kv[2 * i + 1]
            layer.batch_size, layer.num_heads = kv[2 * i].shape[:2]
            layer.k_head_dim, layer.v_head_dim = kv[2 * i].shape[-1], kv[2 * i + 1].shape[-1]
            layer.device = kv[2 * i].device
            layer.cumulative_length = cache_position[0]
            layer.is_initialized = True
            layer.update = types.MethodType(_functional_update, layer)
        out = self.lm(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                      past_key_values=cache, cache_position=cache_position, use_cache=True)
        news = []
        for layer in cache.layers:
            news += [layer.keys, layer.values]
        return (out.logits[:, -1], *news)


# an InferencePlan's dtype -> (the torch dtype its steps are traced and run in, ``autopar.plan``'s precision)
STEP_DTYPES = {"fp32": (torch.float32, "fp32"), "bf16": (torch.bfloat16, "bf16"), "fp16": (torch.float16, "bf16")}


def model_dtype(lm: nn.Module) -> torch.dtype:
    """The dtype of ``lm``'s floating parameters (fp32 when it has none)."""
    return next((p.dtype for p in lm.parameters() if p.is_floating_point()), torch.float32)


def empty_cache(lm: nn.Module, batch: int, max_len: int, dtype=None) -> list[torch.Tensor]:
    """The whole (unsplit) preallocated cache of ``lm``: k_0, v_0, k_1, ... all zeros, in ``dtype``
    (default: ``lm``'s parameters' dtype, as its attention writes the cache)."""
    dtype = dtype or model_dtype(lm)
    cfg = lm.config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return [torch.zeros(batch, heads, max_len, head_dim, dtype=dtype) for _ in range(2 * cfg.num_hidden_layers)]


def step_inputs(lm: nn.Module, batch: int, seq: int, max_len: int) -> tuple:
    """Example inputs of a (batch, seq) step over a ``max_len`` cache (any values: the traced
    program depends on the shapes only)."""
    mask = torch.zeros(batch, max_len, dtype=torch.long)
    mask[:, :seq] = 1
    return (torch.ones(batch, seq, dtype=torch.long), torch.arange(seq).expand(batch, seq).contiguous(),
            torch.arange(seq), mask, *empty_cache(lm, batch, max_len))


@dataclass
class PlannedStep:
    """A CacheStep traced and planned for one (batch, seq) shape."""
    traced: TracedGraph
    plan: object   # autopar.plans.plan.Plan
    n_inputs: int = N_STEP_INPUTS   # the step's inputs before the cache tensors (its ``n_inputs``)

    @property
    def state(self) -> dict[str, str]:
        """Cache input name -> the output it is returned as."""
        return dict(zip(self.traced.input_names[self.n_inputs:], self.traced.outputs[1:]))


def trace_cache_step(step: CacheStep, batch: int, seq: int, max_len: int) -> TracedGraph:
    """``step`` traced at (batch, seq) over a ``max_len`` cache (deterministic: every rank may trace
    its own), a split of a concatenation into its own pieces folded (``fused_qkv.fold_cat_split``)."""
    return fold_cat_split(trace_step(step, step_inputs(step.lm, batch, seq, max_len)), step)


def plan_cache_step(step: CacheStep, batch: int, seq: int, max_len: int, cluster, traced: TracedGraph | None = None,
                    **plan_kwargs) -> PlannedStep:
    """Trace ``step`` at (batch, seq) over a ``max_len`` cache (or take ``traced``, that trace) and
    plan it (``autopar.plan``'s keyword arguments, e.g. ``constraints={"tp": 2}``); the batch dim of
    every input but ``cache_position`` is dim 0."""
    inputs = step_inputs(step.lm, batch, seq, max_len)
    traced = traced if traced is not None else fold_cat_split(trace_step(step, inputs), step)
    plan = make_plan(step, inputs, cluster, traced=traced, batch_dims=(0, 0, None, 0) + (0,) * (len(inputs) - 4),
                     **plan_kwargs)
    return PlannedStep(traced, plan)


def logits_split(ps: PlannedStep) -> bool:
    """Whether ``ps``'s plan returns the logits as each tp rank's slice of the vocabulary (the last
    dim split over the ``tp`` axis alone, no partial sums): a column (vocabulary)-parallel LM head's
    layout, as the planner chose it."""
    mesh = ps.plan.mesh
    if "tp" not in mesh.names or mesh.shape[mesh.axis("tp")] == 1:
        return False
    op = next((op for op in ps.plan.ops if op["node"] == ps.traced.outputs[0]), None)
    if op is None:
        return False
    lay = Layout.from_json(op["outputs"][0])
    axis = mesh.axis("tp")
    return not lay.partial and lay.dims[-1] == (axis,) and all(axis not in d for d in lay.dims[:-1])


class NewTokens:
    """The new tokens of one ``generate``, chosen step by step from the logits [B, V / shard.size]
    (``shard``: this rank's slice of the vocabulary, default the whole of it): the argmax
    (``vocab_parallel.greedy_tokens``), or ``sample(logits, shard)`` (a callable returning [B]
    token ids, e.g. codegen_engine.py's ``sampler``); a row that chose one of ``eos`` continues
    with ``pad``, and ``done`` once every row has, as Hugging Face's ``generate``. ``stamps`` (a list) gets
    ``time.perf_counter()`` after each new token. ``pick`` needs the logits (a pipeline's last
    stage); ``add`` records the step's tokens (every rank)."""

    def __init__(self, batch: int, eos: tuple = (), pad: int = 0, sample=None, stamps: list | None = None,
                 shard: VocabShard | None = None):
        self.eos = torch.tensor(sorted(set(eos)), dtype=torch.long)
        self.pad, self.sample, self.stamps = pad, sample, stamps
        self.shard = shard if shard is not None else VocabShard()
        self.live = torch.ones(batch, dtype=torch.bool)
        self.tokens: list[torch.Tensor] = []

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        tok = self.sample(logits, self.shard) if self.sample is not None else greedy_tokens(logits, self.shard)
        return torch.where(self.live, tok, self.pad)

    def add(self, tok: torch.Tensor) -> None:
        self.tokens.append(tok)
        self.live = self.live & ~torch.isin(tok, self.eos)
        if self.stamps is not None:
            self.stamps.append(time.perf_counter())

    @property
    def done(self) -> bool:
        return not bool(self.live.any())


def generate_over_steps(runner, prompts: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                        chosen: NewTokens, step) -> torch.Tensor:
    """The generation loop both runners share: left-padded ``prompts`` padded further to the
    shortest planned prefill length that holds them, one prefill step, then decode steps until
    ``max_new_tokens`` or every row has stopped (``chosen``). ``runner`` has ``programs`` (keyed by
    step length), ``batch``, ``max_len`` and ``new_cache()``; ``step(seq, (input_ids,
    position_ids, cache_position, attention_mask), cache)`` returns (the new tokens [B], the
    updated cache). The final cache is left in ``runner.cache``."""
    B, P = prompts.shape
    if B != runner.batch:
        raise ValueError(f"the steps were planned for a batch of {runner.batch}, got {B} prompts")
    lengths = sorted(s for s in runner.programs if s > 1 and s >= P)
    if not lengths:
        raise ValueError(f"no prefill step holds prompts of {P} tokens (planned: {sorted(runner.programs)})")
    S = lengths[0]
    if S + max_new_tokens - 1 > runner.max_len:
        raise ValueError(f"{S} prompt slots + {max_new_tokens} new tokens exceed the cache's {runner.max_len}")
    ids = torch.cat([prompts.new_zeros(B, S - P), prompts], 1)
    mask = torch.cat([attention_mask.new_zeros(B, S - P), attention_mask], 1)
    slots = torch.zeros(B, runner.max_len, dtype=torch.long)
    slots[:, :S] = mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    tok, cache = step(S, (ids, pos, torch.arange(S), slots), runner.new_cache())
    chosen.add(tok)
    last = pos[:, -1:]
    for t in range(max_new_tokens - 1):
        if chosen.done:
            break
        slots[:, S + t] = 1
        last = last + 1
        tok, cache = step(1, (chosen.tokens[-1][:, None], last, torch.tensor([S + t]), slots), cache)
        chosen.add(tok)
    runner.cache = cache
    return torch.stack(chosen.tokens, 1)


class CacheBlocks:
    """The cache blocks a runner holds: ``programs`` (keyed by step length; the decode step, 1,
    gives the layout), ``cache_names``, ``cache_layouts``, ``cache_shapes`` (whole) and ``dtype``
    set by the runner."""

    def new_cache(self) -> list[torch.Tensor]:
        """This rank's zero cache blocks, in the layout the plans give the cache."""
        return [torch.zeros(self.programs[1].input_block_shape(n), dtype=self.dtype) for n in self.cache_names]

    def cache_bytes(self) -> int:
        """Bytes of this rank's cache blocks, as the plan's cache layout says."""
        mesh = self.programs[1].mesh_shape
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return sum(math.prod(shape) * itemsize // math.prod(lay.split_factor(d, mesh) for d in range(len(shape)))
                   for lay, shape in zip(self.cache_layouts, self.cache_shapes))


    def whole_cache_bytes(self) -> int:
        """Bytes of the cache blocks unsplit (what each rank would hold if the plan kept them whole)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return sum(math.prod(shape) * itemsize for shape in self.cache_shapes)


class StepRunner(CacheBlocks):
    """One rank's prefill and decode programs of a CacheStep and the cache blocks they share.

    ``steps``: sequence length -> PlannedStep, 1 the decode step, the others prefill lengths
    (prompts are left-padded to the shortest one that holds them). Every program takes and returns
    the cache in the same layout (checked), so the blocks stay on this rank between steps. Every
    rank of the plans' mesh builds its runner and calls ``generate`` with the same prompts (the
    programs run collectives); ``runtime.context.setup(plan.mesh)`` must have run.

    ``read(fqn, slices)``, when given, returns the block ``slices`` of parameter ``fqn`` (an FQN of
    ``step.lm``, the traced view: ``fused_qkv.mapped_read(read, step.qkv_columns)`` reads a
    checkpoint of the model's own FQNs) from a checkpoint: the parameter blocks are read (once each,
    shared by the programs) instead of sliced from the model's tensors; buffers still come from the
    model."""

    def __init__(self, step: CacheStep, steps: dict[int, PlannedStep], rank: int, read=None):
        if 1 not in steps or len(steps) < 2:
            raise ValueError("StepRunner needs the decode step (length 1) and at least one prefill length")
        self.step, self.rank = step, rank
        self.programs, self.params = {}, {}
        read_blocks: dict = {}
        named = {n for n, _ in step.named_parameters(remove_duplicate=False)}   # not buffers ("lm." + lm's FQN)
        split = all(logits_split(ps) for ps in steps.values())
        for seq, ps in steps.items():
            prog = generate_step(ps.traced, ps.plan, rank, state=ps.state,
                                 whole=() if split else (ps.traced.outputs[0],))
            self.programs[seq] = prog
            blocks = []
            for n in prog.param_names:
                fqn = prog.param_fqn[n]
                if read is None or fqn not in named:
                    blocks.append(prog.block_of(fqn, ps.traced.value_of(step, fqn)))
                    continue
                sl = prog.param_slices[fqn]
                key = (fqn, tuple((s.start, s.stop, s.step) for s in sl))
                if key not in read_blocks:
                    read_blocks[key] = read(fqn[len("lm."):], sl)
                blocks.append(read_blocks[key])
            self.params[seq] = blocks
        decode, n = self.programs[1], step.n_inputs
        self.cache_names = decode.input_names[n:]
        self.cache_layouts = decode.input_layouts[n:]
        self.cache_shapes = decode.input_shapes[n:]
        for seq, prog in self.programs.items():
            if prog.input_layouts[n:] != self.cache_layouts or prog.input_shapes[n:] != self.cache_shapes:
                raise ValueError(f"the length-{seq} step holds the cache in another layout or shape than the "
                                 f"decode step: plan them with the same constraints and cache length")
        self.batch, _, self.max_len, _ = self.cache_shapes[0]
        self.dtype = next(n for n in steps[1].traced.gm.graph.nodes
                          if n.name == self.cache_names[0]).meta["val"].dtype
        self.cache: list[torch.Tensor] = []
        self.vocab_shard = VocabShard()
        if split:   # each tp rank's slice of the logits, as planned (``logits_split``)
            from runtime import context as RC
            mesh = steps[1].plan.mesh
            axis = mesh.axis("tp")
            self.vocab_shard = VocabShard(mesh.coords(rank)[axis], mesh.shape[axis], RC.group_of(axis)[0])

    def run(self, seq: int, *inputs):
        """One step of length ``seq``: (the last position's logits, whole or this rank's
        ``vocab_shard`` slice of them, *this rank's cache blocks)."""
        return self.programs[seq].gm(*self.params[seq], *inputs)

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 eos: tuple = (), pad: int = 0, stamps: list | None = None, sample=None) -> torch.Tensor:
        """Greedy tokens [B, max_new_tokens] of left-padded ``prompts`` (``attention_mask`` 0 on
        the padding), or sampled by ``sample`` (``NewTokens``); the final cache blocks are left in
        ``self.cache``. With ``eos`` token ids, a
        row that chose one continues with ``pad`` (fed back as its next token) and generation stops
        once every row has, as Hugging Face's ``generate``: then fewer than ``max_new_tokens``
        columns. ``stamps`` (a list) gets ``time.perf_counter()`` after each new token."""
        chosen = NewTokens(prompts.shape[0], eos, pad, sample, stamps, self.vocab_shard)

        def step(seq, inputs, cache):
            logits, *new = self.run(seq, *inputs, *cache)
            return chosen.pick(logits), new

        return generate_over_steps(self, prompts, attention_mask, max_new_tokens, chosen, step)
