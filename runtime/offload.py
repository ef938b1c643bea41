"""Optimizer offload for the ZeRO optimizer (runtime/zero.py): the host side of ZeRO-Offload.

``HostOffload(mode, fraction, stage, device, dtype)`` decides which chunks are offloaded, owns
their host buffers and runs their part of the step. ``mode``:

* ``"optimizer"`` (ZeRO-Offload's design): each offloaded chunk's fp32 master (always, fp32
  parameters too: the host copy the CPU updates; the whole buffer at stage 0, the shard at 1-3)
  and its optimizer state live in host memory (pinned when the device is CUDA), and the optimizer
  steps on the CPU; the device keeps the working buffer and the gradients as without offload.
* ``"optimizer+params"`` (stage 3 only): also ``shard_param`` on the host: every gather copies it
  to the device first (h2d, counted: 2 per step with ``zero3_hooks``) and the step writes it in
  place (no h2d at the step).
* ``"optimizer-nvme"`` (ZeRO-Infinity's split): as ``"optimizer"``, but the optimizer state lives
  in files (runtime/nvme.py, in ``directory``: the user's ``offload_dir``, else a temporary
  directory per rank, removed by ``close``), read into a host buffer while the previous chunk
  steps and written back while the next one does (``nvme_bytes``: read = write = the state's
  bytes per step); the fp32 master stays in host memory. ``"optimizer+params-nvme"``: both.

At ``step()``, after the averaging and the clipping norm (on the device: its collectives need
device tensors; the coefficient scales the host's fp32 upcast, the same product as the device's),
each chunk's gradient piece (stage 0 the padded flat gradient, else the shard) is copied into a
host staging buffer of the working dtype (``host_grad``), upcast, stepped into the master, and the
result cast to the working dtype copied back (stage 0 ``flat``, 1-2 the shard of it, then the
all-gather, 3 ``shard_param``). On CUDA the copies run on a side stream: chunk i+1's gradient
travels while the CPU steps chunk i. Stages 2-3 stream each reduced gradient shard to the host as
backward makes it (``drain``: summed into the fp32 ``host_acc``; the device keeps no shard).
LAMB/LARS norms of host tensors are all-reduced on the device (the zero optimizer's reducer).

``fraction`` (Gemini's rule: as much on the device as fits) offloads only the shortest prefix of
the chunks (in order) holding >= fraction of the rank's elements (``indices``, ``numel``); every
other chunk runs exactly as without offload. Bytes per step (``bytes``): d2h = h2d = the gradient
pieces, in the working dtype; ``host_bytes`` the host's (masters + state, staging).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from runtime.nvme import NvmeStore
from runtime.optim import FlatOptimizer
from runtime.zero_chunk import Chunk, nbytes, total_bytes

OFFLOADS = ("none", "optimizer", "optimizer+params", "optimizer-nvme", "optimizer+params-nvme")
HOST = torch.device("cpu")


def check_offload(mode: str, fraction: float, stage: int, directory: Optional[str] = None) -> None:
    """A ValueError for an unknown mode, a fraction outside (0, 1], a mode the stage cannot run or
    a state directory for a mode that writes no files."""
    if mode not in OFFLOADS:
        raise ValueError(f"offload must be one of {', '.join(map(repr, OFFLOADS))}, got {mode!r}")
    if mode.startswith("optimizer+params") and stage != 3:
        raise ValueError(f"{mode} offloads ZeRO-3's parameter shards; use zero_stage=3")
    if not 0 < fraction <= 1:
        raise ValueError(f"offload_fraction must be in (0, 1], got {fraction}")
    if mode == "none" and fraction != 1:
        raise ValueError("offload_fraction is for an offload mode, not offload='none'")
    if directory is not None and not mode.endswith("-nvme"):
        raise ValueError(f"offload_dir is for offload='optimizer-nvme' or 'optimizer+params-nvme', "
                         f"got offload={mode!r}")


class HostOffload:
    """Which chunks live on the host, their buffers, copies and CPU step (module doc)."""

    def __init__(self, mode: str, fraction: float, stage: int, device: torch.device, dtype: torch.dtype,
                 directory: Optional[str] = None, tag: str = "autopar-optimizer"):
        """``directory`` and ``tag`` ("optimizer-nvme"): where the state files go, and their
        directory's name prefix (e.g. the rank's)."""
        check_offload(mode, fraction, stage, directory)
        self.mode, self.fraction, self.stage, self.device, self.dtype = mode, float(fraction), stage, device, dtype
        self.active = mode != "none"                 # masters + state on the host, CPU step
        self.params = mode.startswith("optimizer+params")   # ... and ZeRO-3's parameter shards
        self.nvme = NvmeStore(directory, tag) if mode.endswith("-nvme") else None   # ... the state in files
        self.pin = device.type == "cuda"             # pinned host buffers: truly asynchronous copies
        self.bytes = {"d2h": 0, "h2d": 0}
        self.indices: list[int] = []                 # the offloaded chunks' positions
        self.numel = 0
        self._copy_stream = None                     # CUDA: the side stream of the copies

    # ------------------------------------------------------------------ layout
    def select(self, chunks: list[Chunk]) -> None:
        """Mark the shortest prefix of ``chunks`` holding >= fraction of the elements offloaded
        (the same on every rank of the data group: the same chunks); stages 2-3 stream them."""
        total, covered = sum(c.numel for c in chunks), 0
        for c in chunks:
            if self.active and covered / total < self.fraction:
                c.offloaded = True
                covered += c.numel
            c.stream_grads = c.offloaded and self.stage >= 2
        self.indices = [i for i, c in enumerate(chunks) if c.offloaded]
        self.numel = covered

    def holds_params(self, c: Chunk) -> bool:
        """optimizer+params: the chunk's ZeRO-3 parameter shard lives on the host."""
        return self.params and c.offloaded

    def hostify(self, t: Tensor) -> Tensor:
        """A host buffer pinned when the device is CUDA (asynchronous copies); else as it is."""
        return t.pin_memory() if self.pin and t.device.type == "cpu" else t

    def allocate(self, c: Chunk, init: Tensor, optimizer: FlatOptimizer, index: int) -> None:
        """An offloaded chunk's host buffers: optimizer state and fp32 master of its local piece
        ``init`` (initial values), the gradient's staging buffer (working dtype), the fp32 sum of
        the streamed shards (stages 2-3) and (optimizer+params) the parameter shard; ``index``:
        the chunk's position (its state files' names)."""
        n = init.numel()
        state = optimizer.init_state(n, device=HOST)
        # nvme: the state in files, its initial values written there
        c.state = self.nvme.state(index, state) if self.nvme is not None else \
            {k: self.hostify(v) for k, v in state.items()}
        c.master = self.hostify(init.to(HOST, torch.float32, copy=True))
        c.host_grad = self.hostify(torch.zeros(n, dtype=self.dtype))
        if c.stream_grads:
            c.host_acc = self.hostify(torch.zeros(c.shard, dtype=torch.float32))
        if self.holds_params(c):
            c.shard_param = self.hostify(c.flat[c.lo:c.hi].to(HOST, copy=True))

    def host_bytes(self, chunks: list[Chunk]) -> dict[str, int]:
        """Bytes held in host memory by the offloaded ``chunks``: masters and optimizer state,
        the gradient staging buffers and fp32 sums, and (optimizer+params) parameter shards."""
        off = [c for c in chunks if c.offloaded]
        state = [] if self.nvme is not None else [t for c in off for t in c.state.values()]   # nvme: in files
        return dict(optimizer=total_bytes(state + [c.master for c in off]),
                    staging=total_bytes([c.host_grad for c in off] + [c.host_acc for c in off])
                    + (self.nvme.buffer_bytes() if self.nvme is not None else 0),
                    params=total_bytes([c.shard_param for c in off if self.holds_params(c)]))

    def nvme_bytes(self) -> dict[str, int]:
        """"optimizer-nvme": bytes of state read from and written to the files since the last
        reset, the files' size on disk and the host buffer the state streams through (all 0
        otherwise)."""
        if self.nvme is None:
            return dict(read=0, write=0, disk=0, buffer=0)
        return dict(self.nvme.bytes, disk=self.nvme.disk_bytes(), buffer=self.nvme.buffer_bytes())

    def reset_bytes(self) -> None:
        self.bytes.update(d2h=0, h2d=0)
        if self.nvme is not None:
            self.nvme.bytes.update(read=0, write=0)

    def close(self) -> None:
        """Remove the state files ("optimizer-nvme"); nothing otherwise."""
        if self.nvme is not None:
            self.nvme.close()

    # ------------------------------------------------------------------ backward (stages 2-3)
    def drain(self, pending: list, keep: int = 0) -> list:
        """Each pending reduce-scatter ``(chunk, work, out)`` of a streamed chunk but the last
        ``keep`` pending ones waited for, its shard copied to the host staging buffer and summed
        into the fp32 ``host_acc``: the device holds at most the shards still in flight. Returns
        what stays pending (the chunks kept on the device, and the last ``keep``)."""
        cut = len(pending) - keep
        done = [e for e in pending[:cut] if e[0].stream_grads]
        for c, work, out in done:
            work.wait()
            c.host_grad.copy_(out)   # blocking: the sum below reads it
            self.bytes["d2h"] += nbytes(out)
            c.host_acc.add_(c.host_grad)
        return [e for e in pending[:cut] if not e[0].stream_grads] + pending[cut:]

    # ------------------------------------------------------------------ the step
    def step(self, chunks: list[Chunk], grads: list, coef: Optional[Tensor], per_param: bool,
             device_update: Callable, host_step: Callable, gather: Optional[Callable]) -> None:
        """Chunk by chunk in order (the collectives: the same order as without offload). An
        offloaded chunk: gradient piece d2h into its staging buffer (CUDA: the next offloaded
        chunk's travels on the side stream while the CPU steps this one), upcast and stepped on
        the CPU by ``host_step(c, param, grad, state)``, the working-dtype result h2d, then
        ``gather(c)`` (stages 1-2: its all-gather, started as soon as the shard is back); the
        others: ``device_update(c, grads[i])``."""
        cuda = self.device.type == "cuda" and bool(self.indices)
        main = torch.cuda.current_stream(self.device) if cuda else None
        if cuda and self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=self.device)
        side = self._copy_stream if cuda else None

        def fetch(i: int):
            """Start offloaded chunk i's gradient piece to the host; the event to wait on (CUDA)."""
            c = chunks[i]
            if c.stream_grads:   # already on the host (``drain``)
                return None
            g = c.flat_grad(free=False) if per_param else grads[i]   # stage 0: padded flat
            self.bytes["d2h"] += nbytes(g)
            if not cuda:
                c.host_grad.copy_(g)
                return None
            side.wait_stream(main)   # the gradient is complete
            with torch.cuda.stream(side):
                c.host_grad.copy_(g, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            g.record_stream(side)    # a temporary of the main stream, read on the side stream
            return done

        queue = list(self.indices)
        ready = fetch(queue.pop(0)) if queue else None
        # nvme: the next offloaded chunk's state is read while this one steps (runtime/nvme.py)
        states: dict = {}
        if self.nvme is not None and self.indices:
            states[self.indices[0]] = self.nvme.prefetch(chunks[self.indices[0]].state)
        for i, c in enumerate(chunks):
            if not c.offloaded:
                device_update(c, grads[i])
                continue
            if self.nvme is not None and queue:
                states[queue[0]] = self.nvme.prefetch(chunks[queue[0]].state)
            following = fetch(queue.pop(0)) if queue else None
            if ready is not None:
                ready.synchronize()
            self._update(c, coef, per_param, host_step, states.pop(i, None))
            self._put_back(c, side)
            if gather is not None:
                if cuda:   # the collective's stream waits for the copy, not the host
                    main.wait_stream(side)
                gather(c)
            ready = following
        if self.nvme is not None:
            self.nvme.drain()         # the files hold the stepped state
        if cuda:
            side.synchronize()        # every copy landed: the host buffers are free again
            main.wait_stream(side)

    def _update(self, c: Chunk, coef: Optional[Tensor], per_param: bool, host_step: Callable,
                prefetched=None) -> None:
        """The CPU optimizer step of one chunk's host master from its staged gradient (the same
        calls as the device step: per parameter at stage 0 with an elementwise optimizer);
        ``prefetched`` (nvme): the read of its state, started earlier."""
        # fp32: the streamed sum, or the staged gradient upcast (fp32: the staging buffer itself)
        g = c.host_acc if c.stream_grads else c.host_grad.float()
        if coef is not None:
            g.mul_(coef)
        state = c.state if self.nvme is None else self.nvme.take(prefetched)   # nvme: files -> buffer
        if per_param:
            for i, p in enumerate(c.params):
                a, b = c.offsets[i], c.offsets[i] + p.numel()
                host_step(c, c.master[a:b], g[a:b], {k: v[a:b] for k, v in state.items()}, i)
        else:
            host_step(c, c.master, g, state, None)
        if self.nvme is not None:
            self.nvme.write_back(c.state, state)   # buffer -> files, while the next chunk steps

    def _put_back(self, c: Chunk, side) -> None:
        """The updated master, in the working dtype, to where the device keeps it (stage 0: the
        flat buffer; 1-2: this rank's shard of it; 3: the shard), or into the host shard
        (optimizer+params)."""
        if self.holds_params(c):
            c.shard_param.copy_(c.master)
            return
        src = c.host_grad.copy_(c.master) if self.dtype != torch.float32 else c.master   # pinned either way
        dst = c.flat if self.stage == 0 else c.shard_param if self.stage == 3 else c.flat[c.lo:c.hi]
        self.bytes["h2d"] += nbytes(src)
        if side is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)

    def to_device(self, c: Chunk) -> Tensor:
        """optimizer+params: the chunk's host parameter shard copied to the device for a gather."""
        self.bytes["h2d"] += nbytes(c.shard_param)
        return c.shard_param.to(self.device, non_blocking=True)


__all__ = ["HostOffload", "OFFLOADS", "check_offload"]
