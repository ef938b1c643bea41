"""``autopar.compile``: run a Plan on the current process group.

compile(model, cluster, example_inputs=None, plan=None, optimizer="adamw", lr=1e-3, weights=None, **kw) -> CompiledModel

Set-up (every rank, collectively):
1. a process group must exist and its world size must equal the plan's device count
   (``ExecutionError`` on every rank otherwise);
2. with ``plan=None`` rank 0 plans and broadcasts the JSON (a planning error is broadcast too,
   so every rank raises it instead of waiting);
3. every rank traces the model itself and checks the plan's fingerprint; with several
   micro-batches it re-traces one micro-batch (every input cut along its batch dim, the plan's
   ``batch_dims``, to global batch // num_micro_batches) and checks that the op sequence is the
   same (the plan's ops are keyed by node name);
4. mesh process groups (runtime/context.py), the per-rank program (codegen/per_rank.py; the block
   instances the plan checkpoints run as activation-checkpoint regions, runtime/checkpoint.py), only
   this rank's parameter blocks from ``weights`` (autopar/execution/weights.py: the model's own copy checked
   by a checksum, the replayed initialization of a meta model, or a checkpoint read slice by
   slice; no full tensor crosses the network), and a
   ``ShardedOptimizer`` over the data axes with the plan's ZeRO stage.

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

Process group: ``compile`` uses the one that exists; without one, under torchrun (``RANK`` and
``WORLD_SIZE`` set) it initialises one with the cluster's backend (nccl / gloo).

``step(*batch)`` takes the GLOBAL batch (or just this rank's rows, ``batch_rows()``; rows are
indices along each input's batch dim), first computes the global denominators of the mean losses
(the program's count program over every micro-batch, all-reduced over the axes the targets are
split over), then runs every micro-batch forward and backward — each micro-batch program returns
its exact share of the step's loss, so losses and gradients are summed, not averaged — steps the
optimizer and returns the global loss as a float, identical on every rank. Its inputs must match
the example batch (count, shapes, dtypes; autopar/execution/batch_check.py), and on the first step every rank
passing the global batch must pass the same one. ``compile(loss_fn=...)`` traces
``loss_fn(model(*inputs[:k]), *inputs[k:])``.

Random ops (dropout) draw from generators seeded from one base seed rank 0 broadcasts at set-up
(runtime/rng.py). Frozen parameters (``requires_grad=False``) are held like buffers. ``load``
checks the checkpoint's tensors against this model's before reading (autopar/execution/compiled_state.py).
"""
from __future__ import annotations

import math
from datetime import timedelta  # noqa: F401  (documented: the process-group timeout bounds every wait)

import torch
import torch.distributed as dist

from autopar.execution import compiled_state
from autopar.errors import ExecutionError
from autopar.execution.placement import require_process_group as _require_pg
from autopar.execution.placement import run_device as _run_device
from autopar.execution.placement import working_dtype as _working_dtype
from autopar.plans.plan import Plan


def _as_tuple(x):
    if x is None:
        return None
    return x if isinstance(x, tuple) else (tuple(x) if isinstance(x, list) else (x,))


def _broadcast_plan(model, example_inputs, cluster, plan_options, traced) -> Plan:
    box = [None, None]
    if dist.get_rank() == 0:
        try:
            from autopar.api import plan as make_plan
            options = dict(plan_options or {})
            options.setdefault("traced", traced)   # the graph every rank traced (loss_fn included)
            box[0] = make_plan(model, example_inputs, cluster, **options).to_json()
        except Exception as e:   # every rank must learn about it, or the others wait forever
            box[1] = f"{type(e).__name__}: {e}"
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise ExecutionError(f"planning on rank 0 failed: {box[1]}", collective=True)
    return Plan.from_json(box[0])


class CompiledModel:
    def __init__(self, model, cluster, plan, optimizer, lr, optimizer_kwargs, plan_options=None,
                 precision=None, grad_clip=None, loss_fn=None, weights=None):
        self.weights = weights
        # weights="init" replays the initialization from the random stream as it is now (rank 0's
        # is used on every rank), before set-up draws from it.
        self._init_rng_state = torch.get_rng_state()
        self.model, self.cluster, self.plan = model, cluster, plan
        self.loss_fn = loss_fn   # traced as loss_fn(model(*inputs[:k]), *inputs[k:]) (autopar.frontend.trace)
        self.optimizer_name, self.lr, self.optimizer_kwargs = optimizer, lr, dict(optimizer_kwargs)
        self.plan_options = plan_options
        self.precision, self.grad_clip = precision, grad_clip
        self._ready = False

    # ------------------------------------------------------------------ set-up
    def _setup(self, example_inputs):
        from autopar.frontend.trace import trace
        from codegen import generate
        from runtime import context, rng
        from runtime.optim import make_optimizer
        from runtime.zero import ShardedOptimizer

        example_inputs = _as_tuple(example_inputs)
        from autopar.execution.weights import all_on_meta, is_meta_model
        meta = is_meta_model(self.model)
        if meta:
            # A meta model traces (and plans) on meta copies of the batch, and of its real buffers
            # (accelerate.init_empty_weights() keeps them real): one device, nothing allocated.
            example_inputs = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in example_inputs)
        with all_on_meta(self.model, meta):
            traced = trace(self.model, example_inputs, self.loss_fn)   # the same on every rank (an error too: no rank waits)
            if self.plan is None:
                self.plan = _broadcast_plan(self.model, example_inputs, self.cluster, self.plan_options, traced)
        plan = self.plan
        world = dist.get_world_size()
        if plan.world_size != world:
            raise ExecutionError(f"the plan is for {plan.world_size} devices (mesh {plan.mesh.describe()}, pp={plan.pp}) "
                                 f"but the process group has {world} ranks: launch {plan.world_size} processes or re-plan",
                                 collective=True)
        if traced.fingerprint != plan.fingerprint:
            raise ExecutionError(f"plan made for a different model: the plan's fingerprint is "
                                 f"{plan.fingerprint[:16]}, this model traces to {traced.fingerprint[:16]}", collective=True)
        from autopar.execution.grid_compiled import GridCompiledModel, is_grid_plan
        if is_grid_plan(plan):   # 2D / 2.5D / 3D tensor parallelism: its own program (autopar/execution/grid_compiled.py)
            self.__class__ = GridCompiledModel
            return self.setup_grid(traced, example_inputs)
        nm = int(plan.degrees.get("num_micro_batches", 1) or 1)
        self.nm = nm
        from autopar.frontend.batching import batch_size, plan_batch_dims
        self.batch_dims = plan_batch_dims(plan.data, len(example_inputs))
        self.global_batch = batch_size([tuple(x.shape) for x in example_inputs], self.batch_dims)
        self._example = [(tuple(x.shape), x.dtype) for x in example_inputs]
        self._batch_compared = False
        if self.global_batch % nm:
            raise ExecutionError(f"the plan runs {nm} micro-batches but the global batch has {self.global_batch} "
                                 f"rows: re-plan (num_micro_batches must divide the batch)", collective=True)
        if nm > 1:
            micro = tuple(x if d is None else x.narrow(d, 0, x.shape[d] // nm)
                          for x, d in zip(example_inputs, self.batch_dims))
            with all_on_meta(self.model, meta):
                mt = trace(self.model, micro, self.loss_fn)
            seq = lambda t: [(n.name, str(n.target)) for n in t.gm.graph.nodes if n.op == "call_function"]  # noqa: E731
            if seq(mt) != seq(traced):
                raise ExecutionError("re-tracing one micro-batch gave a different op sequence than the global "
                                     "batch; the model's graph depends on the batch size", collective=True)
            from autopar.execution.microbatch import batch_carrying
            carrying = batch_carrying(traced, mt)   # which values the micro-batches cut (autopar/execution/microbatch.py)
            traced = mt
        else:
            carrying = None
        self.traced = traced
        self.device = _run_device()
        self.dtype = _working_dtype(plan.data.get("settings", {}).get("precision", "fp32"), self.precision, self.device)
        self.pp = plan.pp
        if self.pp > 1:
            from autopar.execution import pipeline_run
            pipeline_run.check_options(self)
        # Before the first collective of set-up, so every rank is registered before any step runs:
        # a rank failing mid-step is named to every rank (autopar/execution/step_guard.py).
        from autopar.execution.step_guard import StepGuard
        from runtime.failure_record import FailureRecord, job_store, next_job
        self.guard = StepGuard(FailureRecord(job_store(), dist.get_rank(), dist.get_world_size(), next_job()),
                               dist.get_rank(), watch=self.pp > 1)
        self.ctx = context.setup(plan.mesh, self.device.type, pp=self.pp)
        rng.broadcast_seed(self.device)   # one base seed for every rank's random ops (runtime/rng.py)
        self.rank = dist.get_rank()
        self.stage = self.rank // mesh_size(plan)
        mesh = plan.mesh
        zero = int(plan.degrees.get("zero", 0) or 0)
        self.zero = zero

        # Chunks: one per repeated-block instance (reduced / gathered together), the rest in one.
        chunk_of_module = {}
        for grp in traced.blocks:
            for fqn in grp.module_fqns:
                chunk_of_module.setdefault(fqn, len(chunk_of_module))
        trainable = [n for n in traced.param_fqn if n not in traced.buffers]

        def chunk_key(fqn):
            for m, k in chunk_of_module.items():
                if fqn.startswith(m + "."):
                    return k
            return len(chunk_of_module)

        keys = sorted({chunk_key(traced.param_fqn[n]) for n in trainable})
        chunk_index = {k: i for i, k in enumerate(keys)}
        self.chunk_of = {traced.param_fqn[n]: chunk_index[chunk_key(traced.param_fqn[n])] for n in trainable}
        # ZeRO-3 under pipelining: each stage program gets its own gather/free calls (pipeline_run.setup)
        zero3_chunks = self.chunk_of if zero == 3 and self.pp == 1 else None
        self.program = generate(traced, plan.stage_plan(), self.rank % mesh_size(plan), zero3_chunks,
                                compute_dtype=self.dtype,
                                # a meta model traced on meta: its factory ops (arange) say device=meta
                                device=self.device if (self.device.type != "cpu" or is_meta_model(self.model)) else None,
                                batch_carrying=carrying)
        prog = self.program
        mine = set(prog.param_names)
        if self.pp > 1:   # only this stage's part of the program and of the parameters
            from codegen.stages import split_stages
            stages = plan.data["stages"]   # pp x v (virtual) stages; rank position r runs r, r + pp, ...
            unit_stage = [k for k, st in enumerate(stages) for _ in range(*st["blocks"])]
            self.stage_programs = split_stages(prog, traced, unit_stage, len(stages))
            mine = {n for sp in self.stage_programs if sp.index % self.pp == self.stage for n in sp.param_names}
            # A parameter read on stages of several ranks (a tied embedding and head) is a chunk of
            # its own: the same layout on each of them, so ZeRO-2/3 gradient shards can be summed
            # between the stages (runtime/zero.py shared_groups).
            self.tied_stages = {}
            for n in trainable:
                ranks = tuple(sorted({sp.index % self.pp for sp in self.stage_programs if n in sp.param_names}))
                if len(ranks) > 1:
                    self.tied_stages[traced.param_fqn[n]] = ranks
            tied_key = {fqn: len(chunk_of_module) + 1 + i for i, fqn in enumerate(sorted(self.tied_stages))}
            keys = sorted({tied_key.get(traced.param_fqn[n], chunk_key(traced.param_fqn[n])) for n in trainable})
            chunk_index = {k: i for i, k in enumerate(keys)}
            self.chunk_of = {traced.param_fqn[n]: chunk_index[tied_key.get(traced.param_fqn[n],
                                                                           chunk_key(traced.param_fqn[n]))]
                             for n in trainable}

        # Parameters: only this rank's blocks, from the weight source (autopar/execution/weights.py).
        self.params, self.buffers = {}, {}
        self.local: list[torch.Tensor] = []
        with torch.no_grad():
            source = self._weight_source(traced, prog, mine)
            for name in (n for n in prog.param_names if n in mine):
                fqn = prog.param_fqn[name]
                # fp32 on this rank's device; the optimizer makes the parameters views of its
                # working-dtype buffers, the fp32 values seed the master weights.
                block = source(fqn, prog.param_slices[fqn])
                if name in prog.buffers:
                    if block.is_floating_point():
                        block = block.to(self.dtype)
                    self.buffers[fqn] = block
                    self.local.append(block)
                else:
                    p = torch.nn.Parameter(block)
                    self.params[fqn] = p
                    self.local.append(p)
            del source
        # Partial-over-data-axes grads: the reducer averages, so scale by the axes' size (module doc);
        # the optimizer applies the factor (stage 0: inside the reducer's averaging pass).
        grad_scale = {}
        for fqn, axes in prog.grad_partial_axes.items():
            f = math.prod(mesh.shape[a] for a in axes)
            if f > 1 and fqn in self.params:
                grad_scale[id(self.params[fqn])] = f
        groups = [[] for _ in keys]
        for fqn, p in self.params.items():
            groups[self.chunk_of[fqn]].append(p)
        self.chunks = groups
        model_axes = [a for a in mesh.model_axes() if mesh.shape[a] > 1]
        # Clipping: a parameter replicated on r model-axis ranks counts 1/r in the summed norm (a
        # tied parameter, held whole by the ranks of k stages after its gradient is summed, 1/k more).
        norm_weights = {}
        for fqn, p in self.params.items():
            used = prog.param_layouts[fqn].axes_used()
            r = math.prod(mesh.shape[a] for a in model_axes if a not in used)
            if self.pp > 1 and fqn in self.tied_stages:   # a full copy on each of its stages' ranks
                r *= len(self.tied_stages[fqn])
            if r > 1:
                norm_weights[id(p)] = 1.0 / r
        shared = {}
        if self.pp > 1:   # the groups that sum a tied parameter's gradient between its stages
            from autopar.execution import pipeline_run
            shared = pipeline_run.make_tied_groups(self)
        self.opt = ShardedOptimizer(groups, self.ctx.data_group, zero,
                                    make_optimizer(self.optimizer_name, self.lr, **self.optimizer_kwargs),
                                    grad_clip=self.grad_clip,
                                    # pipelined: the stages' norms are summed too (over the pp group)
                                    extra_norm_groups=[self.ctx.groups[a] for a in model_axes]
                                    + ([self.ctx.extra["pp_group"]] if self.pp > 1 else []),
                                    grad_scale=grad_scale, norm_weights=norm_weights, working_dtype=self.dtype,
                                    forward_order=self._forward_order(), shared_groups=shared)
        if zero == 3:
            context.set_zero3(self.opt)
        self._param_index = {fqn: i for i, fqn in enumerate(prog.param_fqn[n] for n in prog.param_names)}
        if self.pp > 1:
            from autopar.execution import pipeline_run
            pipeline_run.setup(self)
        self._ready = True

    def _weight_source(self, traced, prog, mine=None):
        """fqn, slices -> this rank's block (autopar/execution/weights.py weight_source)."""
        from autopar.execution.weights import weight_source
        return weight_source(self.model, traced, prog, self.weights, self.device,
                             getattr(self, "_init_rng_state", None), mine)

    def _forward_order(self) -> list:
        """Trainable parameters in the order the program first reads them: backward completes
        their gradients in about the reverse order, which the DP buckets follow (a parameter
        read first, like a tied embedding, gets its gradient last)."""
        first = {}
        for k, n in enumerate(self.program.gm.graph.nodes):
            for a in n.all_input_nodes:
                if a.op == "placeholder":
                    first.setdefault(a.name, k)
        by_name = {name: self.params.get(self.program.param_fqn[name]) for name in self.program.param_names}
        ordered = sorted((first.get(name, len(first) + i), i, name) for i, name in enumerate(self.program.param_names))
        return [by_name[name] for _, _, name in ordered if by_name[name] is not None]

    # ------------------------------------------------------------------ batches
    def batch_rows(self) -> list[int]:
        """Indices along the batch dim (the plan's ``batch_dims``) of the global batch this rank
        reads, micro-batch by micro-batch."""
        self._need_ready()
        prog = self.program
        bm = self.global_batch // self.nm
        lay, d = next(((l, d) for l, d in zip(prog.input_layouts, self.batch_dims) if d is not None), (None, None))
        rows = []
        for m in range(self.nm):
            sl = _block_of(lay, bm, prog.mesh_shape, prog.coords, d) if lay is not None and lay.dims else slice(0, bm)
            rows.extend(range(m * bm + sl.start, m * bm + sl.stop))
        return rows

    def _local_micro_batches(self, batch) -> list[tuple]:
        """Per micro-batch this rank's part of every input: cut along the input's batch dim (an
        input without one goes whole to every micro-batch)."""
        prog = self.program
        bm = self.global_batch // self.nm
        n_local = len(self.batch_rows()) // self.nm
        out = [[] for _ in range(self.nm)]
        for x, lay, d in zip(batch, prog.input_layouts, self.batch_dims):
            if not isinstance(x, torch.Tensor):
                raise ExecutionError(f"step() takes tensors, got {type(x).__name__}", collective=True)
            if d is None:
                for m in range(self.nm):
                    out[m].append(x)
            elif x.dim() > d and x.shape[d] == self.global_batch:
                for m in range(self.nm):
                    xm = x.narrow(d, m * bm, bm)
                    if lay.dims and lay.dims[d]:
                        sl = _block_of(lay, bm, prog.mesh_shape, prog.coords, d)
                        xm = xm.narrow(d, sl.start, sl.stop - sl.start)
                    out[m].append(xm)
            elif x.dim() > d and x.shape[d] == n_local * self.nm:   # just my rows (batch_rows())
                for m in range(self.nm):
                    out[m].append(x.narrow(d, m * n_local, n_local))
            else:
                got = x.shape[d] if x.dim() > d else f"no dim {d} in shape {tuple(x.shape)}"
                raise ExecutionError(f"step() got a batch of {got} rows along the batch dim {d}; the plan is for a "
                                     f"global batch of {self.global_batch} (or this rank's {n_local * self.nm} rows)", collective=True)
        # Only this rank's rows go to its device; floating inputs in the working dtype (the program's).
        to = lambda x: x.to(self.device, dtype=self.dtype if x.is_floating_point() else x.dtype)  # noqa: E731
        return [tuple(to(x) for x in o) for o in out]

    def _check_batch(self, batch) -> None:
        """Inputs against the example batch; on the first call, the same global batch on every
        rank (autopar/execution/batch_check.py)."""
        from autopar.execution.batch_check import check_index_ranges, check_inputs, index_bounds, is_global_batch, \
            same_global_batch

        local = len(self.batch_rows())
        check_inputs(batch, self._example, self.global_batch, local, self.batch_dims)
        if not hasattr(self, "_index_bounds"):
            self._index_bounds = index_bounds(self.traced)
        check_index_ranges(batch, self._index_bounds)
        if not self._batch_compared:
            self._batch_compared = True
            same_global_batch(batch, is_global_batch(batch, self.global_batch, self.batch_dims), self.device,
                              self.rank)

    def _check_usable(self) -> None:
        """After a failed step the ranks' communication is out of step: refuse (step_guard.py)."""
        guard = getattr(self, "guard", None)   # set up yet, and not a grid plan
        if guard is not None:
            guard.check_usable()

    def _need_ready(self):
        if not self._ready:
            raise ExecutionError("the compiled model is not set up yet: pass example_inputs to compile() or call "
                                 "step() with a batch first")

    # ------------------------------------------------------------------ running
    def _global_loss(self, local: torch.Tensor) -> float:
        return self._finish_loss(self._start_loss(local))

    def _start_loss(self, local: torch.Tensor):
        """Begin summing the local loss over the axes it is partial over: asynchronously when that
        is one axis (the step overlaps it with backward), else in turn. Returns (tensor, work)."""
        t = local.detach().clone().float()
        axes = self.program.loss_layout.partial
        if len(axes) == 1:
            return t, dist.all_reduce(t, group=self.ctx.groups[axes[0]], async_op=True)
        for a in axes:
            dist.all_reduce(t, group=self.ctx.groups[a])
        return t, None

    @staticmethod
    def _finish_loss(pending) -> float:
        t, work = pending
        if work is not None:
            work.wait()
        return float(t)

    @torch.no_grad()
    def _set_denominators(self, micro) -> None:
        """The global denominators of the program's mean losses for this step (runtime/loss.py):
        this rank's counts summed over its micro-batches, then over the axes the targets are split
        over. Must run before the micro-batches (each divides by the step's global count)."""
        prog = self.program
        if prog.count_gm is None:
            return
        from runtime import loss as RL

        counts = None
        for inputs in micro:
            c = prog.count_gm(*self._all_params(), *inputs)
            counts = list(c) if counts is None else [a + b for a, b in zip(counts, c)]
        values = {}
        for (name, axes), c in zip(prog.mean_losses, counts):
            c = c.clone()
            for a in axes:
                dist.all_reduce(c, group=self.ctx.groups[a])
            values[name] = c
        RL.set_denominators(values)

    def _all_params(self) -> list:
        """The program's parameter arguments: this rank's blocks, None for other stages' ones
        (the count program reads none of them)."""
        if self.pp == 1:
            return self.local
        prog = self.program
        vals = {**self.params, **self.buffers}
        return [vals.get(prog.param_fqn[n]) for n in prog.param_names]

    def step(self, *batch) -> float:
        if not self._ready:
            self._setup(batch)
        self._check_usable()
        self._check_batch(batch)
        # A failure inside names the failing rank on every rank, and a pipelined step never hangs
        # on a failed peer (autopar/execution/step_guard.py).
        if self.pp > 1:
            return self.guard.run(lambda: self._pipelined(batch, train=True), "pipeline step")
        return self.guard.run(lambda: self._step(batch), "training step")

    def _step(self, batch) -> float:
        micro = self._local_micro_batches(batch)
        self._set_denominators(micro)
        total = torch.zeros((), device=self.device)
        reducer = self.opt.reducer
        pending = None
        for m, inputs in enumerate(micro):
            last = m == len(micro) - 1
            sync = reducer.no_sync() if (reducer is not None and not last) else _nullcontext()
            with sync:
                # each micro-batch's loss is its exact share of the step's loss (module doc): summed
                loss = self.program.gm(*self.local, *inputs)
                total = total + loss.detach().float()
                if last:   # the global loss is summed while backward runs
                    pending = self._start_loss(total)
                loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return self._finish_loss(pending)

    def _pipelined(self, batch, train: bool) -> float:
        from autopar.execution import pipeline_run

        micro = self._local_micro_batches(batch)
        self._set_denominators(micro)
        return pipeline_run.step(self, micro) if train else pipeline_run.forward(self, micro)

    @torch.no_grad()
    def __call__(self, *inputs):
        """Forward only: the global loss of the batch (a 0-d tensor, the same on every rank)."""
        if not self._ready:
            self._setup(inputs)
        self._check_usable()
        self._check_batch(inputs)
        if self.pp > 1:
            return torch.tensor(self.guard.run(lambda: self._pipelined(inputs, train=False), "pipelined forward"))
        return torch.tensor(self.guard.run(lambda: self._forward(inputs), "forward"))

    def _forward(self, inputs) -> float:
        micro = self._local_micro_batches(inputs)
        self._set_denominators(micro)
        total = torch.zeros((), device=self.device)
        for mb in micro:
            total = total + self.program.gm(*self.local, *mb).float()
        return self._global_loss(total)

    # ------------------------------------------------------------------ state (autopar/execution/compiled_state.py)
    def _gather_full(self, local: torch.Tensor, fqn: str) -> torch.Tensor:
        return compiled_state.gather_full(self, local, fqn)

    def _local_values(self) -> dict[str, torch.Tensor]:
        return compiled_state.local_values(self)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors, keys of model.state_dict() (tied aliases included); on every rank."""
        self._check_usable()
        return compiled_state.full_state_dict(self)

    def _optimizer_local_state(self) -> dict[str, dict[str, torch.Tensor]]:
        return compiled_state.optimizer_local_state(self)

    def _full_optimizer_state(self) -> dict[str, torch.Tensor]:
        return compiled_state.full_optimizer_state(self)

    def _fqn_of(self, p):
        if not hasattr(self, "_fqn_by_id"):
            self._fqn_by_id = {id(q): f for f, q in self.params.items()}
        return self._fqn_by_id[id(p)]

    def save(self, directory) -> None:
        """Full (unsharded) tensors via torch.distributed.checkpoint: loads onto any plan."""
        self._check_usable()
        compiled_state.save(self, directory)

    def load(self, directory) -> None:
        """Values saved by save() (from any plan), after checking they are this model's."""
        self._check_usable()
        compiled_state.load(self, directory)

    # ------------------------------------------------------------------ communication
    def comm_stats(self) -> dict[str, int]:
        """Bytes per rank moved since the last reset, by mesh axis name (optimizer traffic under the data axis)."""
        from runtime.collectives import COMM_STATS

        out = dict(COMM_STATS.snapshot())
        if self._ready:
            data = [self.plan.mesh.names[a] for a in self.program.data_axes]
            key = "+".join(data) if data else "dp"
            out[key] = out.get(key, 0) + self.opt.bytes_sent
            if self.pp > 1:   # activations/gradients sent between stages; tied gradients summed between them
                out["pp"] = self.runner.p2p_bytes
                out["pp_tied"] = self.tied_bytes
        return out

    def reset_comm_stats(self) -> None:
        from runtime.collectives import COMM_STATS

        COMM_STATS.reset()
        if self._ready:
            self.opt.reset_comm_stats()
            if self.pp > 1:
                self.tied_bytes = self.runner.p2p_bytes = 0


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


def mesh_size(plan) -> int:
    """Ranks of one pipeline stage (the plan's mesh is one stage's)."""
    return plan.mesh.size


def _block_of(lay, n, mesh_shape, coords, dim: int = 0) -> slice:
    """My rows of a dim ``dim`` of ``n`` rows split per ``lay``."""
    idx, k = 0, 1
    for a in lay.dims[dim]:
        idx = idx * mesh_shape[a] + coords[a]
        k *= mesh_shape[a]
    step = n // k
    return slice(idx * step, (idx + 1) * step)


def compile(model, cluster, example_inputs=None, plan=None, optimizer: str = "adamw", lr: float = 1e-3,
            plan_options: dict | None = None, precision: str | None = None, grad_clip: float | None = None,
            loss_fn=None, batch_dims=None, weights=None, **optimizer_kwargs) -> CompiledModel:
    """Set up ``model`` to train under ``plan`` (planned now on rank 0 when None) on the current
    process group. ``plan_options`` are keyword arguments for autopar.plan (e.g. constraints).
    ``precision``: "fp32" | "bf16" | None (the plan's on a GPU, fp32 on the CPU; module doc).
    ``grad_clip``: clip the global gradient norm (over every shard) to this value.
    ``loss_fn``: as for autopar.plan, ``loss_fn(model(*inputs[:k]), *inputs[k:])`` is the loss
    (k: the required positional parameters of model.forward); ``step`` then takes the same tuple.
    ``batch_dims``: each input's batch dim for planning (autopar.plan's keyword; with a given plan it
    must match the plan's). Without ``example_inputs`` the set-up happens at the first ``step``.
    ``weights``: None (the model's own tensors), "init" (a meta model's initialization, run for this
    rank's shards only) or a directory (Hugging Face safetensors checkpoint or compiled.save());
    see autopar/execution/weights.py."""
    _require_pg(cluster)
    if dist.get_world_size() > 1:   # an uncaught autopar error prints once, not once per rank
        from autopar.execution.error_report import install
        install()
    if plan is not None and not isinstance(plan, Plan):
        raise ExecutionError(f"plan must be an autopar.Plan, got {type(plan).__name__}", collective=True)
    if plan is not None and plan.world_size != dist.get_world_size():
        raise ExecutionError(f"the plan is for {plan.world_size} devices (mesh {plan.mesh.describe()}, pp={plan.pp}) "
                             f"but the process group has {dist.get_world_size()} ranks: launch {plan.world_size} "
                             f"processes or re-plan", collective=True)
    if grad_clip is not None and not grad_clip > 0:
        raise ExecutionError(f"grad_clip must be a positive number, got {grad_clip!r}", collective=True)
    options = dict(plan_options or {})
    if loss_fn is not None and options.get("loss_fn", loss_fn) is not loss_fn:
        raise ExecutionError("compile() got two different loss functions (loss_fn= and plan_options['loss_fn']): "
                             "pass one", collective=True)
    loss_fn = loss_fn if loss_fn is not None else options.get("loss_fn")
    if loss_fn is not None:
        if not callable(loss_fn):
            raise ExecutionError(f"loss_fn must be callable, got {type(loss_fn).__name__}", collective=True)
        options["loss_fn"] = loss_fn
    if batch_dims is not None:
        if plan is not None:
            from autopar.frontend.batching import plan_batch_dims
            want = [batch_dims] * len(plan.data.get("inputs", [])) if isinstance(batch_dims, int) else list(batch_dims)
            if want != plan_batch_dims(plan.data, len(want)):
                raise ExecutionError(f"batch_dims={batch_dims!r} differs from the plan's batch dims "
                                     f"{plan_batch_dims(plan.data, len(want))}: re-plan with batch_dims=...", collective=True)
        else:
            options["batch_dims"] = batch_dims
    cm = CompiledModel(model, cluster, plan, optimizer, lr, optimizer_kwargs, options, precision, grad_clip,
                       loss_fn, weights)
    if example_inputs is not None:
        cm._setup(example_inputs)
    return cm


__all__ = ["compile", "CompiledModel"]
