"""The public planning entry point: ``autopar.plan`` (pins: autopar/constraints.py, docs/constraints.md).

trace -> outer search (candidates, pricing, ILP per configuration) -> Plan JSON.
"""
from __future__ import annotations

import gc
import time

import torch

from autopar.frontend.batching import batch_info, graph_batch_dims, infer_batch_dims, input_shapes
from autopar.search.build import chosen
from autopar.pricing.price import Settings
from autopar.cluster import Cluster
from autopar.constraints import Constraints
from autopar.errors import PlanError
from autopar.pricing.memory import check_optimizer, check_precision
from autopar.plans.plan import PLAN_VERSION, Plan
from autopar.rules import tensor_inputs
from autopar.search.outer import Result, degrees_of
from autopar.frontend.fuse import uses_kernels
from autopar.frontend.trace import trace
from autopar.units import parse_bytes, parse_seconds
from solver import release_threads
from autopar.rules import hybrid_sequence
from autopar.search.grid_price import GridResult
from autopar.search.grid_search import grid_plan_data
from autopar.search.pipeline import apply_pipeline
from autopar.search import pipeline_search




def plan(model: torch.nn.Module, example_inputs, cluster: Cluster, *, loss_fn=None, optimizer: str = "adamw",
         precision: str = "bf16", memory_budget: float | None = None, constraints: Constraints | dict | None = None,
         time_limit: float | None = None, overlap_grad_comm: bool = True, verbose: bool = False,
         traced=None, policy: str | None = None, batch_dims=None, kernels: str | None = None) -> Plan:
    """Find the fastest configuration of ``model`` on ``cluster`` that fits in memory.

    Beyond README.md's options: ``traced`` reuses a TracedGraph (autopar.frontend.trace.trace) instead of tracing again;
    ``policy="megatron"`` restricts every linear to Megatron's column/row splits (to price a
    hand-written Megatron-LM configuration in the same cost model); ``verbose`` logs every
    configuration the search solves. ``constraints`` pins part of the configuration, as an
    ``autopar.Constraints`` or its dict form (``{"tp": 2, "zero": 1}``): every key, its values and
    default in autopar/constraints.py and docs/constraints.md; a bad pin is a ConstraintError before
    tracing. ``batch_dims`` names each input's batch dim (an int or None
    per input, or one int for all; default: inferred, autopar/frontend/batching.py) — the dim the data
    axes split and micro-batching cuts, recorded in the plan. ``kernels``: "auto" (Triton kernels on
    GPU clusters, torch ops on CPU ones; the default, or with ``traced`` that graph's choice),
    "triton" or "torch": with Triton, RMSNorm, SwiGLU, LayerNorm and GeGLU are planned (and run) as the fused
    operators of runtime/kernels (docs/kernels.md)."""
    if not isinstance(model, torch.nn.Module):
        raise PlanError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(cluster, Cluster):
        raise PlanError(f"cluster must be an autopar.Cluster (e.g. Cluster.preset('dgx-a100')), got "
                        f"{type(cluster).__name__}")
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    check_example_inputs(example_inputs)
    check_optimizer(optimizer)
    check_precision(precision)
    if memory_budget is not None:
        memory_budget = parse_bytes(memory_budget, "memory_budget")
    if time_limit is not None:
        time_limit = parse_seconds(time_limit, "time_limit")
    pins = Constraints.coerce(constraints)   # every key's type, values and contradictions (autopar/constraints.py)
    if kernels is None:
        kernels = "auto" if traced is None else ("triton" if traced.kernels else "torch")
    fused = uses_kernels(kernels, cluster.backend)
    t0 = time.perf_counter()
    graph = traced if traced is not None else trace(model, example_inputs, loss_fn=loss_fn, kernels=fused)
    if graph.kernels != fused:
        raise PlanError(f"the traced graph was traced with kernels={graph.kernels} but this plan "
                        f"{'uses' if fused else 'does not use'} the Triton kernels (kernels={kernels!r}, "
                        f"backend {cluster.backend}): trace with kernels={fused}")
    t_trace = time.perf_counter() - t0
    graph.batch_dims = infer_batch_dims(input_shapes(graph), batch_dims)
    # sp_mode="hybrid": its (u, r) split from the heads
    constraints = hybrid_sequence.resolve(graph, cluster, pins.to_dict())
    budget = float(memory_budget if memory_budget is not None else cluster.device.memory_bytes)
    base = Settings(optimizer=optimizer, precision=precision, budget=budget, overlap_grad_comm=overlap_grad_comm,
                    kernels=fused)
    log = print if verbose else None
    # The search allocates millions of small objects, freed by reference counting; the cyclic
    # garbage it leaves is small (1T on 3,072 GPUs: 1,895 MB peak RSS with no collection during
    # the search, 1,857 MB with one), yet every collection walked the memoised prices and reshard
    # paths: the cyclic collector is off while planning (1T: 139 -> 119 CPU s; with raised
    # thresholds before, GPT 18.4B 13.6 -> 10.8 s). Freezing keeps the traced model and graph out
    # of the one collection at the end (release_threads).
    gc.freeze()
    enabled = gc.isenabled()
    gc.disable()
    try:   # pp=1 and pipelined candidates (stages over sub-meshes): autopar/search/pipeline_search.py
        result, stats, pipe = pipeline_search.plan_search(graph, cluster, base, constraints,
                                                          time_limit=time_limit, log=log, policy=policy)
    finally:
        # release_threads() collects garbage first: while the model is still frozen, that walks
        # only what the search allocated (after unfreezing, 0.3 s of a small model's plan)
        release_threads()   # no solver thread outlives planning (solver/ilp.py: release_threads)
        gc.unfreeze()
        if enabled:
            gc.enable()
    make = grid_plan_data if isinstance(result, GridResult) else plan_data
    data = make(result, cluster, graph, optimizer, precision, budget, overlap_grad_comm, stats)
    if pipe is not None:
        data = apply_pipeline(data, pipe)
    data["settings"]["kernels"] = "triton" if fused else "torch"
    data["batch"] = batch_info(graph)   # global batch and tokens per step (report, lr scaling)
    data["fused"] = dict(graph.fused)
    stats.update(trace_seconds=t_trace, total_seconds=time.perf_counter() - t0)
    return Plan(data, stats=stats)


def check_example_inputs(example_inputs: tuple) -> None:
    """The example batch is one real global batch of tensors: say so before tracing trips on it."""
    if not example_inputs:
        raise PlanError("example_inputs is empty: pass one global training batch, e.g. (input_ids, labels)")
    for i, x in enumerate(example_inputs):
        if isinstance(x, dict):
            raise PlanError(f"example input {i} is a dict (keys {sorted(map(str, x))[:6]}): pass the batch as a "
                            f"tuple of tensors in the order of forward's arguments, e.g. "
                            f"(batch['input_ids'], batch['labels']), or wrap the model so forward takes tensors")
        if isinstance(x, torch.Tensor) and any(int(d) == 0 for d in x.shape):
            raise PlanError(f"example input {i} has shape {tuple(x.shape)} with an empty dimension: autopar plans "
                            f"for one real global batch; give at least one row per data-parallel rank")


def split_share(cands, pick: dict, mesh) -> dict[str, float]:
    """Per mesh axis: the share of the model's forward FLOPs run by ops that split their work over
    that axis (a letter split or a partial pass-through). A model axis with share 0 is a mesh axis
    only: its devices all do the same work, which the summary says instead of a bare "tp=2"."""
    total = 0.0
    split = [0.0] * len(mesh.shape)
    for name in cands.order:
        info = cands.nodes[name]
        if info.kind != "op" or info.spec is None:
            continue
        st = info.strategies[pick[info.rep]]
        flops = float(info.spec.flops)
        total += flops
        for a, s in enumerate(st.splits):
            if s is not None:
                split[a] += flops
    return {mesh.names[a]: (split[a] / total if total else 0.0) for a in range(len(mesh.shape))}


def plan_data(result: Result, cluster: Cluster, graph, optimizer, precision, budget, overlap, stats) -> dict:
    cands = result.cands
    mesh = result.config.mesh
    sol = result.solution
    pick = chosen(result.problem, sol)
    ops, params = [], {}
    first_op = last_op = None
    for name in cands.order:
        info = cands.nodes[name]
        st = info.strategies[pick[info.rep]]
        if info.kind == "param":
            fqn = graph.param_fqn[name]
            params[fqn] = {"node": name, "shape": list(info.node.meta["val"].shape),
                           "layout": st.outputs[0].to_json(), "tied": sorted(graph.tied.get(fqn, []))}
        elif info.kind == "op":
            first_op = first_op or name
            last_op = name
            ops.append({
                "node": name, "target": str(info.node.target), "module": graph.module_of(info.node),
                "rule": info.spec.rule, "strategy": st.name,
                "inputs": [None if l is None else l.to_json() for l in st.inputs],
                "outputs": [l.to_json() for l in st.outputs],
                "splits": [s for s in st.splits], "special": list(getattr(st, "special", ()) or ()),
                "args": [p.name for p in tensor_inputs(info.node)],
            })
    pred = dict(result.prediction)
    pred["split_share"] = split_share(cands, pick, mesh)
    return {
        "version": PLAN_VERSION,
        "fingerprint": graph.fingerprint,
        "cluster": cluster.to_dict(),
        "mesh": mesh.to_json(),
        "settings": {"optimizer": optimizer, "precision": precision, "memory_budget": budget,
                     "overlap_grad_comm": overlap},
        "degrees": degrees_of(result),
        "stages": [{"index": 0, "ranks": [0, mesh.size - 1], "nodes": [first_op, last_op],
                    "checkpoint": pred["checkpoint"]}],
        "ops": ops,
        "params": params,
        "inputs": graph.input_names,
        "batch_dims": graph_batch_dims(graph),
        "predictions": {k: v for k, v in pred.items() if k != "checkpoint"},
        "solver": {"status": sol.status, "gap": sol.gap, "configs": stats["configs"], "pruned": stats["pruned"],
                   "ilp_nodes": result.problem.num_nodes, "ilp_strategy_vars": result.problem.num_strategy_vars()},
    }
