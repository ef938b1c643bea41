"""The runtime's host work per training step outside the program's ops, measured (``autopar
calibrate`` on a CPU writes it to the profile as ``step_overhead``).

A compiled step does more than run the program: it checks the batch against the example and
the index inputs against their tables, slices this rank's micro-batches, runs the mean losses'
count program and all-reduces the counts, all-reduces the loss, zeroes the gradients and starts
the backward engine. On a GPU the host runs ahead of the device and none of it shows; on a CPU it
all adds to the step (about 0.2-0.5 ms on these machines, a tenth of a tiny model's step).

``measure(profile)``: on every rank of the current process group, plan a minimal model (one
linear layer and a cross-entropy loss, a few rows per rank) with the profile measured so far on
the ``cpu`` preset, data parallel over every rank, compile it, and time each piece of that host
work the way the step calls it (``PIECES``), fastest of ``CALLS`` single calls (as calibrate
times kernels: other users' load only adds time), the slowest rank's; the sum. The count's and
the loss's all-reduces are timed up to their launch: the step overlaps them with the forward and
the backward. A first version took measured minus predicted steps of that model instead; under
a load of 3-4 on these 2 cores it read 1.9 ms at 2 processes and 5 ms at 4, the machine's
load more than the runtime's work.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from autopar.api import plan as make_plan
from autopar.cluster import Cluster
from autopar.execution import compiled
from autopar.plans.plan import Plan
from autopar.profile import Calibration
from runtime import loss as RL

CALLS = 50          # single calls per piece, the fastest kept
ROWS_PER_RANK = 4


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x, y):
        return F.cross_entropy(self.proj(x), y)


def measure(profile: dict) -> float:
    """Seconds of host work per step outside the program's ops (module doc). Collective: every
    rank of the current group calls it; each returns the same value."""

    world = dist.get_world_size() if dist.is_initialized() else 1
    torch.manual_seed(0)
    model = _Tiny()
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(ROWS_PER_RANK * world, 8, generator=g),
             torch.randint(4, (ROWS_PER_RANK * world,), generator=g))
    cluster = Cluster.preset("cpu", devices=world).with_calibration(
        Calibration.from_dict(profile, "autopar calibrate (so far)"))
    plan = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        plan = make_plan(model, batch, cluster, precision="fp32",
                            constraints={"dp": world, "tp": 1, "zero": 0, "num_micro_batches": 1}).to_json()
    if world > 1:   # one plan for every rank
        box = [plan]
        dist.broadcast_object_list(box, src=0)
        plan = box[0]
    cm = compiled.compile(model, cluster, example_inputs=batch, plan=Plan.from_json(plan))
    for _ in range(3):
        cm.step(*batch)
    micro = cm._local_micro_batches(batch)
    loss = torch.zeros(())

    def denominators():
        cm._set_denominators(micro, overlap=True)
        return RL.settle      # waited for untimed: the step overlaps it with the forward

    def loss_sum():
        pending = cm._start_loss(loss)
        return lambda: cm._finish_loss(pending)   # overlapped with the backward

    PIECES = {
        "batch checks": lambda: cm._check_batch(batch),
        "micro-batches": lambda: cm._local_micro_batches(batch),
        "loss count": denominators,
        "loss sum": loss_sum,
        "zero_grad": lambda: cm.opt.zero_grad(),
        "step guard": lambda: cm.guard.run(lambda: None, "training step"),
    }
    total = 0.0
    for fn in PIECES.values():
        best = float("inf")
        for _ in range(CALLS):
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            after = fn()
            best = min(best, time.perf_counter() - t0)
            if callable(after):
                after()
        total += best
    t = torch.tensor([total], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)   # a synchronous step waits for its slowest rank
    return float(t)


__all__ = ["measure"]
