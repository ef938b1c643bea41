"""The execution side of a pipelined plan inside ``autopar.compile`` (CompiledModel with pp > 1).

``setup(cm)`` builds this rank's stage runner (runtime/pipeline.py: PyTorch's PipelineStage and
schedule over the stage program codegen/stages.py cut from the per-rank program) and the groups
that sum a parameter's gradient over the stages that read it; ``step(cm, micro)`` runs one
training step, ``forward(cm, micro)`` a forward-only one; ``full_state_dict(cm)`` assembles
full tensors when ranks hold different stages;
``full_optimizer_state(cm, local)`` the same for the optimizer's state (save/load);
``check_options(cm)`` refuses what does not run under pipelining yet, before any group is made.

Gradient clipping (``compile(grad_clip=...)``) is the sharded optimizer's (runtime/zero_step.py), with
the pp group among its norm groups: each stage's squared norm (summed over its data and model
axes) is summed over the stages, and a tied parameter, whose full gradient every one of its k
stages holds once the copies are summed, is weighted 1/k — the norm of the whole model's gradient,
as ``clip_grad_norm_`` on one process computes it.

ZeRO inside a stage runs over the stage's data group as without pipelining (runtime/zero.py):
ZeRO-2/3 reduce-scatter a chunk's gradient as each micro-batch's backward completes it, ZeRO-3
gathers each chunk per micro-batch for forward and again for backward (calls codegen/stages.py
puts into each stage program) — what the planner prices. A tied parameter is a chunk of its own
on both of its stages, so its gradient shards line up and are summed between them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.errors import ExecutionError
from autopar.plans.plan_schema import checkpoint_mode_of
from codegen.stages import add_zero3_regions
from runtime.pipeline import PipelineRunner, sum_tied_grads, tied_groups


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def check_options(cm) -> None:
    """What pipelined execution does not do yet: a clear error before any group is made."""

    modes = {checkpoint_mode_of(v) for v in (cm.plan.data["stages"][0].get("checkpoint") or {}).values()} - {"none"}
    if modes:
        zero = int(cm.plan.degrees.get("zero", 0) or 0)
        sched = cm.plan.degrees.get("pp_schedule")
        why = ("selective recompute" if "selective" in modes else
               "ZeRO-3 (the stages' gathers are outside their checkpoint regions)" if zero == 3 else
               "the zero-bubble schedule" if sched == "zero-bubble" else None)
        if why:
            raise ExecutionError(f"activation checkpointing under pipeline parallelism with {why} is not implemented: "
                                 f"re-plan (autopar/search/pipeline_pins.py refuses these pins)", collective=True)
    if int(cm.plan.degrees.get("zero", 0) or 0) == 3 and cm.plan.degrees.get("pp_schedule") == "zero-bubble":
        raise ExecutionError("ZeRO-3 under the zero-bubble schedule is not implemented: a micro-batch's weight "
                             "pass runs after later forwards freed its chunks; plan with zero <= 2 or another "
                             "schedule", collective=True)


def make_tied_groups(cm) -> dict:
    """The groups that sum a parameter's gradient over the stages of several ranks that read it
    (a tied embedding and head; ``cm.tied_stages``, found when the program was cut): every rank
    makes every group. Stages of one rank share the tensor, so autograd already sums there.
    Returns ``shared_groups`` for the sharded optimizer: under ZeRO-2/3 it sums the tied
    parameters' gradient shards itself (runtime/zero.py); under ZeRO <= 1 ``step`` sums the full
    gradients before the optimizer."""

    cm.tied_groups = tied_groups(cm.tied_stages, cm.pp, cm.plan.mesh.size, cm.rank % cm.plan.mesh.size)
    cm.tied_bytes = 0
    if cm.zero < 2:
        return {}
    return {id(cm.params[fqn]): cm.tied_groups[ranks] for fqn, ranks in cm.tied_stages.items() if fqn in cm.params}


def setup(cm) -> None:
    """This rank's stage(s) under PyTorch's pipeline schedule (runtime/pipeline.py); under ZeRO-3
    each stage program gets its chunks' gather / free calls (codegen/stages.py add_zero3_regions)."""

    prog = cm.program
    values = {**cm.params, **cm.buffers}
    mine = [sp for sp in cm.stage_programs if sp.index % cm.pp == cm.stage]   # virtual stages r, r + pp, ...
    if cm.zero == 3:
        chunk = {id(p): i for i, c in enumerate(cm.opt.chunks) for p in c.params}
        for sp in mine:
            add_zero3_regions(sp, {n: chunk[id(cm.params[prog.param_fqn[n]])] for n in sp.param_names
                                   if prog.param_fqn[n] in cm.params},
                              returns_loss=sp.index == len(cm.stage_programs) - 1)
    specs = [(sp.index, sp.gm, [values[prog.param_fqn[n]] for n in sp.param_names], sp.input_positions)
             for sp in mine]
    schedule = cm.plan.degrees.get("pp_schedule") or "1f1b"
    cm.runner = PipelineRunner(specs, len(cm.stage_programs), schedule, cm.nm, cm.device, cm.ctx.extra["pp_group"],
                               on_weight_grads=cm.opt.grads_accumulated if cm.zero >= 2 else None)


def step(cm, micro) -> float:
    """One step under the pipeline schedule: every micro-batch through this rank's stage,
    gradients accumulated, tied gradients summed between stages, the DP/ZeRO reducer and the
    optimizer once; the loss from the last stage to every rank."""

    reducer = cm.opt.reducer
    with (reducer.no_sync() if reducer is not None else _nullcontext()):
        local = cm.runner.run(micro)
    pending = cm._start_loss(local) if local is not None else None
    if cm.zero < 2:   # ZeRO-2/3: the optimizer sums the tied gradient shards (make_tied_groups)
        cm.tied_bytes += sum_tied_grads(cm.params, cm.tied_stages, cm.tied_groups, cm.stage)
    shared = cm.opt.shared_bytes
    cm.opt.step()
    cm.tied_bytes += cm.opt.shared_bytes - shared
    cm.opt.zero_grad()
    loss = torch.tensor(cm._finish_loss(pending), device=cm.device) if pending is not None else None
    return cm.runner.broadcast_loss(loss, cm.device)


def forward(cm, micro) -> float:
    """Forward only (``compiled(*inputs)``): the schedule's eval; the loss on every rank."""
    local = cm.runner.run(micro, train=False)
    loss = torch.tensor(cm._global_loss(local), device=cm.device) if local is not None else None
    return cm.runner.broadcast_loss(loss, cm.device)


def _assemble(cm, local: dict) -> dict:
    """key -> full tensor from every rank's ``key -> (fqn, block)``: the blocks are all-gathered as
    objects and placed by the parameter's slices. Simple and exact; it moves the whole model
    through every rank, which is fine for tests and small models (ranks hold different stages, so
    the equal-sized all_gather of the unpipelined path does not apply)."""
    prog = cm.program
    mine = {k: (prog.param_slices[fqn], block.cpu()) for k, (fqn, block) in local.items()}
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    shapes = {fqn: v["shape"] for fqn, v in cm.plan.data["params"].items()}
    full = {}
    for part in parts:
        for k, (sl, block) in part.items():
            if k not in full:
                fqn = local_fqn(k)
                full[k] = torch.empty(shapes.get(fqn) or [x.stop for x in sl], dtype=block.dtype)
            full[k][sl] = block
    return full


def local_fqn(key) -> str:
    return key if isinstance(key, str) else key[0]


def full_state_dict(cm) -> dict[str, torch.Tensor]:
    """Full tensors, keys of model.state_dict() (tied aliases included), on every rank."""
    full = _assemble(cm, {fqn: (fqn, v) for fqn, v in cm._local_values().items()})
    out = {}
    for fqn, t in full.items():
        for alias in cm.traced.tied.get(fqn, [fqn]):
            out[alias] = t
    keys = list(cm.model.state_dict().keys())
    return {k: out[k] for k in keys if k in out}


def full_optimizer_state(cm, local: dict) -> dict[str, torch.Tensor]:
    """"{fqn}.{state name}" -> full tensor, from every rank's ``fqn -> {name: block}``."""
    full = _assemble(cm, {(fqn, name): (fqn, t) for fqn, d in local.items() for name, t in d.items()})
    return {f"{fqn}.{name}": t for (fqn, name), t in full.items()}


__all__ = ["check_options", "setup", "step", "forward", "full_state_dict", "full_optimizer_state"]
