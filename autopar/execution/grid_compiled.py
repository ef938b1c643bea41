"""Execution of a 2D / 2.5D / 3D tensor-parallel plan (tp_mode "2d", "2.5d", "3d"): the grid of
runtime/grid.py, each rank's parameter blocks, codegen/grid_ops.py's per-rank program, the
optimizer on the local blocks, micro-batches (the program run once per micro-batch, gradients
accumulated), ZeRO-1 over the dp replicas, the global loss, and checkpoints: ``save`` / ``load``
write and read whole tensors in the format of autopar/execution/compiled_state.py (model,
optimizer state by "{fqn}.{state name}", step count), reassembled from / cut into the blocks, so
a grid checkpoint resumes on any plan and any plan's checkpoint on a grid.

``CompiledModel._setup`` hands a grid plan to ``GridCompiledModel.setup_grid`` (the object's
class becomes GridCompiledModel: same public API - step, __call__, full_state_dict, save, load,
comm_stats, reset_comm_stats).

Parameter blocks (the stored global tensor, then runtime/grid.take with the rank's spec):
    weight  nn.Linear.weight.T [in, out] (QKV: columns in head-grouped order), weight spec
    conv    patch-embedding weight reshaped to [out, C*kh*kw], transposed, weight spec
    bias    [out] (QKV: same order), vector spec of the linear's layout
    norm    LayerNorm vector: vector spec of swap(layout) (3D), the plane's otherwise
    table   embedding table [V, h]: hidden piece of q^2 (q^3 in 3D)
    loose   hidden block of q on its hidden dim, replicated over the token groups
Gradients are exactly each block's (the grid ops' own backward); so plain SGD / Adam on the
local blocks is the one-process optimizer, element by element (and so is ZeRO-1's optimizer on
a flat shard of them: SGD / Adam are elementwise).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.execution.compiled import CompiledModel
from autopar.errors import ExecutionError
from codegen.grid_layout import GRID_MODES, geometry_of
from runtime.grid import take


def is_grid_plan(plan) -> bool:
    return plan.degrees.get("tp_mode") in GRID_MODES


def _spec(geo, use, coords, shape):
    if use.kind in ("weight", "conv"):
        return geo.weight_spec(use.L, coords)
    if use.kind == "bias":
        return geo.vector_spec(use.L, coords)
    if use.kind == "norm":
        return geo.vector_spec(geo.swap(use.L), coords)
    if use.kind == "table":
        return geo.table_spec(use.L, coords)
    spec = [None] * len(shape)
    if use.kind == "whole":     # read by an op run whole on every rank (codegen/grid_replicated.py)
        return tuple(spec)
    spec[use.hdim] = geo.hid_block(use.L, coords)
    return tuple(spec)


def to_stored(use, t: torch.Tensor) -> torch.Tensor:
    """The global tensor the blocks are cut from."""
    if use.kind == "weight":
        t = t.t()
    elif use.kind == "conv":
        t = t.reshape(t.shape[0], -1).t()
    if use.perm is not None:
        t = t[..., list(use.perm)]
    return t.contiguous()


def from_stored(use, t: torch.Tensor, shape) -> torch.Tensor:
    if use.perm is not None:
        out = torch.empty_like(t)
        out[..., list(use.perm)] = t
        t = out
    if use.kind == "weight":
        t = t.t()
    elif use.kind == "conv":
        t = t.t().reshape(shape)
    return t.contiguous()


def _place(full: torch.Tensor, spec, block: torch.Tensor) -> None:
    idx = []
    for dim, s in enumerate(spec):
        if s is None:
            idx.append(slice(None))
        else:
            i, n = s
            size = full.shape[dim] // n
            idx.append(slice(i * size, (i + 1) * size))
    idx += [slice(None)] * (full.dim() - len(idx))
    full[tuple(idx)] = block


class GridCompiledModel(CompiledModel):
    def setup_grid(self, traced, example_inputs):
        from codegen.grid_ops import GridProgram
        from runtime.grid import Grid2D, Grid3D, Grid25D

        plan = self.plan
        d = plan.degrees
        if self.weights is not None:
            raise ExecutionError("a grid plan takes the model's own weights (weights=None)", collective=True)
        self.geo = geo = geometry_of(d["tp_mode"], d["tp_shape"], int(d.get("dp", 1)),
                                     int(d.get("num_micro_batches", 1) or 1), int(d.get("zero", 0) or 0))
        if geo.zero not in (0, 1):
            raise ExecutionError(f"a grid plan runs ZeRO 0 or 1, not zero={geo.zero}", collective=True)
        self.grid = {"2d": lambda: Grid2D(geo.q, dp=geo.dp), "2.5d": lambda: Grid25D(geo.q, geo.d, dp=geo.dp),
                     "3d": lambda: Grid3D(geo.q, dp=geo.dp)}[geo.mode]()
        self.traced = traced
        coords = dict(zip(self.grid.names, self.grid.coords), dp=self.grid.dp_rank)
        batch = example_inputs[0].shape[0]
        prog = GridProgram(traced, geo, batch).analyse()
        self.local_params = {}
        for name, use in prog.uses.items():
            full = traced.value_of(self.model, traced.param_fqn[name]).detach()
            stored = to_stored(use, full.float())
            block = take(stored, _spec(geo, use, coords, stored.shape))
            self.local_params[name] = block.requires_grad_(name not in traced.buffers)
        self.program = prog.bind(self.grid, coords, self.local_params)
        self.coords = coords
        trainable = list(self._trainable().values())
        self.zero = geo.zero if geo.dp > 1 else 0
        if self.zero:
            # ZeRO-1 over dp: the trainable blocks as one flat vector padded to dp equal shards;
            # the optimizer owns this replica's shard (its state is 1/dp of the blocks')
            numel = sum(t.numel() for t in trainable)
            self._flat_len = -(-numel // geo.dp) * geo.dp
            self._shard_len = self._flat_len // geo.dp
            self._lo = self.grid.dp_rank * self._shard_len
            self.shard = self._my_shard([t.detach() for t in trainable]).clone().requires_grad_()
            trainable = [self.shard]
        kw = dict(self.optimizer_kwargs)
        if self.optimizer_name == "sgd":
            self.opt = torch.optim.SGD(trainable, lr=self.lr, **kw)
        elif self.optimizer_name in ("adam", "adamw"):
            cls = torch.optim.Adam if self.optimizer_name == "adam" else torch.optim.AdamW
            self.opt = cls(trainable, lr=self.lr, **kw)
        else:
            raise ExecutionError(f"optimizer {self.optimizer_name!r} is not supported on a grid plan "
                                 f"(sgd, adam, adamw)", collective=True)
        self.rank = dist.get_rank()
        self.step_count = 0
        self._ready = True

    def _inputs(self, batch):
        return dict(zip(self.traced.input_names, batch))

    def _global(self, share: torch.Tensor) -> float:
        t = share.detach().clone().reshape(1)
        dist.all_reduce(t)    # uncounted: the loss report is not the plan's traffic
        return float(t[0]) / self.program.replicas

    def _micro_batches(self, inputs: dict):
        """Run the program once per micro-batch (the coordinate "mb" picks its slice of the
        batch, codegen/grid_layout.py); yields each micro-batch's loss share. Every program call
        takes the whole batch and cuts its own rows, so each loss divides by the step's count of
        targets and the shares add up to the step's loss."""
        for mb in range(self.geo.nm):
            self.coords["mb"] = mb
            yield self.program.forward(inputs)
        self.coords["mb"] = 0

    def step(self, *batch) -> float:
        if not self._ready:
            self._setup(batch)
        total = torch.zeros(())
        for loss in self._micro_batches(self._inputs(batch)):
            loss.backward()      # gradients accumulate over the micro-batches in each block's .grad
            total = total + loss.detach()
        if self.zero:
            self._zero_step()
        else:
            if self.geo.dp > 1:
                # the replicas' losses are shares of one global loss: their gradients add up
                from runtime.collectives import _raw_all_reduce
                for t in self.opt.param_groups[0]["params"]:
                    t.grad = _raw_all_reduce(t.grad, self.grid.dp_group, "dp")
            self.opt.step()
            self.opt.zero_grad()
        self.step_count += 1
        return self._global(total)

    # ------------------------------------------------------------------ ZeRO-1 over dp
    def _flat(self, tensors) -> torch.Tensor:
        """The trainable blocks (in _trainable() order) as one flat vector padded to dp shards."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.cat([flat, flat.new_zeros(self._flat_len - flat.numel())])

    def _my_shard(self, tensors) -> torch.Tensor:
        return self._flat(tensors)[self._lo:self._lo + self._shard_len]

    def _unflat(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out, off = {}, 0
        for name, t in self._trainable().items():
            out[name] = flat[off:off + t.numel()].view(t.shape)
            off += t.numel()
        return out

    def _zero_step(self) -> None:
        """Gradients reduce-scattered over dp (this replica keeps its shard of their sum), the
        optimizer steps the shard, the updated shards all-gathered back into every block."""
        from runtime.collectives import _raw_all_gather, _raw_reduce_scatter

        blocks = self._trainable()
        grads = self._flat([t.grad if t.grad is not None else torch.zeros_like(t) for t in blocks.values()])
        self.shard.grad = _raw_reduce_scatter(grads, 0, self.grid.dp_group, "dp")
        self.opt.step()
        self.opt.zero_grad()
        full = _raw_all_gather(self.shard.detach(), 0, self.grid.dp_group, "dp")
        with torch.no_grad():
            for name, v in self._unflat(full).items():
                blocks[name].copy_(v)
                blocks[name].grad = None

    def _gather_dp(self, shard: torch.Tensor) -> torch.Tensor:
        """The whole flat vector from every replica's shard (uncounted: checkpoint traffic, not the plan's)."""
        parts = [torch.empty_like(shard) for _ in range(self.geo.dp)]
        dist.all_gather(parts, shard.contiguous(), group=self.grid.dp_group)
        return torch.cat(parts)

    @torch.no_grad()
    def __call__(self, *inputs):
        return torch.tensor(self._global(sum(self._micro_batches(self._inputs(inputs)))))

    # ------------------------------------------------------------------ state and checkpoints
    def _assemble(self, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Parameter name -> the whole tensor (model.state_dict() shape) from every rank's block
        ``local[name]`` (collective over the world; replicas over dp hold equal blocks)."""
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {n: t.detach().cpu() for n, t in local.items()})
        out = {}
        for name, use in self.program.uses.items():
            if name not in local:
                continue
            shape = tuple(self.traced.value_of(self.model, self.traced.param_fqn[name]).shape)
            stored = to_stored(use, torch.zeros(shape))
            full = torch.zeros_like(stored)
            for r, blocks in enumerate(gathered):
                _place(full, _spec(self.geo, use, self.geo.coords_of(r), stored.shape), blocks[name])
            out[name] = from_stored(use, full, shape)
        return out

    def _block_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of parameter ``name`` cut from its whole tensor ``full``."""
        use = self.program.uses[name]
        stored = to_stored(use, full.float())
        return take(stored, _spec(self.geo, use, self.coords, stored.shape))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole (blocks of all ranks placed back; tied names share it), keys of
        model.state_dict() (as other plans' full_state_dict)."""
        self._need_ready()
        out = {}
        for name, value in self._assemble(self.local_params).items():
            fqn = self.traced.param_fqn[name]
            for f in self.traced.tied.get(fqn, [fqn]):
                out[f] = value
        keys = list(self.model.state_dict().keys())
        return {k: out[k] for k in keys if k in out}

    def _state_names(self) -> tuple[str, ...]:
        """The optimizer's per-parameter state tensors, named as runtime/optim.py (and torch) name
        them, so a checkpoint moves between grid and other plans."""
        kw = self.optimizer_kwargs
        if self.optimizer_name == "sgd":
            return ("momentum_buffer",) if kw.get("momentum", 0) else ()
        return ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if kw.get("amsgrad") else ())

    def _trainable(self) -> dict[str, torch.Tensor]:
        return {n: t for n, t in self.local_params.items() if n not in self.traced.buffers}

    def _full_optimizer_state(self) -> dict[str, torch.Tensor]:
        """"{fqn}.{state name}" -> the whole tensor (zeros before the first step, as runtime/optim.py
        keeps them); collective over the world."""
        out = {}
        for sn in self._state_names():
            if self.zero:
                shard = self.opt.state.get(self.shard, {}).get(sn, torch.zeros_like(self.shard))
                local = self._unflat(self._gather_dp(shard.detach()))
            else:
                local = {n: self.opt.state.get(t, {}).get(sn, torch.zeros_like(t)) for n, t in self._trainable().items()}
            for name, full in self._assemble(local).items():
                out[f"{self.traced.param_fqn[name]}.{sn}"] = full
        return out

    def save(self, directory) -> None:
        """Whole (unsharded) tensors via torch.distributed.checkpoint, in the format of
        autopar/execution/compiled_state.py: loads onto any plan, grid or not."""
        import torch.distributed.checkpoint as dcp

        self._need_ready()
        state = {"model": self.full_state_dict(), "optim": self._full_optimizer_state(),
                 "step": torch.tensor(self.step_count)}
        dcp.save(state, checkpoint_id=str(directory))

    @torch.no_grad()
    def load(self, directory) -> None:
        """Values saved by save() of any plan, checked against this model's first
        (compiled_state.check_checkpoint); this rank's blocks are cut from the whole tensors."""
        from autopar.execution.compiled_state import read_checkpoint

        self._need_ready()
        state = {"model": {k: v.clone() for k, v in self.full_state_dict().items()},
                 "optim": self._full_optimizer_state(), "step": torch.tensor(0)}
        read_checkpoint(self.rank, directory, state)
        for name, t in self.local_params.items():
            fqn = self.traced.param_fqn[name]
            # a non-persistent buffer is not in the state dict: it keeps the model's value
            if fqn in state["model"]:
                t.copy_(self._block_of(name, state["model"][fqn]))
        step = int(state["step"])
        blocks = self._trainable()

        def saved(name, sn):
            return self._block_of(name, state["optim"][f"{self.traced.param_fqn[name]}.{sn}"])

        if self.zero:
            self.shard.copy_(self._my_shard(list(blocks.values())))
            owners = {self.shard: {sn: (lambda sn=sn: self._my_shard([saved(n, sn) for n in blocks]))
                                   for sn in self._state_names()}}
        else:
            owners = {t: {sn: (lambda name=name, sn=sn: saved(name, sn)) for sn in self._state_names()}
                      for name, t in blocks.items()}
        for p, states in owners.items():
            st = self.opt.state[p]
            st.clear()
            if step == 0:       # no step taken: the optimizer starts fresh (SGD's first step copies the gradient)
                continue
            for sn, value in states.items():
                st[sn] = value().clone()
            if self.optimizer_name in ("adam", "adamw"):
                st["step"] = torch.tensor(float(step))
        self.step_count = step

    def comm_stats(self) -> dict[str, int]:
        from runtime.collectives import COMM_STATS
        return dict(COMM_STATS.snapshot())

    def reset_comm_stats(self) -> None:
        from runtime.collectives import COMM_STATS
        COMM_STATS.reset()
