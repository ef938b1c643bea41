"""2D (SUMMA), 2.5D (Tesseract) and 3D tensor parallelism in the search: the grid configuration
the search chooses (``best_grid``) and its plan data (``grid_plan_data``). The pins and the
geometries: autopar/search/grid_geometry.py; their price: autopar/search/grid_price.py.

What is chosen (a block-level choice, the honest first step the design allows): the whole model
runs in one grid mode (codegen/grid_ops.py lowers every op of the traced graph; a model it cannot
lower has no grid configuration), priced here and compared by the search (autopar/search/outer.py)
with the best ILP plan of the 1D and 2d-reshard meshes by predicted step time, under the same
memory budget. Per-op mixing of grid layouts with the ILP's layouts is not modelled.

Unpinned, one micro-batch and ZeRO-0 are priced first; only a grid over the budget is retried
with ZeRO-1, then ZeRO-2 (dp > 1), then with more micro-batches (``best_grid``).
"""
from __future__ import annotations

import math
from dataclasses import replace

from autopar.errors import ConstraintError
from autopar.frontend.batching import graph_batch_dims
from autopar.mesh import Mesh
from autopar.plans.plan import PLAN_VERSION
from autopar.pricing.memory import state_bytes, zero_shard
from autopar.rules.candidates import candidates
from autopar.search.grid_bound import grid_step_lower_bound
from autopar.search.grid_geometry import grid_batch, grid_geometries
from autopar.search.grid_price import GridResult, price_grid
from codegen.grid_layout import GRID_MODES, Geometry
from codegen.grid_ops import GridLoweringError


def best_grid(graph, cluster, base, constraints: dict, best_step: float | None, stats, log=None,
              exhaustive: bool = False, memo: dict | None = None):
    """The cheapest grid configuration that fits the budget and beats ``best_step`` (None: any),
    or None. A pinned grid mode the model cannot run is a ConstraintError naming the op.
    ``stats``: the search's counters (autopar/search/context.py ``SearchStats``); ``exhaustive``
    (outer.search's): every geometry is priced, none pruned by its bound; ``memo``: the bounds'
    (autopar/search/grid_bound.py)."""
    batch = grid_batch(graph)
    geos = grid_geometries(cluster.num_devices, constraints, batch)
    if not geos:
        return None
    pinned = constraints.get("tp_mode") in GRID_MODES
    cands = candidates(graph, Mesh((1,), ("dp",), cluster.devices_per_node))
    best = None
    first_error = None   # (geometry, GridLoweringError) of the first geometry that did not lower
    lowered = 0
    free_nm = "num_micro_batches" not in constraints and "micro_batch_size" not in constraints
    free_zero = "zero" not in constraints
    queue = list(geos)
    while queue:
        geo = queue.pop(0)
        stats.configs += 1
        if best_step is not None and not pinned and _static_floor(graph, base, geo, free_zero) > base.budget:
            # its parameters and optimizer state alone exceed the budget: not lowered (a second
            # each for a 96-layer model), and with a plan found no error message needs its peak
            stats.pruned += 1
            continue
        if (best_step is not None and not pinned and not exhaustive
                and grid_step_lower_bound(graph, cluster, base, geo, cands, memo) >= best_step):
            # its linears alone (compute + collectives, autopar/search/grid_bound.py) cannot beat the
            # best plan: not lowered. Its ZeRO-1 and micro-batch variants are made only from a
            # priced geometry, and cost at least as much (below), so they go with it.
            stats.pruned += 1
            continue
        try:
            r = price_grid(graph, cluster, base, geo, cands)
        except GridLoweringError as e:
            # another geometry the pins allow (a smaller q, another d or dp) may still lower
            first_error = first_error or (geo, e)
            stats.infeasible += 1   # no grid program for this model
            continue
        lowered += 1
        stats.solved += 1    # priced exactly (no solver needed)
        if log:
            log(f"{geo.mode:>6} grid {geo.tp_shape}" + (f" x dp={geo.dp}" if geo.dp > 1 else "")
                + (f" micro={geo.nm}" if geo.nm > 1 else "")
                + f"  step={r.prediction['step_time']:.4g}s peak={r.prediction['peak_memory'] / 2**30:.2f}GiB")
        if r.prediction["peak_memory"] > base.budget:
            stats.infeasible += 1
            # the search's MemoryBudgetError states the smallest peak of any plan, grids included
            peak = r.prediction["peak_memory"]
            stats.grid_min_peak = peak if stats.grid_min_peak is None else min(stats.grid_min_peak, peak)
            # over the budget: ZeRO-1 over dp (the same ring traffic, the optimizer state / dp),
            # then the next micro-batch count (fewer saved activations, more traffic): only then
            # are they priced, so a model that fits plans as fast as before
            # a variant that cannot beat the best plan is not priced (unpinned): ZeRO-1 saves at most
            # the gradient sync and (dp-1)/dp of the optimizer step; more micro-batches only add time
            t = r.prediction["time_breakdown"]
            slower = lambda floor: not pinned and best_step is not None and floor >= best_step  # noqa: E731
            zero1_floor = r.prediction["step_time"] - t["grad_comm"] - t["optimizer"] * (1 - 1 / max(geo.dp, 1))
            if free_zero and geo.dp > 1 and geo.zero < 2 and not slower(zero1_floor):
                nxt = replace(geo, zero=geo.zero + 1)   # ZeRO-1, then ZeRO-2 (gradients sharded too)
            elif not free_nm or slower(r.prediction["step_time"]):
                nxt = None
            else:
                nxt = _more_micro_batches(geo, batch, _micro_batches_needed(r, geo, base.budget))
            if nxt is not None:
                queue.insert(0, nxt)
            continue
        if best is None or r.prediction["step_time"] < best.prediction["step_time"]:
            best = r
    if pinned and not lowered:
        geo, e = first_error
        tried = ", ".join(f"{g.tp_shape}" + (f" x dp={g.dp}" if g.dp > 1 else "") for g in geos)
        raise ConstraintError(f"constraint tp_mode={geo.mode!r} cannot be met: {e}"
                              + (f" (no grid the pins allow lowers: tried {tried})" if len(geos) > 1 else ""))
    if best is not None and best_step is not None and best.prediction["step_time"] >= best_step:
        return None
    return best


def _static_floor(graph, base, geo: Geometry, free_zero: bool) -> float:
    """A lower bound of the parameter, gradient and optimizer bytes per rank of ``geo`` (or its
    ZeRO-1 variant when ZeRO is free), before lowering: no tensor is split over more ranks than
    the grid has, and ZeRO-1 shards the optimizer state over dp at most."""
    trained = [n for n in graph.param_fqn if n not in graph.buffers and n not in getattr(graph, "frozen", set())]
    # one pass, not one per parameter
    placeholders = {n.target: n for n in graph.gm.graph.nodes if n.op == "placeholder"}
    total = sum(placeholders[n].meta["val"].numel() for n in trained)
    local = total / geo.world
    zero = 2 if geo.dp > 1 and free_zero else geo.zero
    return float(sum(zero_shard(state_bytes(local, base.optimizer, base.precision), zero, geo.dp).values()))


def _micro_batches_needed(r: GridResult, geo: Geometry, budget: float) -> float:
    """The fewest micro-batches that could bring ``r``'s peak under ``budget``: only the saved
    activations shrink with more micro-batches, at best in proportion (parts that do not
    depend on the micro-batch size only make more needed), so no count below this fits; inf
    when parameters, gradients and optimizer state alone exceed the budget. Without it a large model walked every
    count up to the batch, each lowered and priced."""
    mem = r.prediction["memory_breakdown"]
    acts = mem["activations"]
    room = budget - (r.prediction["peak_memory"] - acts)
    if room <= 0:
        return math.inf
    return acts * geo.nm / room


def _more_micro_batches(geo: Geometry, batch: int, at_least: float = 0.0) -> Geometry | None:
    """``geo`` with the next micro-batch count (at least ``at_least``) whose micro-batch still
    splits into the grid's blocks of whole sequences (None: there is none). More micro-batches
    only lower the saved activations (parameters, gradients and optimizer state stay) and cost
    time (every micro-batch repeats the weight broadcasts, GEMMs get smaller), so they are tried
    in order and the first that fits is the grid's choice for this geometry."""
    if at_least == math.inf:
        return None
    per = batch // (geo.dp * geo.grid_tok_parts) if batch % (geo.dp * geo.grid_tok_parts) == 0 else 0
    for nm in range(max(geo.nm + 1, math.ceil(at_least * (1 - 1e-9))), per + 1):
        if per % nm == 0:
            return replace(geo, nm=nm)
    return None


def grid_plan_data(result: GridResult, cluster, graph, optimizer, precision, budget, overlap, stats) -> dict:
    geo, prog = result.geo, result.program
    batch = grid_batch(graph)
    params = {}
    for name, use in sorted(prog.uses.items()):
        fqn = graph.param_fqn[name]
        params[fqn] = {"node": name, "shape": list(graph.gm.graph.find_nodes(op="placeholder", target=name)[0]
                                                      .meta["val"].shape),
                       "grid": {"kind": use.kind, "layout": list(use.L) if isinstance(use.L, tuple) else use.L,
                                "qkv_order": use.perm is not None, "hdim": use.hdim},
                       "tied": sorted(graph.tied.get(fqn, []))}
    ops = [{"node": n.name, "target": str(n.target), "module": graph.module_of(n), "rule": "grid",
            "strategy": f"{geo.mode}: {prog.kinds.get(n.name, 'local')}",
            "inputs": [], "outputs": [], "splits": [], "special": []}
           for n in graph.gm.graph.nodes if n.op == "call_function"]
    names = [n for n in graph.gm.graph.nodes if n.op == "call_function"]
    return {
        "version": PLAN_VERSION,
        "fingerprint": graph.fingerprint,
        "cluster": cluster.to_dict(),
        "mesh": result.mesh.to_json(),
        "settings": {"optimizer": optimizer, "precision": precision, "memory_budget": budget,
                     "overlap_grad_comm": overlap},
        "degrees": {"dp": geo.dp, "tp": geo.world, "tp_mode": geo.mode, "tp_shape": geo.tp_shape, "sp": 1,
                    "sp_mode": None, "pp": 1, "pp_schedule": None, "micro_batch_size": batch // geo.batch_parts,
                    "num_micro_batches": geo.nm, "zero": geo.zero, "checkpoint": "none", "offload": "none"},
        "stages": [{"index": 0, "ranks": [0, geo.devices - 1], "nodes": [names[0].name, names[-1].name],
                    "checkpoint": {}}],
        "ops": ops,
        "params": params,
        "inputs": graph.input_names,
        "batch_dims": graph_batch_dims(graph),
        "grid": {"mode": geo.mode, "q": geo.q, "d": geo.d, "dp": geo.dp, "nm": geo.nm, "axes": list(geo.mesh_names),
                 "collectives": [[c.kind, c.group, c.size, c.nbytes, c.count, c.phase] for c in prog.colls]},
        "predictions": dict(result.prediction),
        "solver": {"status": "grid", "gap": 0.0, "configs": stats.get("configs", 0),
                   "pruned": stats.get("pruned", 0), "ilp_nodes": 0, "ilp_strategy_vars": 0},
    }


__all__ = ["best_grid", "grid_plan_data"]
