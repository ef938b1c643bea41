"""Building the intra-stage sharding ILP from a Problem (torch-free): the model as arrays
(solver/lp_arrays.py) that solver/backends.py runs and solver/ilp.py solves.

Variables and constraint families (each added by the function named; the model is held as
arrays by solver/lp_arrays.py):

- ``x[n,s]`` binary, one per strategy of each node; **one-hot choice**
  ``sum_s x[n,s] == 1`` -- ``_add_choice``.
- **Edges, linearised** -- ``_add_edges``, after ``_fold_edges`` has simplified them: parallel
  edges between the same pair are summed (a reversed pair is transposed first), self edges
  (``src == dst``) become node costs ``M[s,s]``, all-zero matrices are dropped and separable
  matrices (``M[s,t] = a[s] + b[t]``, e.g. a producer or consumer with one strategy) are folded
  into the two node costs. Each remaining pair (u,v) gets continuous ``e[s,t] >= 0`` with
  ``sum_t e[s,t] == x[u,s]`` (every s) and ``sum_s e[s,t] == x[v,t]`` (every t but the last,
  which the others and the two one-hots imply). For binary x this forces ``e = x[u,s]*x[v,t]``.
- **Checkpoint groups** -- ``_add_checkpoint_groups``: binary ``c[g]`` (a constant when
  ``forced``), continuous ``z[g,n,s] = x[n,s] AND NOT c[g]`` via ``z <= x[n,s]``,
  ``z >= x[n,s] - c`` and ``sum_s z[n,s] <= 1 - c`` (the per-node sum of ``z <= 1 - c``, valid
  because of the one-hot). z exists only for nodes in the group's term lists and only for
  strategies where it changes a coefficient. Group activation bytes
  ``= sum_saved z*a + sum_kept (x - z)*b``; recompute working set
  ``rec_g = sum_recompute_memory (x - z)*r``; extra time ``= sum_recompute_time (x - z)*t``.
  Only with more than ``solver.decisions.MAX_SPLIT_GROUPS`` free groups: with fewer, ``solve``,
  ``relaxation_bound`` and ``mip_reaches`` run once per allowed decision with every group pinned
  (solver/decisions.py: the z relaxation is weak where memory binds, the pinned LPs are tight).
- **Checkpoint links** -- ``_add_checkpoint_links`` (solver/checkpoint_links.py): ``c[implied_by] <= c[g]`` for a group
  with ``implied_by`` (a block group's selective-recompute companion is on whenever the whole
  block is recomputed; a pinned side becomes a bound).
- **Memory (liveness sets)** -- ``_add_memory``: ``const + sum terms + group bytes + R <= budget``
  per MemoryConstraint with a finite budget, where continuous ``R >= rec_g`` for each group the
  constraint lists (``_recompute_rows``): backward recomputes one block at a time, so only the
  largest recompute working set is alive, not their sum. Each row is divided by its largest
  magnitude so the solver's feasibility tolerance is relative. A row with no variables is
  checked directly.
- **Presolve** -- ``solver/presolve.py``: checkpoint groups that cannot matter (every memory row
  holds with them off whatever the strategies) are pinned off before the model is built.
- **Objective** -- ``_set_objective``: node costs + edge costs + recompute time. Each node's
  cheapest cost is moved into a constant offset and the rest is scaled so the largest
  coefficient is ``_OBJ_TARGET``; costs from 1e-6 s to 100 s then sit well above solver
  tolerances. The reported objective is recomputed exactly in seconds by ``evaluate``.
  Accuracy: plans whose costs differ by less than about 1e-9 of the largest cost coefficient
  are ties to the solver (its tolerances are ~1e-7 of the scaled coefficients).
- **Ties** -- solver/tie_break.py, after each solve: between strategies of equal time a node
  takes the one with fewer bytes (the objective has no memory term).
- **Peak rows** (``min_peak_memory`` only) -- ``_add_peak_rows``: ``total_k <= P`` for every
  memory constraint, objective ``min P``; budgets are ignored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from solver.checkpoint_links import add_checkpoint_links as _add_checkpoint_links
from solver.lp_arrays import _BINARY, _LP, _Model, _var
from solver.problem import Problem
from solver.problem_checks import _MEM_RTOL, _sum_terms

_OBJ_TARGET = 1e3      # largest objective coefficient after scaling
_SEP_RTOL = 1e-12      # a matrix is separable when its residual is below this * max|M|


# ----------------------------------------------------------------------------- model building

@dataclass
class _GroupParts:
    """A checkpoint group's bytes and time as x-coefficients plus z terms."""
    mem_x: dict[int, np.ndarray]
    mem_z: list[tuple[int, float]]
    rec_x: dict[int, np.ndarray]                     # recompute working set: x-coefficients
    rec_z: list[tuple[int, float]]       # ... and z terms
    time_x: dict[int, np.ndarray]
    time_z: list[tuple[int, float]]




def _add_choice(lp: _LP, sizes: list[int]) -> list[np.ndarray]:
    total = int(sum(sizes))
    allx = lp.block("x", (total,), 0.0, 1.0, binary=True)
    x, off = [], 0
    for k in sizes:
        x.append(allx[off:off + k])
        off += k
    for n, xs in enumerate(x):
        lp.row([(v, 1.0) for v in xs], "EQ", 1.0, f"onehot_{n}")
    return x


def _fold_edges(problem: Problem, node_obj: list[np.ndarray]) -> list[tuple[int, int, np.ndarray]]:
    """Sum, drop and fold edges (see module docstring); adds folded parts to ``node_obj``."""
    pairs: dict[tuple[int, int], np.ndarray] = {}
    for e in problem.edges:
        m = np.asarray(e.cost, dtype=float)
        if e.src == e.dst:
            node_obj[e.src] = node_obj[e.src] + np.diag(m)
            continue
        key, m = ((e.src, e.dst), m) if e.src < e.dst else ((e.dst, e.src), m.T)
        pairs[key] = pairs[key] + m if key in pairs else m.copy()
    kept = []
    for (u, v) in sorted(pairs):
        m = pairs[(u, v)]
        big = float(np.abs(m).max())
        if big == 0.0:
            continue
        a, b = m[:, 0], m[0, :] - m[0, 0]
        if float(np.abs(m - a[:, None] - b[None, :]).max()) <= _SEP_RTOL * big:
            node_obj[u] = node_obj[u] + a
            node_obj[v] = node_obj[v] + b
            continue
        kept.append((u, v, m))
    return kept


def _add_edges(lp: _LP, x, edges) -> tuple[np.ndarray, np.ndarray]:
    """Edge variables and marginal rows (numpy blocks); returns the objective's (e index, cost)."""
    obj_i, obj_v = [], []
    for k, (u, v, m) in enumerate(edges):
        ns, nt = m.shape
        e = lp.block(f"e_{k}", (ns, nt), 0.0, math.inf)
        xu, xv = np.asarray(x[u]), np.asarray(x[v])
        # sum_t e[s,t] - x[u,s] == 0 for every s
        lp.row_block(np.concatenate([e, xu[:, None]], axis=1),
                     np.concatenate([np.ones((ns, nt)), -np.ones((ns, 1))], axis=1), 0.0, 0.0)
        # sum_s e[s,t] - x[v,t] == 0 for every t but the last
        if nt > 1:
            lp.row_block(np.concatenate([e[:, :nt - 1].T, xv[:nt - 1, None]], axis=1),
                         np.concatenate([np.ones((nt - 1, ns)), -np.ones((nt - 1, 1))], axis=1), 0.0, 0.0)
        nz = m != 0.0
        obj_i.append(e[nz])
        obj_v.append(m[nz].astype(float))
    if not obj_i:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    return np.concatenate(obj_i), np.concatenate(obj_v)


def _add_checkpoint_groups(lp: _LP, problem: Problem, x, sizes) -> tuple[list, list[_GroupParts]]:
    cs, parts = [], []
    for gi, g in enumerate(problem.checkpoint_groups):
        saved = _sum_terms(g.saved, sizes)
        ckpt = _sum_terms(g.kept, sizes)
        rmem = _sum_terms(g.recompute_memory, sizes)
        rtime = _sum_terms(g.recompute_time, sizes)
        nodes = sorted(set(saved) | set(ckpt) | set(rmem) | set(rtime))
        zero = {n: np.zeros(sizes[n]) for n in nodes}
        a = {n: saved.get(n, zero[n]) for n in nodes}
        b = {n: ckpt.get(n, zero[n]) for n in nodes}
        r = {n: rmem.get(n, zero[n]) for n in nodes}
        t = {n: rtime.get(n, zero[n]) for n in nodes}
        if g.forced is not None:
            # A pinned decision needs no c or z: the bytes and time are linear in x alone.
            cs.append(bool(g.forced))
            if g.forced:
                parts.append(_GroupParts(mem_x=b, mem_z=[], rec_x=r, rec_z=[], time_x=t, time_z=[]))
            else:
                parts.append(_GroupParts(mem_x=a, mem_z=[], rec_x={}, rec_z=[], time_x={}, time_z=[]))
            continue
        c = _var(lp, f"c_{gi}", cat=_BINARY)
        cs.append(c)
        mem_z, rec_z, time_z = [], [], []
        for n in nodes:
            zs = []
            for s in range(sizes[n]):
                dm, dr, dt = a[n][s] - b[n][s], -r[n][s], -t[n][s]
                if dm == 0.0 and dr == 0.0 and dt == 0.0:
                    continue  # z would not change any coefficient
                z = _var(lp, f"z_{gi}_{n}_{s}", 0.0, 1.0)
                zs.append(z)
                lp.row([(z, 1.0), (x[n][s], -1.0)], "LE", 0.0, f"zx_{gi}_{n}_{s}")
                lp.row([(z, 1.0), (x[n][s], -1.0), (c, 1.0)], "GE", 0.0, f"zlo_{gi}_{n}_{s}")
                if dm != 0.0:
                    mem_z.append((z, dm))
                if dr != 0.0:
                    rec_z.append((z, dr))
                if dt != 0.0:
                    time_z.append((z, dt))
            if zs:
                lp.row([(z, 1.0) for z in zs] + [(c, 1.0)], "LE", 1.0, f"zc_{gi}_{n}")
        parts.append(_GroupParts(mem_x=b, mem_z=mem_z, rec_x=r, rec_z=rec_z, time_x=t, time_z=time_z))
    return cs, parts


def _merge_z(zterms) -> list[tuple[int, float]]:
    zsum: dict[int, list] = {}
    for z, w in zterms:  # a group listed twice in one constraint counts twice
        if z in zsum:
            zsum[z][1] += w
        else:
            zsum[z] = [z, w]
    return [(z, w) for z, w in zsum.values() if w != 0.0]


def _recompute_rows(lp: _LP, problem: Problem, mi: int, sizes, x, parts) -> list:
    """``R_mi >= rec_g`` for every group of memory constraint ``mi`` that can recompute; returns
    the (R, unit) term to add to the constraint's row (none when no group can)."""
    rows = []
    for gi in sorted(set(problem.memory[mi].groups)):
        p = parts[gi]
        terms = [(x[n][s], float(w)) for n in sorted(p.rec_x) for s, w in enumerate(p.rec_x[n]) if w != 0.0]
        terms += _merge_z(p.rec_z)
        if terms:
            rows.append(terms)
    if not rows:
        return []
    # R is kept in units of the largest recompute coefficient, not bytes: in bytes its coefficient
    # in the normalised memory row (1 / the row's largest bytes, ~1e-10 for 10 GB rows) would fall
    # below HiGHS's small_matrix_value (1e-9) and be dropped, leaving R unconstrained there.
    unit = max(abs(w) for terms in rows for _, w in terms)
    rvar = _var(lp, f"rec_{mi}", 0.0)
    for k, terms in enumerate(rows):
        norm = max(abs(w) for _, w in terms)
        lp.row([(v, w / norm) for v, w in terms] + [(rvar, -unit / norm)], "LE", 0.0, f"rec_{mi}_{k}")
    return [(rvar, unit)]


def _memory_row(lp: _LP, problem: Problem, mi: int, sizes, x, parts: list[_GroupParts]):
    """(list of (var, bytes), const bytes) of memory constraint ``mi``'s total (adds its
    recompute rows to ``lp``)."""
    m = problem.memory[mi]
    coef = _sum_terms(m.terms, sizes)
    zterms: list[tuple[int, float]] = []
    for gi in m.groups:
        for n, arr in parts[gi].mem_x.items():
            coef[n] = coef.get(n, np.zeros(sizes[n])) + arr
        zterms.extend(parts[gi].mem_z)
    terms = [(x[n][s], float(w)) for n in sorted(coef) for s, w in enumerate(coef[n]) if w != 0.0]
    terms.extend(_merge_z(zterms))
    terms.extend(_recompute_rows(lp, problem, mi, sizes, x, parts))
    return terms, float(m.const)


def _add_memory(lp: _LP, problem: Problem, sizes, x, parts) -> bool:
    """Budget rows; returns False when a variable-free row is already over budget."""
    for mi, m in enumerate(problem.memory):
        if not math.isfinite(m.budget) and m.budget > 0:
            continue
        terms, const = _memory_row(lp, problem, mi, sizes, x, parts)
        rhs = m.budget - const
        if not terms:
            if rhs < -_MEM_RTOL * max(1.0, abs(m.budget)):
                return False
            continue
        if not math.isfinite(rhs):  # budget == -inf
            return False
        norm = max(abs(rhs), max(abs(w) for _, w in terms))
        lp.row([(v, w / norm) for v, w in terms], "LE", rhs / norm, f"mem_{mi}")
    return True


def _set_objective(lp: _LP, x, node_obj, edge_terms, parts) -> tuple[float, float]:
    """Set the scaled objective; returns (offset, scale)."""
    node_obj = [o.copy() for o in node_obj]
    zterms: list[tuple[int, float]] = []
    for p in parts:
        for n, arr in p.time_x.items():
            node_obj[n] = node_obj[n] + arr
        zterms.extend(p.time_z)
    offset = 0.0
    for n, o in enumerate(node_obj):
        lo = float(o.min())
        offset += lo
        node_obj[n] = o - lo
    e_idx, e_val = edge_terms
    big = max([float(o.max()) for o in node_obj] + [float(np.abs(e_val).max()) if e_val.size else 0.0]
              + [abs(w) for _, w in zterms] + [0.0])
    scale = _OBJ_TARGET / big if big > 0 else 1.0
    lp.set_objective([(v, w * scale) for v, w in zterms])
    xi = np.concatenate([np.asarray(xs) for xs in x]) if x else np.zeros(0, dtype=np.int64)
    xv = np.concatenate(node_obj) * scale if node_obj else np.zeros(0)
    nz = xv != 0.0
    lp.add_objective(xi[nz], xv[nz])
    lp.add_objective(e_idx, e_val * scale)
    return offset, scale


def _add_peak_rows(lp: _LP, problem: Problem, sizes, x, parts) -> None:
    rows = [_memory_row(lp, problem, mi, sizes, x, parts) for mi in range(len(problem.memory))]
    # One common scale: every row shares the variable P.
    norm = max([abs(c) for _, c in rows] + [abs(w) for t, _ in rows for _, w in t] + [1.0])
    peak = _var(lp, "peak")
    for mi, (terms, const) in enumerate(rows):
        lp.row([(v, w / norm) for v, w in terms] + [(peak, -1.0)], "LE", -const / norm, f"peak_{mi}")
    lp.set_objective([(peak, 1.0)])


def build(problem: Problem, peak: bool = False) -> _Model:
    """Build the PuLP model (``peak=True``: the min-peak-memory model). Exposed for timing."""
    sizes = [len(c) for c in problem.costs]
    lp = _LP("autopar_min_peak" if peak else "autopar_sharding")
    x = _add_choice(lp, sizes)
    cs, parts = _add_checkpoint_groups(lp, problem, x, sizes)
    _add_checkpoint_links(lp, problem, cs)
    model = _Model(lp=lp, x=x, c=cs)
    if peak:
        _add_peak_rows(lp, problem, sizes, x, parts)
        return model
    node_obj = [np.asarray(c, dtype=float).copy() for c in problem.costs]
    edges = _fold_edges(problem, node_obj)
    edge_terms = _add_edges(lp, x, edges)
    model.infeasible = not _add_memory(lp, problem, sizes, x, parts)
    model.offset, model.scale = _set_objective(lp, x, node_obj, edge_terms, parts)
    return model
