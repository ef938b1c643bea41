"""Shared by the grid-mode execution tests (tests/execution/test_tp_grid_exec.py,
tests/execution/test_tp_grid_micro.py):
the training settings and the function each forked rank runs (3 steps of SGD with momentum under
a plan, returning losses, rank 0's full state dict, bytes per mesh axis and saved-for-backward bytes)."""
from __future__ import annotations

import autopar
from autopar.models import ZOO

STEPS = 3
OPT = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}
KW = {"gpt2": {}, "vit": {"num_classes": 16}}   # 16 classes: the classifier bias splits into q^3 pieces


def cpu_cluster(n):
    return autopar.Cluster.preset("cpu", devices=n)


def train_rank(rank, world, name, plan_json, kw):
    from autopar.pricing.saved_probe import saved_bytes

    model, batch = ZOO[name](**kw)
    cm = autopar.compile(model, cpu_cluster(world), example_inputs=batch, plan=autopar.Plan.from_json(plan_json),
                         **OPT)
    cm.reset_comm_stats()
    losses = [cm.step(*batch) for _ in range(STEPS)]
    stats = cm.comm_stats()
    saved = saved_bytes(cm.program.gm, *cm.local, *batch, 0, exclude=list(cm.local))
    sd = {k: v.numpy() for k, v in cm.full_state_dict().items()}
    return losses, (sd if rank == 0 else None), stats, saved
