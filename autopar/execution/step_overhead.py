"""The runtime's host work per training step outside the program's ops, measured (``autopar
calibrate`` on a CPU writes it to the profile as ``step_overhead``).

A compiled step does more than run the program: it checks the batch against the example and
the index inputs against their tables, slices this rank's micro-batches, runs the mean losses'
count program and all-reduces the counts, all-reduces the loss, zeroes the gradients and starts
the backward engine. On a GPU the host runs ahead of the device and none of it shows; on a CPU it
all adds to the step (about 0.2-0.5 ms on these machines, a tenth of a tiny model's step).

``measure(profile)``: on every rank of the current process group, plan a minimal model (one
linear layer and a cross-entropy loss, a few rows per rank) with the profile measured so far on
the ``cpu`` preset, data parallel over every rank, run it with the runtime, and return the
slowest rank's fastest step minus the plan's step time (at least 0): what the model does not
price yet.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

STEPS = 40          # timed steps after the warm-up, the fastest kept
ROWS_PER_RANK = 4


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, x, y):
        return F.cross_entropy(self.proj(x), y)


def measure(profile: dict) -> float:
    """Seconds of host work per step the cost model does not price (module doc). Collective:
    every rank of the current group calls it; each returns the same value."""
    import autopar
    from autopar.pricing.profile import Calibration

    world = dist.get_world_size() if dist.is_initialized() else 1
    torch.manual_seed(0)
    model = _Tiny()
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(ROWS_PER_RANK * world, 8, generator=g),
             torch.randint(4, (ROWS_PER_RANK * world,), generator=g))
    cluster = autopar.Cluster.preset("cpu", devices=world).with_calibration(
        Calibration.from_dict(profile, "autopar calibrate (so far)"))
    plan = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        plan = autopar.plan(model, batch, cluster, precision="fp32",
                            constraints={"dp": world, "tp": 1, "zero": 0, "num_micro_batches": 1}).to_json()
    if world > 1:   # one plan for every rank
        box = [plan]
        dist.broadcast_object_list(box, src=0)
        plan = box[0]
    plan = autopar.Plan.from_json(plan)
    cm = autopar.compile(model, cluster, example_inputs=batch, plan=plan)
    for _ in range(5):
        cm.step(*batch)
    best = float("inf")
    for _ in range(STEPS):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        cm.step(*batch)
        best = min(best, time.perf_counter() - t0)
    t = torch.tensor([best], dtype=torch.float64)
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)   # a synchronous step waits for its slowest rank
    return max(0.0, float(t) - plan.step_time)


__all__ = ["measure"]
