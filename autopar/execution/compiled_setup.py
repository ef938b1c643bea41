"""Set-up of a compiled model on every rank (collectively): from the model and a Plan to this
rank's program, parameter blocks and optimizer. ``setup(cm, example_inputs)`` is
``CompiledModel._setup`` (autopar/execution/compiled.py); it fills in the CompiledModel.

1. with ``plan=None`` rank 0 plans and broadcasts the JSON (a planning error is broadcast too,
   so every rank raises it instead of waiting); the plan's world size must equal the process
   group's (``ExecutionError`` on every rank otherwise);
2. every rank traces the model itself and checks the plan's fingerprint; with several
   micro-batches it re-traces one micro-batch (every input cut along its batch dim, the plan's
   ``batch_dims``, to global batch // num_micro_batches) and checks that the op sequence is the
   same (the plan's ops are keyed by node name; a 2D / 2.5D / 3D plan's program cuts its own
   micro-batches);
3. mesh process groups (runtime/context.py), the per-rank program (codegen/per_rank.py; the block
   instances the plan checkpoints run as activation-checkpoint regions, runtime/checkpoint.py; a
   pipelined plan's cut into stage programs, codegen/stages.py; a 2D / 2.5D / 3D plan's the grid
   program behind the same interface, codegen/grid_rank_program.py), only this rank's parameter
   blocks from ``weights`` (autopar/execution/weights.py: the model's own copy checked by a
   checksum, the replayed initialization of a meta model, or a checkpoint read slice by slice; no
   full tensor crosses the network), and a ``ShardedOptimizer`` over the data axes with the
   plan's ZeRO stage, one chunk per repeated-block instance.

Gradient bookkeeping: the local loss is a partial sum over the data axes (a mean over a split
batch is scaled by the local share; a mean loss over targets is a local sum divided by the global
count of valid targets, runtime/loss.py), so the gradients a parameter receives through a batch-split
use are partial sums too. The DP/ZeRO reducer AVERAGES over the data group, so those gradients are
multiplied by the data-axis size (sum = average x size): ``ShardedOptimizer(grad_scale=...)`` folds
the factor into the stage-0 reducer's averaging pass (no extra pass over the gradients) and uses a
gradient hook under ZeRO 1-3. Parameters whose
gradient is already complete (the codegen inserted the all-reduce) are averaged as identical values.

Device and precision: the rank's device follows the process group's backend (NCCL: the GPU
``LOCAL_RANK`` names, set as current; gloo: the CPU). The working precision is the plan's on a GPU
(bf16: parameters, activations and gradient collectives in bf16, fp32 master weights and optimizer
state in the ZeRO optimizer) and fp32 on the CPU, unless ``compile(precision=...)`` says otherwise
(bf16 on CPU runs too: that is how the mixed-precision path is tested without a GPU).

Random ops (dropout) draw from generators seeded from one base seed rank 0 broadcasts here
(runtime/rng.py).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from autopar.errors import ExecutionError
from autopar.execution.placement import run_device as _run_device
from autopar.execution.placement import working_dtype as _working_dtype
from autopar.plans.plan import Plan
from autopar.api import plan as make_plan
from autopar.execution import optim_setup, pipeline_run
from autopar.execution.step_guard import StepGuard
from autopar.execution.weights import all_on_meta, is_meta_model, weight_source
from autopar.frontend.batching import batch_size, plan_batch_dims
from autopar.frontend.blocks import param_chunks
from autopar.frontend.trace import trace
from autopar.rules.microbatch import batch_carrying
from codegen import generate
from codegen.grid_rank_program import build, is_grid_plan, plan_geometry
from codegen.stages import split_stages
from runtime import context, rng
from runtime.failure_record import FailureRecord, job_store, next_job
from runtime.grid import Grid25D, Grid2D, Grid3D
from runtime.zero import ShardedOptimizer


def _as_tuple(x):
    if x is None:
        return None
    return x if isinstance(x, tuple) else (tuple(x) if isinstance(x, list) else (x,))


def _broadcast_plan(model, example_inputs, cluster, plan_options, traced) -> Plan:
    box = [None, None]
    if dist.get_rank() == 0:
        try:
            options = dict(plan_options or {})
            options.setdefault("traced", traced)   # the graph every rank traced (loss_fn included)
            box[0] = make_plan(model, example_inputs, cluster, **options).to_json()
        except Exception as e:   # every rank must learn about it, or the others wait forever
            box[1] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise ExecutionError(f"planning on rank 0 failed: {box[1]}", collective=True)
    return Plan.from_json(box[0])


def _fuses_kernels(cm) -> bool:
    """Whether this rank traces for the Triton kernels: the plan's choice, else compile's."""
    if cm.plan is not None:
        return cm.plan.kernels == "triton"
    from autopar.frontend.fuse import uses_kernels
    return uses_kernels((cm.plan_options or {}).get("kernels") or "auto", cm.cluster.backend)


def check_kernels_run(device) -> None:
    """A plan with Triton kernels needs triton, and on the CPU its interpreter."""
    from runtime.kernels import available, interpreted
    if device.type == "cpu" and not interpreted():
        raise ExecutionError("the plan runs Triton kernels (plan.kernels == 'triton') and this rank runs on the "
                             "CPU: set TRITON_INTERPRET=1 before starting Python to run them in Triton's "
                             "interpreter, or re-plan with kernels='torch'", collective=True)
    if not available():
        raise ExecutionError("the plan runs Triton kernels (plan.kernels == 'triton') but triton is not "
                             "installed here: pip install triton, or re-plan with kernels='torch'", collective=True)


def setup(cm, example_inputs):
    """``CompiledModel._setup``: steps 1-3 of the module doc; ``cm`` is ready after it."""

    example_inputs = _as_tuple(example_inputs)
    meta = is_meta_model(cm.model)
    if meta:
        # A meta model traces (and plans) on meta copies of the batch, and of its real buffers
        # (accelerate.init_empty_weights() keeps them real): one device, nothing allocated.
        example_inputs = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in example_inputs)
    fused = _fuses_kernels(cm)
    with all_on_meta(cm.model, meta):
        # the same on every rank (an error too: no rank waits)
        traced = trace(cm.model, example_inputs, cm.loss_fn, kernels=fused)
        if cm.plan is None:
            cm.plan = _broadcast_plan(cm.model, example_inputs, cm.cluster, cm.plan_options, traced)
    plan = cm.plan
    world = dist.get_world_size()
    if plan.world_size != world:
        raise ExecutionError(f"the plan is for {plan.world_size} devices (mesh {plan.mesh.describe()}, pp={plan.pp}) "
                             f"but the process group has {world} ranks: launch {plan.world_size} processes or re-plan",
                             collective=True)
    if traced.fingerprint != plan.fingerprint:
        raise ExecutionError(f"plan made for a different model: the plan's fingerprint is "
                             f"{plan.fingerprint[:16]}, this model traces to {traced.fingerprint[:16]}",
                             collective=True)
    grid = is_grid_plan(plan)   # 2D / 2.5D / 3D: the grid program (codegen/grid_rank_program.py)
    nm = int(plan.degrees.get("num_micro_batches", 1) or 1)
    cm.nm = nm
    cm.batch_dims = plan_batch_dims(plan.data, len(example_inputs))
    cm.global_batch = batch_size([tuple(x.shape) for x in example_inputs], cm.batch_dims)
    cm._example = [(tuple(x.shape), x.dtype) for x in example_inputs]
    cm._batch_compared = False
    if cm.global_batch % nm:
        raise ExecutionError(f"the plan runs {nm} micro-batches but the global batch has {cm.global_batch} "
                             f"rows: re-plan (num_micro_batches must divide the batch)", collective=True)
    if nm > 1 and not grid:   # (a grid program cuts each micro-batch's rows itself)
        micro = tuple(x if d is None else x.narrow(d, 0, x.shape[d] // nm)
                      for x, d in zip(example_inputs, cm.batch_dims))
        with all_on_meta(cm.model, meta):
            mt = trace(cm.model, micro, cm.loss_fn, kernels=fused)
        seq = lambda t: [(n.name, str(n.target)) for n in t.gm.graph.nodes if n.op == "call_function"]  # noqa: E731
        if seq(mt) != seq(traced):
            raise ExecutionError("re-tracing one micro-batch gave a different op sequence than the global "
                                 "batch; the model's graph depends on the batch size", collective=True)
        carrying = batch_carrying(traced, mt)   # which values the micro-batches cut (autopar/rules/microbatch.py)
        traced = mt
    else:
        carrying = None
    cm.traced = traced
    cm.device = _run_device()
    if plan.kernels == "triton":
        check_kernels_run(cm.device)
    cm.dtype = _working_dtype(plan.data.get("settings", {}).get("precision", "fp32"), cm.precision, cm.device)
    cm.pp = plan.pp
    if cm.pp > 1:
        pipeline_run.check_options(cm)
    # Before the first collective of set-up, so every rank is registered before any step runs:
    # a rank failing mid-step is named to every rank (autopar/execution/step_guard.py).
    cm.guard = StepGuard(FailureRecord(job_store(), dist.get_rank(), dist.get_world_size(), next_job()),
                           dist.get_rank(), watch=cm.pp > 1)
    cm.ctx = context.setup(plan.mesh, cm.device.type, pp=cm.pp)
    rng.broadcast_seed(cm.device)   # one base seed for every rank's random ops (runtime/rng.py)
    cm.rank = dist.get_rank()
    cm.stage = cm.rank // mesh_size(plan)
    mesh = plan.mesh
    zero = int(plan.degrees.get("zero", 0) or 0)
    cm.zero = zero

    # Chunks: one per repeated-block instance (reduced / gathered together), the rest in one
    # (frontend/blocks.param_chunks: pricing charges each chunk's collectives at its size).
    trainable = [n for n in traced.param_fqn if n not in traced.buffers]
    chunk_key_of = param_chunks(traced.blocks, traced.param_fqn, trainable)
    keys = sorted(set(chunk_key_of.values()))
    chunk_index = {k: i for i, k in enumerate(keys)}
    cm.chunk_of = {traced.param_fqn[n]: chunk_index[chunk_key_of[n]] for n in trainable}
    # ZeRO-3 under pipelining: each stage program gets its own gather/free calls (pipeline_run.setup)
    zero3_chunks = cm.chunk_of if zero == 3 and cm.pp == 1 else None
    if grid:
        cm.program = _grid_program(cm, traced)
    else:
        cm.program = generate(traced, plan.stage_plan(), cm.rank % mesh_size(plan), zero3_chunks,
                              compute_dtype=cm.dtype,
                              # a meta model traced on meta: its factory ops (arange) say device=meta
                              device=cm.device if (cm.device.type != "cpu" or is_meta_model(cm.model)) else None,
                              batch_carrying=carrying)
    prog = cm.program
    mine = set(prog.param_names)
    if cm.pp > 1:   # only this stage's part of the program and of the parameters
        stages = plan.data["stages"]   # pp x v (virtual) stages; rank position r runs r, r + pp, ...
        unit_stage = [k for k, st in enumerate(stages) for _ in range(*st["blocks"])]
        cm.stage_programs = split_stages(prog, traced, unit_stage, len(stages))
        mine = {n for sp in cm.stage_programs if sp.index % cm.pp == cm.stage for n in sp.param_names}
        # A parameter read on stages of several ranks (a tied embedding and head) is a chunk of
        # its own: the same layout on each of them, so ZeRO-2/3 gradient shards can be summed
        # between the stages (runtime/zero_step.py shared_groups).
        cm.tied_stages = {}
        for n in trainable:
            ranks = tuple(sorted({sp.index % cm.pp for sp in cm.stage_programs if n in sp.param_names}))
            if len(ranks) > 1:
                cm.tied_stages[traced.param_fqn[n]] = ranks
        top = max(chunk_key_of.values(), default=0)
        tied_key = {fqn: top + 1 + i for i, fqn in enumerate(sorted(cm.tied_stages))}
        keys = sorted({tied_key.get(traced.param_fqn[n], chunk_key_of[n]) for n in trainable})
        chunk_index = {k: i for i, k in enumerate(keys)}
        cm.chunk_of = {traced.param_fqn[n]: chunk_index[tied_key.get(traced.param_fqn[n], chunk_key_of[n])]
                         for n in trainable}

    # Parameters: only this rank's blocks, from the weight source (autopar/execution/weights.py).
    cm.params, cm.buffers = {}, {}
    cm.local: list[torch.Tensor] = []
    with torch.no_grad():
        source = _weight_source(cm, traced, prog, mine)
        for name in (n for n in prog.param_names if n in mine):
            fqn = prog.param_fqn[name]
            # fp32 on this rank's device; the optimizer makes the parameters views of its
            # working-dtype buffers, the fp32 values seed the master weights.
            block = prog.read_block(source, fqn)
            if name in prog.buffers:
                if block.is_floating_point():
                    block = block.to(cm.dtype)
                cm.buffers[fqn] = block
                cm.local.append(block)
            else:
                p = torch.nn.Parameter(block)
                cm.params[fqn] = p
                cm.local.append(p)
        del source
    # Partial-over-data-axes grads: the reducer averages, so scale by the axes' size (module doc);
    # the optimizer applies the factor (stage 0: inside the reducer's averaging pass).
    grad_scale = {}
    for fqn, axes in prog.grad_partial_axes.items():
        f = math.prod(mesh.shape[a] for a in axes)
        if f > 1 and fqn in cm.params:
            grad_scale[id(cm.params[fqn])] = f
    groups = [[] for _ in keys]
    for fqn, p in cm.params.items():
        groups[cm.chunk_of[fqn]].append(p)
    cm.chunks = groups
    model_axes = [a for a in mesh.model_axes() if mesh.shape[a] > 1]
    # Clipping: a parameter replicated on r model-axis ranks counts 1/r in the summed norm (a
    # tied parameter, held whole by the ranks of k stages after its gradient is summed, 1/k more).
    norm_weights = {}
    for fqn, p in cm.params.items():
        r = prog.replicas_of(fqn, model_axes)
        if cm.pp > 1 and fqn in cm.tied_stages:   # a full copy on each of its stages' ranks
            r *= len(cm.tied_stages[fqn])
        if r > 1:
            norm_weights[id(p)] = 1.0 / r
    # LAMB / LARS: each tensor's norms summed over the model axes (disjoint blocks), a replicated
    # block counted by one of the ranks holding it (runtime/zero.py module doc).
    norm_skip = [p for fqn, p in cm.params.items() if not prog.counts_norm(fqn, model_axes)]
    shared = {}
    if cm.pp > 1:   # the groups that sum a tied parameter's gradient between its stages
        shared = pipeline_run.make_tied_groups(cm)
    flat_opt, tensor_hparams = optim_setup.build(cm)   # lr scaled and scheduled, parameter groups
    cm.opt = ShardedOptimizer(groups, cm.ctx.data_group, zero, flat_opt,
                                grad_clip=cm.grad_clip,
                                # pipelined: the stages' norms are summed too (over the pp group)
                                extra_norm_groups=[cm.ctx.groups[a] for a in model_axes]
                                + ([cm.ctx.extra["pp_group"]] if cm.pp > 1 else []),
                                grad_scale=grad_scale, norm_weights=norm_weights, working_dtype=cm.dtype,
                                forward_order=_forward_order(cm), shared_groups=shared,
                                tensor_norm_groups=[cm.ctx.groups[a] for a in model_axes], tensor_norm_skip=norm_skip,
                                tensor_hparams=tensor_hparams, offload=cm.plan.degrees.get("offload", "none"),
                                offload_fraction=(cm.plan.predictions.get("offload") or {}).get("fraction", 1.0),
                                offload_dir=cm.offload_dir if cm.plan.degrees.get("offload", "none").endswith("-nvme")
                                else None)
    if zero == 3:
        context.set_zero3(cm.opt)
    cm._param_index = {fqn: i for i, fqn in enumerate(prog.param_fqn[n] for n in prog.param_names)}
    if cm.pp > 1:
        pipeline_run.setup(cm)
    cm._ready = True


def _weight_source(cm, traced, prog, mine=None):
    """fqn, slices -> this rank's block (autopar/execution/weights.py weight_source)."""
    return weight_source(cm.model, traced, prog, cm.weights, cm.device,
                         getattr(cm, "_init_rng_state", None), mine)


def _forward_order(cm) -> list:
    """Trainable parameters in the order the program first reads them: backward completes
    their gradients in about the reverse order, which the DP buckets follow (a parameter
    read first, like a tied embedding, gets its gradient last)."""
    by_name = {name: cm.params.get(cm.program.param_fqn[name]) for name in cm.program.param_names}
    return [by_name[name] for name in cm.program.first_reads() if by_name[name] is not None]


def _grid_program(cm, traced):
    """A 2D / 2.5D / 3D plan's program (codegen/grid_rank_program.py) on this rank's grid."""

    geo = plan_geometry(cm.plan)
    if geo.zero == 3:
        raise ExecutionError("a 2D / 2.5D / 3D plan runs ZeRO 0-2, not 3 (its program has no gather and free "
                             "calls): re-plan without zero=3", collective=True)
    dev = cm.device.type
    grid = {"2d": lambda: Grid2D(geo.q, dev, dp=geo.dp), "2.5d": lambda: Grid25D(geo.q, geo.d, dev, dp=geo.dp),
            "3d": lambda: Grid3D(geo.q, dev, dp=geo.dp)}[geo.mode]()
    coords = dict(zip(grid.names, grid.coords), dp=grid.dp_rank)
    return build(traced, cm.plan, grid, coords, cm.global_batch, cm.device)


def mesh_size(plan) -> int:
    """Ranks of one pipeline stage (the plan's mesh is one stage's)."""
    return plan.mesh.size
