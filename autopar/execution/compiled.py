"""``autopar.compile``: run a Plan on the current process group.

compile(model, cluster, example_inputs=None, plan=None, optimizer="adamw", lr=1e-3, weights=None, **kw) -> CompiledModel

``CompiledModel`` is what users get: ``step``, forward (``__call__``), state (``full_state_dict``,
``save``, ``load``: autopar/execution/compiled_state.py) and communication counters. Its set-up
(every rank, collectively: plan broadcast, trace and fingerprint checks, the per-rank program, this
rank's parameter blocks and the ZeRO optimizer, device and precision) is
autopar/execution/compiled_setup.py, run by ``compile`` when it has ``example_inputs``, else at the
first ``step``. A process group must exist and its world size must equal the plan's device count
(``ExecutionError`` on every rank otherwise).

Process group: ``compile`` uses the one that exists; without one, under torchrun (``RANK`` and
``WORLD_SIZE`` set) it initialises one with the cluster's backend (nccl / gloo).

``step(*batch)`` takes the GLOBAL batch (or just this rank's rows, ``batch_rows()``; rows are
indices along each input's batch dim, autopar/execution/local_batches.py), first computes the
global denominators of the mean losses
(the program's count program over every micro-batch, all-reduced over the axes the targets are
split over), then runs every micro-batch forward and backward — each micro-batch program returns
its exact share of the step's loss, so losses and gradients are summed, not averaged — steps the
optimizer and returns the global loss as a float, identical on every rank. Its inputs must match
the example batch (count, shapes, dtypes; autopar/execution/batch_check.py), and on the first step every rank
passing the global batch must pass the same one. ``compile(loss_fn=...)`` traces
``loss_fn(model(*inputs[:k]), *inputs[k:])``.

Frozen parameters (``requires_grad=False``) are held like buffers. ``load``
checks the checkpoint's tensors against this model's before reading (autopar/execution/compiled_state.py).
"""
from __future__ import annotations

import os
from datetime import timedelta  # noqa: F401  (documented: the process-group timeout bounds every wait)

import torch
import torch.distributed as dist

from autopar.execution import compiled_setup, compiled_state, local_batches, optim_setup
from autopar.errors import ExecutionError
from autopar.execution.placement import check_host_collectives
from autopar.execution.placement import require_process_group as _require_pg
from autopar.plans.plan import Plan
from autopar.constraints import Constraints
from autopar.execution import pipeline_run
from autopar.execution.error_report import install
from autopar.execution.live_stats import StepStats, StepTimer
from autopar.frontend.batching import plan_batch_dims
from runtime import loss as RL
from runtime.collectives import COMM_STATS


class CompiledModel:
    def __init__(self, model, cluster, plan, optimizer, lr, optimizer_kwargs, plan_options=None,
                 precision=None, grad_clip=None, loss_fn=None, weights=None, optim_options=None,
                 log_every=None, on_step=None):
        self.weights = weights
        # measured step figures next to the plan's (autopar/execution/live_stats.py)
        self._timer = StepTimer(log_every, on_step, dist.get_rank)
        # weights="init" replays the initialization from the random stream as it is now (rank 0's
        # is used on every rank), before set-up draws from it.
        self._init_rng_state = torch.get_rng_state()
        self.model, self.cluster, self.plan = model, cluster, plan
        self.loss_fn = loss_fn   # traced as loss_fn(model(*inputs[:k]), *inputs[k:]) (autopar.frontend.trace)
        self.optimizer_name, self.base_lr, self.optimizer_kwargs = optimizer, lr, dict(optimizer_kwargs)
        self.optim_options = optim_options or optim_setup.OptimOptions()
        self.plan_options = plan_options
        self.precision, self.grad_clip = precision, grad_clip
        self.offload_dir = None   # NVMe offload: where the optimizer state's files go (compile)
        self._ready = False

    # ------------------------------------------------------------------ set-up
    def _setup(self, example_inputs):
        """Every rank, collectively (autopar/execution/compiled_setup.py)."""
        return compiled_setup.setup(self, example_inputs)

    @property
    def lr(self) -> float:
        """The learning rate of the next step: ``compile``'s lr, scaled for the global batch
        (``lr_scaling``) and times the schedule's multiplier; before set-up, compile's lr. Each
        parameter group's is this times its ``lr_scale``."""
        if not self._ready:
            return self.base_lr
        return self.opt.opt.lr_at(self.opt.step_count + 1)

    @property
    def step_count(self) -> int:
        """Optimizer steps taken (restored by ``load``)."""
        return self.opt.step_count if self._ready else 0

    # ------------------------------------------------------------------ batches (autopar/execution/local_batches.py)
    def batch_rows(self) -> list[int]:
        """Indices along the batch dim (the plan's ``batch_dims``) of the global batch this rank
        reads, micro-batch by micro-batch."""
        return local_batches.batch_rows(self)

    def _local_micro_batches(self, batch) -> list[tuple]:
        return local_batches.local_micro_batches(self, batch)

    def _check_batch(self, batch) -> None:
        local_batches.check_batch(self, batch)

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
    def _set_denominators(self, micro, overlap: bool = False) -> None:
        """The global denominators of the program's mean losses for this step (runtime/loss.py):
        this rank's counts summed over its micro-batches, then over the axes the targets are split
        over. Must run before the micro-batches (each divides by the step's global count).
        ``overlap``: a sum over one axis runs asynchronously and the loss waits for it, so it
        overlaps the forward (on gloo a blocking scalar all-reduce cost 0.4-0.7 ms of a 3.5 ms
        step); the caller settles it (``RL.settle``) before the step ends."""
        prog = self.program
        if prog.count_gm is None:
            return

        counts = None
        for inputs in micro:
            c = prog.count_gm(*self._all_params(), *inputs)
            counts = list(c) if counts is None else [a + b for a, b in zip(counts, c)]
        values = {}
        for (name, axes), c in zip(prog.mean_losses, counts):
            c = c.clone()
            if overlap and len(axes) == 1:
                values[name] = RL.Pending(c, dist.all_reduce(c, group=self.ctx.groups[axes[0]], async_op=True))
                continue
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
        self._timer.start()
        if self.pp > 1:
            loss = self.guard.run(lambda: self._pipelined(batch, train=True), "pipeline step")
        else:
            loss = self.guard.run(lambda: self._step(batch), "training step")
        self._timer.stop(self)
        return loss

    def stats(self, last: int | None = None) -> StepStats | None:
        """Measured step time, tokens/s (or samples/s), TFLOP/s per device and MFU over the
        ``last`` steps (default: every step but the first, a warm-up), each next to the plan's
        prediction (autopar/execution/live_stats.py); None before the second step."""
        if not self._ready:
            return None
        return self._timer.stats(self, last)

    def _step(self, batch) -> float:

        micro = self._local_micro_batches(batch)
        self._set_denominators(micro, overlap=True)
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
        RL.settle()
        self.opt.step()
        self.opt.zero_grad()
        return self._finish_loss(pending)

    def _pipelined(self, batch, train: bool) -> float:

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

    def save(self, directory, keep_last: int = 1, blocking: bool = True):
        """Collective: parameters, optimizer state and step count via torch.distributed.checkpoint,
        each rank writing only the pieces it holds, as chunks of the full tensors (loads onto any
        plan), into a new generation of ``directory`` committed atomically: a save that dies
        leaves the previous checkpoint. ``keep_last``: committed generations kept (the newest
        loads). ``blocking=False``: stage a CPU copy, write and commit it on a background thread
        while training goes on, return a handle (``wait()``, ``done()``); a later save or load
        waits for it. autopar/execution/checkpoint_atomic.py, checkpoint_io.py, checkpoint_async.py."""
        self._check_usable()
        return compiled_state.save(self, directory, keep_last=keep_last, blocking=blocking)

    def load(self, directory) -> None:
        """Values saved by save() (from any plan), after checking the checkpoint is complete and
        its tensors are this model's; each rank reads only the pieces it needs."""
        self._check_usable()
        compiled_state.load(self, directory)

    def load_latest(self, directory) -> int | None:
        """Resume: load ``directory``'s committed checkpoint and return its step count (the
        optimizer's steps, as ``step_count``), or None, loading nothing, when ``directory`` holds
        no committed checkpoint (absent, empty, or only a save that died before its commit)."""
        self._check_usable()
        if not compiled_state.has_checkpoint(directory):
            return None
        compiled_state.load(self, directory)
        return self.step_count

    # ------------------------------------------------------------------ communication
    def comm_stats(self) -> dict[str, int]:
        """Bytes per rank moved since the last reset, by mesh axis name (optimizer traffic under the data axis)."""

        out = dict(COMM_STATS.snapshot())
        if self._ready:
            data = [self.plan.mesh.names[a] for a in self.program.data_axes]
            key = "+".join(data) if data else "dp"
            out[key] = out.get(key, 0) + self.opt.bytes_sent
            if self.pp > 1:   # activations/gradients sent between stages; tied gradients summed between them
                out["pp"] = self.runner.p2p_bytes
                out["pp_tied"] = self.tied_bytes
        return out

    def offload_stats(self) -> dict[str, int]:
        """Offloaded plans (docs/offload.md): bytes copied device -> host (``d2h``) and host ->
        device (``h2d``) on this rank since the last ``reset_comm_stats``, and the bytes it holds
        now in host memory (``host``) and on the device for model state (``device``: parameters,
        gradients, optimizer state). All zero but ``device`` without offload. NVMe offload also
        ``nvme_read`` / ``nvme_write`` (state bytes since the reset) and ``nvme_disk`` (its files)."""
        self._need_ready()
        moved = dict(self.opt.offload_bytes)
        out = {**moved, "host": sum(self.opt.host_bytes().values()), "device": sum(self.opt.state_bytes().values())}
        if self.opt.offload.nvme is not None:   # the optimizer state's files: read, written, on disk
            out.update({f"nvme_{k}": v for k, v in self.opt.nvme_bytes().items()})
        return out

    def close(self) -> None:
        """Release what the compiled model holds outside the process: the optimizer state's files
        under NVMe offload (``offload_dir``). Training cannot continue after it."""
        if self._ready:
            self.opt.close()

    def kernel_stats(self) -> dict[str, int]:
        """Triton kernel launches on this rank since the last reset, by kernel family
        (runtime/kernels); all zero when the plan runs torch ops (``plan.kernels``)."""
        from runtime.kernels import kernel_stats

        return kernel_stats()

    def reset_kernel_stats(self) -> None:
        from runtime.kernels import reset_kernel_stats

        reset_kernel_stats()

    def reset_comm_stats(self) -> None:

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



def compile(model, cluster, example_inputs=None, plan=None, optimizer: str = "adamw", lr: float = 1e-3,
            plan_options: dict | None = None, precision: str | None = None, grad_clip: float | None = None,
            loss_fn=None, batch_dims=None, weights=None, kernels: str | None = None,
            param_groups=None, lr_schedule=None, warmup_steps: int = 0, total_steps: int | None = None,
            power: float = 1.0, lr_scaling: str | None = None, base_batch: int | None = None,
            log_every: int | None = None, on_step=None, offload_dir: str | None = None,
            **optimizer_kwargs) -> CompiledModel:
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
    see autopar/execution/weights.py. ``kernels``: "auto" (Triton kernels on CUDA, torch ops on the
    CPU), "triton" (on the CPU through Triton's interpreter, ``TRITON_INTERPRET=1``) or "torch";
    with a given plan, the plan's choice (a different one is an error). docs/kernels.md.

    Optimizer (docs/design/execution.md "Optimizers"): ``optimizer`` "adamw" | "adam" | "sgd" |
    "lamb" | "lars", ``lr`` and the optimizer's hyperparameters as keywords (runtime/optim.py:
    ``weight_decay``, ``betas``, ``eps``, ``momentum``; LAMB/LARS ``trust_clip`` (ratio clipped at 1;
    LARS: LARC's min(ratio / lr, 1)) and ``always_adapt`` (trust ratio on the excluded tensors too)).
    ``grad_clip`` clips the global norm before the update, LAMB's included (apex's max_grad_norm).
    ``param_groups``: "bert" (the default for LAMB and LARS: parameters of at most one dimension,
    judged on the FULL tensor, get no weight decay and no trust ratio), "all" (the default for the
    others: every tensor alike) or a list of ``{"params": regex | callable(name, shape),
    "weight_decay": ..., "lr_scale": ..., "adapt": ...}``, first match wins (runtime/optim_groups.py).
    ``lr_schedule``: a callable ``t -> multiplier`` of the steps taken (0 first) or "constant",
    "warmup-linear", "warmup-poly" (``power``), "warmup-cosine" with ``warmup_steps`` and
    ``total_steps`` (runtime/lr_schedule.py). ``lr_scaling`` "linear" | "sqrt" with ``base_batch``:
    lr times global_batch / base_batch (or its square root), the global batch being the example
    batch's. ``compiled.lr`` is the next step's learning rate; ``save``/``load`` keep the step
    count (the schedule's state), the groups' settings and the base lr.

    ``log_every=N``: every N steps rank 0 prints the measured step time (mean over the last N
    steps, the first step left out), tokens/s (samples/s without a sequence dim), TFLOP/s per
    device and MFU, each next to the plan's prediction; ``on_step(stats)``, if given, is called
    instead on every rank with an ``autopar.StepStats``. ``compiled.stats()`` returns the same
    figures at any time (autopar/execution/live_stats.py).

    ``offload_dir``: where a plan that offloads the optimizer state to NVMe (``"optimizer-nvme"``,
    docs/offload.md) keeps its files, an existing directory on the drive (each rank makes its own
    directory inside); None: a temporary directory per rank. ``compiled.close()`` removes them.
    Unused by plans that do not offload to NVMe."""
    _require_pg(cluster)
    check_host_collectives()
    if dist.get_world_size() > 1:   # an uncaught autopar error prints once, not once per rank
        install()
    if plan is not None and not isinstance(plan, Plan):
        raise ExecutionError(f"plan must be an autopar.Plan, got {type(plan).__name__}", collective=True)
    if plan is not None and plan.world_size != dist.get_world_size():
        raise ExecutionError(f"the plan is for {plan.world_size} devices (mesh {plan.mesh.describe()}, pp={plan.pp}) "
                             f"but the process group has {dist.get_world_size()} ranks: launch {plan.world_size} "
                             f"processes or re-plan", collective=True)
    if log_every is not None and (isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1):
        raise ExecutionError(f"log_every must be a positive whole number of steps, got {log_every!r}", collective=True)
    if on_step is not None and not callable(on_step):
        raise ExecutionError(f"on_step must be callable (it gets an autopar.StepStats), got {type(on_step).__name__}",
                             collective=True)
    if on_step is not None and log_every is None:
        log_every = 1
    if grad_clip is not None and not grad_clip > 0:
        raise ExecutionError(f"grad_clip must be a positive number, got {grad_clip!r}", collective=True)
    if offload_dir is not None and not os.path.isdir(offload_dir):
        raise ExecutionError(f"offload_dir {str(offload_dir)!r} is not a directory; create it on the NVMe drive the "
                             f"optimizer state should live on", collective=True)
    optim_options = optim_setup.OptimOptions(param_groups, lr_schedule, warmup_steps, total_steps, power,
                                             lr_scaling, base_batch)
    optim_setup.check_options(optimizer, lr, optim_options, optimizer_kwargs)
    options = dict(plan_options or {})
    if "constraints" in options:   # a bad pin fails here, on every rank alike, not when rank 0 plans
        options["constraints"] = Constraints.coerce(options["constraints"])
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
            want = [batch_dims] * len(plan.data.get("inputs", [])) if isinstance(batch_dims, int) else list(batch_dims)
            if want != plan_batch_dims(plan.data, len(want)):
                raise ExecutionError(f"batch_dims={batch_dims!r} differs from the plan's batch dims "
                                     f"{plan_batch_dims(plan.data, len(want))}: re-plan with batch_dims=...",
                                     collective=True)
        else:
            options["batch_dims"] = batch_dims
    if kernels is not None:
        from autopar.frontend.fuse import uses_kernels
        try:
            wanted = uses_kernels(kernels, cluster.backend)
        except Exception as e:
            raise ExecutionError(str(e), collective=True) from None
        if plan is not None and wanted != (plan.kernels == "triton"):
            raise ExecutionError(f"kernels={kernels!r} differs from the plan's kernels ({plan.kernels!r}): "
                                 f"re-plan with kernels={kernels!r}", collective=True)
        if plan is None:
            options["kernels"] = kernels
    cm = CompiledModel(model, cluster, plan, optimizer, lr, optimizer_kwargs, options, precision, grad_clip,
                       loss_fn, weights, optim_options, log_every, on_step)
    cm.offload_dir = None if offload_dir is None else os.fspath(offload_dir)
    if example_inputs is not None:
        cm._setup(example_inputs)
    return cm


__all__ = ["compile", "CompiledModel", "StepStats"]
