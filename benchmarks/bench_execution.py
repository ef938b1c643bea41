"""Execution speed of compiled plans against PyTorch baselines, side by side, in the same processes.

    .venv/bin/python -m benchmarks.bench_execution [--steps N]

1. single process: ``autopar.compile`` step vs a plain eager step (torch.optim.AdamW, same batch);
   ratio compiled / eager step time (target <= 1.05);
2. 2 processes: autopar plan pinned dp=2 vs torch DistributedDataParallel, same global batch;
   throughput ratio autopar / DDP (target >= 0.95);
3. 4 processes: autopar 1D tensor parallel (policy="megatron", tp=4) vs torch's own tensor
   parallel (parallelize_module, ColwiseParallel / RowwiseParallel on pairs of the MLP's linears,
   DeviceMesh "cpu"); ratio autopar / torch-TP step time (lower is better).

Both sides of a row run in the same forked ranks, steps alternating (A, B, A, B, ...) after a
warm-up, each timed step preceded by a barrier. The times shown are medians over rank 0's steps;
the ratio is the median of the per-pair ratios (A_i / B_i of neighbouring steps, which cancels the
machine's slow drifts; the cores are shared), with its interquartile range in brackets.
Every step ends with the loss as a Python float on both sides (autopar.step returns it).
Plans are made in the parent before forking (planning inside forked ranks is slow/hangs); the
parent stays single-threaded (forked ranks deadlock in OpenMP otherwise), so ranks use 1 thread.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

torch.set_num_threads(1)

import autopar  # noqa: E402
from autopar.models import ZOO  # noqa: E402
from runtime.launch import run_local  # noqa: E402

LR = 1e-3
MLP = dict(d_in=512, hidden=1024, n_layer=4, d_out=16, batch=128)          # ~4.7M params
GPT = dict(n_layer=2, d_model=256, n_head=4, seq=64, batch=4, vocab=2048)   # ~2.1M params, 256 tokens


def _alternate(fns: dict, warmup: int, steps: int, barrier=None) -> dict[str, list[float]]:
    """Seconds of every timed step of each callable, run alternately (same index = neighbours)."""
    times = {k: [] for k in fns}
    for i in range(warmup + steps):
        for k, fn in fns.items():
            if barrier:
                barrier()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if i >= warmup:
                times[k].append(dt)
    return times


def _paired(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Median and quartiles of a_i / b_i."""
    q = statistics.quantiles([x / y for x, y in zip(a, b)], n=4)
    return q[1], q[0], q[2]


def _eager_step(model, opt, batch, rows=None):
    def step():
        inputs = batch if rows is None else tuple(x[rows] for x in batch)
        opt.zero_grad(set_to_none=True)
        loss = model(*inputs)
        loss.backward()
        opt.step()
        return loss.item()
    return step


def _plan(name, kw, devices, constraints, policy=None):
    model, batch = ZOO[name](**kw)
    return autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=devices), precision="fp32",
                        constraints={"num_micro_batches": 1, **constraints}, policy=policy).to_json()


# ------------------------------------------------------------------ 1. single process vs eager
def _single(rank, world, name, kw, plan_json, warmup, steps):
    model, batch = ZOO[name](**kw)
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=1), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), lr=LR)
    eager, _ = ZOO[name](**kw)
    opt = torch.optim.AdamW(eager.parameters(), lr=LR)
    return _alternate({"autopar": lambda: cm.step(*batch), "eager": _eager_step(eager, opt, batch)}, warmup, steps)


# ------------------------------------------------------------------ 2. DP vs DDP
def _dp(rank, world, name, kw, plan_json, warmup, steps):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, batch = ZOO[name](**kw)
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), lr=LR)
    base, _ = ZOO[name](**kw)
    ddp = DDP(base)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR)
    n = batch[0].shape[0] // world
    rows = slice(rank * n, (rank + 1) * n)
    res = _alternate({"autopar": lambda: cm.step(*batch), "torch": _eager_step(ddp, opt, batch, rows)},
                     warmup, steps, barrier=dist.barrier)
    return res if rank == 0 else None


# ------------------------------------------------------------------ 3. 1D TP vs torch TP
def _tp(rank, world, name, kw, plan_json, warmup, steps):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model, batch = ZOO[name](**kw)
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), lr=LR)
    base, _ = ZOO[name](**kw)
    mesh = init_device_mesh("cpu", (world,))
    n_layer = kw["n_layer"]
    # Megatron pairs: column-parallel linear, GELU on the split hidden, row-parallel linear (one
    # all-reduce forward, one backward); the small output head stays replicated.
    style = {f"layers.{i}.0": (ColwiseParallel() if i % 2 == 0 else RowwiseParallel())
             for i in range(n_layer - n_layer % 2)}
    parallelize_module(base, mesh, style)
    opt = torch.optim.AdamW(base.parameters(), lr=LR)
    res = _alternate({"autopar": lambda: cm.step(*batch), "torch": _eager_step(base, opt, batch)},
                     warmup, steps, barrier=dist.barrier)
    return res if rank == 0 else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per side (after 3 warm-up steps)")
    args = ap.parse_args(argv)
    warm, steps = 3, args.steps
    t_start = time.perf_counter()
    rows = []   # (benchmark, autopar s, baseline s, ratio name, ratio, target)

    for label, name, kw in (("MLP 4x1024, batch 128", "mlp", MLP), ("GPT-2 2L d256 s64 b4", "gpt2", GPT)):
        plan = _plan(name, kw, 1, {})
        r = run_local(_single, 1, args=(name, kw, plan, warm, steps), timeout=600)[0]
        rows.append((f"1 proc  {label}: compiled vs eager", r["autopar"], r["eager"],
                     "time autopar/eager", _paired(r["autopar"], r["eager"]), "<= 1.05"))

    for label, name, kw in (("MLP 4x1024, batch 128", "mlp", MLP),
                            ("GPT-2 2L d256 s64 b8", "gpt2", dict(GPT, batch=8))):
        plan = _plan(name, kw, 2, {"dp": 2, "tp": 1, "zero": 0})
        r = run_local(_dp, 2, args=(name, kw, plan, warm, steps), timeout=600)[0]
        rows.append((f"2 proc  {label}: dp=2 vs DDP", r["autopar"], r["torch"],
                     "throughput autopar/DDP", _paired(r["torch"], r["autopar"]), ">= 0.95"))

    plan = _plan("mlp", MLP, 4, {"tp": 4, "dp": 1, "tp_mode": "1d"}, policy="megatron")
    r = run_local(_tp, 4, args=("mlp", MLP, plan, warm, steps), timeout=600)[0]
    rows.append(("4 proc  MLP 4x1024, batch 128: tp=4 megatron vs torch TP", r["autopar"], r["torch"],
                 "time autopar/torchTP", _paired(r["autopar"], r["torch"]), "(lower better)"))

    w = max(len(x[0]) for x in rows)
    print(f"\n{'benchmark':<{w}}  {'autopar ms':>10}  {'baseline ms':>11}  {'ratio':<22} {'value [IQR]':>21}  target")
    for bench, a, b, rname, (ratio, lo, hi), target in rows:
        print(f"{bench:<{w}}  {statistics.median(a) * 1e3:>10.1f}  {statistics.median(b) * 1e3:>11.1f}  "
              f"{rname:<22} {ratio:>6.3f} [{lo:.3f}, {hi:.3f}]  {target}")
    print(f"\n{steps} alternating steps per side after {warm} warm-up, 1 thread per rank; "
          f"total {time.perf_counter() - t_start:.0f} s")
    print("command: .venv/bin/python -m benchmarks.bench_execution")


if __name__ == "__main__":
    main()
