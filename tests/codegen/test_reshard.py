"""The resharding planner against a one-process numpy simulation of a device mesh.

``blocks`` lays a global array out on every rank of a mesh under a Layout (partial axes get
random integer addends that sum to the value, so float64 sums are exact); ``apply`` executes a
plan's steps on all ranks at once. A plan is correct when every rank ends up with its block of
the destination layout (partials compared after summing over the partial axes).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from autopar.rules.layout import Layout
from autopar.pricing.reshard import ReshardPlan, Step, plan_reshard, reshard_cost_matrix


@dataclass(frozen=True)
class ToyComm:
    """Ring alpha-beta model: latency plus bus-bandwidth factor times bytes over bandwidth."""
    mesh_shape: tuple[int, ...]
    alpha: float = 1e-5
    bw: float = 1e9

    def __call__(self, kind: str, nbytes: float, axis: int) -> float:
        n = self.mesh_shape[axis]
        if n == 1:
            return 0.0
        factor = {"all_reduce": 2 * (n - 1) / n}.get(kind, (n - 1) / n)
        return self.alpha + factor * nbytes / self.bw


# ---------------------------------------------------------------- the simulated mesh

def _all_coords(mesh_shape):
    return list(itertools.product(*(range(s) for s in mesh_shape)))


def _block_of(value: np.ndarray, dims, coords, mesh_shape) -> np.ndarray:
    idx = []
    for d, axes in enumerate(dims):
        f, b = 1, 0
        for a in axes:  # first axis is the outer one
            f *= mesh_shape[a]
            b = b * mesh_shape[a] + coords[a]
        size = value.shape[d] // f
        idx.append(slice(b * size, (b + 1) * size))
    return value[tuple(idx)]


def blocks(global_value: np.ndarray, layout: Layout, mesh_shape, rng=None) -> dict:
    """rank coords -> local array. Partial axes: random addends (one per coordinate combination
    of the partial axes) that sum to the global value."""
    rng = rng or np.random.default_rng(0)
    partial = tuple(layout.partial)
    combos = list(itertools.product(*(range(mesh_shape[p]) for p in partial)))
    addends = {}
    rest = global_value.copy()
    for combo in combos[1:]:
        addends[combo] = rng.integers(-5, 6, size=global_value.shape).astype(np.float64)
        rest = rest - addends[combo]
    addends[combos[0]] = rest
    out = {}
    for c in _all_coords(mesh_shape):
        value = addends[tuple(c[p] for p in partial)]
        out[c] = _block_of(value, layout.dims, c, mesh_shape).copy()
    return out


def _groups(mesh_shape, axis):
    """Coordinate lists of every group along ``axis``, each in axis-coordinate order."""
    others = [range(s) if a != axis else range(1) for a, s in enumerate(mesh_shape)]
    for base in itertools.product(*others):
        yield [tuple(i if a == axis else base[a] for a in range(len(mesh_shape))) for i in range(mesh_shape[axis])]


def apply(steps, bl: dict, mesh_shape, comm=None):
    """Execute ``steps`` on every rank; return (new blocks, time priced from the actual buffers)."""
    bl = dict(bl)
    time = 0.0
    for s in steps:
        a = s.axis
        n = mesh_shape[a]
        new = {}
        nbytes = None
        for group in _groups(mesh_shape, a):
            xs = [bl[c] for c in group]
            if s.kind == "all_reduce":
                tot = sum(xs)
                outs = [tot.copy() for _ in group]
                nbytes = xs[0].nbytes
            elif s.kind == "reduce_scatter":
                tot = sum(xs)
                outs = np.split(tot, n, axis=s.dim)
                nbytes = xs[0].nbytes
            elif s.kind == "all_gather":
                full = np.concatenate(xs, axis=s.dim)
                outs = [full.copy() for _ in group]
                nbytes = full.nbytes
            elif s.kind == "all_to_all":
                pieces = [np.split(x, n, axis=s.dst_dim) for x in xs]
                outs = [np.concatenate([pieces[j][i] for j in range(n)], axis=s.dim) for i in range(n)]
                nbytes = xs[0].nbytes
            elif s.kind == "slice":
                outs = [np.split(x, n, axis=s.dim)[i] for i, x in enumerate(xs)]
            elif s.kind == "partial":
                outs = [x if i == 0 else np.zeros_like(x) for i, x in enumerate(xs)]
            else:
                raise AssertionError(s.kind)
            for c, o in zip(group, outs):
                new[c] = o
        if nbytes is not None and comm is not None:
            time += comm(s.kind, float(nbytes), a)
        bl = new
    return bl, time


def _sum_partials(bl: dict, partial, mesh_shape) -> dict:
    out = {}
    for c in bl:
        total = 0
        for combo in itertools.product(*(range(mesh_shape[p]) for p in partial)):
            cc = list(c)
            for p, v in zip(partial, combo):
                cc[p] = v
            total = total + bl[tuple(cc)]
        out[c] = total
    return out


def assert_holds(bl: dict, global_value, layout: Layout, mesh_shape):
    expect = blocks(global_value, Layout(layout.dims), mesh_shape)
    got = _sum_partials(bl, layout.partial, mesh_shape)
    for c in expect:
        assert got[c].shape == expect[c].shape, (c, got[c].shape, expect[c].shape)
        np.testing.assert_array_equal(got[c], expect[c])


# ---------------------------------------------------------------- property test

@st.composite
def _case(draw):
    mesh_shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    ndim = draw(st.integers(1, 3))

    def layout():
        # each axis: -2 unused, -1 partial, d >= 0 split on dim d; order inside a dim random
        where = [draw(st.integers(-2, ndim - 1)) for _ in mesh_shape]
        order = draw(st.permutations(range(len(mesh_shape))))
        dims = tuple(tuple(a for a in order if where[a] == d) for d in range(ndim))
        return Layout(dims, tuple(a for a in range(len(mesh_shape)) if where[a] == -1))

    src, dst = layout(), layout()
    shape = []
    for d in range(ndim):
        axes = set(src.dims[d]) | set(dst.dims[d])
        shape.append(math.prod(mesh_shape[a] for a in axes) * draw(st.integers(1, 3)))
    return mesh_shape, tuple(shape), src, dst


@settings(max_examples=150, deadline=None)
@given(_case(), st.integers(0, 2**31 - 1))
def test_plan_executes_to_destination(case, seed):
    mesh_shape, shape, src, dst = case
    comm = ToyComm(mesh_shape)
    rng = np.random.default_rng(seed)
    g = rng.integers(-9, 10, size=shape).astype(np.float64)
    plan = plan_reshard(src, dst, shape, 8, mesh_shape, comm)
    out, priced = apply(plan.steps, blocks(g, src, mesh_shape, rng), mesh_shape, comm)
    assert_holds(out, g, dst, mesh_shape)
    # the planner's time equals the steps re-priced from the simulated buffer sizes
    assert priced == pytest.approx(plan.time, rel=1e-12, abs=1e-18)
    # never worse than the always-valid fallback: reduce/gather everything, then slice
    assert plan.time <= _fallback_time(src, dst, shape, mesh_shape, comm) * (1 + 1e-9)


@dataclass(frozen=True)
class AxisComm(ToyComm):
    """ToyComm with a bandwidth of its own per axis (inside a node, across nodes)."""
    bws: tuple = (1e9, 2.5e10, 3e8)

    def __call__(self, kind: str, nbytes: float, axis: int) -> float:
        n = self.mesh_shape[axis]
        if n == 1:
            return 0.0
        factor = {"all_reduce": 2 * (n - 1) / n}.get(kind, (n - 1) / n)
        return self.alpha * (1 + axis) + factor * nbytes / self.bws[axis]


@settings(max_examples=300, deadline=None)
@given(_case(), st.booleans())
def test_axes_placed_alike_are_left_out_of_the_search(case, per_axis):
    """plan_reshard searches without the axes source and destination place alike (unused by
    both, partial in both, the leading splits of a dim both share: reshard.reduce_problem); the
    full search over every axis finds no cheaper path, and the steps touch none of those axes."""
    from autopar.pricing.reshard import _plan_cached, reduce_problem

    mesh_shape, shape, src, dst = case
    comm = (AxisComm if per_axis else ToyComm)(mesh_shape)
    plan = plan_reshard(src, dst, shape, 4, mesh_shape, comm)
    full = _plan_cached(src, dst, shape, 4, mesh_shape, comm)
    assert plan.time == pytest.approx(full.time, rel=1e-9, abs=1e-15)
    kept = reduce_problem(src, dst, shape, mesh_shape).kept
    assert {s.axis for s in plan.steps} <= set(kept)


def test_reduced_problem_drops_the_shared_data_axis():
    """An activation split over the data axis on both sides: the search runs on the model axes
    with the per-rank batch, the same problem whatever the data-parallel degree."""
    from autopar.pricing.reshard import reduce_problem

    src = Layout(((0,), (1,), ()))          # batch over dp (axis 0), sequence over tp (axis 1)
    dst = Layout(((0,), (), (2,)), (1,))    # hidden over tp2, partial over tp
    a = reduce_problem(src, dst, (64, 16, 8), (8, 2, 4))
    b = reduce_problem(src, dst, (32, 16, 8), (4, 2, 4))
    assert a.kept == b.kept == (1, 2)
    assert (a.src, a.dst, a.shape, a.mesh_shape) == (b.src, b.dst, b.shape, b.mesh_shape)
    assert a.shape == (8, 16, 8) and a.src == Layout(((), (0,), ())) and a.dst == Layout(((), (), (1,)), (0,))


def _fallback_time(src, dst, shape, mesh_shape, comm):
    steps = [Step("all_reduce", a) for a in src.partial]
    for d, axes in enumerate(src.dims):
        steps += [Step("all_gather", a, d) for a in reversed(axes)]
    for d, axes in enumerate(dst.dims):
        steps += [Step("slice", a, d) for a in axes]
    steps += [Step("partial", a) for a in dst.partial]
    g = np.zeros(shape)
    _, t = apply(steps, blocks(g, src, mesh_shape), mesh_shape, comm)
    return t


# ---------------------------------------------------------------- hand checks

MESH = (4,)
COMM = ToyComm(MESH)


def test_identical_layouts_cost_nothing():
    for lay in [Layout.replicated(2), Layout.shard(2, {0: (0,)}), Layout.shard(2, {}, partial=(0,))]:
        plan = plan_reshard(lay, lay, (8, 8), 4, MESH, COMM)
        assert plan == ReshardPlan((), 0.0)


def test_partial_to_replicate_is_one_all_reduce():
    plan = plan_reshard(Layout.shard(2, {}, (0,)), Layout.replicated(2), (8, 8), 4, MESH, COMM)
    assert plan.steps == (Step("all_reduce", 0),)
    assert plan.time == pytest.approx(COMM("all_reduce", 8 * 8 * 4, 0))


def test_shard_to_shard_is_one_all_to_all():
    plan = plan_reshard(Layout.shard(2, {0: (0,)}), Layout.shard(2, {1: (0,)}), (8, 8), 4, MESH, COMM)
    assert plan.steps == (Step("all_to_all", 0, 0, 1),)
    assert plan.time == pytest.approx(COMM("all_to_all", 2 * 8 * 4, 0))


def test_partial_to_shard_is_one_reduce_scatter():
    plan = plan_reshard(Layout.shard(2, {}, (0,)), Layout.shard(2, {1: (0,)}), (8, 8), 4, MESH, COMM)
    assert plan.steps == (Step("reduce_scatter", 0, 1),)
    assert plan.time == pytest.approx(COMM("reduce_scatter", 8 * 8 * 4, 0))


def test_replicate_to_shard_is_a_free_slice():
    plan = plan_reshard(Layout.replicated(2), Layout.shard(2, {1: (0,)}), (8, 8), 4, MESH, COMM)
    assert plan.steps == (Step("slice", 0, 1),) and plan.time == 0.0


def test_shard_to_replicate_gathers_innermost_first():
    mesh = (2, 2)
    comm = ToyComm(mesh)
    plan = plan_reshard(Layout.shard(1, {0: (0, 1)}), Layout.replicated(1), (8,), 4, mesh, comm)
    assert plan.steps == (Step("all_gather", 1, 0), Step("all_gather", 0, 0))
    assert plan.time == pytest.approx(comm("all_gather", 4 * 4, 1) + comm("all_gather", 8 * 4, 0))


def test_uneven_shapes_are_rejected():
    with pytest.raises(ValueError, match="evenly"):
        plan_reshard(Layout.shard(1, {0: (0,)}), Layout.replicated(1), (6,), 4, MESH, COMM)
    with pytest.raises(ValueError, match="twice"):
        plan_reshard(Layout(((0,),), (0,)), Layout.replicated(1), (8,), 4, MESH, COMM)


def test_cost_matrix_matches_plans_and_is_memoised():
    lays = [Layout.replicated(2), Layout.shard(2, {0: (0,)}), Layout.shard(2, {1: (0,)}),
            Layout.shard(2, {}, (0,))]
    m = reshard_cost_matrix(lays, lays, (8, 16), 2, MESH, COMM)
    assert m.shape == (4, 4)
    assert np.all(np.diag(m) == 0)
    for i, s in enumerate(lays):
        for j, d in enumerate(lays):
            assert m[i, j] == plan_reshard(s, d, [8, 16], 2, list(MESH), COMM).time
    assert plan_reshard(lays[1], lays[2], (8, 16), 2, MESH, COMM) is \
        plan_reshard(lays[1], lays[2], (8, 16), 2, MESH, COMM)


def _all_layouts(ndim, naxes):
    """Every layout of an ndim tensor on an naxes mesh (each axis unused, partial or on a dim)."""
    out = set()
    for where in itertools.product(range(-2, ndim), repeat=naxes):
        for order in itertools.permutations(range(naxes)):
            dims = tuple(tuple(a for a in order if where[a] == d) for d in range(ndim))
            out.add(Layout(dims, tuple(a for a in range(naxes) if where[a] == -1)))
    return sorted(out)


def test_costs_obey_the_triangle_inequality():
    # Shortest paths cannot be beaten by going through an intermediate layout.
    mesh = (2, 4)
    comm = ToyComm(mesh, alpha=3e-6)
    lays = _all_layouts(2, 2)
    m = reshard_cost_matrix(lays, lays, (8, 16), 4, mesh, comm)
    via = (m[:, :, None] + m[None, :, :]).min(axis=1)
    assert np.all(m <= via * (1 + 1e-9) + 1e-15)
    assert np.all(np.isfinite(m)) and np.all(np.diag(m) == 0)


@settings(max_examples=300, deadline=None)
@given(_case(), st.booleans(), st.booleans())
def test_pair_floor_is_below_the_reshard(case, per_axis, grad):
    """autopar/pricing/edge_floor.py ``pair_floors``: for any layout pair, the floor (each needed
    collective at the least a collective that can act on its axis costs on its least bytes) is
    no more than the cheapest reshard's forward and backward seconds."""
    from autopar.pricing.conjugates import step_traffic
    from autopar.pricing.edge_floor import _places, _split_masks, collectives_needed, latency_floor, pair_floors

    mesh_shape, shape, src, dst = case
    comm = (AxisComm if per_axis else ToyComm)(mesh_shape)
    plan = plan_reshard(src, dst, shape, 4, mesh_shape, comm)
    exact = 0.0
    for tr in step_traffic(plan.steps, src, shape, 4, mesh_shape):
        for kind in (tr.forward, tr.backward if grad else None):
            if kind:
                exact += comm(kind, tr.nbytes, tr.axis)
    n = len(mesh_shape)
    need = collectives_needed(_places([src], n), _places([dst], n), grad)
    lat = [latency_floor(comm, a) for a in range(n)]
    floor = pair_floors(need, _split_masks([src]), _split_masks([dst]), 4.0 * math.prod(shape), mesh_shape, lat,
                        lambda b, a, kinds: min(comm(k, b, a) for k in kinds))
    assert floor[0, 0] <= exact * (1 + 1e-9) + 1e-15, (src, dst, plan.describe(), floor[0, 0], exact)


def _reference_search(src, dst, shape, itemsize, mesh_shape, comm):
    """The search written plainly: every state's local block and moves from the real shape."""
    import heapq

    from autopar.pricing.reshard import _key, _moves
    goal, start = (dst.dims, tuple(sorted(dst.partial))), (src.dims, tuple(sorted(src.partial)))
    want, dst_partial, tie = [set(a) for a in dst.dims], set(dst.partial), itertools.count()
    heap, done = [(0.0, 0, next(tie), 0.0, start, ())], set()
    while heap:
        _, n, _, cost, state, steps = heapq.heappop(heap)
        if state in done:
            continue
        if state == goal:
            return ReshardPlan(tuple(Step(*s) for s in steps), cost)
        done.add(state)
        local = [shape[d] // math.prod(mesh_shape[a] for a in axes) for d, axes in enumerate(state[0])]
        for step, nd, npart, kind, nb in _moves(*state, local, float(math.prod(local) * itemsize), mesh_shape,
                                                want, dst_partial):
            if (nd, npart) not in done:
                c = cost + (float(comm(kind, nb, step[1])) if kind else 0.0)
                heapq.heappush(heap, (_key(c), n + 1, next(tie), c, (nd, npart), steps + (step,)))


@settings(max_examples=300, deadline=None)
@given(_case(), st.booleans())
def test_moves_shared_by_divisibility_give_the_plain_search_path(case, per_axis):
    """The search keeps each state's moves per (destination, divisibility, mesh) and shares them
    between shapes alike in divisibility (reshard.divisibility): the path and its time are those of
    the search computing every move from the shape itself."""
    from autopar.pricing.reshard import _plan_cached

    mesh_shape, shape, src, dst = case
    comm = (AxisComm if per_axis else ToyComm)(mesh_shape)
    for scale in (1, 3):   # a second shape, alike in divisibility, on the shared moves
        s = tuple(x * scale ** (d == 0) for d, x in enumerate(shape))
        if math.gcd(s[0], math.prod(mesh_shape)) != math.gcd(shape[0], math.prod(mesh_shape)):
            continue
        assert _plan_cached(src, dst, s, 4, mesh_shape, comm) == _reference_search(src, dst, s, 4, mesh_shape, comm)
