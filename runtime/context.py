"""The per-process execution context: mesh, this rank's coordinates, one process group per
mesh axis, and the functions generated per-rank programs call.

``setup(mesh, device)`` builds the groups with ``init_device_mesh(device, shape,
mesh_dim_names=names)`` (gloo on CPU, NCCL on CUDA) and installs them as the current context.
Generated code refers to mesh axes by index, e.g. ``all_gather(x, 1, axis=1)``; the functions
below look the axis' group up in the current context, so the printed program reads like the
plan and does not embed process-group objects. Bytes are counted in ``COMM_STATS`` under the
axis name (see runtime/collectives.py for the autograd conjugates).

ZeRO-3 hooks (``zero3_gather`` / ``zero3_free`` / ``zero3_exit``) call into the sharded
optimizer registered with ``set_zero3``: the generated graph gathers a chunk of parameters
before its first use, frees it after its last forward use, and re-gathers it when backward
reaches the values that leave the chunk's region. Inside an activation-checkpoint region the
gather and free run again in recomputation, except that the free is skipped there
(runtime/checkpoint.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from runtime import collectives as C
from runtime.checkpoint import recomputing


@dataclass
class Context:
    mesh: object                         # autopar.mesh.Mesh
    rank: int
    coords: tuple[int, ...]
    groups: dict[int, object]            # mesh axis -> process group (this rank's)
    labels: dict[int, str]               # mesh axis -> name (COMM_STATS key)
    data_group: object = None            # all data axes together (the DP/ZeRO reducer's group)
    zero3: object = None                 # ShardedOptimizer running stage 3, if any
    device_mesh: object = None
    extra: dict = field(default_factory=dict)


_CTX: Context | None = None

# Seconds the process, at exit, leaves the GIL free for gloo's worker threads (``_guard_exit``).
EXIT_GRACE = 0.1
_EXIT_GUARDED = False


def _guard_exit() -> None:
    """Once per process: at exit, while the interpreter is still whole, release the GIL for
    ``EXIT_GRACE`` seconds. Gloo's worker threads destroy a collective's work object after its
    ``wait()`` has returned; the work holds tensors, and dropping them takes the GIL. A thread
    still doing so when the interpreter finalizes cannot take it: the thread is unwound through
    C++ and the process aborts with "terminate called without an active exception" (gdb: a
    ``pt_gloo_runloop`` thread in ``~AsyncAllgatherWork`` -> ``decref_pyobject`` ->
    ``take_gil`` during ``Py_FinalizeEx``; examples/finetune.py under torchrun, about 1 run in 4,
    on either rank; pytorch/pytorch#179291 describes the same race). Every collective has
    completed by then, so the threads only need the GIL for an instant."""
    global _EXIT_GUARDED
    if not _EXIT_GUARDED:
        import atexit

        _EXIT_GUARDED = True
        atexit.register(_let_collective_threads_finish)


def _let_collective_threads_finish() -> None:
    import time

    time.sleep(EXIT_GRACE)


def current() -> Context:
    if _CTX is None:
        raise RuntimeError("no autopar execution context on this process: autopar.compile sets it up")
    return _CTX


def set_current(ctx: Context | None) -> None:
    global _CTX
    _CTX = ctx


def _timed(group, timeout):
    """``group`` waiting at most ``timeout`` in a collective. torch's default group (what
    ``init_device_mesh`` hands back for an axis spanning every rank) is not changed: a group of
    the same ranks is made in its place."""
    if timeout is None or group is None:
        return group
    if group is dist.group.WORLD:
        return dist.new_group(list(range(dist.get_world_size())), timeout=timeout)
    group.set_timeout(timeout)
    return group


def setup(mesh, device: str = "cpu", pp: int = 1, timeout=None) -> Context:
    """Create the process groups of ``mesh`` (collective: every rank must call it) and make them
    the current context. Requires an initialised default process group of ``mesh.size`` ranks,
    or ``pp * mesh.size`` with ``pp`` pipeline stages: then ``mesh`` is one stage's sub-mesh, the
    global mesh is (pp, *mesh) with stage s on ranks [s * mesh.size, (s + 1) * mesh.size), every
    axis group stays inside a stage, and ``extra`` holds ``stage`` and ``pp_group`` (this rank's
    counterparts on every stage, the pipeline's point-to-point group). ``timeout`` (a
    ``datetime.timedelta``): the longest a collective on these groups waits for a peer before it
    raises; None leaves them the default group's."""
    from torch.distributed.device_mesh import init_device_mesh

    _guard_exit()
    rank = dist.get_rank()
    if pp > 1:
        dm = init_device_mesh(device, (pp, *mesh.shape), mesh_dim_names=("pp", *mesh.names))
        groups = {a: _timed(dm.get_group(mesh.names[a]), timeout) for a in range(mesh.ndim)}
    else:
        dm = init_device_mesh(device, tuple(mesh.shape), mesh_dim_names=tuple(mesh.names))
        groups = {a: _timed(dm.get_group(a), timeout) for a in range(mesh.ndim)}
    stage, local = divmod(rank, mesh.size)
    labels = {a: mesh.names[a] for a in range(mesh.ndim)}
    data_axes = [a for a in mesh.data_axes() if mesh.shape[a] > 1]
    if len(data_axes) == 1:
        data_group = groups[data_axes[0]]
    else:
        # Zero or several data axes: one group per set of ranks that share the model coordinates.
        # new_group is collective over the world, so every rank creates every group in one order.
        data_group = None
        coords = mesh.coords(local)
        model_axes = [a for a in range(mesh.ndim) if a not in data_axes]
        for s in range(pp):   # (pp > 1: every stage's groups, created by every rank in one order)
            buckets: dict[tuple, list[int]] = {}
            for r in range(mesh.size):
                c = mesh.coords(r)
                buckets.setdefault(tuple(c[a] for a in model_axes), []).append(s * mesh.size + r)
            for key in sorted(buckets):
                g = dist.new_group(buckets[key], timeout=timeout)
                if s == stage and key == tuple(coords[a] for a in model_axes):
                    data_group = g
    ctx = Context(mesh=mesh, rank=rank, coords=tuple(mesh.coords(local)), groups=groups, labels=labels,
                  data_group=data_group, device_mesh=dm)
    if pp > 1:
        ctx.extra.update(stage=stage, pp_group=_timed(dm.get_group("pp"), timeout))
    set_current(ctx)
    # Every rank leaves only when all have made their groups: a rank that stops right after (an
    # engine refusing its plan on every rank) would otherwise take the store it serves (rank 0)
    # away from a peer still connecting one ("Broken pipe" in that peer's new_group).
    dist.barrier()
    return ctx


def group_of(axis: int):
    """(process group, label) of mesh ``axis`` on this rank."""
    return _g(axis)


def _g(axis: int):
    ctx = current()
    return ctx.groups[axis], ctx.labels[axis]


# ------------------------------------------------------------------ reshard steps (generated code calls these)

def all_reduce(x: torch.Tensor, *, axis: int) -> torch.Tensor:
    """Partial sum over ``axis`` -> replicated. Backward: identity."""
    return C.all_reduce(x, *_g(axis))


def copy(x: torch.Tensor, *, axis: int) -> torch.Tensor:
    """Identity; backward all-reduces the (partial) gradient over ``axis``."""
    return C.copy(x, *_g(axis))


def all_gather(x: torch.Tensor, dim: int, *, axis: int, partial_grad: bool = False) -> torch.Tensor:
    """Concatenate the blocks of ``dim`` over ``axis``. Backward: my block of the gradient
    (reduce-scattered when ``partial_grad``: the consumer's grads are partial over ``axis``)."""
    g, lab = _g(axis)
    return C.all_gather(x, dim, g, lab, partial_grad=partial_grad)


def reduce_scatter(x: torch.Tensor, dim: int, *, axis: int) -> torch.Tensor:
    """Sum over ``axis`` and keep my block of ``dim``. Backward: all_gather."""
    g, lab = _g(axis)
    return C.reduce_scatter(x, dim, g, lab)


def all_to_all(x: torch.Tensor, dim: int, dst_dim: int, *, axis: int) -> torch.Tensor:
    """``dim`` (split over ``axis``) becomes whole, ``dst_dim`` becomes split over ``axis``."""
    g, lab = _g(axis)
    return C.all_to_all(x, dst_dim, dim, g, lab)


def slice_block(x: torch.Tensor, dim: int, *, axis: int) -> torch.Tensor:
    """Keep my block of ``dim`` along ``axis`` (free). Backward: all_gather."""
    g, lab = _g(axis)
    return C.slice_block(x, dim, g, lab)


def make_partial(x: torch.Tensor, *, axis: int) -> torch.Tensor:
    """Replicated -> partial sum over ``axis`` (coordinate 0 keeps x, the others zeros)."""
    g, _ = _g(axis)
    return C.make_partial(x, g)


# ------------------------------------------------------------------ ZeRO-3 parameter gathering

def set_zero3(optimizer) -> None:
    current().zero3 = optimizer


def zero3_gather(chunk: int) -> None:
    """Materialise chunk ``chunk``'s full parameters (all-gather over the data group)."""
    opt = current().zero3
    if opt is not None:
        opt._gather(opt.chunks[chunk])


def zero3_free(chunk: int) -> None:
    """Drop the chunk's full parameters after their last forward use (only when autograd will
    re-gather them: under no_grad nothing needs them again either)."""
    opt = current().zero3
    # In a checkpoint region's recomputation (runtime/checkpoint.py) backward is about to use the
    # parameters: keep them; the optimizer frees the chunk once its gradients are complete.
    if opt is not None and not recomputing():
        opt._free(opt.chunks[chunk])


class _Zero3Exit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, chunks):
        ctx.chunks = chunks
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        for c in ctx.chunks:
            zero3_gather(c)
        return g, None


def zero3_exit(x: torch.Tensor, chunks: tuple[int, ...]) -> torch.Tensor:
    """Identity; when backward reaches ``x``, re-gather the chunks whose region it leaves."""
    if not isinstance(x, torch.Tensor) or not x.requires_grad:
        return x
    return _Zero3Exit.apply(x, tuple(chunks))


__all__ = ["Context", "current", "set_current", "setup", "all_reduce", "copy", "all_gather", "reduce_scatter",
           "all_to_all", "slice_block", "make_partial", "set_zero3", "zero3_gather", "zero3_free", "zero3_exit"]
