"""Running this rank's pipeline stage(s) of a per-rank program with torch.distributed.pipelining.

``PipelineRunner(stages, num_stages, schedule, num_micro_batches, device, pp_group)`` wraps each of
this rank's stage programs (codegen/stages.py; one, or v under interleaving: stages r, r + pp, ...)
in a ``StageModule`` and a ``PipelineStage``, and runs them under one of PyTorch's schedules
(``SCHEDULES``: ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble);
the schedules decide every send, receive, forward and backward — nothing here orders them.
``run(micro)`` is one training step's forward and backward, ``run(micro, train=False)`` the
schedule's ``eval``. Counters for tests: ``calls`` (stage forwards), ``p2p_bytes`` (what the
schedule's send operations carried), ``weight_passes`` (zero-bubble's separate weight-gradient
passes) and ``measure_saved()`` (``SavedProbe``: saved-activation bytes alive on the rank).

How the pieces meet PyTorch's runtime:
- Micro-batches are cut by autopar (``compiled._local_micro_batches``: along each input's batch dim,
  this rank's data-parallel rows), not by the schedule. The schedule is handed only the micro-batch
  INDEX (``arange(m)``, split into one-element chunks: as the first stage's positional argument, as
  the ``mb`` keyword argument of the other stages), and every stage looks its inputs up by it: the
  last stage reads the labels, any stage the masks or positions it recomputes, whatever order the
  schedule runs the micro-batches in.
- The last stage's program returns its micro-batch's exact SHARE of the step's loss (runtime/loss.py
  global denominators, 1/m scales; autopar/rules/microbatch.py), so the schedule's loss function is the
  identity on that output, losses and gradients are sums over micro-batches and the schedule must
  not rescale gradients (``scale_grads=False``).
- Gradients accumulate in ``p.grad`` over the micro-batches; the caller's DP/ZeRO reducer runs once
  after the schedule (``step`` runs the schedule inside the reducer's ``no_sync``). ZeRO-2/3
  reduce a chunk's gradient as soon as a micro-batch's backward completes it (post-accumulate-grad
  hooks); zero-bubble's separate weight pass writes ``p.grad`` itself (no hooks) except on stage
  0, so ``on_weight_grads(params)`` is called after each weight pass (the sharded optimizer's
  ``grads_accumulated``).
- A parameter read on several stages (a tied embedding and output head) has a gradient part on
  each: ``sum_tied_grads`` all-reduces them over the group of those stages' ranks (same sub-mesh
  coordinates) before the optimizer, so every copy takes the same update.
- The loss: the last stage sums its micro-batch shares; ``run`` returns it (the caller all-reduces
  it over the stage's partial axes) and ``broadcast_loss`` sends it to every stage.
- Stages of one rank share a parameter tensor they both read (autograd sums its gradient there);
  zero-bubble computes weight gradients for ``StageModule.parameters()``, so the trainable
  parameters are registered on each stage module.

PipelineStage infers the shapes of what crosses each boundary at the first step by running one
micro-batch's forward and backward metadata pass (PyTorch's "dynamic" mode); its collectives run
inside every stage's own groups, symmetrically.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

# Schedules with several stages per rank: PyTorch's class for each.
MULTI = {"interleaved-1f1b": "ScheduleInterleaved1F1B", "zero-bubble": "ScheduleInterleavedZeroBubble"}
SCHEDULES = ("gpipe", "1f1b", *MULTI)


class SavedProbe:
    """Saved-activation bytes alive on this rank while a schedule runs (measurement, tests):
    autograd's saved tensors of every (stage, micro-batch) forward, as distinct storages without
    the parameters', alive from that forward until the micro-batch's backward on that stage; with
    activation checkpointing, the tensor inputs each region keeps (runtime/checkpoint.py), and
    ``regions`` lists the regions run (a test reruns their bodies to measure what recomputation saves)."""

    def __init__(self, params):
        self.skip = {id(p.untyped_storage()) for p in params}
        self.keep = [p.untyped_storage() for p in params]   # alive, so their ids stay theirs
        self.reset()

    def reset(self):
        self.regions: list[tuple] = []   # (key, region name, body, inputs) of every checkpoint region run
        self.saved: dict[tuple, dict] = {}
        self.alive: set = set()
        self.peak = 0
        self.peak_alive = 0

    def run(self, key, fn, *args, inputs=()):
        """``fn(*args)`` under the hooks; ``inputs``: the micro-batch's input tensors, views of the
        global batch, whose shared storage is counted at the micro-batch's own size."""
        from runtime.checkpoint import record_regions

        seen = self.saved.setdefault(key, {})
        views = {id(x.untyped_storage()): x.numel() * x.element_size() for x in inputs if isinstance(x, torch.Tensor)}

        def note(t):
            st = t.untyped_storage()
            if id(st) not in self.skip and id(st) not in seen:
                seen[id(st)] = (st, views.get(id(st), st.nbytes()))

        def pack(t):
            note(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), record_regions() as log:
            out = fn(*args)
        # an activation-checkpoint region saves nothing through these hooks (torch.utils.checkpoint's
        # own take them); what it keeps for backward is its tensor inputs
        for name, body, rargs in log:
            for a in rargs:
                if isinstance(a, torch.Tensor):
                    note(a)
            self.regions.append((key, name, body, rargs))
        self.alive.add(key)
        total = sum(nb for k in self.alive for _, nb in self.saved[k].values())
        if total > self.peak:
            self.peak, self.peak_alive = total, len(self.alive)
        return out

    def released(self, key):
        self.alive.discard(key)
        self.saved.pop(key, None)


class StageModule(nn.Module):
    """One stage program as the module PipelineStage runs (see the module doc)."""

    def __init__(self, gm, params, input_positions, first: bool):
        super().__init__()
        self.gm = gm
        self.first = first
        self.stage_params = list(params)          # this rank's blocks, in the stage program's order
        # registered too: zero-bubble schedules compute weight gradients for submod.parameters()
        self.trainable = nn.ParameterList([p for p in params if isinstance(p, nn.Parameter)])
        self.input_positions = list(input_positions)
        self.micro: list[tuple] = []              # this step's micro-batches (set by the runner)
        self.calls = 0                            # forwards run (tests: the stage really ran)
        self.index = 0                            # its stage index
        self.probe: SavedProbe | None = None      # measures saved activations when set

    def forward(self, *args, mb=None):
        if self.first:
            (mb,), acts = args[:1], ()
        else:
            acts = args
        i = int(mb.reshape(-1)[0])
        inputs = self.micro[i]
        self.calls += 1
        args = (*self.stage_params, *acts, *(inputs[k] for k in self.input_positions))
        if self.probe is not None and torch.is_grad_enabled():
            return self.probe.run((self.index, i), self.gm, *args,
                                  inputs=[inputs[k] for k in self.input_positions])
        return self.gm(*args)


def _identity_loss(output, target):
    return output


class PipelineRunner:
    """This rank's stages (one, or ``v`` under interleaving: virtual stages r, r + pp, ...) under
    one PyTorch schedule. ``stages``: (stage index, GraphModule, parameter values, input positions)."""

    def __init__(self, stages, num_stages: int, schedule: str, num_micro_batches: int, device, pp_group,
                 on_weight_grads=None):
        from torch.distributed import pipelining as PL

        if schedule not in SCHEDULES:
            raise ValueError(f"pipeline schedule {schedule!r}: runnable schedules are {', '.join(SCHEDULES)}")
        self.num_stages, self.nm = num_stages, num_micro_batches
        self.first = any(i == 0 for i, *_ in stages)
        self.last = any(i == num_stages - 1 for i, *_ in stages)
        self.modules = [StageModule(gm, params, pos, i == 0) for i, gm, params, pos in stages]
        for mod, (i, *_) in zip(self.modules, stages):
            mod.index = i
        self.probe = None
        self.pp_group = pp_group
        self.pipe_stages = [PL.PipelineStage(mod, i, num_stages, torch.device(device), group=pp_group)
                            for mod, (i, *_) in zip(self.modules, stages)]
        self.p2p_bytes = 0   # activations and gradients this rank sent to other stages
        self.weight_passes = 0   # separate weight-gradient passes run (zero-bubble schedules)
        for st in self.pipe_stages:
            for name in ("get_fwd_send_ops", "get_bwd_send_ops"):
                setattr(st, name, self._counting(getattr(st, name)))
            st.backward_weight_one_chunk = self._counting_weight(st.backward_weight_one_chunk, st.submod)
        self.on_weight_grads = on_weight_grads
        kw = dict(loss_fn=_identity_loss, scale_grads=False)
        if schedule in MULTI:
            self.schedule = getattr(PL, MULTI[schedule])(self.pipe_stages, num_micro_batches, **kw)
        else:
            if len(self.pipe_stages) != 1:
                raise ValueError(f"schedule {schedule!r} runs one stage per rank, this rank has {len(stages)}")
            cls = {"gpipe": PL.ScheduleGPipe, "1f1b": PL.Schedule1F1B}[schedule]
            self.schedule = cls(self.pipe_stages[0], num_micro_batches, **kw)

    def measure_saved(self) -> SavedProbe:
        """Start measuring saved activations alive on this rank (``SavedProbe``); returns the probe."""
        self.probe = SavedProbe([p for m in self.modules for p in m.stage_params])
        for m in self.modules:
            m.probe = self.probe
        for st in self.pipe_stages:
            st.backward_one_chunk = self._releasing(st, st.backward_one_chunk)
        return self.probe

    def _releasing(self, stage, fn):
        def wrapped(chunk, *a, **k):
            out = fn(chunk, *a, **k)
            self.probe.released((stage.stage_index, chunk))
            return out
        return wrapped

    @property
    def calls(self) -> int:
        return sum(m.calls for m in self.modules)

    def _counting(self, get_ops):
        """The schedule's send operations, their bytes counted (what this rank sends point-to-point)."""
        def wrapped(*a, **k):
            ops = get_ops(*a, **k)
            for op in ops:
                if op.op in (dist.isend, dist.send):
                    self.p2p_bytes += op.tensor.numel() * op.tensor.element_size()
            return ops
        return wrapped

    def _counting_weight(self, fn, module):
        def wrapped(*a, **k):
            self.weight_passes += 1
            out = fn(*a, **k)
            if self.on_weight_grads is not None:   # its p.grad were written without autograd's hooks
                self.on_weight_grads(module.stage_params)
            return out
        return wrapped

    def run(self, micro: list[tuple], train: bool = True) -> torch.Tensor | None:
        """Forward and backward of every micro-batch (forward only with ``train=False``: the
        schedule's ``eval``); on the last stage's rank the summed loss shares."""
        for m in self.modules:
            m.micro = micro
        idx = torch.arange(self.nm)
        losses = [] if self.last else None
        target = torch.zeros(self.nm) if self.last else None
        args = (idx,) if self.first else ()
        if train:
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False, mb=idx)
        else:   # PyTorch re-runs its metadata pass when switching between eval and step
            self.schedule.eval(*args, target=target, losses=losses, return_outputs=False, mb=idx)
        for m in self.modules:
            m.micro = []
        if not self.last:
            return None
        total = torch.zeros((), dtype=torch.float32, device=losses[0].device)
        for x in losses:
            total = total + x.detach().float()
        return total

    def broadcast_loss(self, loss: torch.Tensor | None, device) -> float:
        """The step's loss from the last stage's rank to every rank (over this rank's pp group)."""
        t = loss.clone() if loss is not None else torch.zeros((), dtype=torch.float32, device=device)
        src = (self.num_stages - 1) % dist.get_world_size(self.pp_group)
        dist.broadcast(t, group=self.pp_group, group_src=src)
        return float(t)


def tied_groups(stages_of: dict[str, tuple[int, ...]], num_stages: int, stage_size: int, local_rank: int):
    """For every distinct set of stages sharing parameters: the process group of this rank's
    counterparts (same sub-mesh position) on those stages. Collective over the world: every rank
    creates every group in one order. Returns {stage set: group or None (not a member)}."""
    out = {}
    for sset in sorted(set(stages_of.values())):
        mine = None
        for pos in range(stage_size):
            g = dist.new_group([s * stage_size + pos for s in sset])
            if pos == local_rank:
                mine = g
        out[sset] = mine
    return out


@torch.no_grad()
def sum_tied_grads(params: dict, stages_of: dict, groups: dict, stage: int) -> int:
    """All-reduce the gradient of every parameter read on several stages over those stages'
    ranks; returns the bytes sent."""
    sent = 0
    for fqn, sset in sorted(stages_of.items()):
        if stage not in sset or fqn not in params:
            continue
        p = params[fqn]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=groups[sset])
        sent += p.grad.numel() * p.grad.element_size()
    return sent


__all__ = ["SCHEDULES", "StageModule", "PipelineRunner", "tied_groups", "sum_tied_grads"]
