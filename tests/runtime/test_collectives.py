"""Autograd collectives and reshard execution on 2 and 4 forked gloo ranks.

Every rank builds the same seeded global tensors, computes the single-process reference for its
own block, and compares forward values, input gradients and COMM_STATS bytes against it.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from autopar.rules.layout import Layout
from autopar.mesh import Mesh
from autopar.pricing.reshard import plan_reshard
from runtime import collectives as C
from runtime.collectives import COMM_STATS
from runtime.launch import run_local
from runtime.reshard_exec import apply_steps

# Imported here, before run_local forks: backward(grad) lazily imports this sympy-heavy module
# (1-2 s per child on 2 cores); forked children inherit it already imported.
import torch.fx.experimental.symbolic_shapes  # noqa: E402,F401



@dataclass(frozen=True)
class ToyComm:
    """Ring alpha-beta model (the planner only needs a hashable comm(kind, nbytes, axis))."""
    mesh_shape: tuple[int, ...]

    def __call__(self, kind: str, nbytes: float, axis: int) -> float:
        n = self.mesh_shape[axis]
        factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
        return 0.0 if n == 1 else 1e-5 + factor * nbytes / 1e9


SHAPE = (4, 8, 12)
DT = torch.float64
NB = 8  # bytes per element


def _rand(seed, shape=SHAPE):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


def _blk(x, n, i, dim):
    return torch.chunk(x, n, dim=dim)[i]


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _mesh_groups(mesh: Mesh, rank: int) -> dict:
    """This rank's group per mesh axis; every rank creates every group in the same order."""
    mine = {}
    for axis in range(mesh.ndim):
        for ranks in mesh.axis_groups(axis):
            g = dist.new_group(ranks)
            if rank in ranks:
                mine[axis] = g
    return mine


def _check_group(group, label):
    """Each collective's forward/backward against the reference, on one group."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    xs = [_rand(100 + j) for j in range(n)]
    X, G = _rand(7), _rand(8)
    gs = [_rand(200 + j) for j in range(n)]
    full = X.numel() * NB

    def run(fn, x, grad, expect_y, expect_grad, expect_bytes):
        COMM_STATS.reset()
        x = x.clone().requires_grad_()
        y = fn(x)
        _close(y, expect_y)
        y.backward(grad)
        _close(x.grad, expect_grad)
        assert COMM_STATS.snapshot().get(label, 0) == expect_bytes, (fn, COMM_STATS.snapshot_by_kind())

    run(lambda x: C.all_reduce(x, group, label), xs[me], G, sum(xs), G, full)
    run(lambda x: C.copy(x, group, label), xs[me], gs[me], xs[me], sum(gs), full)
    for d in (0, 2):
        run(lambda x: C.all_gather(x, d, group, label), _blk(X, n, me, d), gs[me],
            X, _blk(sum(gs), n, me, d), 2 * full)
        run(lambda x: C.all_gather(x, d, group, label, partial_grad=False), _blk(X, n, me, d), G,
            X, _blk(G, n, me, d), full)
        run(lambda x: C.reduce_scatter(x, d, group, label), xs[me], _blk(G, n, me, d),
            _blk(sum(xs), n, me, d), G, 2 * full)
        run(lambda x: C.slice_block(x, d, group, label), X, _blk(G, n, me, d),
            _blk(X, n, me, d), G, full)
    for d, e in ((0, 1), (2, 1), (1, 0)):
        # all_to_all(split e, cat d): from blocks of dim d to blocks of dim e
        run(lambda x: C.all_to_all(x, e, d, group, label), _blk(X, n, me, d), _blk(G, n, me, e),
            _blk(X, n, me, e), _blk(G, n, me, d), 2 * full // n)
    run(lambda x: C.make_partial(x, group), X, G, X if me == 0 else torch.zeros_like(X), G, 0)
    return True


def _collectives_world(rank, world):
    group = dist.new_group(list(range(world)))
    return _check_group(group, "world")


def _collectives_mesh(rank, world):
    mesh = Mesh((2, 2), ("dp", "tp"), 2)
    groups = _mesh_groups(mesh, rank)
    # group rank must equal the mesh coordinate on that axis
    for a, g in groups.items():
        assert dist.get_rank(g) == mesh.coords(rank)[a]
    return _check_group(groups[0], "dp") and _check_group(groups[1], "tp")


@pytest.mark.parametrize("nprocs", [2, 4])
def test_collectives_match_reference(nprocs):
    assert run_local(_collectives_world, nprocs) == [True] * nprocs


def test_collectives_on_mesh_axis_groups():
    assert run_local(_collectives_mesh, 4) == [True] * 4


# ------------------------------------------------------------------ reshard execution

RESHARD_SHAPE = (4, 8)


def _local(X, layout: Layout, mesh: Mesh, coords, seed=0):
    """This rank's block of X under layout; partial axes: coordinate 0 holds X minus the
    seeded addends every other coordinate holds."""
    value = X
    if layout.partial:
        combos = list(itertools.product(*(range(mesh.shape[p]) for p in layout.partial)))
        mine = tuple(coords[p] for p in layout.partial)
        addend = {c: _rand(seed + 1 + i, X.shape) for i, c in enumerate(combos[1:], 0)}
        value = X - sum(addend.values()) if mine == combos[0] else addend[mine]
    idx = []
    for d, axes in enumerate(layout.dims):
        f, b = 1, 0
        for a in axes:
            f *= mesh.shape[a]
            b = b * mesh.shape[a] + coords[a]
        size = X.shape[d] // f
        idx.append(slice(b * size, (b + 1) * size))
    return value[tuple(idx)].clone()


def _expected_bytes(steps, layout_shape, mesh_shape, partial_grad_axes, names):
    """Per-label bytes of forward + backward, walking block shapes step by step."""
    out = {}
    shape = list(layout_shape)
    last = {s.axis: i for i, s in enumerate(steps)}
    fused = {a for a in partial_grad_axes if a in last and steps[last[a]].kind == "all_gather"}

    def add(axis, nbytes):
        out[names[axis]] = out.get(names[axis], 0) + int(nbytes)

    for i, s in enumerate(steps):
        n = mesh_shape[s.axis]
        local = math.prod(shape) * NB
        if s.kind == "all_reduce":
            add(s.axis, local)                                   # backward: identity
        elif s.kind == "reduce_scatter":
            add(s.axis, 2 * local)                               # backward all_gather: same full size
            shape[s.dim] //= n
        elif s.kind == "all_gather":
            fuse = s.axis in fused and i == last[s.axis]
            add(s.axis, local * n * (2 if fuse else 1))          # backward: reduce_scatter or slice
            shape[s.dim] *= n
        elif s.kind == "all_to_all":
            add(s.axis, 2 * local)
            shape[s.dim] *= n
            shape[s.dst_dim] //= n
        elif s.kind == "slice":
            add(s.axis, local)                                   # backward all_gather of the grad
            shape[s.dim] //= n
    for a in set(partial_grad_axes) - fused:
        add(a, math.prod(shape) * NB)                            # copy's backward all_reduce
    return out


CASES = [
    # (src, dst, partial_grad_axes)
    (Layout.shard(2, {}, (0,)), Layout.replicated(2), ()),
    (Layout.shard(2, {}, (1,)), Layout.shard(2, {1: (1,)}), ()),
    (Layout.shard(2, {0: (0,)}), Layout.shard(2, {1: (0,)}), ()),
    (Layout.shard(2, {0: (0, 1)}), Layout.shard(2, {1: (1, 0)}), ()),
    (Layout.shard(2, {0: (0,), 1: (1,)}), Layout.replicated(2), ()),
    (Layout.shard(2, {0: (0,), 1: (1,)}), Layout.replicated(2), (0, 1)),
    (Layout.shard(2, {}, (0, 1)), Layout.shard(2, {1: (0,)}), (1,)),
    (Layout.replicated(2), Layout.shard(2, {0: (1,)}, (0,)), ()),
    (Layout.shard(2, {1: (0,)}), Layout.shard(2, {}, (0,)), ()),
]


def _reshard_worker(rank, world):
    mesh = Mesh((2, 2), ("dp", "tp"), 2)
    groups = _mesh_groups(mesh, rank)
    labels = dict(enumerate(mesh.names))
    coords = mesh.coords(rank)
    comm = ToyComm(mesh.shape)
    X, G = _rand(11, RESHARD_SHAPE), _rand(12, RESHARD_SHAPE)
    for k, (src, dst, pga) in enumerate(CASES):
        plan = plan_reshard(src, dst, RESHARD_SHAPE, NB, mesh.shape, comm)
        x = _local(X, src, mesh, coords, seed=1000 * k).requires_grad_()
        COMM_STATS.reset()
        y = apply_steps(x, plan.steps, groups, labels, partial_grad_axes=pga)
        # forward: after summing over dst's partial axes, my block of X under dst
        total = y.detach().clone()
        for a in dst.partial:
            dist.all_reduce(total, group=groups[a])
        _close(total, _local(X, Layout(dst.dims), mesh, coords))
        # backward: grads arrive as dst's blocks of G (partial over pga: weights summing to 1)
        w = 1.0
        for a in pga:
            w *= (0.25, 0.75)[coords[a]]
        y.backward(_local(G, Layout(dst.dims), mesh, coords) * w)
        _close(x.grad, _local(G, Layout(src.dims), mesh, coords))
        expect = _expected_bytes(plan.steps, src.local_shape(RESHARD_SHAPE, mesh.shape), mesh.shape,
                                 pga, mesh.names)
        got = {k2: v for k2, v in COMM_STATS.snapshot().items() if v}
        assert got == {k2: v for k2, v in expect.items() if v}, (k, plan.describe(), got, expect)
    return True


def test_apply_steps_reproduces_destination_blocks():
    assert run_local(_reshard_worker, 4) == [True] * 4


def test_stats_reset_and_snapshot_in_process():
    stats = C.CommStats()
    stats.add("tp", "all_gather", 64)
    stats.add("tp", "all_reduce", 16)
    stats.add("dp", "all_reduce", 8)
    assert stats.snapshot() == {"tp": 80, "dp": 8}
    assert stats.snapshot_by_kind()[("tp", "all_gather")] == 64
    stats.reset()
    assert stats.snapshot() == {}


def _reduce_scatter_storage(rank, world):
    x = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6) + rank
    out = C._raw_reduce_scatter(x, 0, None, "t")
    want = sum(torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6) + r for r in range(world)).chunk(world)[rank]
    return torch.equal(out, want), out.untyped_storage().nbytes(), out.numel() * out.element_size()


def test_reduce_scatter_returns_its_own_block_not_a_view_of_the_whole():
    """On gloo the reduce-scatter is an all-reduce and a slice; a leading-dim block would be a
    view keeping the whole reduced buffer alive in whatever saves it (Hugging Face Bloom under
    Megatron-SP saved 6-7% more than its plan): the block is its own storage, as NCCL's output."""
    for same, storage, own in run_local(_reduce_scatter_storage, 2):
        assert same and storage == own, (same, storage, own)
