"""2D (SUMMA), 2.5D (Tesseract) and 3D tensor parallelism in the search: the tp_mode / tp_shape
constraints, the grid configurations of a cluster, their price, and their plan data.

What is chosen (a block-level choice, the honest first step the design allows): the whole model
runs in one grid mode (codegen/grid_ops.py lowers every op of the traced graph; a model it cannot
lower has no grid configuration), priced here and compared by the search (autopar/search/outer.py)
with the best ILP plan of the 1D and 2d-reshard meshes by predicted step time, under the same
memory budget. Per-op mixing of grid layouts with the ILP's layouts is not modelled.

Price of a grid configuration (dp replicas of the grid, ``nm`` micro-batches run in turn with
gradients accumulated, ZeRO 0-2 over dp, no activation checkpointing; ops the grid cannot run
run replicated, codegen/grid_replicated.py: their work is not split over the grid):
  * compute: every op of the graph with its work split evenly over the world (each grid op
    computes 1/world of the GEMM; local ops run on 1/tok_parts of the tokens and 1/q of the
    hidden), priced by autopar.pricing.cost.fwd_bwd_compute as the ILP prices an op (``grid_compute``:
    the GEMM efficiency curve at the local kernel shape the grid program records, e.g. SUMMA's
    q GEMMs [my tokens, k/q] x [k/q, n/q] per linear, bf16 bytes, the op's backward ratio);
  * communication: each collective of solver/tp_grid_cost.py the lowering issues (forward +
    backward, exactly what COMM_STATS records), priced by autopar.pricing.cost.Collectives on the mesh
    axis of its group (mesh axes named like the grid's groups: col/row, depth/col/row, x/y/z),
    serial with compute (SUMMA's broadcasts are not overlapped by the runtime); with nm
    micro-batches every collective is issued nm times (the lowering runs on one micro-batch:
    activation blocks 1/nm as large, weight broadcasts as large) and every op computes nm
    times on 1/nm of the tokens;
  * with dp > 1: one all-reduce of the local gradient blocks over the dp axis per step, not
    overlapped; ZeRO-1/2: a reduce-scatter and an all-gather of them (per optimizer chunk, padded
    to dp shards);
  * optimizer step on the local blocks (ZeRO-1: on this replica's 1/dp shard);
  * memory: the local parameter blocks with their gradients and optimizer state (ZeRO-1: the
    state / dp), plus the saved activations of one micro-batch the lowering counts (1/q^2,
    1/(d q^2) or 1/q^3 of the activations).

Unpinned, one micro-batch and ZeRO-0 are priced first; only a grid over the budget is retried
with ZeRO-1, then ZeRO-2 (dp > 1), then with more micro-batches (``best_grid``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.errors import ConstraintError
from codegen.grid_layout import GRID_MODES, Geometry

TP_MODES = ("1d", "2d-reshard") + GRID_MODES


def check_grid_constraints(constraints: dict) -> None:
    """A grid mode's pinned tp / tp_shape is a grid that mode can build (q x q, q x q x d,
    q x q x q). The per-key checks and the contradictions between keys are autopar/constraints.py's."""
    mode = constraints.get("tp_mode")
    if mode not in GRID_MODES:
        return
    shape = constraints.get("tp_shape")
    if shape is not None:
        _check_world(mode, math.prod(shape), shape)
    elif "tp" in constraints:
        _check_world(mode, constraints["tp"], None)


def _check_world(mode: str, tp: int, shape) -> None:
    """A grid of ``tp`` devices (and its shape, when pinned) that the mode can build."""
    from runtime.grid import GridError, check_2d, check_2p5d, check_3d
    try:
        if mode == "2d":
            q = shape[0] if shape else round(tp ** 0.5)
            if shape is not None and (len(shape) != 2 or shape[0] != shape[1]):
                raise GridError(f"2D tensor parallelism runs on a q x q grid: tp_shape must be [q, q], got {list(shape)}")
            check_2d(tp, q)
        elif mode == "2.5d":
            if shape is None:
                if not any(tp % (q * q) == 0 and tp // (q * q) >= 1 for q in range(2, int(tp ** 0.5) + 1)):
                    raise GridError(f"2.5D tensor parallelism needs q*q*d devices with q >= 2; {tp} is not")
                return
            if len(shape) != 3 or shape[0] != shape[1]:
                raise GridError(f"2.5D tensor parallelism runs on q x q x d: tp_shape must be [q, q, d], got {list(shape)}")
            check_2p5d(tp, shape[0], shape[2])
        else:
            q = shape[0] if shape else round(tp ** (1 / 3))
            if shape is not None and (len(shape) != 3 or len(set(shape)) != 1):
                raise GridError(f"3D tensor parallelism runs on q x q x q: tp_shape must be [q, q, q], got {list(shape)}")
            check_3d(tp, q)
    except GridError as e:
        raise ConstraintError(f"constraint tp_mode={mode!r}: {e}") from None


def grid_geometries(num_devices: int, constraints: dict, batch: int | None = None) -> list[Geometry]:
    """The grid configurations the pins allow: dp replicas (outermost) of a 2D / 2.5D / 3D grid,
    with the pinned micro-batch count (``num_micro_batches``, or ``micro_batch_size`` rows per
    replica given ``batch``), else one micro-batch (best_grid tries more when that does not fit)."""
    mode = constraints.get("tp_mode")
    if mode is not None and mode not in GRID_MODES:
        return []
    zero = constraints.get("zero", 0)
    pins_ok = (zero in (0, 1, 2)
               and constraints.get("checkpoint", "none") in ("none", None)
               and constraints.get("sp", 1) == 1 and constraints.get("sp_mode") is None)
    if mode is None and constraints.get("num_micro_batches", 1) != 1:
        # A micro-batch count pinned without a grid mode: the grid modes stay out, as before they
        # ran micro-batches. The pipelined search's inner searches (autopar/search/pipeline.py)
        # pin the count this way, and a grid plan cannot be cut into pipeline stages.
        return []
    out = []
    for dp in range(1, num_devices + 1):
        if num_devices % dp or constraints.get("dp", dp) != dp or (zero >= 1 and dp == 1):
            continue     # ZeRO-1/2 shard the optimizer state (and gradients) over the grid's dp replicas: dp > 1
        nm = constraints.get("num_micro_batches", 1)
        if "micro_batch_size" in constraints and batch is not None:
            rows = dp * constraints["micro_batch_size"]
            if batch % rows:
                continue
            nm = batch // rows
        tp = num_devices // dp
        for q in range(2, tp + 1):
            if q * q == tp:
                out.append(Geometry("2d", q, 1, dp, nm, zero))
            if q ** 3 == tp:
                out.append(Geometry("3d", q, 1, dp, nm, zero))
            for d in range(2, tp + 1):
                if q * q * d == tp:
                    out.append(Geometry("2.5d", q, d, dp, nm, zero))
    out = [g for g in out if (mode is None or g.mode == mode)
           and ("tp_shape" not in constraints or list(constraints["tp_shape"]) == g.tp_shape)
           and constraints.get("tp", g.world) == g.world]
    if out and not pins_ok:
        if mode is not None:
            raise ConstraintError(f"constraint tp_mode={mode!r} runs with zero=0, 1 or 2 (optimizer state, and "
                                  f"with 2 gradients, sharded over the grid's dp replicas), no activation "
                                  f"checkpointing and no sequence parallelism in this version; drop the other pins")
        return []
    if mode is not None and not out:
        if zero not in (0, 1, 2):
            raise ConstraintError(f"constraint tp_mode={mode!r} runs with zero=0, 1 or 2 (optimizer state, and with 2 "
                                  f"gradients, sharded over the grid's dp replicas), not zero={zero}; drop the other pins")
        if zero >= 1 and grid_geometries(num_devices, dict(constraints, zero=0), batch):
            # the grids the other pins allow all have dp = 1
            raise ConstraintError(f"constraints tp_mode={mode!r} and zero={zero} need dp > 1: ZeRO shards the "
                                  f"optimizer state over the data-parallel replicas of the grid; pin dp > 1 or drop zero")
        if "micro_batch_size" in constraints and batch is not None:
            raise ConstraintError(f"constraint micro_batch_size={constraints['micro_batch_size']} with tp_mode={mode!r}: "
                                  f"no data-parallel degree the pins allow on {num_devices} devices makes dp x "
                                  f"micro_batch_size divide the batch of {batch}")
        tp = constraints.get("tp", num_devices // constraints.get("dp", 1))
        _check_world(mode, tp, constraints.get("tp_shape"))   # the grid's own message first
        raise ConstraintError(f"constraint tp_mode={mode!r} cannot be met on {num_devices} devices"
                              + (f" with tp_shape={list(constraints['tp_shape'])}" if "tp_shape" in constraints else "")
                              + ": 2d needs q*q devices, 2.5d q*q*d, 3d q*q*q (q >= 2)")
    return out


@dataclass
class GridResult:
    geo: Geometry
    mesh: object
    program: object
    prediction: dict
    cands: object


def price_grid(graph, cluster, base, geo: Geometry, cands) -> GridResult:
    """The predicted step of ``graph`` in grid mode ``geo`` (module doc). ``cands``: candidates
    of the graph on a one-device mesh (per-op FLOPs and bytes)."""
    from autopar.frontend.batching import graph_batch_dims, input_shapes, batch_size
    from autopar.pricing.cost import (TRUST_NORM_BYTES_PER_TENSOR, TRUST_RATIO_OPTIMIZERS, Collectives,
                                      optimizer_step_time, profile_of)
    from autopar.pricing.price import trust_norm_axes
    from autopar.pricing.memory import state_bytes, zero_shard
    from autopar.mesh import Mesh
    from autopar.search.predict import model_flops
    from codegen.grid_ops import GridProgram

    batch = batch_size(input_shapes(graph), graph_batch_dims(graph))
    prog = GridProgram(graph, geo, batch).analyse()
    mesh = Mesh(geo.mesh_shape, geo.mesh_names, cluster.devices_per_node)
    comm = Collectives(cluster, mesh)
    dtype = "bf16" if base.precision == "bf16" else "fp32"
    scale = 0.5 if base.precision == "bf16" else 1.0    # the lowering counts fp32 bytes
    cal = profile_of(cluster)
    per_op = grid_compute(cands, prog, cluster, base.precision, geo)
    compute = sum(t for _, t in per_op.values())
    # a rooted reduce is priced as the broadcast it mirrors (pipelined ring: S/B + (n-1) alpha;
    # autopar/pricing/cost.py has no separate reduce); every micro-batch issues them all
    op_comm = geo.nm * sum(c.count * comm("broadcast" if c.kind == "reduce" else c.kind, c.nbytes * scale,
                                          geo.mesh_names.index(c.group)) for c in prog.colls)
    # the trainable blocks per optimizer chunk (one per repeated-block instance, as the
    # ShardedOptimizer of runtime/zero.py groups them; ZeRO pads each to dp shards)
    from autopar.frontend.blocks import param_chunks
    trainable = [n for n in prog.uses if n not in graph.buffers]
    chunk_of = param_chunks(graph.blocks, graph.param_fqn, trainable)
    per_chunk: dict = {}
    for n in trainable:
        per_chunk[chunk_of[n]] = per_chunk.get(chunk_of[n], 0) + _local_numel(graph, n, geo, prog.uses[n])
    local = sum(per_chunk.values())
    # data parallelism over the grid replicas: each local gradient block all-reduced over dp;
    # ZeRO-1/2: each chunk's gradient (padded to dp shards) reduce-scattered, each replica
    # updating its shard of the optimizer state, the updated shards all-gathered
    grad_bytes = local * 4
    if geo.dp > 1 and geo.zero:
        grad_bytes = sum(-(-c // geo.dp) * geo.dp for c in per_chunk.values()) * 4
        grad_comm = comm("reduce_scatter", grad_bytes * scale, 0) + comm("all_gather", grad_bytes * scale, 0)
        dp_bytes = 2 * grad_bytes
    else:
        grad_comm = comm("all_reduce", grad_bytes * scale, 0) if geo.dp > 1 else 0.0
        dp_bytes = grad_bytes
    static = zero_shard(state_bytes(local, base.optimizer, base.precision), geo.zero, geo.dp)
    stepped = grad_bytes // 4 // geo.dp if geo.zero else local
    optimizer = optimizer_step_time(stepped, base.optimizer, base.precision, cluster.device, cal, base.kernels)
    if base.optimizer in TRUST_RATIO_OPTIMIZERS:   # LAMB/LARS: each chunk's norms summed (price.py)
        tensors: dict = {}
        for n in trainable:
            tensors[chunk_of[n]] = tensors.get(chunk_of[n], 0) + 1
        optimizer += sum(comm("all_reduce", TRUST_NORM_BYTES_PER_TENSOR * (k + 1), a)
                         for k in tensors.values() for a in trust_norm_axes(mesh, geo.zero))
    acts = prog.saved * scale     # one micro-batch's: its backward runs before the next forward
    step = compute + op_comm + grad_comm + optimizer
    peak = sum(static.values()) + acts
    flops = model_flops(cands)
    comm_bytes = {g: 0 for g in ("dp",) + geo.mesh_names}   # "dp": the optimizer's traffic, as every plan reports
    comm_bytes.update({g: geo.nm * b for g, b in prog.bytes_per_group().items()})
    if geo.dp > 1:
        comm_bytes["dp"] = dp_bytes
    pred = {
        "step_time": step,
        "time_breakdown": {"compute": compute, "recompute": 0.0, "op_comm": op_comm, "reshard_comm": 0.0,
                           "grad_comm": grad_comm, "grad_comm_exposed": grad_comm, "optimizer": optimizer, "bubble": 0.0},
        "overlap_grad_comm": base.overlap_grad_comm,
        "peak_memory": int(math.ceil(peak)),
        "memory_breakdown": {**{k: int(round(v)) for k, v in static.items()}, "activations": int(round(acts)),
                             "other": 0},
        "comm_bytes": {k: int(v) for k, v in comm_bytes.items()},
        "model_flops": flops,
        "mfu": flops / (step * geo.devices * cluster.device.peak_flops[dtype]) if step > 0 else 0.0,
        "saved_activations_per_rank": int(prog.saved),
        "split_share": {g: 1.0 for g in geo.mesh_names},
    }
    return GridResult(geo, mesh, prog, pred, cands)


def grid_compute(cands, prog, cluster, precision: str, geo: Geometry) -> dict[str, tuple[float, float]]:
    """Per op (representative, times its repeats): (forward, forward + backward) seconds of one
    rank in grid mode ``geo``. Priced as autopar/pricing/price.py prices an ILP op - bf16 bytes, the
    op's backward ratio, and for a contraction the GEMM-by-intensity curve at the local shape
    the rank's kernel runs on - so grid and ILP plans compare like with like. A SUMMA linear
    runs q kernels of 1/q of its work each (one per step), a 3D linear one; with ``geo.nm``
    micro-batches every op runs nm times on 1/nm of the work (at the micro-batch's shapes)."""
    from autopar.pricing.cost import fwd_bwd_compute, gemm_intensity, profile_of
    from autopar.pricing.price import has_contraction, op_bytes_scale
    from autopar.rules.table import val as node_val

    dtype = "bf16" if precision == "bf16" else "fp32"
    itemsize = 2 if dtype == "bf16" else 4
    cal = profile_of(cluster)
    world = geo.devices * geo.nm    # the work of one op call, as a fraction of the step's
    whole = geo.nm * geo.dp         # ... of an op run whole on every rank, on its rows of the batch
    out = {}
    for name in cands.order:
        info = cands.nodes[name]
        if info.rep != name or info.kind != "op" or info.spec is None:
            continue
        spec = info.spec
        wgrad = has_contraction(spec)
        kernels, ai = 1, None
        if name in prog.gemms:
            kernels, m, k, n = prog.gemms[name]
            # the ILP's intensity of a linear counts its bias among the operands: so does this one
            bias = ["n"] if spec.rule == "linear" and len([t for t in spec.inputs if t]) == 3 else []
            ai = gemm_intensity({"m": m, "k": k, "n": n}, ["mk", "nk", *bias, "mn"], itemsize)
        elif wgrad:
            ai = _local_intensity(spec, prog.local_shapes.get(name), itemsize)
        bscale = op_bytes_scale(node_val(info.node), precision)
        share = whole if name in prog.replicated else world
        f, b = fwd_bwd_compute(spec.flops / share / kernels, spec.bytes * bscale / share / kernels, dtype,
                               cluster.device, wgrad, ai, cal, op=spec.rule)
        out[name] = (f * kernels * geo.nm * info.repeats, (f + b) * kernels * geo.nm * info.repeats)
    return out


def _local_intensity(spec, shapes, itemsize: int) -> float:
    """FLOP/byte of a local contraction (e.g. attention) at the shapes it ran on in the grid
    program: each letter of the op's spec takes its local size (global where no shape says)."""
    from autopar.pricing.cost import gemm_intensity

    sizes = {ch: float(v) for ch, v in spec.sizes.items()}
    if shapes is not None:
        ins, outs = shapes
        tensors = [t for t in spec.inputs if t is not None]
        for letters, shape in list(zip(tensors, ins)) + list(zip(spec.outputs, outs)):
            if letters and len(letters) == len(shape):
                for ch, size in zip(letters, shape):
                    sizes[ch] = min(sizes[ch], float(size))
    used = {ch for t in list(spec.inputs) + list(spec.outputs) if t for ch in t}
    return gemm_intensity({ch: v for ch, v in sizes.items() if ch in used},
                          [t for t in spec.inputs if t] + list(spec.outputs), itemsize)


def _local_numel(graph, name, geo, use) -> int:
    n = graph.gm.graph.find_nodes(op="placeholder", target=name)[0].meta["val"].numel()
    if use.kind in ("weight", "conv"):
        return n // (geo.q ** 3 if geo.mode == "3d" else geo.q ** 2)
    if use.kind in ("bias", "norm", "table"):
        return n // geo.table_parts()
    if use.kind == "whole":
        return n
    return n // geo.q


def best_grid(graph, cluster, base, constraints: dict, best_step: float | None, stats: dict, log=None,
              exhaustive: bool = False):
    """The cheapest grid configuration that fits the budget and beats ``best_step`` (None: any),
    or None. A pinned grid mode the model cannot run is a ConstraintError naming the op.
    ``exhaustive`` (outer.search's): every geometry is priced, none pruned by its bound."""
    from dataclasses import replace

    from autopar.rules.candidates import candidates
    from autopar.mesh import Mesh
    from autopar.search.grid_bound import grid_step_lower_bound
    from codegen.grid_ops import GridLoweringError

    batch = _batch(graph)
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
        stats["configs"] = stats.get("configs", 0) + 1
        if best_step is not None and not pinned and _static_floor(graph, base, geo, free_zero) > base.budget:
            # its parameters and optimizer state alone exceed the budget: not lowered (a second
            # each for a 96-layer model), and with a plan found no error message needs its peak
            stats["pruned"] = stats.get("pruned", 0) + 1
            continue
        if best_step is not None and not pinned and not exhaustive and grid_step_lower_bound(graph, cluster, base, geo, cands) >= best_step:
            # its linears alone (compute + collectives, autopar/search/grid_bound.py) cannot beat the
            # best plan: not lowered. Its ZeRO-1 and micro-batch variants are made only from a
            # priced geometry, and cost at least as much (below), so they go with it.
            stats["pruned"] = stats.get("pruned", 0) + 1
            continue
        try:
            r = price_grid(graph, cluster, base, geo, cands)
        except GridLoweringError as e:
            # another geometry the pins allow (a smaller q, another d or dp) may still lower
            first_error = first_error or (geo, e)
            stats["infeasible"] = stats.get("infeasible", 0) + 1   # no grid program for this model
            continue
        lowered += 1
        stats["solved"] = stats.get("solved", 0) + 1    # priced exactly (no solver needed)
        if log:
            log(f"{geo.mode:>6} grid {geo.tp_shape}" + (f" x dp={geo.dp}" if geo.dp > 1 else "")
                + (f" micro={geo.nm}" if geo.nm > 1 else "")
                + f"  step={r.prediction['step_time']:.4g}s peak={r.prediction['peak_memory'] / 2**30:.2f}GiB")
        if r.prediction["peak_memory"] > base.budget:
            stats["infeasible"] = stats.get("infeasible", 0) + 1
            # the search's MemoryBudgetError states the smallest peak of any plan, grids included
            stats["grid_min_peak"] = min(stats.get("grid_min_peak", math.inf), r.prediction["peak_memory"])
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
    from autopar.pricing.memory import state_bytes, zero_shard

    trained = [n for n in graph.param_fqn if n not in graph.buffers and n not in getattr(graph, "frozen", set())]
    placeholders = {n.target: n for n in graph.gm.graph.nodes if n.op == "placeholder"}   # one pass, not one per parameter
    total = sum(placeholders[n].meta["val"].numel() for n in trained)
    local = total / geo.world
    zero = 2 if geo.dp > 1 and free_zero else geo.zero
    return float(sum(zero_shard(state_bytes(local, base.optimizer, base.precision), zero, geo.dp).values()))


def _micro_batches_needed(r: GridResult, geo: Geometry, budget: float) -> float:
    """The fewest micro-batches that could bring ``r``'s peak under ``budget``: only the saved
    activations shrink with more micro-batches, at best in proportion (parts that do not
    depend on the micro-batch size only make more needed), so no count below this fits; inf
    when parameters, gradients and optimizer state alone exceed the budget. Without it a 175B
    model walked every count up to the batch, each lowered and priced (100 s of planning)."""
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
    from dataclasses import replace

    if at_least == math.inf:
        return None
    per = batch // (geo.dp * geo.grid_tok_parts) if batch % (geo.dp * geo.grid_tok_parts) == 0 else 0
    for nm in range(max(geo.nm + 1, math.ceil(at_least * (1 - 1e-9))), per + 1):
        if per % nm == 0:
            return replace(geo, nm=nm)
    return None


def grid_plan_data(result: GridResult, cluster, graph, optimizer, precision, budget, overlap, stats) -> dict:
    from autopar.frontend.batching import graph_batch_dims
    from autopar.plans.plan import PLAN_VERSION

    geo, prog = result.geo, result.program
    batch = _batch(graph)
    params = {}
    for name, use in sorted(prog.uses.items()):
        fqn = graph.param_fqn[name]
        params[fqn] = {"node": name, "shape": list(graph.gm.graph.find_nodes(op="placeholder", target=name)[0]
                                                      .meta["val"].shape),
                       "grid": {"kind": use.kind, "layout": list(use.L) if isinstance(use.L, tuple) else use.L,
                                "qkv_order": use.perm is not None, "hdim": use.hdim},
                       "tied": sorted(graph.tied.get(fqn, []))}
    ops = [{"node": n.name, "target": str(n.target), "module": graph.module_of(n), "rule": "grid",
            "strategy": f"{geo.mode}: {prog.kinds.get(n.name, 'local')}", "inputs": [], "outputs": [], "splits": [], "special": []}
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
                    "num_micro_batches": geo.nm, "zero": geo.zero, "checkpoint": "none", "offload": False},
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


def _batch(graph) -> int:
    from autopar.frontend.batching import batch_size, graph_batch_dims, input_shapes
    return batch_size(input_shapes(graph), graph_batch_dims(graph))
