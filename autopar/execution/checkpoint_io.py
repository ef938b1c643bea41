"""Sharded checkpoint reading and writing: every rank writes only the pieces of each tensor it
holds, and reads only the pieces it needs, through torch.distributed.checkpoint (DCP).

A checkpoint tensor (``model.<fqn>``: a parameter or persistent buffer of ``model.state_dict()``,
tied aliases included; ``optim.<fqn>.<state>``: an optimizer state) is saved as DCP *chunks* of
the FULL tensor (offsets and sizes in its global shape), so DCP's own resharding serves any other
plan, a one-process ``load`` and ``dcp_to_torch_save`` alike. What a rank holds of a parameter is
its block (``RankProgram.param_slices``: one contiguous slice per dim) laid at ``offset`` in a flat
ZeRO chunk (runtime/zero.py); a buffer covering the chunk range ``[base, base + n)`` (the whole
padded chunk, or this rank's ZeRO shard ``[lo, hi)``) covers a contiguous row-major range of each
parameter block, which ``flat_boxes`` cuts into at most ``2 * ndim - 1`` boxes (partial first row,
whole rows, partial last row, recursively): each box is a view of the buffer (no copy) and a
rectangle of the full tensor. Values: the most precise copy held (the fp32 master under mixed
precision, the stage-3 shard, else the working buffer); optimizer states: their flat buffers.

Replicas (a block held by every data-parallel rank without ZeRO, a bias every tensor-parallel
rank holds) list the same chunk (same fqn and offsets) on each rank: DCP's ``dedup_save_plans``
keeps one writer per chunk (balancing bytes between ranks), and its global-plan check refuses
chunks that overlap or leave a gap. A rank's extra memory during ``save`` is one piece at a time
(a compact copy, released once written: ``PiecesSavePlanner.resolve_data``; with a CUDA device
DCP loads ahead and the copies stay until the file closes, up to what the rank writes); during
``load`` one saved chunk at a time (DCP's reader loads a saved chunk whole, then narrows it into
the views it overlaps). benchmarks/bench_checkpoint_memory.py measures both.

Used for every plan: 1D tensor parallelism, data parallelism, ZeRO 0-3, any mesh, pipelined plans
too (each stage's ranks write their stage's tensors; a tied parameter held on two stages is
deduplicated like any replica; on load a stage lists the other stages' tensors without pieces, so
the key check sees the whole model), and 2D / 2.5D / 3D grid plans. A grid rank's block is a block
of the parameter's *stored* form (codegen/grid_rank_program.py: a linear's weight transposed, its
QKV columns head-grouped, a patch-embedding weight reshaped to [out, C*kh*kw] and transposed):
``block_place`` gives where the block starts in the stored form and a map from a box of the stored
form to boxes of the full tensor (``stored_to_full``: a transposed box is a box with its dims
swapped, viewed ``.t()``; the QKV order cuts it into runs of consecutive columns; a conv weight's
row range into ``flat_boxes`` of [C, kh, kw]), all views of the rank's buffers, so a grid rank too
writes and reads only its blocks (a block several ranks hold: the 2.5D depth replicas, the dp
replicas, a parameter read whole, is deduplicated as above). ``AUTOPAR_CHECKPOINT_FULL=1``
selects the full-tensor path instead (every tensor gathered whole on every rank,
compiled_state.py): kept to measure against; its checkpoints are the same.

``write(state, path)`` / ``read(state, path)``: DCP save / load of a nested dict whose leaves are
tensors, ``Pieces`` or other picklable objects (written as bytes): extra entries a caller adds
(a learning-rate schedule, ...) are saved and read as they are.
"""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from autopar.execution.checkpoint_atomic import fault
from codegen.boxes import flat_boxes
from codegen.rank_program import RankProgram


# ---------------------------------------------------------------- pieces of a full tensor

class Pieces:
    """A tensor of global ``shape`` of which this rank holds ``pieces``: (offsets in the full
    tensor, local tensor of the piece's sizes). DCP reads and writes it through the
    ``__create_write_items__`` / ``__create_chunk_list__`` protocol its planners call for DTensor."""

    def __init__(self, shape, dtype: torch.dtype):
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.pieces: list[tuple[torch.Size, torch.Tensor]] = []

    def add(self, offsets, t: torch.Tensor) -> None:
        self.pieces.append((torch.Size(offsets), t))

    def add_box(self, offsets, t: torch.Tensor, place=None) -> None:
        """A box ``t`` at ``offsets``: in the full tensor, or (``place``: a grid program's
        ``full_pieces`` of the parameter) in its stored form, added as the boxes of the full
        tensor ``place`` maps it to (views of ``t``)."""
        if place is None:
            self.add(offsets, t)
        else:
            for off, v in place(offsets, t):
                self.add(off, v)

    def add_flat(self, block_offsets, block_shape, buf: torch.Tensor, lo: int, hi: int, place=None) -> None:
        """The elements ``[lo, hi)`` of a block (at ``block_offsets`` in the full tensor, or in
        its stored form with ``place``: ``add_box``) held as ``buf`` (a flat tensor of
        ``hi - lo`` elements)."""
        for off, size, start in flat_boxes(block_shape, lo, hi):
            n = math.prod(size)
            self.add_box([o + b for o, b in zip(off, block_offsets)], buf[start - lo:start - lo + n].view(size), place)

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=off, sizes=t.size()),
                                                      properties=TensorProperties(dtype=self.dtype),
                                                      size=self.shape))
                for off, t in self.pieces]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=off, sizes=t.size()) for off, t in self.pieces]

    def find(self, offsets) -> torch.Tensor:
        for off, t in self.pieces:
            if off == torch.Size(offsets):
                return t
        raise KeyError(f"no piece at {tuple(offsets)}")

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.pieces)


class PiecesSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, resolving ``Pieces`` (and the ``during`` fault of tests)."""

    _last: torch.Tensor | None = None

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, Pieces):
            return obj.find(index.offset)
        return super().lookup_object(index)

    def resolve_data(self, write_item: WriteItem):
        """The item's data; a piece as a compact CPU copy. DCP's FileSystemWriter keeps the last
        tensor it wrote of every fqn until the rank's file is closed (a dict it only reads for the
        safetensors format), which held up to the rank's whole shard in copies. Its serial loader
        (no CUDA device: DCP's own condition) writes an item before it resolves the next, so the
        copy handed out before is written by now: its storage is released here."""
        fault("during")
        if self._last is not None:
            self._last.untyped_storage().resize_(0)
            self._last = None
        out = super().resolve_data(write_item)
        if isinstance(out, torch.Tensor) and out.dtype != write_item.tensor_data.properties.dtype:
            out = out.to(write_item.tensor_data.properties.dtype)
        if isinstance(out, torch.Tensor) and isinstance(self.state_dict.get(write_item.index.fqn), Pieces):
            # compact, in one copy (a grid piece is a transposed view): the loader does not copy it again
            out = out.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
            if not torch.cuda.is_available():
                self._last = out
        return out


class PiecesLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner on an already flat state dict (``read`` flattens it; DCP's own
    set-up would replace a ``Pieces`` by None) that resolves ``Pieces``: a read item's
    ``dest_index.index`` is the position of the piece in ``__create_chunk_list__``."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.original_state_dict = state_dict
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, Pieces):
            return obj.pieces[index.index][1]
        return super().lookup_tensor(index)


def _flatten(state: dict, prefix: str = "", out: dict | None = None) -> dict:
    out = {} if out is None else out
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            _flatten(v, key + ".", out)
        else:
            out[key] = v
    return out


def _unflatten_into(state: dict, flat: dict, prefix: str = "") -> None:
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            _unflatten_into(v, flat, key + ".")
        elif not isinstance(v, (torch.Tensor, Pieces)):
            state[k] = flat[key]     # a non-tensor entry (bytes in the checkpoint) is replaced


def write(state: dict, path: str, group=None) -> None:
    """Collective (over ``group``, default the world): DCP save of ``state`` (nested dicts of
    tensors, Pieces, objects) into ``path``."""
    no_dist = not dist.is_initialized() or dist.get_world_size() == 1
    dcp.save(state, checkpoint_id=str(path), planner=PiecesSavePlanner(), process_group=group, no_dist=no_dist)


def read(state: dict, path: str, no_dist: bool = False) -> None:
    """Collective (unless ``no_dist``): fill ``state`` (same nesting as written) from ``path``, in place."""
    flat = _flatten(state)
    dcp.load(flat, checkpoint_id=str(path), planner=PiecesLoadPlanner(),
             no_dist=no_dist or not dist.is_initialized())
    _unflatten_into(state, flat)


# ---------------------------------------------------------------- a compiled model's pieces

def sharded_supported(cm) -> bool:
    """Whether ``cm``'s plan saves and loads pieces (module doc): every plan, unless
    ``AUTOPAR_CHECKPOINT_FULL=1`` selects the full-tensor path (every tensor gathered whole on
    every rank; kept to compare, benchmarks/bench_checkpoint_memory.py; its checkpoints are the same)."""
    return os.environ.get("AUTOPAR_CHECKPOINT_FULL") != "1"


def full_shape(prog, fqn: str) -> tuple[int, ...]:
    """The full tensor's shape from this rank's block and its layout (as RankProgram.assemble)."""
    if not isinstance(prog, RankProgram):   # a grid plan's GridRankProgram knows it
        return tuple(prog.param_shapes[fqn])
    lay = prog.param_layouts[fqn]
    return tuple((s.stop - s.start) * math.prod(prog.mesh_shape[a] for a in lay.dims[d])
                 for d, s in enumerate(prog.param_slices[fqn]))


def block_place(prog, fqn: str):
    """(where this rank's block of ``fqn`` starts, place): in the full tensor with place None
    (per-dim block slices), or in the parameter's stored form (a grid plan: a transposed,
    QKV-reordered or reshaped tensor, codegen/grid_rank_program.py) with ``place`` mapping a box
    of the stored form to boxes of the full tensor (``Pieces.add_box``)."""
    if isinstance(prog, RankProgram):
        return [s.start for s in prog.param_slices[fqn]], None
    return prog.block_offsets(fqn), lambda off, t: prog.full_pieces(fqn, off, t)


def _value_buffers(opt, c, for_load: bool) -> list[torch.Tensor]:
    """Chunk ``c``'s parameter buffers: the one to save (the most precise copy held), or every one
    a load must fill (working copy, stage-3 shard, fp32 master: mixed precision, or the host copy
    of an offloaded optimizer, runtime/zero.py, whatever the working dtype)."""
    if not for_load:
        if c.master is not None:
            return [c.master]
        return [c.shard_param] if opt.stage == 3 else [c.flat]
    out = [c.shard_param] if opt.stage == 3 else [c.flat]
    if opt.stage == 3 and c.gathered:
        out.append(c.flat)
    if c.master is not None:
        out.append(c.master)
    return out


def _base(c, t: torch.Tensor) -> int:
    """Where the local buffer ``t`` starts in the padded chunk: 0, or this rank's shard start."""
    return 0 if t.numel() == c.padded else c.lo


def local_state(cm, for_load: bool = False) -> dict:
    """{"model": {key: Pieces}, "optim": {"<fqn>.<state>": Pieces}}: what this rank holds (module
    doc); with ``for_load``, views of every buffer a load fills, written in place by ``read``."""
    prog, opt = cm.program, cm.opt
    keys = set(cm.model.state_dict().keys())
    model, optim = {}, {}

    def aliases(fqn):
        return [k for k in cm.traced.tied.get(fqn, [fqn]) if k in keys]

    for c in opt.chunks:
        values = _value_buffers(opt, c, for_load)
        for p, off in zip(c.params, c.offsets):
            fqn = cm._fqn_of(p)
            shape, (start, place) = full_shape(prog, fqn), block_place(prog, fqn)
            n = p.numel()

            def pieces_of(bufs, dtype):
                out = Pieces(shape, dtype)
                for t in bufs:
                    base = _base(c, t)
                    lo, hi = max(base, off), min(base + t.numel(), off + n)
                    if lo < hi:
                        out.add_flat(start, p.shape, t[lo - base:hi - base], lo - off, hi - off, place)
                return out

            for k in aliases(fqn):
                model[k] = pieces_of(values, torch.float32)
            for name, t in c.state.items():
                optim[f"{fqn}.{name}"] = pieces_of([t], t.dtype)
    for fqn, b in cm.buffers.items():
        for k in aliases(fqn):
            pc, (start, place) = Pieces(full_shape(prog, fqn), b.dtype), block_place(prog, fqn)
            pc.add_box(start, b, place)
            model[k] = pc
    if for_load and cm.pp > 1:
        # A stage holds only its own tensors: the others are listed without pieces (nothing is
        # read for them), so check_checkpoint compares the whole model's keys on every rank.
        sd = cm.model.state_dict()
        for k in sd:
            model.setdefault(k, Pieces(sd[k].shape, sd[k].dtype))
        names = sorted({name for c in opt.chunks for name in c.state})
        trainable = [f for n, f in cm.traced.param_fqn.items() if n not in cm.traced.buffers]
        for fqn in trainable:
            for name in names:
                optim.setdefault(f"{fqn}.{name}", Pieces(sd[fqn].shape if fqn in sd else full_shape(prog, fqn),
                                                         torch.float32))
    order = [k for k in cm.model.state_dict().keys() if k in model]
    return {"model": {k: model[k] for k in order}, "optim": optim}


def local_bytes(state: dict) -> int:
    """Bytes of the pieces in a ``local_state`` (views: nothing is copied to build them)."""
    return sum(v.nbytes() for group in ("model", "optim") for v in state[group].values())
