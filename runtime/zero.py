"""ZeRO stages 0-3 over flat chunks, with any FlatOptimizer (runtime/optim.py).

``ShardedOptimizer(param_groups, dp_group, zero_stage, optimizer, grad_clip=None)``: every inner
list of parameters is one *chunk* (e.g. one transformer block). A chunk's parameters become views
into one flat buffer of ``padded`` elements (the chunk's numel rounded up to a multiple of
the data-parallel size W); rank r owns the shard ``[r*S, (r+1)*S)``, ``S = padded / W``.
Parameters must be identical on all ranks at construction (rank 0's are broadcast, to be sure).
Buffers live on the parameters' device (CPU for gloo, the rank's GPU for NCCL).

Precision: the flat buffer (and so the parameters the model computes with, their gradients and
every gradient/parameter collective) has the parameters' dtype, the *working* dtype. fp32: the
optimizer updates that buffer directly. bf16/fp16 (mixed precision): each rank also keeps an fp32
*master* copy of what it updates (the whole buffer at stage 0, its shard at stages 1-3); the
optimizer steps the master with the gradient upcast to fp32 and the result is cast back into the
working buffer (stages 1-2: the all-gather sends the cast shard). Bytes per parameter element,
unsharded: working 2 + gradient 2 + master 4 + optimizer state — the ZeRO paper's 2 + 2 + 12 for
AdamW, which is what the planner's memory model counts (master under "optimizer").

Stage 0  gradients all-reduced by ``GradAllReducer`` (bucketed, overlapped with backward; each
         ``p.grad`` ends up a view of its reduced bucket); the whole optimizer runs on every rank.
         An elementwise optimizer (AdamW, Adam, SGD) steps each parameter's slice of the flat
         buffer with its ``p.grad`` as it is (no flat gradient copy); LAMB/LARS step the flat
         buffer with a flat copy of the gradients (per-tensor trust ratios need Segments).
         Persistent: params padded, grads N (p.grad), optimizer state padded.
Stage 1  at ``step()``: each chunk's flat gradient is reduce-scattered (sum, then / W), each rank
         updates its shard, the params are all-gathered. Persistent: params padded, grads N,
         optimizer state S.
Stage 2  same traffic, but a chunk's gradient is reduce-scattered (async) as soon as backward has
         produced all of it (post-accumulate-grad hooks) and the full ``p.grad`` is freed; only the
         S-element gradient shard is kept. Persistent: params padded, grads S, optimizer S.
Stage 3  like stage 2, and parameters are stored as the S-element shard only. The full flat
         buffer keeps its shape but its storage is resized to 0 when not in use (the parameters
         stay views of it, so modules and autograd see the same tensors throughout).
         ``zero3_hooks(modules)`` (one module per chunk): all-gather before the module's forward,
         free after it; a hook on the module's outputs re-gathers when backward reaches the module
         (the gradient of the output is computed first); the buffer is freed again once every
         parameter of the chunk has its gradient. Simple and correct, no prefetching.
         Persistent: params S, grads S, optimizer S.

A data group of ONE rank runs no collective at all (no reducer, no reduce-scatter, all-gather
or norm all-reduce: each would be an identity) and counts no bytes; the stages keep their
buffers and their arithmetic.

Traffic accounting (``bytes_sent``, ``comm_log``): per rank, the bytes of the tensor handed to
each collective (runtime/zero_comm.py: the padded flat buffer for all_reduce, reduce_scatter and
all_gather), plus the 4-byte norms of clipping and LAMB/LARS.

Gradient clipping (``grad_clip``) computes the norm of the whole model's gradient: local squared
norms, each parameter weighted by ``norm_weights`` (1/r for a parameter replicated on r ranks of
``extra_norm_groups``, e.g. a bias every tensor-parallel rank holds whole), summed over the data
group (shards) and over ``extra_norm_groups``.

LAMB and LARS scale each tensor's update by a ratio of its WHOLE norms (of the weight and of the
update or gradient), whatever the tensor is split on. The local squared norms (per tensor, from
the chunk's Segments: a flat ZeRO shard never mixes two tensors in one norm) are summed over the
data group when the chunk is sharded (stages 1-3: the shards hold disjoint pieces) and over
``tensor_norm_groups`` (the groups a plan's model axes form: tensor-parallel blocks are disjoint
pieces too). A rank holding a replica of a block that another rank of those groups also holds
(a norm weight every tensor-parallel rank holds whole) lists the parameter in
``tensor_norm_skip``: its norms count 0 there, so every block counts exactly once.

A chunk may also be replicated OUTSIDE the data group (``shared_groups``: id(param) -> process
group, e.g. a tied embedding and output head held by the first and the last pipeline stage, each
stage with its own data group): at stages 2-3 its reduced gradient shard is then all-reduced
(summed) over that group before the update, so every copy takes the same step. Its parameters
must form a chunk of their own with the same layout on every member of the group (same
parameters, same data-group size and rank), so the shards line up. Stages 0-1 keep full
``p.grad`` until ``step()``; the caller sums those before it (runtime/pipeline.py
``sum_tied_grads``). Bytes: ``shared_bytes``, not in ``bytes_sent`` (another group).

Parameter groups (``tensor_hparams``: id(param) -> (weight_decay, lr_scale, adapt), from
runtime/optim_groups.py ``resolve_groups`` on the FULL parameters' names and shapes): each chunk gets
a ``TensorHParams`` over its tensor ids (its Segments'), which the optimizer reads per segment; an
elementwise optimizer then also steps chunk by segment (stages 1-3) or parameter by parameter
(stage 0, its usual path), each with its own settings.

Offload (``offload="optimizer"``, ``"optimizer+params"`` or ``"optimizer-nvme"``,
``offload_fraction``, ``offload_dir``): the offloaded
chunks' masters, optimizer state and CPU step are runtime/offload.py's (``self.offload``); the
step goes chunk by chunk in order (the collectives in the same order as without offload); the
clipping norm sums each chunk's squared norm, computed where its gradient lives, on the device;
``offload_bytes`` (reset with ``comm_log``) counts the copies, ``host_bytes()`` the host's bytes.

Collectives must be issued in the same order on every rank: all ranks must run the same graph
(same chunks used, in the same order). A parameter may belong to one chunk only (no tying across
chunks); all parameters share one floating dtype and one device.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from runtime.clip import clip_coefficient, grad_norm
from runtime.ddp import GradAllReducer
from runtime.optim import FlatOptimizer
from runtime.offload import HOST, HostOffload, check_offload
from runtime.optim_groups import chunk_hparams
from runtime.zero_chunk import Chunk, nbytes, total_bytes
from runtime.zero_comm import ChunkComm


class ShardedOptimizer:
    def __init__(self, param_groups: Sequence[Sequence[nn.Parameter]],
                 dp_group: Optional[dist.ProcessGroup], zero_stage: int, optimizer: FlatOptimizer,
                 grad_clip: Optional[float] = None,
                 extra_norm_groups: Sequence[dist.ProcessGroup] = (),
                 bucket_bytes: Optional[int] = None, sync_params: bool = True,
                 first_bucket_bytes: int = 2 ** 20, grad_scale: Optional[dict] = None,
                 norm_weights: Optional[dict] = None, working_dtype: Optional[torch.dtype] = None,
                 forward_order: Optional[Sequence[nn.Parameter]] = None,
                 shared_groups: Optional[dict] = None,
                 tensor_norm_groups: Sequence[dist.ProcessGroup] = (), tensor_norm_skip=(),
                 tensor_hparams: Optional[dict] = None, offload: str = "none",
                 offload_fraction: float = 1.0, offload_dir: Optional[str] = None):
        """``extra_norm_groups``: groups over which the gradients are *additionally* split into
        disjoint pieces (e.g. tensor parallel), for the global clipping norm. ``grad_scale``:
        id(param) -> factor its gradient is multiplied by before the averaging over the data
        group (stage 0: folded into the reducer's averaging pass; otherwise a gradient hook).
        ``norm_weights``: id(param) -> weight of its squared norm in clipping (module doc).
        ``working_dtype`` (e.g. bf16, for fp32 parameters): the parameters become views of a
        buffer of that dtype, and the fp32 masters start from their exact initial values.
        ``bucket_bytes`` (stage 0): None sizes the DP buckets to half the gradient bytes, between
        1 and 25 MiB (DDP's fixed 25 MiB puts a small model's gradient, after the 1 MiB first
        bucket, in one bucket launched when backward ends: nothing overlaps. Measured on GPT-2 2L
        d256, 2 gloo ranks, median paired throughput vs DDP: 0.94 with one 7 MiB bucket, 0.97-0.98
        with two of 4 MiB, 0.94 with four of 2 MiB). Large models get DDP's 25 MiB.
        ``forward_order``: the parameters in the order the forward first uses them (stage 0's
        buckets follow its reverse, the order backward completes their gradients; default: the
        chunks' order). ``shared_groups``: id(param) -> group its chunk's gradient is also summed
        over (module doc; stages 2-3). ``tensor_norm_groups`` / ``tensor_norm_skip``: where LAMB and
        LARS sum their per-tensor norms, and the ids of the parameters whose block another rank of
        those groups counts (module doc). ``tensor_hparams``: id(param) -> (weight_decay,
        lr_scale, adapt), parameter groups (module doc); None: the optimizer's own settings.
        ``offload``: "none", "optimizer" (fp32 masters and optimizer state in host memory, the
        step on the CPU) or "optimizer+params" (also ZeRO-3's parameter shards; module doc).
        ``offload_fraction`` (0 < f <= 1): offload only the first chunks whose elements reach f of
        the total; the others run as without offload (module doc). ``offload_dir``
        ("optimizer-nvme"): the directory the optimizer state's files go in (default: a temporary
        directory per rank); ``close()`` removes them."""
        if zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
        check_offload(offload, offload_fraction, zero_stage, offload_dir)
        self.group, self.stage, self.opt = dp_group, zero_stage, optimizer
        self.grad_clip, self.extra_norm_groups = grad_clip, tuple(extra_norm_groups)
        self.world, self.rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self.step_count = 0
        self.last_grad_norm: Optional[Tensor] = None
        seen, kinds = set(), set()
        for group in param_groups:
            for p in group:
                if id(p) in seen:
                    raise ValueError("ShardedOptimizer: a parameter appears in two chunks")
                if not p.is_floating_point():
                    raise TypeError(f"ShardedOptimizer: parameters must be floating point, got {p.dtype}")
                seen.add(id(p))
                kinds.add((p.dtype, p.device))
        if len(kinds) > 1:
            raise TypeError(f"ShardedOptimizer: all parameters must share one dtype and device, "
                            f"got {sorted(map(str, kinds))}")
        self.dtype, self.device = next(iter(kinds)) if kinds else (torch.float32, torch.device("cpu"))
        if working_dtype is not None:
            self.dtype = working_dtype
        self.mixed = self.dtype != torch.float32
        self.norm_weights = dict(norm_weights or {})
        self.tensor_norm_groups = tuple(tensor_norm_groups)
        tensor_norm_skip = {id(p) if isinstance(p, Tensor) else p for p in tensor_norm_skip}
        self.chunks = [Chunk(list(g), self.world, self.rank, self.dtype) for g in param_groups if len(g)]
        self.offload = HostOffload(offload, offload_fraction, zero_stage, self.device, self.dtype, offload_dir,
                                   tag=f"autopar-optimizer-rank{dist.get_rank()}")
        self.offload.select(self.chunks)
        self.stream_grads = any(c.stream_grads for c in self.chunks)   # some chunk streams
        self._chunk_of = {id(p): c for c in self.chunks for p in c.params}
        self.shared_bytes = 0
        shared_groups = dict(shared_groups or {})
        for c in self.chunks:
            gs = {id(shared_groups.get(id(p))) for p in c.params}
            if len(gs) > 1:
                raise ValueError("ShardedOptimizer: a shared parameter must form a chunk of its own "
                                 "(every parameter of a chunk summed over the same group)")
            c.shared_group = shared_groups.get(id(c.params[0]))
        if zero_stage < 2 and any(c.shared_group is not None for c in self.chunks):
            raise ValueError("ShardedOptimizer: shared_groups is for zero_stage 2 and 3 (stages 0-1 keep full "
                             "gradients: sum them before step())")
        self.comm = ChunkComm(dp_group, self.device)
        self.comm_log = self.comm.log

        with torch.no_grad():
            for index, c in enumerate(self.chunks):
                # The initial values at the parameters' own precision (the masters start from them).
                init = torch.zeros(c.padded, dtype=next(iter(kinds))[0], device=self.device)
                for p, off in zip(c.params, c.offsets):
                    init[off:off + p.numel()].copy_(p.detach().reshape(-1))
                if sync_params and self.world > 1:
                    dist.broadcast(init, src=self.comm.global_rank(0), group=dp_group)
                c.flat.copy_(init)
                # The parameters become views of the flat buffer: an in-place update of the buffer
                # (optimizer, all-gather) is an update of the parameters. Setting .data keeps each
                # parameter's own autograd identity and version counter.
                for p, off in zip(c.params, c.offsets):
                    p.data = c.flat[off:off + p.numel()].view(p.shape)
                sharded = zero_stage >= 1
                local = init[c.lo:c.hi] if sharded else init
                if c.offloaded:   # master, state, staging (and parameter shard) on the host
                    self.offload.allocate(c, local, optimizer, index)
                else:
                    c.state = optimizer.init_state(local.numel(), device=self.device)
                    if self.mixed:
                        c.master = local.to(torch.float32, copy=True)
                del init
                if optimizer.needs_segments:
                    c.segments = c.local_segments(sharded)
                    if any(id(p) in tensor_norm_skip for p in c.params):   # counted by another rank
                        c.norm_mask = torch.tensor([0.0 if id(p) in tensor_norm_skip else 1.0 for p in c.params]
                                                   + [1.0], device=HOST if c.offloaded else self.device)
                if zero_stage >= 2 and not c.stream_grads:
                    c.grad_shard = torch.zeros(c.shard, dtype=self.dtype, device=self.device)
                if zero_stage == 3:
                    if c.shard_param is None:   # (optimizer+params: on the host already)
                        c.shard_param = c.flat[c.lo:c.hi].clone()
                    self._free(c)
                if zero_stage == 0 and not c.offloaded:   # (updated slice, states, working slice)
                    upd = c.master if c.master is not None else c.flat
                    c.views = [(upd[off:off + p.numel()], {k: v[off:off + p.numel()] for k, v in c.state.items()},
                                c.flat[off:off + p.numel()] if self.mixed else None)
                               for p, off in zip(c.params, c.offsets)]
        self._per_param = zero_stage == 0 and not optimizer.needs_segments
        if tensor_hparams is not None:
            self.set_tensor_hparams(tensor_hparams)

        self.reducer: Optional[GradAllReducer] = None
        self._hooks = []
        self._pending: list[tuple[Chunk, object, Tensor]] = []
        grad_scale = {k: v for k, v in (grad_scale or {}).items() if v != 1}
        if zero_stage == 0 and self.world > 1:
            order = [p for c in self.chunks for p in c.params]
            if forward_order is not None:
                if sorted(map(id, forward_order)) != sorted(map(id, order)):
                    raise ValueError("forward_order must list every parameter of the chunks once")
                order = list(forward_order)
            if bucket_bytes is None:
                total = sum(p.numel() * p.element_size() for p in order)
                bucket_bytes = min(25 * 2 ** 20, max(2 ** 20, total // 2))
            self.reducer = GradAllReducer(order, dp_group,
                                          bucket_bytes=bucket_bytes, average=True,
                                          first_bucket_bytes=first_bucket_bytes, grad_scale=grad_scale)
        else:
            for c in self.chunks:
                for p in c.params:
                    f = grad_scale.get(id(p))
                    if f is not None and p.requires_grad:
                        self._hooks.append(p.register_hook(lambda g, f=f: g * f))
        if zero_stage >= 2:
            for c in self.chunks:
                for p in c.params:
                    if p.requires_grad:
                        self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self.reset_comm_stats()  # construction traffic (probe, broadcast) is not a step's

    def set_tensor_hparams(self, tensor_hparams: Optional[dict]) -> None:
        """Parameter groups: id(param) -> (weight_decay, lr_scale, adapt) (module doc); a
        parameter left out takes the optimizer's own settings; None: every one does."""
        own = (getattr(self.opt, "weight_decay", 0.0), 1.0, True)
        for c in self.chunks:
            c.hparams = None if tensor_hparams is None else \
                chunk_hparams([tensor_hparams.get(id(p)) for p in c.params], own)
            if c.segments is None and c.hparams is not None:   # an elementwise optimizer, per segment
                c.segments = c.local_segments(self.stage >= 1)

    @property
    def offload_bytes(self) -> dict[str, int]:
        """Bytes copied device -> host (``d2h``) and host -> device (``h2d``) since the last
        ``reset_comm_stats`` (runtime/offload.py)."""
        return self.offload.bytes

    @property
    def offloaded_chunks(self) -> list[int]:
        return self.offload.indices

    @property
    def offload_numel(self) -> int:
        return self.offload.numel

    @property
    def offload_params(self) -> bool:
        return self.offload.params

    # ---------------------------------------------------------------- collectives
    def _all_gather_async(self, c: Chunk, shard: Tensor):
        return self.comm.all_gather_async(c, shard)

    def _tensor_norm_reducer(self, c: Chunk):
        """LAMB/LARS: the callable summing a chunk's [k, tensors] local squared norms into the
        whole tensors' (module doc), or None when this rank holds every tensor whole."""
        groups = ([self.group] if self.stage >= 1 and self.world > 1 else []) + list(self.tensor_norm_groups)
        if not groups:
            return None

        def reduce(t: Tensor) -> None:
            if c.norm_mask is not None:
                t.mul_(c.norm_mask)
            # Offload: norms of host tensors; the collective runs on the device's (NCCL: CUDA).
            x = t if t.device == self.device else t.to(self.device)
            for g in groups:
                dist.all_reduce(x, group=g)
                self.comm_log.append(("all_reduce", nbytes(x)))
            if x is not t:
                t.copy_(x)
        return reduce

    @property
    def bytes_sent(self) -> int:
        return sum(n for _, n in self.comm_log) + (self.reducer.bytes_sent if self.reducer else 0)

    def reset_comm_stats(self) -> None:
        self.comm_log.clear()
        self.offload.reset_bytes()
        if self.reducer is not None:
            self.reducer.bytes_sent = 0

    # ---------------------------------------------------------------- stage 3 gather / free
    def _gather(self, c: Chunk) -> None:
        if c.gathered:
            return
        c.flat.untyped_storage().resize_(c.padded * c.flat.element_size())
        # optimizer+params: the host shard goes to the device for the all-gather
        shard = self.offload.to_device(c) if self.offload.holds_params(c) else c.shard_param
        self._all_gather_async(c, shard).wait()
        c.gathered = True

    def _free(self, c: Chunk) -> None:
        # The parameters are views of c.flat: they keep their shapes, their storage goes.
        c.flat.untyped_storage().resize_(0)
        c.gathered = False

    def zero3_hooks(self, modules: Sequence[nn.Module]) -> list:
        """Stage 3: gather chunk i around ``modules[i]``'s forward and backward (see module doc)."""
        if self.stage != 3:
            raise ValueError("zero3_hooks is for zero_stage 3")
        if len(modules) != len(self.chunks):
            raise ValueError(f"{len(modules)} modules for {len(self.chunks)} chunks")
        handles = []
        for c, m in zip(self.chunks, modules):
            owned = {id(p) for p in m.parameters()}
            if any(id(p) not in owned for p in c.params):
                raise ValueError(f"module {type(m).__name__} does not own all parameters of its chunk")

            def pre(mod, args, c=c):
                self._gather(c)

            def post(mod, args, out, c=c):
                if torch.is_grad_enabled():
                    for t in _tensors(out):
                        if t.requires_grad:
                            t.register_hook(lambda g, c=c: self._gather(c))
                self._free(c)

            handles.append(m.register_forward_pre_hook(pre))
            handles.append(m.register_forward_hook(post))
        self._hooks.extend(handles)
        return handles

    # ---------------------------------------------------------------- backward (stages 2, 3)
    def _on_grad(self, p: Tensor) -> None:
        c = self._chunk_of[id(p)]
        c.ready.add(id(p))
        if len(c.ready) == len(c.params):
            self._reduce_chunk(c)

    def grads_accumulated(self, params) -> None:
        """Stages 2-3: report gradients written into ``p.grad`` without autograd's accumulation
        (so without its post-accumulate-grad hooks), e.g. torch.distributed.pipelining's
        separate weight-gradient pass (zero-bubble schedules). A parameter already reported
        since its chunk's last reduction, or without a gradient, is skipped."""
        if self.stage < 2:
            return
        for p in params:
            c = self._chunk_of.get(id(p))
            if c is not None and p.grad is not None and id(p) not in c.ready:
                self._on_grad(p)

    def _reduce_chunk(self, c: Chunk) -> None:
        flat = c.flat_grad(free=True)  # the full gradient is gone once it is in flight
        work, out = self.comm.reduce_scatter_async(c, flat)
        self._pending.append((c, work, out))
        c.ready.clear()
        if self.stage == 3:
            self._free(c)
        if self.stream_grads:   # the streamed shards reduced before this one go to the host now
            self._pending = self.offload.drain(self._pending, keep=1)

    @torch.no_grad()
    def _finish_backward(self) -> list[Tensor]:
        """Bring every chunk's averaged gradient (full for stage 0, shard otherwise); return them."""
        if self.stage == 0:
            if self.reducer is not None:
                self.reducer.wait()
            if self._per_param:   # the gradients as they are; a missing one counts as zeros
                return [p.grad if p.grad is not None else torch.zeros_like(p) for c in self.chunks
                        for p in c.params]
            return [c.flat_grad(free=False) for c in self.chunks]
        if self.stage == 1:
            pending = [(c, *self.comm.reduce_scatter_async(c, c.flat_grad(free=False))) for c in self.chunks]
            grads = []
            for c, work, out in pending:
                work.wait()
                grads.append(out.div_(self.world) if self.comm.native_reduce_scatter else out.div(self.world))
            return grads
        # Stages 2, 3: chunks not completed by the hooks (a parameter without gradient) go now.
        # (and, to be safe, any gradient written without the hooks: grads_accumulated)
        for c in self.chunks:
            if c.ready or any(p.grad is not None for p in c.params):
                self._reduce_chunk(c)
        self._pending = self.offload.drain(self._pending)   # the offloaded chunks' shards: summed on the host
        for c, work, out in self._pending:
            work.wait()
            c.grad_shard.add_(out)
        self._pending.clear()
        grads = [c.host_acc if c.stream_grads else c.grad_shard for c in self.chunks]
        for g in grads:
            g.div_(self.world)
        return grads

    # ---------------------------------------------------------------- public
    def _norm_weights(self) -> list:
        """Clipping weights, one entry per gradient ``_finish_backward`` returns."""
        if self._per_param:
            return [self.norm_weights.get(id(p)) for c in self.chunks for p in c.params]
        return [c.norm_ranges(self.norm_weights, sharded=self.stage >= 1) for c in self.chunks]

    @torch.no_grad()
    def step(self) -> None:
        grads = self._finish_backward()
        if self.stage >= 2:
            for c, g in zip(self.chunks, grads):
                if c.shared_group is not None:   # a copy outside the data group (module doc)
                    if g.device != self.device:   # a streamed host shard: the collective on the device
                        d = g.to(self.device)
                        dist.all_reduce(d, group=c.shared_group)
                        g.copy_(d)
                    else:
                        dist.all_reduce(g, group=c.shared_group)
                    self.shared_bytes += nbytes(g)
        # the chunk of each gradient entry (stage 0 elementwise: one entry per parameter)
        owners = [c for c in self.chunks for _ in c.params] if self._per_param else list(self.chunks)
        if self.mixed:   # the device optimizer (and the norm) work in fp32: upcast the working-dtype
            # gradients (an offloaded chunk's are upcast on the host, after the copy)
            grads = [g if c.offloaded else g.float() for g, c in zip(grads, owners)]
        coef = None
        if self.grad_clip is not None:
            # The norm (and its collectives) on the device: per entry where it lives, summed there.
            groups = ([] if self.stage == 0 or self.world == 1 else [self.group]) + list(self.extra_norm_groups)
            self.last_grad_norm = grad_norm(grads, groups, comm_counter=self.comm_log, weights=self._norm_weights(),
                                            comm_device=self.device)
            dev_coef = clip_coefficient(self.last_grad_norm, self.grad_clip)
            for g, c in zip(grads, owners):   # clip_grad_norm's scaling, on the device's fp32 gradients
                if not c.offloaded:
                    g.mul_(dev_coef.to(g.dtype))
            # offloaded: the scaling on the host's fp32 upcast, the same product as the device's
            # (mixed precision scales the upcast too, not the working-dtype gradient)
            if self.offloaded_chunks:
                coef = dev_coef.to(HOST)
        self.step_count += 1
        if self._per_param:   # the entries of each chunk
            it = iter(grads)
            grads = [[next(it) for _ in c.params] for c in self.chunks]
        works = []
        gather = None
        if self.stage in (1, 2) and self.world > 1:   # an offloaded shard is back: its all-gather
            def gather(c):
                works.append(self._all_gather_async(c, c.flat[c.lo:c.hi].clone()))
        self.offload.step(self.chunks, grads, coef, self._per_param,
                          lambda c, g: self._device_update(c, g, works), self._host_step, gather)
        for w in works:
            w.wait()
        for c in self.chunks:   # averaged and consumed: the next backward accumulates anew
            if c.grad_shard is not None:
                c.grad_shard.zero_()
            if c.host_acc is not None:
                c.host_acc.zero_()

    def _device_update(self, c: Chunk, g, works: list) -> None:
        """The device step of a chunk not offloaded (``g``: its gradient, or at stage 0 with an
        elementwise optimizer its parameters' gradients); stages 1-2 start its all-gather."""
        if self._per_param:
            for i, ((param, state, working), pg) in enumerate(zip(c.views, g)):
                hp = None if c.hparams is None else c.hparams.entry(i)
                self.opt.step(param, pg.reshape(-1), state, self.step_count, hparams=hp)
                if working is not None:
                    working.copy_(param)
            return
        if self.mixed:
            param = c.master
        elif self.stage == 0:
            param = c.flat
        elif self.stage == 3:
            param = c.shard_param
        else:
            param = c.flat[c.lo:c.hi]
        self.opt.step(param, g, c.state, self.step_count, segments=c.segments, hparams=c.hparams,
                      reduce_sq_norms=self._tensor_norm_reducer(c) if self.opt.needs_segments else None)
        if self.mixed and self.stage == 0:
            c.flat.copy_(param)
        elif self.mixed and self.stage == 3:
            c.shard_param.copy_(param)
        elif self.mixed and self.world == 1:   # stages 1, 2 over a group of one: no all-gather
            c.flat[c.lo:c.hi].copy_(param)
        if self.stage in (1, 2) and self.world > 1:
            works.append(self._all_gather_async(c, param.to(self.dtype) if self.mixed else param.clone()))

    def _host_step(self, c: Chunk, param: Tensor, grad: Tensor, state: dict, index: Optional[int]) -> None:
        """The optimizer's step of an offloaded chunk on the host (runtime/offload.py): the whole
        local buffer (``index`` None) or, stage 0 elementwise, parameter ``index``'s slice."""
        if index is not None:
            hp = None if c.hparams is None else c.hparams.entry(index)
            self.opt.host_step(param, grad, state, self.step_count, hparams=hp)
            return
        self.opt.host_step(param, grad, state, self.step_count, segments=c.segments, hparams=c.hparams,
                           reduce_sq_norms=self._tensor_norm_reducer(c) if self.opt.needs_segments else None)

    def zero_grad(self) -> None:
        for c in self.chunks:
            for p in c.params:
                p.grad = None
            if c.grad_shard is not None:
                c.grad_shard.zero_()
            if c.host_acc is not None:
                c.host_acc.zero_()
            c.ready.clear()

    def state_bytes(self) -> dict[str, int]:
        """Bytes held on this rank's device by persistent state, measured on the storages actually
        alive (an offloaded chunk's master and optimizer state are host memory: ``host_bytes``)."""
        params = [c.shard_param if self.stage == 3 and not self.offload.holds_params(c) else c.flat
                  for c in self.chunks]
        if self.stage == 3:
            params += [c.flat for c in self.chunks if c.gathered]  # only if left gathered
        grads = [p.grad for c in self.chunks for p in c.params] + [c.grad_shard for c in self.chunks]
        optim = self._optimizer_tensors([c for c in self.chunks if not c.offloaded])
        return dict(params=total_bytes(params), grads=total_bytes(grads), optimizer=total_bytes(optim))

    @staticmethod
    def _optimizer_tensors(chunks) -> list:
        return [t for c in chunks for t in c.state.values()] + [c.master for c in chunks]

    def host_bytes(self) -> dict[str, int]:
        """Bytes this rank holds in host memory under offload, measured like ``state_bytes``
        (runtime/offload.py ``host_bytes``). All 0 without offload."""
        return self.offload.host_bytes(self.chunks)

    @torch.no_grad()
    def full_flat(self, c: Chunk) -> Tensor:
        """The chunk's full padded parameter buffer in fp32, from the most precise copy held: the
        master under mixed precision (all-gathered from the shards at stages 1-3), else the working
        buffer (gathered at stage 3). Collective over the data group when anything is sharded."""
        if not self.mixed:
            was = c.gathered
            self._gather(c)
            out = c.flat.clone()
            if not was:
                self._free(c)
            return out
        return self.gather_local(c, c.master).clone()

    def gather_local(self, c: Chunk, t: Tensor) -> Tensor:
        """A chunk's buffer of this rank (the padded buffer itself, or its shard at stages 1-3:
        all-gathered over the data group) as the full padded buffer on the device; ``t`` when
        already whole there. A host buffer (offload) goes to the device first, one chunk's piece."""
        return self.comm.gather_local(c, t)

    @torch.no_grad()
    def load_flat(self, c: Chunk, full: Tensor) -> None:
        """Set the chunk's parameters from a full padded fp32 buffer (working copy and master)."""
        if self.offload.indices and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)   # no copy from the host buffers still in flight
        if self.stage == 3:
            c.shard_param.copy_(full[c.lo:c.hi])
            if c.gathered:
                c.flat.copy_(full)
        else:
            c.flat.copy_(full)
        if c.master is not None:   # mixed precision or offload (a host copy)
            c.master.copy_(full[c.lo:c.hi] if self.stage >= 1 else full)

    @torch.no_grad()
    def full_parameters(self) -> list[Tensor]:
        """Full parameter values, chunk by chunk in parameter order (collective under stage 3)."""
        out = []
        for c in self.chunks:
            was = c.gathered
            self._gather(c)
            out += [p.detach().clone() for p in c.params]
            if not was:
                self._free(c)
        return out

    def nvme_bytes(self) -> dict[str, int]:
        """offload="optimizer-nvme": state bytes read from / written to its files since the last
        ``reset_comm_stats``, and the files' size (runtime/offload.py); all 0 otherwise."""
        return self.offload.nvme_bytes()

    def close(self) -> None:
        """Release what outlives the process otherwise: the optimizer state's files (NVMe offload)."""
        self.offload.close()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.reducer is not None:
            self.reducer.remove()


def _tensors(out):
    if isinstance(out, Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)


__all__ = ["ShardedOptimizer"]
