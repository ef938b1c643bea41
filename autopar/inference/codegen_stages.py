"""A Hugging Face causal LM's prefill and decode steps (``autopar.inference.codegen_step``'s
``CacheStep``) run as pipeline stages of autopar's per-rank programs on a pp x tp grid of ranks:
each stage rank runs its decoder layers' part of the step program
(``codegen.stages.split_step_stages``), holds only its layers' parameter blocks and cache blocks,
and passes the boundary values (the hidden states) to the same tp position of the next stage by
point-to-point send / recv; the attention mask and the rotary cos / sin are recomputed by every
stage from the step inputs, which every rank has.

- ``plan_stage_steps``: each step traced and planned on ONE stage's sub-mesh (tp ranks). The
  planner does pipeline stages only for training with at least pp micro-batches, so a step is
  planned without pp and cut at block boundaries here: evenly (``codegen.stages.even_stages``)
  unless the caller gives ``unit_stage`` (``unit_stages_of``: the cut of a pipelined plan of the
  same step, planned with the micro-batches the planner asks for).
- ``StageStepRunner``: one rank's stage programs (a prefill per padded prompt length, the decode
  step), its parameter and cache blocks; ``generate`` runs greedy (or sampled) generation over a
  left-padded batch, rows stopping at end-of-sequence tokens. The last stage chooses the tokens
  from its logits: when the plans return them as each tp rank's vocabulary slice
  (``codegen_step.logits_split``) its programs keep the slices and the choice runs over its tp
  group (``vocab_shard``, autopar/inference/vocab_parallel.py: greedy 2 numbers per row per rank,
  top-k 2 k), else its programs gather them whole (a shard of one). The tokens are then
  broadcast over the pipeline group, so every rank returns the same tokens. The static engine
  runs it for plans with ``pp > 1``
  (``compile_inference(..., backend="codegen")``, autopar/inference/codegen_engine.py).

Ranks: global rank ``offset + s * tp + l`` is tp position ``l`` of stage ``s``
(``runtime.context.setup`` with ``pp``; ``offset``: the first rank of this rank's data-parallel
replica, whose stages are consecutive; the tokens are then broadcast on the replica's own
pipeline group). No micro-batches: one step (``run``) runs the stages one after another. In flight
(``in_flight`` set: the continuous engine's virtual engines, autopar/inference/codegen_flights.py)
``forward`` runs one forward of this stage and sends its boundary values with ``isend``, waited on
by ``wait_sends`` at the end of the next tick, and ``share_tokens`` broadcasts the last stage's
tokens of a turn.
"""
from __future__ import annotations


import torch
import torch.distributed as dist

from autopar.cluster import Cluster
from autopar.inference.codegen_step import (N_STEP_INPUTS, CacheBlocks, CacheStep, NewTokens, PlannedStep,
                                            generate_over_steps, logits_split, plan_cache_step)
from autopar.inference.vocab_parallel import VocabShard, greedy_tokens
from codegen.per_rank import generate_step
from codegen.stages import even_stages, pipeline_units, split_step_stages
from runtime import context as RC

# dtype <-> code of the shape headers sent ahead of a boundary value
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool)
HEADER = 8   # dtype code, ndim, up to 6 sizes


def plan_stage_steps(step: CacheStep, batch: int, lengths, max_len: int, tp: int = 1, cluster=None,
                     **plan_kwargs) -> dict[int, PlannedStep]:
    """Sequence length -> its step planned on one stage's sub-mesh of ``tp`` ranks (1: the decode
    step); ``cluster`` defaults to ``tp`` CPU devices, ``plan_kwargs`` go to ``autopar.plan``."""
    cluster = cluster or Cluster.preset("cpu", devices=tp)
    constraints = dict(plan_kwargs.pop("constraints", {}))
    constraints.setdefault("dp", 1)
    if tp > 1:
        constraints.setdefault("tp", tp)
    return {s: plan_cache_step(step, batch, s, max_len, cluster, constraints=constraints, **plan_kwargs)
            for s in sorted(set(lengths) | {1})}


def unit_stages_of(plan) -> list[int]:
    """The stage of each block (``unit_stage``) in a pipelined plan of the same model (e.g. the
    step planned with ``{"pp": 2, "pp_schedule": "gpipe"}`` and the micro-batches the planner
    asks for): its cut, with one stage per rank position (no virtual stages: a step runs its
    stages once, in order)."""
    stages = plan.data.get("stages") or []
    if plan.pp < 2 or len(stages) != plan.pp:
        raise ValueError(f"unit_stages_of: a plan with {plan.pp} pipeline stage(s) over {len(stages)} stage "
                         f"entries; pin a schedule with one stage per rank (gpipe, 1f1b)")
    return [k for k, st in enumerate(stages) for _ in range(*st["blocks"])]


class StageStepRunner(CacheBlocks):
    """One rank's stage of a CacheStep's prefill and decode programs (module doc).

    ``steps``: sequence length -> PlannedStep on one stage's sub-mesh (``plan_stage_steps``);
    ``pp``: the stages; ``rank``: this global rank; ``unit_stage``: the stage of each decoder
    layer (``codegen.stages.pipeline_units`` order; default an even cut). ``offset``: the first
    rank of this rank's replica (its stage and tp position are of ``rank - offset``; peers are
    global ranks); ``group``: the replica's pipeline group of this tp position (the last stage's
    tokens are broadcast over it), default setup's ``pp_group``.
    ``read(fqn, slices)``, when given, returns the block ``slices`` of parameter ``fqn`` (an FQN of
    ``step.lm``) from a checkpoint, as ``StepRunner``'s; buffers still come from the model.
    ``runtime.context.setup(plan.mesh, pp=pp)`` must have run on every rank."""

    def __init__(self, step: CacheStep, steps: dict[int, PlannedStep], rank: int, pp: int,
                 unit_stage: list[int] | None = None, read=None, offset: int = 0, group=None):
        if 1 not in steps or len(steps) < 2:
            raise ValueError("StageStepRunner needs the decode step (length 1) and at least one prefill length")
        self.step, self.rank, self.pp = step, rank, pp
        self.tp = steps[1].plan.mesh.size
        self.stage, self.local = divmod(rank - offset, self.tp)
        self.source = offset + (pp - 1) * self.tp + self.local   # the last stage's rank of this tp position
        self.group = group
        self.last = self.stage == pp - 1
        units = len(pipeline_units(steps[1].traced))
        self.unit_stage = list(unit_stage) if unit_stage is not None else even_stages(units, pp)
        self.programs, self.stages, self.params = {}, {}, {}
        blocks: dict[tuple, torch.Tensor] = {}   # (fqn, slices) -> this rank's block, one copy for all programs
        named = {n for n, _ in step.named_parameters(remove_duplicate=False)}   # not buffers ("lm." + lm's FQN)
        split = all(logits_split(ps) for ps in steps.values())
        for seq, ps in steps.items():
            prog = generate_step(ps.traced, ps.plan, self.local, state=ps.state,
                                 whole=() if split else (ps.traced.outputs[0],))
            sp = split_step_stages(prog, ps.traced, self.unit_stage, pp)[self.stage]
            self.programs[seq], self.stages[seq] = prog, sp
            self.params[seq] = []
            for n in sp.param_names:
                fqn = prog.param_fqn[n]
                key = (fqn, tuple((s.start, s.stop) for s in prog.param_slices[fqn]))
                if key not in blocks and read is not None and fqn in named:
                    blocks[key] = read(fqn[len("lm."):], prog.param_slices[fqn])
                elif key not in blocks:
                    blocks[key] = prog.block_of(fqn, ps.traced.value_of(step, fqn)).detach().clone()
                self.params[seq].append(blocks[key])
        self.blocks = list(blocks.values())
        decode, dsp = self.programs[1], self.stages[1]
        self.cache_names = list(dsp.state_inputs)
        idx = [decode.input_names.index(n) for n in self.cache_names]
        self.cache_layouts = [decode.input_layouts[i] for i in idx]
        self.cache_shapes = [decode.input_shapes[i] for i in idx]
        for seq, sp in self.stages.items():
            prog = self.programs[seq]
            j = [prog.input_names.index(n) for n in sp.state_inputs]
            if sp.state_inputs != self.cache_names or [prog.input_layouts[i] for i in j] != self.cache_layouts \
                    or [prog.input_shapes[i] for i in j] != self.cache_shapes:
                raise ValueError(f"the length-{seq} step's stage {self.stage} holds other cache tensors, or in "
                                 f"another layout or shape, than the decode step's")
            if self.last and 0 not in sp.outputs:
                raise ValueError("the last stage does not return the logits")
        self.batch = decode.input_shapes[0][0]
        self.max_len = decode.input_shapes[N_STEP_INPUTS - 1][1]
        self.dtype = next(n for n in steps[1].traced.gm.graph.nodes
                          if n.name == decode.input_names[N_STEP_INPUTS]).meta["val"].dtype
        self.cache: list[torch.Tensor] = []
        self.vocab_shard = VocabShard()
        if split:   # the last stage's logits: each tp rank's vocabulary slice, over this stage's tp group
            mesh = steps[1].plan.mesh
            axis = mesh.axis("tp")
            self.vocab_shard = VocabShard(mesh.coords(self.local)[axis], mesh.shape[axis], RC.group_of(axis)[0])
        self.shapes: dict[tuple, list[tuple]] = {}   # (seq, boundary) -> shapes and dtypes, once known
        self.in_flight = False     # sends by isend (module doc)
        self.sends: list = []      # in flight: this tick's (work, tensor) isends
        self.sending: list = []    # in flight: the previous tick's, waited on by ``wait_sends``

    # ------------------------------------------------------------- blocks this rank holds
    def param_bytes(self) -> int:
        """Bytes of the parameter / buffer blocks this rank holds (every program's, once)."""
        return sum(b.numel() * b.element_size() for b in self.blocks)

    def param_fqns(self, seq: int = 1) -> list[str]:
        """FQNs of the parameters / buffers this rank holds blocks of (the length-``seq`` step's)."""
        prog = self.programs[seq]
        return [prog.param_fqn[n] for n in self.stages[seq].param_names]

    # ------------------------------------------------------------- point-to-point
    def _send(self, seq: int, values) -> None:
        peer = self.rank + self.tp
        key = (seq, self.stage)
        if key not in self.shapes:   # first step of this length: the receiver learns the shapes
            self.shapes[key] = [(tuple(v.shape), v.dtype) for v in values]
            for v in values:
                if v.dim() > HEADER - 2 or v.dtype not in DTYPES:
                    raise NotImplementedError(f"a boundary value of {v.dim()} dims, {v.dtype}: the shape header "
                                              f"holds up to {HEADER - 2} dims of {DTYPES}")
                head = torch.zeros(HEADER, dtype=torch.int64)
                head[0], head[1] = DTYPES.index(v.dtype), v.dim()
                head[2:2 + v.dim()] = torch.tensor(v.shape, dtype=torch.int64)
                self._post(head, peer)
        for v in values:
            self._post(v.contiguous(), peer)

    def _post(self, value: torch.Tensor, peer: int) -> None:
        if self.in_flight:
            self.sends.append((dist.isend(value, peer), value))
        else:
            dist.send(value, peer)

    def wait_sends(self) -> None:
        """In flight, the end of a tick: wait for the previous tick's sends (the next stage received
        them in this tick); this tick's are waited on at the end of the next."""
        for work, _ in self.sending:
            work.wait()
        self.sending, self.sends = self.sends, []

    def drop(self) -> None:
        """Forget the sends in flight (after a failed step: the pipeline is out of step)."""
        self.sends, self.sending = [], []

    def share_tokens(self, tokens: torch.Tensor | None, count: int) -> torch.Tensor:
        """The last stage's ``tokens`` ([count] int64) on every rank of this rank's pipeline (the
        other stages pass None)."""
        out = tokens.to(torch.int64).contiguous() if self.last else torch.empty(count, dtype=torch.int64)
        dist.broadcast(out, self.source, group=self.pipe_group())
        return out

    def pipe_group(self):
        """This rank's pipeline group: ``group``, else ``runtime.context.setup``'s ``pp_group``."""
        return self.group if self.group is not None else RC.current().extra["pp_group"]

    def _recv(self, seq: int, count: int) -> list[torch.Tensor]:
        peer = self.rank - self.tp
        key = (seq, self.stage - 1)
        if key not in self.shapes:
            shapes = []
            for _ in range(count):
                head = torch.zeros(HEADER, dtype=torch.int64)
                dist.recv(head, peer)
                shapes.append((tuple(head[2:2 + int(head[1])].tolist()), DTYPES[int(head[0])]))
            self.shapes[key] = shapes
        out = []
        for shape, dtype in self.shapes[key]:
            x = torch.empty(shape, dtype=dtype)
            dist.recv(x, peer)
            out.append(x)
        return out

    def run(self, seq: int, inputs: tuple, cache: list[torch.Tensor], chosen: NewTokens | None = None):
        """One step of length ``seq`` on this stage: (the step's tokens, every rank the same;
        this rank's new cache blocks). ``inputs``: the step inputs before the cache; ``chosen``
        picks the tokens from the last stage's logits (default: the argmax over ``vocab_shard``)."""
        logits, new = self.forward(seq, inputs, cache)
        if self.last:
            tokens = chosen.pick(logits) if chosen is not None else greedy_tokens(logits, self.vocab_shard)
        else:
            tokens = torch.empty(self.batch, dtype=torch.int64)
        if self.pp > 1:
            dist.broadcast(tokens, self.source, group=self.pipe_group())
        return tokens, new

    def forward(self, seq: int, inputs: tuple, cache: list[torch.Tensor]):
        """This stage's part of one step of length ``seq``: the boundary values received from the
        previous stage, its program run, its boundary values sent to the next; (the last-position
        logits on the last stage, whole or this rank's ``vocab_shard`` slice of them, None on the
        others; this rank's new cache blocks)."""
        sp, prog = self.stages[seq], self.programs[seq]
        received = self._recv(seq, len(sp.received)) if self.stage > 0 else []
        whole = dict(zip(prog.input_names, inputs))
        whole.update(zip(self.cache_names, cache))
        args = [whole[prog.input_names[p]] for p in sp.input_positions]
        out = sp.gm(*self.params[seq], *received, *args)
        n = len(sp.sent)
        if self.stage < self.pp - 1:
            self._send(seq, out[:n])
        results = dict(zip(sp.outputs, out[n:]))
        new = [results[prog.output_names.index(prog.state[c])] for c in self.cache_names]
        return (results[0] if self.last else None), new

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 eos: tuple = (), pad: int = 0, stamps: list | None = None, sample=None) -> torch.Tensor:
        """Greedy tokens [B, max_new_tokens] of left-padded ``prompts`` (``attention_mask`` 0 on
        the padding), or sampled by ``sample`` on the last stage (``NewTokens``), the same on every
        rank; this rank's final cache blocks are left in ``self.cache``. ``eos``, ``pad`` and
        ``stamps`` as ``StepRunner.generate``: rows stop at end-of-sequence tokens, and every rank
        stops together (the tokens are broadcast)."""
        chosen = NewTokens(prompts.shape[0], eos, pad, sample if self.last else None, stamps, self.vocab_shard)
        return generate_over_steps(self, prompts, attention_mask, max_new_tokens, chosen,
                                   lambda seq, inputs, cache: self.run(seq, inputs, cache, chosen))


__all__ = ["plan_stage_steps", "unit_stages_of", "StageStepRunner"]
