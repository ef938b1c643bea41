"""The predicted step of a model in a 2D / 2.5D / 3D grid mode (``price_grid``).

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
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.frontend.batching import graph_batch_dims, input_shapes, batch_size
from autopar.frontend.blocks import param_chunks
from autopar.mesh import Mesh
from autopar.pricing.cost import (TRUST_NORM_BYTES_PER_TENSOR, TRUST_RATIO_OPTIMIZERS, Collectives, fwd_bwd_compute,
                                  gemm_intensity, optimizer_step_time, profile_of)
from autopar.pricing.memory import state_bytes, zero_shard
from autopar.pricing.op_base import has_contraction, op_bytes_scale
from autopar.pricing.price import trust_norm_axes
from autopar.rules.table import val as node_val
from autopar.search.predict import model_flops
from codegen.grid_layout import Geometry
from codegen.grid_ops import GridProgram


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
                           "grad_comm": grad_comm, "grad_comm_exposed": grad_comm, "optimizer": optimizer,
                           "bubble": 0.0},
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



__all__ = ["GridResult", "price_grid", "grid_compute"]
