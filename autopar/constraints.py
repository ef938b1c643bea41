"""``constraints=``: the pins that fix part of a configuration and let the search choose the rest.

``autopar.plan(..., constraints=...)``, ``autopar.compile(..., plan_options={"constraints": ...})``
and the CLI's ``--constraint k=v`` take them, as a dict or as a ``Constraints``. ``Constraints`` has
one field per key (the names of ``plan.degrees``); ``None``, every field's default, means "not
pinned: the search chooses". Every key's type and values, and the contradictions between keys,
are checked here when a ``Constraints`` is made (``Constraints.from_dict`` for the dict form), as
a ``ConstraintError`` saying what to change. What needs the model or the cluster (a degree the
devices do not divide, a batch that does not cut into the pinned micro-batches, a block group the
model lacks, a grid the devices cannot form, a pipeline the blocks cannot fill) is checked by the
search that meets it, naming the pin. docs/constraints.md has the table of keys.

The search reads the pins as the dict ``to_dict()`` returns: only the pinned keys.
"""
from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType

from autopar.errors import ConstraintError

TP_MODES = ("1d", "2d-reshard", "2d", "2.5d", "3d")
SP_MODES = ("megatron", "ulysses", "ring", "ring-contiguous", "hybrid")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble")
# Other spellings of the schedules (any case); a Constraints holds the name above, which plans record.
SCHEDULE_ALIASES = {"interleaved_1f1b": "interleaved-1f1b", "interleaved": "interleaved-1f1b",
                    "zero_bubble": "zero-bubble", "zb": "zero-bubble"}
CHECKPOINT_MODES = ("none", "selective", "full")
OFFLOAD_MODES = ("none", "optimizer", "optimizer+params", "optimizer-nvme", "optimizer+params-nvme")


@dataclass(frozen=True, repr=False)
class Constraints:
    """Pins for ``autopar.plan``; each field ``None`` (not pinned) unless given. See the module doc
    and docs/constraints.md. ``Constraints.from_dict({"tp": 2, "zero": 1})`` is the dict form."""

    dp: int | None = None
    """Data-parallel degree: the replicas the global batch's rows are split over (the mesh's ``dp``
    axis; under pipelining, the replicas inside each stage). A positive integer."""

    tp: int | None = None
    """Tensor-parallel degree: the devices each op may be split over, the product of ``tp_shape``
    (sequence axes not counted). A positive integer; 1 rules tensor parallelism out."""

    tp_mode: str | None = None
    """How tensors are split over the model axes: ``"1d"`` (at most one model axis: Megatron's
    column/row linears and the like), ``"2d-reshard"`` (two model axes, values moved between
    layouts by ordinary resharding collectives), ``"2d"`` (SUMMA on a q x q grid), ``"2.5d"``
    (Tesseract, q x q x d) or ``"3d"`` (q x q x q). The last three are the grid modes: a whole-model
    choice, with ``dp`` replicas of the grid, ZeRO 0-2 over them, and no pipeline."""

    tp_shape: tuple[int, ...] | None = None
    """The model-axis grid: one to three sizes > 1, e.g. ``[2, 2]`` (2d with q=2, or 2d-reshard),
    ``[2, 2, 2]`` (2.5d with q=2, d=2, or 3d with q=2); ``tp`` is their product. Three axes need
    ``tp_mode`` "2.5d" or "3d"; "1d" takes one, "2d-reshard" two. Held as a tuple."""

    sp: int | None = None
    """Sequence-parallel degree: the ranks one sequence is split over. A positive integer; 1 rules
    sequence axes out (the search adds them on its own only when nothing fits or sequences are
    long). Under ``sp_mode="megatron"`` the split is the tensor axis, so sp equals tp; under
    "hybrid" sp = u*r."""

    sp_mode: str | None = None
    """How attention runs on a split sequence: ``"megatron"`` (no new axis: norms and dropouts split
    the sequence over the tensor axis around tensor-parallel regions; needs tp > 1),
    ``"ulysses"`` (all-to-all between sequence and heads), ``"ring"`` (ring attention, zig-zag
    load-balanced when causal), ``"ring-contiguous"`` (ring attention on contiguous blocks) or
    ``"hybrid"`` (Ulysses over u ranks x ring over r ranks, two sequence axes). With ``sp`` > 1
    pinned and no mode, the ILP chooses per attention op."""

    sp_shape: tuple[int, int] | None = None
    """``[u, r]`` of ``sp_mode="hybrid"``: the Ulysses and ring sizes, both >= 2, u*r = sp. Not
    pinned, the hybrid puts Ulysses inside a node and the ring across nodes, u dividing the
    attention heads. Held as a tuple."""

    pp: int | None = None
    """Pipeline stages: a positive integer; 1 rules pipelining out. Pinned without
    ``num_micro_batches``, the search chooses the micro-batches (and the schedule, if not
    pinned). The model's repeated blocks are cut into the stages."""

    pp_schedule: str | None = None
    """Pipeline schedule (needs pp > 1): ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"`` (two
    stages per rank) or ``"zero-bubble"`` (PyTorch's InterleavedZeroBubble, two stages per rank).
    Also spelled "interleaved", "interleaved_1f1b", "zero_bubble", "zb"; held as the name above."""

    micro_batch_size: int | None = None
    """Rows of one micro-batch per data-parallel rank: global batch / (dp x num_micro_batches). A
    positive integer that must cut each data-parallel rank's rows evenly."""

    num_micro_batches: int | None = None
    """Micro-batches per step per data-parallel rank (gradients accumulated over them). A positive
    integer that divides each data-parallel rank's rows; at least pp under pipelining."""

    zero: int | None = None
    """ZeRO stage over the data-parallel ranks: 0 (none), 1 (optimizer state sharded), 2 (and
    gradients), 3 (and parameters, gathered around their use). 1-3 need dp > 1."""

    checkpoint: str | Mapping[str, bool | str] | None = None
    """Activation checkpointing: ``"none"``, ``"selective"`` (recompute only each block's
    attention core, Korthikanti et al. 2022), ``"full"`` (recompute every block), or per block group (the names of
    ``TracedGraph.blocks``, e.g. ``{"blocks": "selective"}``) true/false or one of those, the other
    groups left to the search. Not pinned, the search chooses per group (under pipelining: none)."""

    offload: str | None = None
    """What lives off the device: ``"none"`` (``False`` is the older spelling); ``"optimizer"``
    (``True``): the fp32 master weights and optimizer state on host memory, the optimizer step on
    the CPU; ``"optimizer+params"``: ZeRO-3's parameter shards also on the host between uses (needs
    zero=3); ``"optimizer-nvme"`` (ZeRO-Infinity's split): the fp32 masters on the host, the
    optimizer state (Adam's m and v) in files on the node's NVMe, streamed through the CPU step
    (needs the cluster's ``nvme:``); ``"optimizer+params-nvme"``: both (zero=3). Not pinned, the
    search offloads only where it is faster or nothing else fits (to NVMe only where the host
    cannot hold the state). Not with the grid modes (2d / 2.5d / 3d) yet."""

    def __post_init__(self):
        _validate(self)

    # ---------------------------------------------------------------- the dict form

    @classmethod
    def from_dict(cls, pins) -> Constraints:
        """The ``Constraints`` of a dict of pins; a key with the value None is not pinned. Unknown
        keys are a ConstraintError with the closest valid key."""
        if not isinstance(pins, Mapping):
            raise ConstraintError(f"constraints must be a dict of degree pins (or an autopar.Constraints), e.g. "
                                  f"{{'tp': 2, 'zero': 1}}, got {type(pins).__name__} {pins!r}")
        for k in pins:
            if k not in KEYS:
                hint = difflib.get_close_matches(str(k), KEYS, n=1)
                raise ConstraintError(f"unknown constraint {k!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                                      + f"; valid keys: {', '.join(KEYS)}")
        return cls(**pins)

    @classmethod
    def coerce(cls, pins) -> Constraints:
        """``pins`` as a Constraints: None (nothing pinned), a dict (``from_dict``) or a Constraints."""
        if pins is None:
            return cls()
        return pins if isinstance(pins, cls) else cls.from_dict(pins)

    def to_dict(self) -> dict:
        """The pinned keys only, as plain values (lists for the shapes, a dict per checkpoint group)."""
        out = {}
        for k in KEYS:
            v = getattr(self, k)
            if v is not None:
                out[k] = list(v) if isinstance(v, tuple) else dict(v) if isinstance(v, Mapping) else v
        return out

    def __repr__(self) -> str:
        return f"Constraints({', '.join(f'{k}={v!r}' for k, v in self.to_dict().items())})"

    def __hash__(self) -> int:
        return hash(tuple((k, tuple(sorted(v.items())) if isinstance(v, dict) else tuple(v) if isinstance(v, list)
                           else v) for k, v in self.to_dict().items()))

    def __reduce__(self):
        return Constraints.from_dict, (self.to_dict(),)


KEYS = tuple(f.name for f in fields(Constraints))


# ------------------------------------------------------------------ validation (one place)

_WHAT = {"dp": "data-parallel replicas", "tp": "devices each op is split over", "sp": "ranks a sequence is split over",
         "pp": "pipeline stages", "micro_batch_size": "rows per micro-batch per data-parallel rank",
         "num_micro_batches": "micro-batches per data-parallel rank"}


def _set(c: Constraints, key: str, value) -> None:
    object.__setattr__(c, key, value)   # the canonical form of a frozen field


def _validate(c: Constraints) -> None:
    """Each key's type and values (canonical forms stored), then the contradictions between keys."""
    for k, what in _WHAT.items():
        v = getattr(c, k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ConstraintError(f"constraint {k}={v!r}: must be a positive integer ({what})")
    if c.zero is not None and (isinstance(c.zero, bool) or c.zero not in (0, 1, 2, 3)):
        raise ConstraintError(f"constraint zero={c.zero!r}: must be 0, 1, 2 or 3 (the ZeRO stage)")
    _check_tp(c)
    _check_sp(c)
    _check_pp(c)
    _check_checkpoint(c)
    _check_offload(c)
    if c.zero and c.dp == 1:
        raise ConstraintError(f"constraints zero={c.zero} and dp=1 contradict each other: ZeRO shards "
                              f"optimizer state, gradients and parameters over the data-parallel ranks, and dp=1 "
                              f"leaves one. Drop the zero pin, or let dp be larger than 1")


def _int_list(v, size_ok, least: int) -> bool:
    return (isinstance(v, (list, tuple)) and size_ok(len(v))
            and all(isinstance(x, int) and not isinstance(x, bool) and x >= least for x in v))


def _check_tp(c: Constraints) -> None:
    """tp_mode, tp_shape and tp against the shape. (Whether a grid mode can build its grid on the
    pinned shape or tp is autopar/search/grid_geometry.py's ``check_grid_constraints``.)"""
    mode, shape = c.tp_mode, c.tp_shape
    if mode is not None and mode not in TP_MODES:
        hint = " ('2d' now means SUMMA; the former 2-axis resharding mode is '2d-reshard')" if mode == "2D" else ""
        raise ConstraintError(f"constraint tp_mode={mode!r}: must be one of {', '.join(map(repr, TP_MODES))}{hint}")
    if shape is None:
        return
    if not _int_list(shape, lambda n: 1 <= n <= 3, 2):
        raise ConstraintError(f"constraint tp_shape={shape!r}: must be a list of one to three model-axis sizes > 1, "
                              f"e.g. [2, 2] for 2d q=2, [2, 2, 2] for 2.5d q=2 d=2 or 3d q=2")
    _set(c, "tp_shape", tuple(shape))
    if mode in (None, "1d", "2d-reshard") and len(shape) > 2:
        raise ConstraintError(f"constraint tp_shape={list(shape)!r} has three axes: pin tp_mode='2.5d' (q, q, d) or "
                              f"'3d' (q, q, q) with it")
    if mode == "1d" and len(shape) != 1 or mode == "2d-reshard" and len(shape) != 2:
        raise ConstraintError(f"constraints tp_mode={mode!r} and tp_shape={list(shape)!r} contradict each other: "
                              f"'1d' has one model axis, '2d-reshard' two")
    if c.tp is not None and c.tp != math.prod(shape):
        raise ConstraintError(f"constraints tp={c.tp} and tp_shape={list(shape)!r} contradict each other: "
                              f"tp is the product of tp_shape ({math.prod(shape)})")


def _check_sp(c: Constraints) -> None:
    """sp_mode, sp_shape, and sp against them and tp."""
    mode, sp, shape = c.sp_mode, c.sp, c.sp_shape
    if mode is not None and mode not in SP_MODES:
        raise ConstraintError(f"constraint sp_mode={mode!r}: must be one of {', '.join(map(repr, SP_MODES))} "
                              f"(or None: not pinned)")
    if shape is not None:
        if not _int_list(shape, lambda n: n == 2, 2):
            raise ConstraintError(f"constraint sp_shape={shape!r}: must be [u, r], the Ulysses and ring sizes of "
                                  f"sp_mode='hybrid', two integers >= 2 (e.g. [2, 2] for sp=4)")
        shape = tuple(shape)
        _set(c, "sp_shape", shape)
        if mode != "hybrid":
            raise ConstraintError(f"constraint sp_shape={list(shape)!r} is the (Ulysses, ring) split of "
                                  f"sp_mode='hybrid'; got sp_mode={mode!r}")
    if mode == "hybrid":
        if shape is not None and sp is not None and sp != shape[0] * shape[1]:
            raise ConstraintError(f"constraints sp={sp} and sp_shape={list(shape)} contradict each other: "
                                  f"sp_mode='hybrid' splits the sequence over u x r = {shape[0]} x {shape[1]} = "
                                  f"{shape[0] * shape[1]} ranks, so sp must equal u*r")
        if shape is None and sp is None:
            raise ConstraintError("constraint sp_mode='hybrid' needs the size of the sequence axes: pin sp (= u*r) "
                                  "and optionally sp_shape=[u, r]")
        if shape is None and not any(sp % u == 0 and sp // u >= 2 for u in range(2, sp)):
            raise ConstraintError(f"constraint sp={sp} with sp_mode='hybrid': the hybrid runs Ulysses over u and ring "
                                  f"attention over r ranks with u, r >= 2, and {sp} is not such a product u*r; "
                                  f"pin sp_mode 'ulysses' or 'ring' for it")
    if mode in ("ulysses", "ring", "ring-contiguous") and sp == 1:
        raise ConstraintError(f"constraints sp=1 and sp_mode={mode!r} contradict each other: {mode} attention needs "
                              f"a sequence axis of at least 2 ranks")
    if mode == "megatron" and sp not in (None, 1) and c.tp is not None and sp != c.tp:
        raise ConstraintError(f"constraint sp_mode='megatron' splits the sequence over the tensor axis, so sp must "
                              f"equal tp: got sp={sp}, tp={c.tp}")
    if mode == "megatron" and c.tp == 1:
        raise ConstraintError("constraint sp_mode='megatron' needs tensor parallelism (tp > 1): the sequence is "
                              "split over the tensor axis around the tensor-parallel linears")


def _check_pp(c: Constraints) -> None:
    """pp_schedule's spelling, and that it comes with pp > 1. (What the model's blocks, the
    cluster and the other pins allow under pipelining: autopar/search/pipeline_pins.py.)"""
    sched = c.pp_schedule
    if sched is None:
        return
    name = sched.lower() if isinstance(sched, str) else sched
    name = SCHEDULE_ALIASES.get(name, name) if isinstance(name, str) else name
    if name not in PP_SCHEDULES:
        raise ConstraintError(f"constraint pp_schedule={sched!r}: known schedules are {', '.join(PP_SCHEDULES)}")
    _set(c, "pp_schedule", name)
    if (c.pp or 1) == 1:
        raise ConstraintError(f"constraint pp_schedule={name!r} needs pp > 1 "
                              + ("(pin pp as well)" if c.pp is None else "(got pp=1)"))


def _check_checkpoint(c: Constraints) -> None:
    ck = c.checkpoint
    if ck is None or ck in CHECKPOINT_MODES:
        return
    if not (isinstance(ck, Mapping) and ck and all(
            isinstance(k, str) and (isinstance(v, bool) or v in CHECKPOINT_MODES) for k, v in ck.items())):
        raise ConstraintError(f"constraint checkpoint={ck!r}: must be 'none', 'selective', 'full' or a dict block "
                              f"group name -> bool or one of those (e.g. {{'blocks': 'selective'}})")
    _set(c, "checkpoint", MappingProxyType(dict(ck)))


def _check_offload(c: Constraints) -> None:
    v = c.offload
    if v is False or v is True:
        _set(c, "offload", v := "optimizer" if v else "none")
    if v is None:
        return
    if v not in OFFLOAD_MODES:
        raise ConstraintError(f"constraint offload={v!r}: must be one of {', '.join(map(repr, OFFLOAD_MODES))} "
                              f"(or False / True for 'none' / 'optimizer')")
    if v in ("optimizer+params", "optimizer+params-nvme") and c.zero is not None and c.zero != 3:
        raise ConstraintError(f"constraints offload={v!r} and zero={c.zero} contradict each other: "
                              f"{v!r} keeps ZeRO-3's parameter shards on the host; pin zero=3, or "
                              f"offload='optimizer'")
    if v != "none" and c.tp_mode in ("2d", "2.5d", "3d"):
        raise ConstraintError(f"constraint offload={v!r} cannot be met with tp_mode={c.tp_mode!r}: the grid modes "
                              f"do not offload yet; use tp_mode '1d' or '2d-reshard', or offload='none'")


__all__ = ["Constraints", "KEYS", "TP_MODES", "SP_MODES", "PP_SCHEDULES", "SCHEDULE_ALIASES", "CHECKPOINT_MODES",
           "OFFLOAD_MODES"]
