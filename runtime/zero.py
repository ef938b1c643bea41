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

Gradient clipping, LAMB/LARS's whole-tensor norms and chunks replicated outside the data group
(``shared_groups``) are the step's: runtime/zero_step.py. The class's parts: runtime/zero_grads.py
(gradient reduction), runtime/zero_step.py (the step), runtime/zero_stage3.py (stage 3's
gathering), runtime/zero_state.py (state bytes, full buffers); a chunk's layout
runtime/zero_chunk.py, its collectives runtime/zero_comm.py.

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

from runtime.ddp import GradAllReducer
from runtime.offload import HOST, HostOffload, check_offload
from runtime.optim import FlatOptimizer
from runtime.optim_groups import chunk_hparams
from runtime.zero_chunk import Chunk
from runtime.zero_comm import ChunkComm
from runtime.zero_grads import GradientReduction
from runtime.zero_stage3 import Zero3Gathering
from runtime.zero_state import StateAccess
from runtime.zero_step import OptimizerStep


class ShardedOptimizer(GradientReduction, OptimizerStep, Zero3Gathering, StateAccess):
    """ZeRO stages 0-3 over flat chunks with any FlatOptimizer (module doc)."""

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
        ``norm_weights``: id(param) -> weight of its squared norm in clipping (runtime/zero_step.py).
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
        over (runtime/zero_step.py; stages 2-3). ``tensor_norm_groups`` / ``tensor_norm_skip``: where
        LAMB and LARS sum their per-tensor norms, and the ids of the parameters whose block another
        rank of those groups counts (runtime/zero_step.py). ``tensor_hparams``: id(param) -> (weight_decay,
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

    @property
    def bytes_sent(self) -> int:
        return sum(n for _, n in self.comm_log) + (self.reducer.bytes_sent if self.reducer else 0)

    def reset_comm_stats(self) -> None:
        self.comm_log.clear()
        self.offload.reset_bytes()
        if self.reducer is not None:
            self.reducer.bytes_sent = 0

    def zero_grad(self) -> None:
        for c in self.chunks:
            for p in c.params:
                p.grad = None
            if c.grad_shard is not None:
                c.grad_shard.zero_()
            if c.host_acc is not None:
                c.host_acc.zero_()
            c.ready.clear()

    def close(self) -> None:
        """Release what outlives the process otherwise: the optimizer state's files (NVMe offload)."""
        self.offload.close()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.reducer is not None:
            self.reducer.remove()


__all__ = ["ShardedOptimizer"]
