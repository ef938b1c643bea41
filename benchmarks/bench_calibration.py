"""Predicted against measured step time of real gloo training runs on this CPU, after
``autopar calibrate`` of the ``cpu`` preset.

For each process count n in (1, 2, 4): calibrate with n forked gloo processes (the rates depend on
how many processes share the cores), then for each case plan with the calibrated cluster
(precision fp32, one micro-batch), run it on n forked ranks (warm-up, then the fastest of at
least ``--steps`` steps spread over at least ``--seconds``, each step at its slowest rank's time) and compare with
the plan's ``step_time``. Every multi-process case asserts that collectives moved bytes (the plan really splits).

    .venv/bin/python -m benchmarks.bench_calibration [--steps 15] [--repeats 5] [--seconds 2]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch

import autopar
from autopar.execution.calibrate import calibrate
from autopar.models import ZOO
from runtime.launch import run_local

torch.set_num_threads(1)

MODELS = {   # zoo factory, keyword arguments (gpt2: kernels dominate; the default mlp: host overheads do)
    "mlp": ("mlp", {}),
    "gpt2": ("gpt2", dict(n_layer=2, d_model=128, n_head=4, seq=64, batch=8)),
}
# name -> (model, processes, constraints, policy)
CASES = {
    "mlp-1": ("mlp", 1, {"dp": 1, "tp": 1}, None),
    "gpt2-1": ("gpt2", 1, {"dp": 1, "tp": 1}, None),
    "mlp-dp2": ("mlp", 2, {"dp": 2, "tp": 1, "zero": 0}, None),
    "gpt2-dp2-zero1": ("gpt2", 2, {"dp": 2, "tp": 1, "zero": 1}, None),
    "gpt2-tp2": ("gpt2", 2, {"dp": 1, "tp": 2}, "megatron"),
    "mlp-dp2-zero3": ("mlp", 2, {"dp": 2, "tp": 1, "zero": 3}, None),
    "mlp-dp4": ("mlp", 4, {"dp": 4, "tp": 1, "zero": 0}, None),
    "gpt2-dp2-tp2": ("gpt2", 4, {"dp": 2, "tp": 2}, None),
    "gpt2-tp4": ("gpt2", 4, {"dp": 1, "tp": 4, "tp_mode": "1d"}, "megatron"),
    "mlp-dp4-zero3": ("mlp", 4, {"dp": 4, "tp": 1, "zero": 3}, None),
}


def _run(rank, world, name, plan_json, steps, seconds):
    zoo, kw = MODELS[name]
    model, batch = ZOO[zoo](**kw)
    plan = autopar.Plan.from_json(plan_json)
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch, plan=plan)
    t0 = time.perf_counter()
    for _ in range(3):
        cm.step(*batch)
    # at least ``steps`` steps spread over at least ``seconds``: on a machine other jobs share, a
    # few milliseconds of steps can fall entirely inside someone else's burst
    n = torch.tensor([max(steps, math.ceil(seconds / max((time.perf_counter() - t0) / 3, 1e-6)))])
    if world > 1:
        torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MAX)   # every rank runs as many
    cm.reset_comm_stats()
    ts = []
    for _ in range(int(n)):
        if world > 1:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        cm.step(*batch)
        ts.append(time.perf_counter() - t0)
    return ts, sum(cm.comm_stats().values())   # every timed step (the caller takes the fastest)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seconds", type=float, default=2.0, help="least wall time of each case's timed steps")
    ap.add_argument("--profiles", default="benchmarks/profiles")
    args = ap.parse_args()
    os.makedirs(args.profiles, exist_ok=True)
    print(f"load before: {open('/proc/loadavg').read().split()[:3]}", flush=True)
    rows = []
    for n in (1, 2, 4):
        t0 = time.perf_counter()
        path = os.path.join(args.profiles, f"cpu-{n}proc.yaml")
        cal = calibrate(nprocs=n, sweep="cpu", repeats=args.repeats, output=path)
        print(f"calibrated {n} process(es) in {time.perf_counter() - t0:.0f} s -> {path}", flush=True)
        cluster = autopar.Cluster.preset("cpu", devices=n).with_calibration(cal)
        for key, (name, procs, cons, policy) in CASES.items():
            if procs != n:
                continue
            zoo, kw = MODELS[name]
            model, batch = ZOO[zoo](**kw)
            plan = autopar.plan(model, batch, cluster, precision="fp32", policy=policy,
                                constraints={"num_micro_batches": 1, **cons})
            res = run_local(_run, n, args=(name, plan.to_json(), args.steps, args.seconds), timeout=600)
            # the fastest step, each step at its slowest rank's time: every rank starts a step at
            # the barrier and the step lasts until its slowest rank is done (the slowest rank's
            # own fastest step is faster than any step was: ranks' fastest are different steps)
            measured = min(max(per_rank) for per_rank in zip(*(r[0] for r in res)))
            moved = sum(r[1] for r in res)
            if n > 1:
                assert moved > 0, f"{key}: no bytes moved — the plan does not split"
            err = plan.step_time / measured - 1
            d = plan.degrees
            rows.append((key, n, f"dp={d['dp']} tp={d['tp']} zero={d['zero']}", plan.step_time, measured, moved, err))
            print(f"| {key} | {n} | dp={d['dp']} tp={d['tp']} zero={d['zero']} | {plan.step_time * 1e3:.1f} ms | "
                  f"{measured * 1e3:.1f} ms | {moved / n / 1e6:.2f} MB | {err:+.1%} |", flush=True)
    errs = [abs(r[-1]) for r in rows]
    print(f"median |error| {statistics.median(errs):.1%}, max {max(errs):.1%}, "
          f"within ±25%: {sum(e <= 0.25 for e in errs)}/{len(errs)}")
    print(f"load after: {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    main()
