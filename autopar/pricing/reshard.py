"""The resharding planner: the cheapest collective sequence between two Layouts of a tensor.

A tensor of a given global shape on a mesh (only the mesh shape matters here) moves from a
source Layout to a destination Layout by a sequence of Steps, each acting on one mesh axis a:

- ``all_reduce``     removes a from the partial axes;
- ``reduce_scatter`` removes a from the partial axes and appends a as the innermost split of ``dim``;
- ``all_gather``     removes a from ``dim``'s split axes (only when a is the innermost one, so every
                     rank's block stays one contiguous piece of the global tensor);
- ``all_to_all``     moves a from the innermost split of ``dim`` to the innermost split of ``dst_dim``;
- ``slice``          appends an unused axis a as the innermost split of ``dim`` (a local slice: free);
- ``partial``        makes the tensor a partial sum over an unused axis a (rank 0 of the axis keeps
                     the value, the others hold zeros: free). Not in the original step list; it exists
                     so that every (src, dst) pair has a path even when dst has partial axes src lacks.

``plan_reshard`` runs a uniform-cost (Dijkstra) search over layout states with these moves,
pricing each collective with the shared ``comm(kind, nbytes, axis) -> seconds`` convention
(nbytes: per rank, the larger buffer involved). Times are forward only; the backward of each
step is its conjugate and moves the same bytes, the caller adds it. Results are memoised, the
ILP builder asks for thousands of (src, dst) pairs, and so are each state's moves: they depend on
the shape only through which splits divide it (``divisibility``), so the micro-batch shapes of one
tensor share them and only the bytes differ.

The search runs on the axes the reshard can need (``reduce_problem``): an axis that source and
destination place alike is left where it is. That is an axis neither uses, one both are partial
over, or one in the common leading splits of a dim (the data axis of every activation: the
batch split over it on both sides). Moving such an axis only to put it back costs a collective
and enlarges what the other steps move (comm grows with bytes), so no cheapest path does it.
Without them the problem is the same on every mesh whose remaining axes sit alike on the nodes,
whatever the data-parallel degree: autopar/pricing/edge_price.py shares the answers across the
meshes and micro-batch counts of one planning (a pipeline stage's sub-mesh at m micro-batches
asks what the whole mesh asked at m / pp), and codegen, calling ``plan_reshard``, runs the same
reduced search, so the path executed is the path priced.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

from autopar.rules.layout import Layout

STEP_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "slice", "partial")


@dataclass(frozen=True)
class Step:
    kind: str
    axis: int
    dim: int | None = None       # tensor dim; None for all_reduce / partial
    dst_dim: int | None = None   # all_to_all only: the dim that becomes split (``dim`` becomes gathered)

    def __post_init__(self):
        if self.kind not in STEP_KINDS:
            raise ValueError(f"unknown reshard step kind {self.kind!r}; expected one of {STEP_KINDS}")

    def describe(self) -> str:
        if self.kind == "all_to_all":
            return f"all_to_all[axis {self.axis}](S({self.dim})->S({self.dst_dim}))"
        if self.dim is None:
            return f"{self.kind}[axis {self.axis}]"
        return f"{self.kind}[axis {self.axis}](dim {self.dim})"


@dataclass(frozen=True)
class ReshardPlan:
    steps: tuple[Step, ...]
    time: float   # seconds, forward only

    def describe(self) -> str:
        return " ; ".join(s.describe() for s in self.steps) or "(no-op)"


def _validate(layout: Layout, shape: tuple[int, ...], mesh_shape: tuple[int, ...], what: str) -> None:
    if layout.ndim != len(shape):
        raise ValueError(f"{what} layout {layout} has {layout.ndim} dims but the tensor shape {shape} has {len(shape)}")
    used = [a for axes in layout.dims for a in axes] + list(layout.partial)
    for a in used:
        if not 0 <= a < len(mesh_shape):
            raise ValueError(f"{what} layout {layout} uses mesh axis {a}; "
                             f"the mesh {mesh_shape} has {len(mesh_shape)} axes")
    if len(used) != len(set(used)):
        raise ValueError(f"{what} layout {layout} uses a mesh axis twice (split and/or partial)")
    for d, s in enumerate(shape):
        f = layout.split_factor(d, mesh_shape)
        if s % f:
            raise ValueError(f"{what} layout {layout}: dim {d} of size {s} does not split evenly into {f} blocks")


def _moves(dims, partial, local, nbytes, mesh_shape, want, dst_partial):
    """Every useful (step, next dims, next partial, kind, nbytes) from the state (``dims``,
    ``partial``) whose per-rank block has shape ``local`` and ``nbytes`` bytes, in a fixed order.
    Steps are plain tuples (kind, axis, dim, dst_dim); ``plan_reshard`` makes Step objects of the
    winning path only (this search runs tens of thousands of times per mesh).

    Moves that put an axis where the destination does not want it (slicing, reduce-scattering
    or all-to-all-ing axis a into a dim the destination does not split over a, or making the
    tensor partial over an axis the destination is not partial over) are never part of a
    cheapest path, since undoing them costs a collective; skipping them keeps the search small.
    A path always exists: reduce and gather everything, then slice and make partial as wanted."""
    ndim = len(dims)
    for a in partial:
        rest = tuple(p for p in partial if p != a)
        yield ("all_reduce", a, None, None), dims, rest, "all_reduce", nbytes
        for d in range(ndim):
            if a in want[d] and local[d] % mesh_shape[a] == 0:
                yield ("reduce_scatter", a, d, None), dims[:d] + (dims[d] + (a,),) + dims[d + 1:], rest, \
                    "reduce_scatter", nbytes
    for d in range(ndim):
        if not dims[d]:
            continue
        a = dims[d][-1]
        gathered = dims[:d] + (dims[d][:-1],) + dims[d + 1:]
        yield ("all_gather", a, d, None), gathered, partial, "all_gather", nbytes * mesh_shape[a]
        for e in range(ndim):
            if e != d and a in want[e] and local[e] % mesh_shape[a] == 0:
                yield ("all_to_all", a, d, e), gathered[:e] + (gathered[e] + (a,),) + gathered[e + 1:], partial, \
                    "all_to_all", nbytes
    used = {a for axes in dims for a in axes}.union(partial)
    for a in range(len(mesh_shape)):
        if a in used:
            continue
        for d in range(ndim):
            if a in want[d] and local[d] % mesh_shape[a] == 0:
                yield ("slice", a, d, None), dims[:d] + (dims[d] + (a,),) + dims[d + 1:], partial, None, 0.0
        if a in dst_partial:
            yield ("partial", a, None, None), dims, tuple(sorted(partial + (a,))), None, 0.0


def _key(cost: float) -> float:
    # Equal-cost paths (all_reduce vs reduce_scatter + all_gather under a ring model) differ in
    # the last bits of a float sum; round so the step count decides ties, not rounding noise.
    return float(f"{cost:.9g}")


@functools.lru_cache(maxsize=1 << 14)
def _checked(layout: Layout, shape: tuple[int, ...], mesh_shape: tuple[int, ...], what: str) -> None:
    # a layout recurs with many partners: checked once per (layout, shape, mesh)
    _validate(layout, shape, mesh_shape, what)


class Reduced(NamedTuple):   # a tuple: made once per priced layout pair
    """A reshard problem on the axes it can need (module doc): ``kept`` are the original indices
    of the remaining mesh axes, renumbered 0.. in ``src``, ``dst`` and ``mesh_shape``; ``shape``
    is the tensor divided by the leading splits both sides share."""
    kept: tuple[int, ...]
    src: Layout
    dst: Layout
    shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]


def reduce_problem(src: Layout, dst: Layout, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> Reduced:
    """``src`` -> ``dst`` without the axes both place alike (module doc). Layouts must be valid."""
    kept, rsrc, rdst, divisors, rmesh = reduction(src, dst, mesh_shape)
    if divisors is not None:
        shape = tuple([x // q for x, q in zip(shape, divisors)])
    return Reduced(kept, rsrc, rdst, tuple(shape), rmesh)


@functools.lru_cache(maxsize=1 << 16)
def reduction(src: Layout, dst: Layout, mesh_shape: tuple[int, ...]):
    """What ``reduce_problem`` does to a (src, dst) pair whatever the tensor's shape: (kept axes,
    reduced src, reduced dst, per-dim divisors of the shape or None, reduced mesh shape)."""
    used = [False] * len(mesh_shape)
    for lay in (src, dst):
        for axes in lay.dims:
            for a in axes:
                used[a] = True
        for a in lay.partial:
            used[a] = True
    for a in src.partial:
        if a in dst.partial:
            used[a] = False
    divisors = None
    for d, s in enumerate(src.dims):
        t = dst.dims[d]
        if s and t and s[0] == t[0]:
            if divisors is None:
                divisors = [1] * len(src.dims)
            k, n = 0, min(len(s), len(t))
            while k < n and s[k] == t[k]:
                used[s[k]] = False
                divisors[d] *= mesh_shape[s[k]]
                k += 1
    kept = tuple(a for a, u in enumerate(used) if u)
    if len(kept) == len(mesh_shape):
        return kept, src, dst, None, tuple(mesh_shape)
    at = {a: i for i, a in enumerate(kept)}

    def renumber(lay: Layout) -> Layout:
        return Layout(tuple(tuple([at[a] for a in axes if a in at]) for axes in lay.dims),
                      tuple(sorted([at[a] for a in lay.partial if a in at])))
    return (kept, renumber(src), renumber(dst), None if divisors is None else tuple(divisors),
            tuple(mesh_shape[a] for a in kept))


@dataclass(frozen=True)
class KeptAxes:
    """``comm`` seen from a reduced problem: its axis i is the original axis ``kept[i]``."""
    comm: Callable[[str, float, int], float]
    kept: tuple[int, ...]

    def __call__(self, kind: str, nbytes: float, axis: int) -> float:
        return self.comm(kind, nbytes, self.kept[axis])


def search_reduced(r: Reduced, itemsize: int, comm) -> ReshardPlan:
    """The cheapest plan of a reduced problem, its steps on the reduced axes (``comm`` priced on
    the original ones)."""
    identity = r.kept == tuple(range(len(r.kept)))   # only trailing axes left out, if any
    return _plan_cached(r.src, r.dst, r.shape, itemsize, r.mesh_shape, comm if identity else KeptAxes(comm, r.kept))


def plan_reduced(src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int,
                 mesh_shape: tuple[int, ...], comm) -> tuple[Reduced, ReshardPlan]:
    """The reduced problem and its cheapest plan (steps on the reduced axes). Raises ValueError
    for layouts that do not fit the tensor or the mesh."""
    _checked(src, shape, mesh_shape, "source")
    _checked(dst, shape, mesh_shape, "destination")
    r = reduce_problem(src, dst, shape, mesh_shape)
    return r, search_reduced(r, itemsize, comm)


@functools.lru_cache(maxsize=1 << 16)
def _plan_cached(src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int,
                 mesh_shape: tuple[int, ...], comm) -> ReshardPlan:
    _checked(src, shape, mesh_shape, "source")
    _checked(dst, shape, mesh_shape, "destination")
    goal = (dst.dims, tuple(sorted(dst.partial)))
    start = (src.dims, tuple(sorted(src.partial)))
    if start == goal:
        return ReshardPlan((), 0.0)
    # The moves out of each state depend on the shape only through divisibility (``_state_moves``),
    # shared by every shape alike in that; the bytes they move scale with the tensor's.
    divisible = divisibility(shape, mesh_shape)
    graph = _state_moves(dst, divisible, mesh_shape)
    total = math.prod(shape) * itemsize
    tie = itertools.count()
    # heap entries: (rounded cost, number of steps, insertion order, exact cost, state, steps)
    heap = [(0.0, 0, next(tie), 0.0, start, ())]
    done: set = set()
    while heap:
        _, n, _, cost, state, steps = heapq.heappop(heap)
        if state in done:
            continue
        if state == goal:
            return ReshardPlan(tuple(Step(*st) for st in steps), cost)
        done.add(state)
        got = graph.get(state)
        if got is None:
            got = graph[state] = _expand(state, dst, divisible, mesh_shape)
        factor, moves = got
        nbytes = float(total // factor)
        for step, nxt, kind, scale in moves:
            if nxt in done:
                continue
            c = cost + (float(comm(kind, nbytes * scale if scale != 1 else nbytes, step[1])) if kind else 0.0)
            heapq.heappush(heap, (_key(c), n + 1, next(tie), c, nxt, steps + (step,)))
    # Unreachable: gather/reduce everything, then slice and make partial, is always a path.
    raise AssertionError(f"no reshard path from {src} to {dst}")  # pragma: no cover


def divisibility(shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """What the search needs of a shape besides its size: gcd(dim, product of the mesh axes) per
    dim. A split over any set of axes divides a dim exactly when it divides that gcd (the
    product of distinct axes' sizes divides the product of all)."""
    m = math.prod(mesh_shape)
    return tuple(math.gcd(s, m) for s in shape)


@functools.lru_cache(maxsize=1 << 14)
def _state_moves(dst: Layout, divisible: tuple[int, ...], mesh_shape: tuple[int, ...]) -> dict:
    """The search's state graph toward ``dst`` for shapes of one ``divisibility``, filled as states
    are expanded: state -> (the product of its split factors, its moves as (step, next state,
    collective kind or None, bytes relative to the state's block))."""
    return {}


def _expand(state, dst: Layout, divisible: tuple[int, ...], mesh_shape: tuple[int, ...]):
    dims, partial = state
    local = []
    factor = 1
    for d, axes in enumerate(dims):
        f = 1
        for a in axes:
            f *= mesh_shape[a]
        local.append(divisible[d] // f)
        factor *= f
    want = [set(axes) for axes in dst.dims]
    moves = tuple((step, (ndims, npartial), kind, nb)
                  for step, ndims, npartial, kind, nb in _moves(dims, partial, local, 1, mesh_shape, want,
                                                                 set(dst.partial)))
    return factor, moves


def plan_reshard(src: Layout, dst: Layout, shape, itemsize: int, mesh_shape,
                 comm: Callable[[str, float, int], float]) -> ReshardPlan:
    """Cheapest step sequence turning ``src`` into ``dst`` (forward seconds). ``comm`` must be
    hashable (a frozen dataclass); results are memoised per argument tuple."""
    r, rp = plan_reduced(src, dst, tuple(int(s) for s in shape), int(itemsize),
                         tuple(int(m) for m in mesh_shape), comm)
    if len(r.kept) == len(mesh_shape):
        return rp
    return ReshardPlan(tuple(dataclasses.replace(st, axis=r.kept[st.axis]) for st in rp.steps), rp.time)


def reshard_cost_matrix(srcs: list[Layout], dsts: list[Layout], shape, itemsize: int, mesh_shape,
                        comm: Callable[[str, float, int], float]) -> np.ndarray:
    """``out[i, j]`` = forward seconds of resharding ``srcs[i]`` into ``dsts[j]``."""
    out = np.zeros((len(srcs), len(dsts)), dtype=np.float64)
    for i, s in enumerate(srcs):
        for j, d in enumerate(dsts):
            out[i, j] = plan_reshard(s, d, shape, itemsize, mesh_shape, comm).time
    return out
