"""A compiled model's state: full tensors assembled from every rank's blocks, and checkpoints.

``full_state_dict`` gathers each parameter's blocks (collective over the world) into the tensors of
``model.state_dict()``. ``save`` writes the parameters, the optimizer state and the step count
through torch.distributed.checkpoint as chunks of the full tensors, each rank only the pieces it
holds (autopar/execution/checkpoint_io.py: every plan, 2D / 2.5D / 3D grids included), into a new
generation of the directory committed atomically (autopar/execution/checkpoint_atomic.py): a
checkpoint loads onto any plan, and a save that dies leaves the previous one. ``load`` first
checks the checkpoint is complete and that its tensors are this model's (``check_checkpoint``),
then reads only this rank's pieces. ``AUTOPAR_CHECKPOINT_FULL=1`` selects the full-tensor path
(every tensor gathered whole on every rank, the blocks cut out of them on load: the path before
issue 30, kept to measure against, benchmarks/bench_checkpoint_memory.py). With the optimizer
state go its step count (the learning-rate schedule's whole state: a schedule is a function of
it), the base learning rate (after ``lr_scaling``) as "lr" and each parameter's group settings as
"optim_groups.{fqn}" (weight_decay, lr_scale, adapt), all restored by ``load`` (a checkpoint
written before these existed loads without them: the compiled model keeps its own). Pipelined
plans assemble their full state in autopar/execution/pipeline_run.py. The functions take the
CompiledModel (autopar/execution/compiled.py), whose methods of the same names call them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.errors import ExecutionError
from autopar.execution import checkpoint_async, checkpoint_atomic, checkpoint_io, optim_setup, pipeline_run

OPTIONAL = ("lr", "optim_groups")   # checkpoint entries older checkpoints lack


def gather_full(cm, local: torch.Tensor, fqn: str) -> torch.Tensor:
    """Assemble the full tensor from every rank's block (collective over the world)."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.contiguous())
    return cm.program.assemble(fqn, [p.cpu() for p in parts], cm.plan.mesh.coords)

@torch.no_grad()
def local_values(cm) -> dict[str, torch.Tensor]:
    """This rank's block of every parameter (fp32: the master copy under mixed precision) and buffer."""
    vals = {}
    for c in cm.opt.chunks:
        flat = cm.opt.full_flat(c)
        for p, off in zip(c.params, c.offsets):
            vals[cm._fqn_of(p)] = flat[off:off + p.numel()].view(p.shape).clone()
    vals.update({fqn: b.clone() for fqn, b in cm.buffers.items()})
    return vals

def full_state_dict(cm) -> dict[str, torch.Tensor]:
    """Full tensors, keys of model.state_dict() (tied aliases included); on every rank."""
    cm._need_ready()
    if cm.pp > 1:
        return pipeline_run.full_state_dict(cm)
    out = {}
    for fqn, v in cm._local_values().items():
        full = cm._gather_full(v, fqn).cpu()
        for alias in cm.traced.tied.get(fqn, [fqn]):
            out[alias] = full
    keys = list(cm.model.state_dict().keys())
    return {k: out[k] for k in keys if k in out}

def optimizer_local_state(cm) -> dict[str, dict[str, torch.Tensor]]:
    """fqn -> {state name: tensor shaped like my parameter block} (collective over the data group)."""
    out = {}
    for c in cm.opt.chunks:
        for name, t in c.state.items():
            flat = cm.opt.gather_local(c, t)
            for p, off in zip(c.params, c.offsets):
                fqn = cm._fqn_of(p)
                out.setdefault(fqn, {})[name] = flat[off:off + p.numel()].view(p.shape).clone()
    return out

def full_optimizer_state(cm) -> dict[str, torch.Tensor]:
    """"{fqn}.{state name}" -> the full tensor (collective over the world)."""
    local = cm._optimizer_local_state()
    if cm.pp > 1:
        return pipeline_run.full_optimizer_state(cm, local)
    return {f"{fqn}.{name}": cm._gather_full(t, fqn) for fqn, d in local.items() for name, t in d.items()}

def save(cm, directory, keep_last: int = 1, blocking: bool = True):
    """This rank's pieces (full tensors with ``AUTOPAR_CHECKPOINT_FULL=1``) via torch.distributed.checkpoint
    into a new generation of ``directory``, committed atomically; loads onto any plan. With
    ``blocking=False``: a checkpoint_async.SaveHandle, written in the background."""
    cm._need_ready()
    checkpoint_async.wait_pending(cm)   # one save in flight at a time
    if checkpoint_io.sharded_supported(cm):
        state = checkpoint_io.local_state(cm)
    else:
        state = {"model": cm.full_state_dict()}
        state["optim"] = {k: v.cpu() for k, v in cm._full_optimizer_state().items()}
    state["step"] = torch.tensor(cm.opt.step_count)
    state.update(_optimizer_settings(cm))
    if not blocking:
        return checkpoint_async.save_async(cm, state, directory, cm.opt.step_count, keep_last)
    generation = checkpoint_atomic.begin(directory, cm.opt.step_count)
    checkpoint_io.write(state, generation)
    checkpoint_atomic.commit(directory, generation, keep_last)


def _optimizer_settings(cm) -> dict:
    """The base learning rate and every parameter's group settings, as checkpoint entries."""
    return {"lr": torch.tensor(cm.opt.opt.lr, dtype=torch.float64),
            "optim_groups": {fqn: torch.tensor(e, dtype=torch.float64) for fqn, e in sorted(cm.group_settings.items())}}

@torch.no_grad()
def load(cm, directory) -> None:
    cm._need_ready()
    checkpoint_async.wait_pending(cm)
    sharded = checkpoint_io.sharded_supported(cm)
    if sharded:   # views of this rank's buffers, read in place
        state = checkpoint_io.local_state(cm, for_load=True)
    else:
        state = {"model": {k: v.clone() for k, v in cm.full_state_dict().items()},
                 "optim": {k: v.clone() for k, v in cm._full_optimizer_state().items()}}
    state.update({"step": torch.tensor(0), **_optimizer_settings(cm)})
    read_checkpoint(cm.rank, directory, state)
    if not sharded:
        _blocks_from_full(cm, state)
    cm.opt.step_count = int(state["step"])
    if "lr" in state:
        cm.opt.opt.lr = float(state["lr"])
    if "optim_groups" in state:
        optim_setup.apply_groups(cm, {f: (float(t[0]), float(t[1]), bool(t[2]))
                                      for f, t in state["optim_groups"].items()})


def _blocks_from_full(cm, state: dict) -> None:
    """The full-tensor path (``AUTOPAR_CHECKPOINT_FULL=1``): cut this rank's blocks out of the full
    tensors read."""
    prog = cm.program

    def my_flat(c, values: dict, suffix: str = "") -> torch.Tensor:
        """The chunk's padded fp32 buffer filled with this rank's blocks of the saved tensors."""
        flat = torch.zeros(c.padded, dtype=torch.float32)
        for p, off in zip(c.params, c.offsets):
            fqn = cm._fqn_of(p)
            flat[off:off + p.numel()] = prog.block_of(fqn, values[fqn + suffix]).reshape(-1)
        return flat.to(cm.device)

    for c in cm.opt.chunks:
        cm.opt.load_flat(c, my_flat(c, state["model"]))   # working copy (and master) from fp32 values
        for name, t in c.state.items():
            flat = my_flat(c, state["optim"], "." + name)
            t.copy_(flat[c.lo:c.hi] if t.numel() == c.shard and cm.zero >= 1 else flat[:t.numel()])
    for fqn, b in cm.buffers.items():
        # Non-persistent buffers (RoPE tables) and lifted constants are not in the state dict:
        # they keep the model's values, as torch's load_state_dict does.
        if fqn in state["model"]:
            b.copy_(prog.block_of(fqn, state["model"][fqn]))


def has_checkpoint(directory) -> bool:
    """Whether ``directory`` holds a committed checkpoint (checkpoint_atomic.committed_path)."""
    try:
        checkpoint_atomic.committed_path(directory)
    except ExecutionError:
        return False
    return True


def read_checkpoint(rank: int, directory, state: dict) -> None:
    """Fill ``state`` ({"model": full tensors, "optim": "{fqn}.{state name}" -> full tensors,
    "step": 0-d tensor}, shaped as this model's; or checkpoint_io.Pieces) from the committed
    checkpoint of ``directory``, after ``check_complete`` and ``check_checkpoint``."""
    directory = checkpoint_atomic.committed_path(directory)
    checkpoint_atomic.check_complete(directory)
    check_checkpoint(directory, state)
    try:
        checkpoint_io.read(state, directory)
    except BaseException as e:   # dcp's CheckpointException is a BaseException, not an Exception
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise ExecutionError(f"rank {rank}: could not load checkpoint {directory}: "
                             f"{type(e).__name__}: {str(e).strip()[:500]}") from None


def check_checkpoint(directory, state: dict) -> None:
    """Refuse a checkpoint whose tensors are not the ones this plan trains (a 2-layer model into a
    1-layer one, another optimizer's state, other shapes): dcp.load would fill what matches and
    silently ignore the rest. Every rank reads the same metadata, so every rank raises."""
    import os

    import torch.distributed.checkpoint as dcp

    if not os.path.exists(str(directory)):
        raise ExecutionError(f"checkpoint directory {directory} does not exist: give the directory "
                             f"compiled.save() wrote", collective=True)
    if not os.path.isdir(str(directory)):
        raise ExecutionError(f"{directory} is a file, not a checkpoint directory: give the directory "
                             f"compiled.save() wrote", collective=True)
    try:
        meta = dcp.FileSystemReader(str(directory)).read_metadata()
    except Exception as e:
        raise ExecutionError(f"no readable checkpoint at {directory}: {type(e).__name__}: {e}",
                             collective=True) from None
    saved = {k: getattr(v, "size", None) for k, v in meta.state_dict_metadata.items()}
    for key in OPTIONAL:   # absent from an older checkpoint: not read
        if key in state and not any(k == key or k.startswith(key + ".") for k in saved):
            del state[key]
    want = {"step": torch.Size([])}
    if "lr" in state:
        want["lr"] = torch.Size([])
    for group in ("model", "optim", "optim_groups"):
        want.update({f"{group}.{k}": v.shape for k, v in state.get(group, {}).items()})
    missing = sorted(set(want) - set(saved))
    extra = sorted(set(saved) - set(want))
    shapes = sorted(f"{k} {tuple(saved[k])} (this model: {tuple(want[k])})" for k in set(want) & set(saved)
                    if saved[k] is not None and tuple(saved[k]) != tuple(want[k]))
    if not (missing or extra or shapes):
        return
    show = lambda xs: ", ".join(xs[:8]) + (f" and {len(xs) - 8} more" if len(xs) > 8 else "")  # noqa: E731
    parts = ([f"missing from the checkpoint: {show(missing)}"] if missing else []) + \
            ([f"not in this model: {show(extra)}"] if extra else []) + \
            ([f"shape differs: {show(shapes)}"] if shapes else [])
    raise ExecutionError(f"checkpoint {directory} does not match this model and optimizer ("
                         + "; ".join(parts) + "): nothing was loaded. Load it into the model (and "
                         "optimizer) it was saved from.", collective=True)
