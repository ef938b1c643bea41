"""The intra-stage sharding ILP: Problem -> Solution (HiGHS or CBC: solver/backends.py runs the
built model). Torch-free.

Variables and constraint families (each added by the function named; the model is held as arrays by solver/lp_arrays.py):

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
- **Peak rows** (``min_peak_memory`` only) -- ``_add_peak_rows``: ``total_k <= P`` for every
  memory constraint, objective ``min P``; budgets are ignored.

Optimality gap when a time limit stops the search with an incumbent (status "feasible"):
HiGHS reports its MIP dual bound (``Highs.getInfo().mip_dual_bound``), which we use; PuLP does
not expose CBC's bound, so for CBC we re-solve the LP relaxation (``mip=False``) and use its
optimum as the bound (``inf`` gap if that LP does not finish). Either way
``gap = (objective - bound) / |objective|`` in true seconds.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np

from solver import decisions
from solver.backends import _bound, _extract, _run, _run_highs, _use_highs, release_threads  # noqa: F401 (re-exported)
from solver.checkpoint_links import add_checkpoint_links as _add_checkpoint_links
from solver.checkpoint_links import validate_links as _validate_links
from solver.errors import PlanError
from solver.lp_arrays import _BINARY, _LP, _Model, _var
from solver.presolve import fix_needless_checkpointing
from solver.problem import Problem, Solution

_OBJ_TARGET = 1e3      # largest objective coefficient after scaling
_SEP_RTOL = 1e-12      # a matrix is separable when its residual is below this * max|M|
_MEM_RTOL = 1e-9       # relative slack allowed when checking a budget in numpy
_MAX_TIME_LIMIT_GAP = math.inf


def _input_error(message: str) -> Exception:
    return PlanError(message)


# ----------------------------------------------------------------------------- validation

def validate(problem: Problem) -> None:
    """Raise ``autopar.errors.PlanError`` naming the first malformed part of ``problem``."""
    n = problem.num_nodes
    if len(problem.node_names) != n:
        raise _input_error(f"Problem has {len(problem.node_names)} node_names but {n} cost arrays; "
                           "give one name per node")
    sizes = []
    for i, c in enumerate(problem.costs):
        a = np.asarray(c, dtype=float)
        if a.ndim != 1 or a.size == 0:
            raise _input_error(f"node {i} ({problem.node_names[i]!r}): costs must be a 1-D array with "
                               f"at least one strategy, got shape {a.shape}")
        if not np.all(np.isfinite(a)):
            raise _input_error(f"node {i} ({problem.node_names[i]!r}): costs contain NaN or inf")
        sizes.append(a.size)
    if problem.strategy_names is not None:
        for i, names in enumerate(problem.strategy_names):
            if i >= n or len(names) != sizes[i]:
                raise _input_error(f"strategy_names[{i}] does not match node {i}'s number of strategies")

    def check_node(where: str, node: int) -> None:
        if not isinstance(node, (int, np.integer)) or not 0 <= node < n:
            raise _input_error(f"{where}: node index {node!r} is not in [0, {n})")

    for k, e in enumerate(problem.edges):
        check_node(f"edge {k} src", e.src)
        check_node(f"edge {k} dst", e.dst)
        m = np.asarray(e.cost, dtype=float)
        want = (sizes[e.src], sizes[e.dst])
        if m.shape != want:
            raise _input_error(f"edge {k} ({problem.node_names[e.src]!r} -> {problem.node_names[e.dst]!r}): "
                               f"cost matrix has shape {m.shape}, expected {want} "
                               "(src strategies x dst strategies)")
        if not np.all(np.isfinite(m)):
            raise _input_error(f"edge {k}: cost matrix contains NaN or inf")

    def check_terms(where: str, terms) -> None:
        for node, arr in terms:
            check_node(where, node)
            a = np.asarray(arr, dtype=float)
            if a.shape != (sizes[node],):
                raise _input_error(f"{where}: array for node {node} has shape {a.shape}, "
                                   f"expected ({sizes[node]},) (one value per strategy)")
            if not np.all(np.isfinite(a)):
                raise _input_error(f"{where}: array for node {node} contains NaN or inf")

    g_count = len(problem.checkpoint_groups)
    for gi, g in enumerate(problem.checkpoint_groups):
        for part in ("saved", "kept", "recompute_memory", "recompute_time"):
            check_terms(f"checkpoint group {g.name!r} {part}", getattr(g, part))
    _validate_links(problem)
    seen = set()
    for m in problem.memory:
        if m.name in seen:
            raise _input_error(f"two memory constraints are named {m.name!r}; names key "
                               "Solution.peak_memory, make them unique")
        seen.add(m.name)
        if math.isnan(m.budget) or not math.isfinite(m.const):
            raise _input_error(f"memory constraint {m.name!r}: budget must not be NaN and const must be finite")
        check_terms(f"memory constraint {m.name!r}", m.terms)
        for gi in m.groups:
            if not isinstance(gi, (int, np.integer)) or not 0 <= gi < g_count:
                raise _input_error(f"memory constraint {m.name!r}: checkpoint group index {gi!r} "
                                   f"is not in [0, {g_count})")


# ----------------------------------------------------------------------------- evaluation

def _group_bytes(group, choice, checkpointed: bool) -> float:
    """Bytes the group holds through backward (kept when checkpointed, else saved)."""
    terms = group.kept if checkpointed else group.saved
    return float(sum(float(arr[choice[n]]) for n, arr in terms))


def _recompute_bytes(group, choice, checkpointed: bool) -> float:
    """Bytes one block of the group saves again while backward recomputes it."""
    if not checkpointed:
        return 0.0
    return float(sum(float(arr[choice[n]]) for n, arr in group.recompute_memory))


def evaluate(problem: Problem, choice, checkpoint) -> tuple[float, dict[str, float]]:
    """Objective (seconds) and bytes per memory constraint of one decision. Pure numpy.

    ``checkpoint`` is taken as given (a ``forced`` pin is not applied here).
    """
    if len(choice) != problem.num_nodes:
        raise _input_error(f"choice has {len(choice)} entries for {problem.num_nodes} nodes")
    if len(checkpoint) != len(problem.checkpoint_groups):
        raise _input_error(f"checkpoint has {len(checkpoint)} entries for "
                           f"{len(problem.checkpoint_groups)} checkpoint groups")
    obj = sum(float(c[s]) for c, s in zip(problem.costs, choice))
    # A self edge reads M[s, s] here automatically, since choice[src] == choice[dst].
    obj += sum(float(e.cost[choice[e.src], choice[e.dst]]) for e in problem.edges)
    for g, on in zip(problem.checkpoint_groups, checkpoint):
        if on:
            obj += sum(float(arr[choice[n]]) for n, arr in g.recompute_time)
    mem = {}
    for m in problem.memory:
        total = m.const + sum(float(arr[choice[n]]) for n, arr in m.terms)
        total += sum(_group_bytes(problem.checkpoint_groups[gi], choice, bool(checkpoint[gi]))
                     for gi in m.groups)
        # one block is recomputed at a time: the largest working set, not the sum
        total += max([_recompute_bytes(problem.checkpoint_groups[gi], choice, bool(checkpoint[gi]))
                      for gi in m.groups] + [0.0])
        mem[m.name] = float(total)
    return float(obj), mem


def fits(problem: Problem, memory_bytes: dict[str, float]) -> bool:
    """True when every memory constraint's bytes are within its budget (relative 1e-9 slack)."""
    return all(memory_bytes[m.name] <= m.budget + _MEM_RTOL * max(1.0, abs(m.budget))
               for m in problem.memory)


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


def _sum_terms(terms, sizes) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    for n, arr in terms:
        out.setdefault(n, np.zeros(sizes[n]))
        out[n] = out[n] + np.asarray(arr, dtype=float)
    return out


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


# ----------------------------------------------------------------------------- solving

def _is_trivial(problem: Problem) -> bool:
    return not problem.checkpoint_groups and all(len(c) == 1 for c in problem.costs)


def solve(problem: Problem, time_limit: float | None = None, backend: str = "auto", threads: int = 2,
          mip_gap: float = 1e-7, start: list | None = None) -> Solution:
    """Cheapest strategy per node and checkpoint decision per group within every memory budget.

    ``mip_gap`` is the relative gap at which the solver may stop and call the result optimal
    (1e-7 by default so results match brute force; 1e-4, HiGHS's own default, is much faster
    on large problems). ``start``: per node a strategy index (or None) to warm-start from
    (HiGHS; an incumbent to prune with from the first node). ``backend``: "auto" (HiGHS if available, else CBC), "highs", "cbc".
    """
    t0 = time.perf_counter()
    validate(problem)
    problem = fix_needless_checkpointing(problem)   # solver/presolve.py: same optimum, smaller ILP
    if _is_trivial(problem):
        choice = [0] * problem.num_nodes
        obj, mem = evaluate(problem, choice, [])
        if not fits(problem, mem):
            return Solution([], [], math.inf, "infeasible", solve_seconds=time.perf_counter() - t0)
        return Solution(choice, [], obj, "optimal", solve_seconds=time.perf_counter() - t0, peak_memory=mem)
    if decisions.splits(problem):   # one ILP per checkpoint decision (solver/decisions.py)
        return _solve_each_decision(problem, time_limit, backend, threads, mip_gap, start, t0)
    model = build(problem)
    if start is not None and len(start) == problem.num_nodes:
        model.start = [s if s is None or 0 <= s < len(problem.costs[n]) else None for n, s in enumerate(start)]
    if model.infeasible:
        return Solution([], [], math.inf, "infeasible", solve_seconds=time.perf_counter() - t0)
    status = _run(model, backend, time_limit, threads, mip_gap)
    if status == "infeasible":
        return Solution([], [], math.inf, "infeasible", solve_seconds=time.perf_counter() - t0)
    choice, ckpt = _extract(model)
    obj, mem = evaluate(problem, choice, ckpt)
    gap = 0.0
    if status == "feasible":
        bound = model.offset + _bound(model, backend, time_limit, threads) / model.scale
        gap = max(0.0, obj - bound) / max(abs(obj), 1e-300) if math.isfinite(bound) else _MAX_TIME_LIMIT_GAP
    return Solution(choice, ckpt, obj, status, gap=gap, solve_seconds=time.perf_counter() - t0, peak_memory=mem)


def _solve_each_decision(problem: Problem, time_limit, backend, threads, mip_gap, start, t0) -> Solution:
    """``solve`` over each checkpoint decision with the groups pinned (solver/decisions.py): the
    cheapest pinned solution (the first on ties, all groups off first). Its gap covers every
    decision: a decision stopped by ``time_limit`` contributes its own bound, one stopped without
    a solution an unknown one. With no solution at all: infeasible, or the time-limit error when
    some decision ran out of time."""
    best, bounds, timed_out, all_optimal = None, [], None, True
    for sub in decisions.pinned_problems(problem):
        if memory_floor_exceeds_budget(sub):
            continue   # no choice fits with this decision: proved without the solver
        left = None if time_limit is None else max(0.05, time_limit - (time.perf_counter() - t0))
        try:
            sol = solve(sub, left, backend, threads, mip_gap, start)
        except PlanError as e:
            if time_limit is None:
                raise
            timed_out, all_optimal = e, False
            bounds.append(-math.inf)
            continue
        if sol.status == "infeasible":
            continue
        all_optimal = all_optimal and sol.status == "optimal"
        bounds.append(sol.objective - sol.gap * abs(sol.objective))
        if best is None or sol.objective < best.objective:
            best = sol
    seconds = time.perf_counter() - t0
    if best is None:
        if timed_out is not None:
            raise timed_out
        return Solution([], [], math.inf, "infeasible", solve_seconds=seconds)
    if all_optimal:   # each decision within its gap, so the least of them too
        return dataclasses.replace(best, solve_seconds=seconds)
    low = min(bounds)
    gap = max(0.0, best.objective - low) / max(abs(best.objective), 1e-300) if math.isfinite(low) \
        else _MAX_TIME_LIMIT_GAP
    return dataclasses.replace(best, status="feasible", gap=gap, solve_seconds=seconds)


def memory_floor_exceeds_budget(problem: Problem) -> bool:
    """True when some memory constraint cannot hold whatever the choice: its constant plus each
    node's smallest bytes plus, per checkpoint group, the smaller of its smallest saved and
    kept bytes (recompute working sets taken as 0) is over budget. Pure numpy, a quick
    infeasibility test before the solver spends seconds proving it."""
    def floor(terms) -> float:
        return float(sum(float(np.min(arr)) for _, arr in terms if len(arr)))

    for m in problem.memory:
        if not math.isfinite(m.budget):
            continue
        total = m.const + floor(_sum_terms(m.terms, [len(c) for c in problem.costs]).items())
        for gi in m.groups:
            g = problem.checkpoint_groups[gi]
            sizes = [len(c) for c in problem.costs]
            saved = floor(_sum_terms(g.saved, sizes).items())
            kept = floor(_sum_terms(g.kept, sizes).items())
            total += saved if g.forced is False else kept if g.forced else min(saved, kept)
        if total > m.budget + _MEM_RTOL * max(1.0, abs(m.budget)):
            return True
    return False


def relaxation_bound(problem: Problem, time_limit: float | None = None, threads: int = 2,
                     cutoff: float | None = None) -> float:
    """The optimum of the LP relaxation (seconds): a lower bound of the ILP's optimum, or -inf
    when HiGHS is unavailable or the LP does not finish. With ``cutoff`` (seconds; pruning only
    needs to know whether the bound reaches it) HiGHS's dual simplex stops as soon as its dual
    objective, itself a lower bound of the LP optimum, passes the cutoff: then ``cutoff`` is
    returned, often after a fraction of the iterations."""
    validate(problem)
    problem = fix_needless_checkpointing(problem)
    if _is_trivial(problem):
        return evaluate(problem, [0] * problem.num_nodes, [])[0]
    if not _use_highs("auto"):
        return -math.inf
    if decisions.splits(problem):
        # the least of the pinned decisions' LPs (solver/decisions.py): far tighter than the LP
        # with the decisions free, and each stops at ``cutoff`` on its own
        t0 = time.perf_counter()
        low = math.inf
        for sub in decisions.pinned_problems(problem):
            if memory_floor_exceeds_budget(sub):
                continue
            left = None if time_limit is None else max(0.05, time_limit - (time.perf_counter() - t0))
            low = min(low, relaxation_bound(sub, left, threads, cutoff))
        return low
    model = build(problem)
    if model.infeasible:
        return math.inf
    scaled = None if cutoff is None else (cutoff - model.offset) * model.scale
    status = _run_highs(model, time_limit, threads, 1e-7, mip=False, cutoff=scaled)
    if status == "infeasible":
        return math.inf
    if status == "above cutoff":
        return cutoff
    h = model.lp.solver_model
    if status != "optimal":
        return -math.inf
    return model.offset + h.objective_function_value / model.scale


def mip_reaches(problem: Problem, cutoff: float, time_limit: float | None = None, threads: int = 2) -> bool:
    """Whether the ILP's optimum is at least ``cutoff`` (seconds), proved by HiGHS's branch and
    bound with ``cutoff`` as its objective bound: every node whose bound reaches it is pruned, so
    the search ends "infeasible" when no integer solution lies below it (True), and stops at the
    first one it finds below it (False). Far cheaper than solving when the optimum is well above
    the cutoff (GPT-3 175B's 2-axis meshes: 1.2-1.6 s of CPU where solving takes 6-10 s), and a
    stronger bound than the LP relaxation (their LPs are 15-19% below their optima). False when
    HiGHS is unavailable or runs out of time: only a proof prunes."""
    validate(problem)
    problem = fix_needless_checkpointing(problem)
    if _is_trivial(problem):
        return evaluate(problem, [0] * problem.num_nodes, [])[0] >= cutoff
    if not _use_highs("auto"):
        return False
    if decisions.splits(problem):   # every pinned decision must reach it (solver/decisions.py)
        t0 = time.perf_counter()
        for sub in decisions.pinned_problems(problem):
            if memory_floor_exceeds_budget(sub):
                continue
            left = None if time_limit is None else max(0.05, time_limit - (time.perf_counter() - t0))
            if not mip_reaches(sub, cutoff, left, threads):
                return False
        return True
    model = build(problem)
    if model.infeasible:
        return True
    scaled = (cutoff - model.offset) * model.scale
    try:
        status = _run_highs(model, time_limit, threads, 1e-7, mip=True, cutoff=scaled, first_solution=True)
    except PlanError:   # out of time before any answer
        return False
    if status == "optimal":   # HiGHS may solve it outright (e.g. in presolve) without the bound
        return model.lp.solver_model.objective_function_value >= scaled
    return status == "infeasible"


def min_peak_memory(problem: Problem, time_limit: float | None = None, backend: str = "auto",
                    threads: int = 2, mip_gap: float = 1e-7) -> float:
    """Smallest achievable max over memory constraints (bytes), budgets ignored; 0 with none."""
    sol = min_peak_solution(problem, time_limit, backend, threads, mip_gap)
    return max(sol.peak_memory.values()) if sol.peak_memory else 0.0


def min_peak_solution(problem: Problem, time_limit: float | None = None, backend: str = "auto",
                      threads: int = 2, mip_gap: float = 1e-7) -> Solution:
    """The decision with the smallest max over memory constraints, budgets ignored (its objective
    and bytes per constraint computed exactly by ``evaluate``)."""
    validate(problem)
    t0 = time.perf_counter()
    if not problem.memory or _is_trivial(problem):
        choice, ckpt = [0] * problem.num_nodes, [False] * len(problem.checkpoint_groups)
    else:
        model = build(problem, peak=True)
        if _run(model, backend, time_limit, threads, mip_gap) == "infeasible":
            raise _input_error("min_peak_memory: the peak model is infeasible, which should not happen")
        choice, ckpt = _extract(model)
    obj, mem = evaluate(problem, choice, ckpt)
    return Solution(choice, ckpt, obj, "optimal", solve_seconds=time.perf_counter() - t0, peak_memory=mem)
