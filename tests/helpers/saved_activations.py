"""Saved activations of one rank's generated program, measured on meta tensors without a process
group (used by tests/pricing/test_activation_memory_full_scale.py and benchmarks/bench_activation_memory.py).

``rank_saved_bytes(model, inputs, plan, rank)`` generates ``rank``'s program of ``plan``
(codegen.per_rank.generate, working dtype from the plan's precision), gives it this rank's
blocks of the parameters and inputs as meta tensors, rewrites its dropout / SDPA calls to the
ops CUDA runs when the plan is for a GPU cluster (autopar.pricing.saved_probe.cuda_kernels_fx), and runs
its forward under saved_tensors_hooks (autopar.pricing.saved_probe.saved_bytes: distinct storages,
parameters excluded).

The collectives are stubbed: on meta there is nothing to communicate, and one rank's saved
tensors do not depend on the values its peers send. Each stub returns a fresh tensor of the
shape the real collective returns (all-reduce: the same shape; all-gather: ``n`` blocks
concatenated; reduce-scatter / slice: this rank's block; all-to-all: blocks moved between the
dims) — the same as runtime/collectives.py, whose autograd functions save nothing. What the
program saves is then exactly what the rank saves on a GPU, up to the kernels the emulation
covers (module doc of autopar/pricing/saved_probe.py).
"""
from __future__ import annotations

import contextlib
import math

import torch

from autopar.pricing.saved_probe import as_cuda, cuda_kernels_fx, saved_bytes
from codegen.per_rank import generate
from codegen.rank_program import block_slices
from runtime import collectives as C
from runtime import context, rng


def seeded_as_cuda(fn, position, op, block, /, *args, **kwargs):
    """runtime.rng.seeded with the op CUDA runs (dropout: native_dropout; SDPA: flash/efficient)."""
    return rng.seeded(as_cuda(fn), position, op, block, *args, **kwargs)


class _Group:
    """A stand-in process group: the axis size and this rank's coordinate on it."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank


class _Dist:
    """What runtime/collectives.py asks torch.distributed besides the collectives themselves."""

    @staticmethod
    def get_rank(group=None):
        return group.rank

    @staticmethod
    def get_world_size(group=None):
        return group.size


def _all_gather(x, dim, group, label):
    return torch.cat([x.contiguous()] * group.size, dim=dim)


def _block(x, dim, group):
    return C._blocks(x, group.size, dim)[group.rank] if group.size > 1 else x.clone()


def _all_to_all(x, split_dim, cat_dim, group, label):
    blocks = C._blocks(x, group.size, split_dim)
    return torch.cat(blocks, dim=cat_dim)


@contextlib.contextmanager
def stub_collectives(mesh, rank: int):
    """Install a context for ``rank`` of ``mesh`` whose collectives are shape-only stubs."""
    coords = tuple(mesh.coords(rank))
    groups = {a: _Group(mesh.shape[a], coords[a]) for a in range(len(mesh.shape))}
    ctx = context.Context(mesh=mesh, rank=rank, coords=coords, groups=groups,
                          labels={a: mesh.names[a] for a in range(len(mesh.shape))})
    saved = {k: getattr(C, k) for k in ("_raw_all_reduce", "_raw_all_gather", "_raw_reduce_scatter",
                                         "_raw_all_to_all", "_raw_slice")}
    old, old_dist = context._CTX, C.dist
    C.dist = _Dist
    C._raw_all_reduce = lambda x, group, label: x.contiguous().clone()
    C._raw_all_gather = _all_gather
    C._raw_reduce_scatter = lambda x, dim, group, label: _block(x, dim, group)
    C._raw_all_to_all = _all_to_all
    C._raw_slice = _block
    context.set_current(ctx)
    try:
        yield ctx
    finally:
        for k, v in saved.items():
            setattr(C, k, v)
        context.set_current(old)
        C.dist = old_dist


def rank_saved_bytes(model, inputs, plan, traced, rank: int = 0, cuda: bool = True, detail=None) -> int:
    """Saved-activation bytes of ``rank``'s program of ``plan`` (module doc). ``model`` and
    ``inputs`` on meta; ``traced`` is ``autopar.frontend.trace.trace(model, inputs)``."""
    precision = plan.data.get("settings", {}).get("precision", "fp32")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    prog = generate(traced, plan, rank, compute_dtype=dtype)
    if cuda:
        cuda_kernels_fx(prog.gm, {rng.seeded: seeded_as_cuda})
    local = []
    for name in prog.param_names:
        fqn = prog.param_fqn[name]
        block = traced.value_of(model, fqn).detach()[prog.param_slices[fqn]]
        block = torch.empty(block.shape, dtype=dtype if block.is_floating_point() else block.dtype, device="meta")
        local.append(block if name in prog.buffers else block.requires_grad_())
    args = []
    for x, lay in zip(inputs, prog.input_layouts):
        sl = block_slices(lay, tuple(x.shape), prog.mesh_shape, prog.coords) if lay is not None else ...
        x = x[sl] if sl is not ... else x
        args.append(torch.empty(x.shape, dtype=dtype if x.is_floating_point() else x.dtype, device="meta"))
    with stub_collectives(plan.mesh, rank):
        return saved_bytes(prog.gm, *local, *args, exclude=[t for t in local if t.requires_grad], detail=detail)


def hidden_dropout_splits(plan) -> list[int]:
    """How many blocks the plan splits each hidden-state dropout's output (b, s, h) into: the
    dropouts after the output projection and after fc_out (not the attention probabilities')."""
    shape = plan.mesh.shape
    out = []
    for op in plan.data["ops"]:
        dims = op["outputs"][0]["dims"] if op["rule"] == "dropout" else None
        if dims is not None and len(dims) == 3:
            out.append(math.prod(shape[a] for axes in dims for a in axes))
    return out
