"""The offloaded optimizer's CPU step: torch's fused CPU AdamW (runtime/optim.py ``host_step``,
what offload runs) against the flat optimizer's single-tensor ops (``step``) on one fp32 shard.

    .venv/bin/python -m benchmarks.bench_cpu_step [--numel 50000000] [--repeats 4]

Prints seconds per step (fastest of ``--repeats`` after a warm-up) and GB/s of state touched at
28 bytes per element (param, grad, exp_avg, exp_avg_sq read once; param, exp_avg, exp_avg_sq
written once: what the fused kernel moves, and what autopar/pricing/offload.py prices the step
with), on this machine's torch threads.
"""
from __future__ import annotations

import argparse
import time

import torch

from runtime.optim import make_optimizer

TOUCHED = 28


def seconds(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=50_000_000)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args(argv)
    n = args.numel
    param, grad = torch.full((n,), 0.5), torch.full((n,), 1e-3)
    print(f"AdamW on {n:,} fp32 elements, {torch.get_num_threads()} torch threads")
    for label, fused in (("single-tensor ops (step)", False), ("torch fused CPU (host_step)", True)):
        opt = make_optimizer("adamw", 1e-3)
        opt.cpu_fused = fused
        state = opt.init_state(n)
        t = seconds(lambda: opt.host_step(param, grad, state, 1), args.repeats)
        print(f"  {label:30s} {t:.3f} s/step  {n * TOUCHED / t / 1e9:6.1f} GB/s of state touched")


if __name__ == "__main__":
    main()
