"""The execution side of a pipelined plan inside ``autopar.compile`` (CompiledModel with pp > 1).

``setup(cm)`` builds this rank's stage runner (runtime/pipeline.py: PyTorch's PipelineStage and
schedule over the stage program codegen/stages.py cut from the per-rank program) and the groups
that sum a parameter's gradient over the stages that read it; ``step(cm, micro)`` runs one
training step, ``forward(cm, micro)`` a forward-only one; ``full_state_dict(cm)`` assembles full tensors when ranks hold different stages;
``full_optimizer_state(cm, local)`` the same for the optimizer's state (save/load);
``check_options(cm)`` refuses what does not run under pipelining yet, before any group is made.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.errors import ExecutionError


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def check_options(cm) -> None:
    """What pipelined execution does not do yet: a clear error before any group is made."""
    if cm.grad_clip is not None:
        raise ExecutionError("grad_clip under pipeline parallelism is not implemented yet (the norm would "
                             "have to be summed over the stages)", collective=True)
    if int(cm.plan.degrees.get("zero", 0) or 0) == 3:
        raise ExecutionError("ZeRO-3 under pipeline parallelism is not implemented yet: plan with zero <= 2",
                             collective=True)


def setup(cm) -> None:
    """This rank's stage under PyTorch's pipeline schedule (runtime/pipeline.py), and the
    groups that sum a parameter's gradient over the stages that read it (a tied embedding)."""
    from runtime.pipeline import PipelineRunner, tied_groups

    prog = cm.program
    values = {**cm.params, **cm.buffers}
    mine = [sp for sp in cm.stage_programs if sp.index % cm.pp == cm.stage]   # virtual stages r, r + pp, ...
    specs = [(sp.index, sp.gm, [values[prog.param_fqn[n]] for n in sp.param_names], sp.input_positions)
             for sp in mine]
    schedule = cm.plan.degrees.get("pp_schedule") or "1f1b"
    cm.runner = PipelineRunner(specs, len(cm.stage_programs), schedule, cm.nm, cm.device, cm.ctx.extra["pp_group"])
    # A parameter read on stages of several ranks (a tied embedding and head) is summed between
    # them; stages of one rank share the tensor, so autograd already sums there.
    trainable = {n for n in prog.param_names if n not in prog.buffers}
    cm.tied_stages = {}
    for n in trainable:
        ranks = tuple(sorted({s.index % cm.pp for s in cm.stage_programs if n in s.param_names}))
        if len(ranks) > 1:
            cm.tied_stages[prog.param_fqn[n]] = ranks
    cm.tied_groups = tied_groups(cm.tied_stages, cm.pp, cm.plan.mesh.size, cm.rank % cm.plan.mesh.size)
    if cm.tied_stages and cm.zero >= 2:
        raise ExecutionError(f"parameters {sorted(cm.tied_stages)[:3]} are read on several pipeline stages; "
                             f"summing their gradients between stages under ZeRO-{cm.zero} is not implemented "
                             f"yet: plan with zero <= 1", collective=True)
    cm.tied_bytes = 0


def step(cm, micro) -> float:
    """One step under the pipeline schedule: every micro-batch through this rank's stage,
    gradients accumulated, tied gradients summed between stages, the DP/ZeRO reducer and the
    optimizer once; the loss from the last stage to every rank."""
    from runtime.pipeline import sum_tied_grads

    reducer = cm.opt.reducer
    with (reducer.no_sync() if reducer is not None else _nullcontext()):
        local = cm.runner.run(micro)
    pending = cm._start_loss(local) if local is not None else None
    cm.tied_bytes += sum_tied_grads(cm.params, cm.tied_stages, cm.tied_groups, cm.stage)
    cm.opt.step()
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
