"""Train the tiny GPT-2 of the zoo on 4 local CPU processes under its automatic plan.

``train(nprocs=4, steps=30)``: plans on ``Cluster.preset("cpu", devices=nprocs)`` (in this
process: the plan is data, every rank receives the same JSON), forks ``nprocs`` gloo ranks
(runtime.launch.run_local) that ``autopar.compile`` the model under that plan and train it on one
fixed batch, with a rich progress bar on rank 0 (loss, step time); then prints the plan's summary
and the first/last loss. Returns the list of losses (rank 0's; every rank reports the same).
"""
from __future__ import annotations

import time


def _rank_main(rank, world, plan_json, steps, lr):
    import torch

    import autopar
    from autopar.models import ZOO

    model, batch = ZOO["gpt2"]()
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), lr=lr)
    losses = []
    if rank == 0:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
        columns = (TextColumn("[bold]train gpt2"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TextColumn("loss {task.fields[loss]:.4f}"), TextColumn("{task.fields[ms]:.0f} ms/step"),
                   TimeElapsedColumn())
        with Progress(*columns) as bar:
            task = bar.add_task("train", total=steps, loss=float("nan"), ms=0.0)
            for _ in range(steps):
                t0 = time.perf_counter()
                losses.append(cm.step(*batch))
                bar.update(task, advance=1, loss=losses[-1], ms=1e3 * (time.perf_counter() - t0))
    else:
        losses = [cm.step(*batch) for _ in range(steps)]
    del torch
    return losses


def train(nprocs: int = 4, steps: int = 30, lr: float = 3e-3) -> list[float]:
    import torch

    import autopar
    from autopar.models import ZOO
    from runtime.launch import run_local

    # Forked ranks must not inherit a busy OpenMP pool from this process (they would deadlock).
    torch.set_num_threads(1)
    model, batch = ZOO["gpt2"]()
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=nprocs))
    losses = run_local(_rank_main, nprocs, args=(plan.to_json(), steps, lr))[0]
    print(plan.summary(), end="")
    print(f"loss: first {losses[0]:.4f} -> last {losses[-1]:.4f} over {steps} steps on {nprocs} processes")
    if not losses[-1] < losses[0]:
        raise RuntimeError(f"the loss did not go down ({losses[0]:.4f} -> {losses[-1]:.4f})")
    return losses


if __name__ == "__main__":  # pragma: no cover
    train()
