"""Per-rank compute orders of torch.distributed.pipelining's schedules, obtained without process groups.

The planner prices a pipeline by simulating the order of forward / backward actions each rank
runs (solver/pipeline_schedule.py). That order must be the one torch runs, so it is taken from
torch's own schedule classes here, never written by hand. This module is the one small adapter
over torch internals; tests/search/test_pipeline_schedule.py pins its behaviour.

How the order is obtained, per kind of torch schedule:

* ``PipelineScheduleMulti`` subclasses (Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble)
  compute ``pipeline_order`` (rank -> actions, ``None`` for an idle slot) in their constructor
  from stage counts alone, then lower it to ``pipeline_order_with_comms`` (adding send/recv
  actions, dropping the ``None`` slots), the list their runtime walks. Lowering never reorders
  compute actions but is slow at scale, so it is skipped and ``pipeline_order`` read (the tests
  check the two agree, and that both equal what the runtime calls on gloo). The constructor is
  given stand-in stages
  carrying ``num_stages``, ``group_size`` and ``group_rank``, as torch's own
  ``_schedule_visualizer.get_schedule_ops`` does.
* ``PipelineScheduleSingle`` subclasses (GPipe, 1F1B) run their own ``_step_microbatches`` loop;
  their ``pipeline_order`` is only descriptive and, in torch 2.13, wrong for 1F1B's last rank (it
  lists micro-batches 1..m instead of 0..m-1). So the loop itself is run, per rank, on a
  recording stand-in stage whose send/recv op lists are empty: what it records is what torch runs.

An action is a plain tuple ``(kind, stage, micro_batch)``; kind is ``"F"`` (forward), ``"B"``
(full backward), ``"I"`` (input-gradient backward) or ``"W"`` (weight-gradient backward).
Known torch 2.13 detail for pricing: under the zero-bubble schedules stage 0 does no work in
its ``I`` action (it has no input gradient to send) and its whole backward in ``W``; and the
``I`` pass keeps the autograd graph (``retain_graph=True``) until ``W``, so a micro-batch's
saved activations live until its ``W``.
"""
from __future__ import annotations

import functools
from unittest import mock

# api.md's pp_schedule values -> torch.distributed.pipelining schedule names (get_schedule_class).
# "zbv" (ZBVZeroBubble, exactly 2 virtual stages per rank in a V shape) is torch's other
# zero-bubble schedule, offered for pricing comparisons; it is not an api.md value.
SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved-1f1b": "Interleaved1F1B",
    "zero-bubble": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
}

_COMPUTE_KINDS = {"F": "F", "B": "B", "I": "I", "W": "W"}


def torch_schedule_class(schedule: str):
    """The torch schedule class behind an api.md ``pp_schedule`` name."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {sorted(SCHEDULES)}")
    return get_schedule_class(SCHEDULES[schedule])


def _check_args(schedule: str, pp: int, num_micro_batches: int, virtual_stages: int) -> None:
    for name, value in (("pp", pp), ("num_micro_batches", num_micro_batches), ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if schedule in ("gpipe", "1f1b") and virtual_stages != 1:
        raise ValueError(f"schedule {schedule!r} runs one stage per rank; got virtual_stages={virtual_stages}")
    if schedule == "zbv" and virtual_stages != 2:
        raise ValueError(f"schedule 'zbv' needs exactly 2 virtual stages per rank; got {virtual_stages}")


class _RecordingStage:
    """Stands in for a PipelineStage in a single-stage schedule's loop: no tensors, no peers."""

    def __init__(self, stage_index: int, num_stages: int, log: list):
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.has_backward = True
        self.output_chunks: list = []
        self._log = log

    # Empty op lists: torch's _batch_p2p / _sorted_batch_p2p return without touching dist.
    def get_fwd_recv_ops(self, *_a, **_k):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, mb, *_a, **_k):
        self._log.append(("F", self.stage_index, mb))

    def backward_one_chunk(self, mb, *_a, full_backward: bool = True, **_k):
        self._log.append(("B" if full_backward else "I", self.stage_index, mb))

    def backward_weight_one_chunk(self, mb, *_a, **_k):
        self._log.append(("W", self.stage_index, mb))

    def perform_reduce_grad(self, *_a, **_k):
        pass

    def clear_runtime_states(self):
        pass


def _single_stage_orders(cls, pp: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    orders = {}
    # One schedule object serves every rank (its constructor builds the descriptive IR for all
    # ranks, O(pp^2 m)); only the stage its loop drives changes.
    sched = cls(_RecordingStage(0, pp, []), m)
    # No loss_fn is given (none is needed to order actions), so mark the schedule as training
    # and skip stage initialisation, which would exchange shapes with peer ranks.
    sched._has_backward = True
    sched._initialize_stage = lambda *a, **k: None
    for rank in range(pp):
        log: list = []
        sched._stage = _RecordingStage(rank, pp, log)
        sched._step_microbatches(None, None, None, None)
        orders[rank] = log
    return orders


def _multi_stage_orders(cls, pp: int, m: int, v: int, lowered: bool = False) -> dict[int, list[tuple[str, int, int]]]:
    """rank -> compute actions of a PipelineScheduleMulti subclass.

    ``lowered=False`` (default) reads ``pipeline_order`` with torch's lowering pass
    (``_prepare_schedule_with_comms``: send/recv, FSDP unshard/reshard insertion) skipped, since it
    costs O(pp^2 m v) (22 s at pp=64, m=512) and never reorders compute actions;
    ``lowered=True`` reads the lowered program the runtime walks. The tests check both agree.
    """
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    from torch.distributed.pipelining.stage import PipelineStage

    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank = 0
    stage.group_size = pp
    stage.submod = None
    stage.num_stages = pp * v
    if lowered:
        sched = cls([stage] * v, m)
        program = sched.pipeline_order_with_comms
    else:
        with mock.patch.object(_PipelineScheduleRuntime, "_prepare_schedule_with_comms",
                               lambda self, actions, format="compute_only": None):
            sched = cls([stage] * v, m)
        program = sched.pipeline_order
    orders = {}
    for rank in range(pp):
        acts = []
        for a in program[rank]:
            if a is None:  # an idle slot in pipeline_order; the runtime waits on its receives
                continue
            kind = a.computation_type.value
            if kind == "OVERLAP_F_B":
                raise ValueError(f"torch schedule {cls.__name__} overlaps forward and backward actions; "
                                 "the simulator runs one action at a time")
            if kind in _COMPUTE_KINDS:  # skip SEND/RECV, REDUCE_GRAD, UNSHARD/RESHARD
                acts.append((kind, int(a.stage_index), int(a.microbatch_index)))
        orders[rank] = acts
    return orders


def pipeline_orders(schedule: str, pp: int, num_micro_batches: int,
                    virtual_stages: int = 1) -> dict[int, list[tuple[str, int, int]]]:
    """rank -> ordered compute actions ``(kind, stage, micro_batch)`` torch runs for this schedule.

    ``pp`` ranks, ``num_micro_batches`` micro-batches, ``virtual_stages`` model chunks per rank
    (``pp * virtual_stages`` stages in all). Errors torch raises for an impossible combination
    (e.g. 1F1B with fewer micro-batches than stages) come back as ``ValueError`` naming it.
    """
    _check_args(schedule, pp, num_micro_batches, virtual_stages)
    return {r: list(acts) for r, acts in _cached_orders(schedule, pp, num_micro_batches, virtual_stages)}


@functools.lru_cache(maxsize=256)
def _cached_orders(schedule: str, pp: int, m: int, v: int) -> tuple[tuple[int, tuple], ...]:
    # A planner asks for the same (schedule, pp, m, v) once per candidate stage split; torch's
    # constructors are O(pp^2 m), so the orders are kept (immutable; callers get fresh lists).
    cls = torch_schedule_class(schedule)
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    try:
        if issubclass(cls, PipelineScheduleSingle):
            orders = _single_stage_orders(cls, pp, m)
        else:
            orders = _multi_stage_orders(cls, pp, m, v)
    except (ValueError, RuntimeError, AssertionError) as e:
        raise ValueError(
            f"torch's {cls.__name__} rejects pp={pp}, num_micro_batches={m}, "
            f"virtual_stages={v}: {e}") from e
    return tuple((r, tuple(orders[r])) for r in sorted(orders))


def stage_ranks(orders: dict[int, list[tuple[str, int, int]]]) -> dict[int, int]:
    """stage -> the rank that runs it, read off the orders (torch's placement, loop or V shape)."""
    out: dict[int, int] = {}
    for rank, acts in orders.items():
        for _kind, stage, _mb in acts:
            if out.setdefault(stage, rank) != rank:
                raise ValueError(f"stage {stage} appears on ranks {out[stage]} and {rank}")
    return out
