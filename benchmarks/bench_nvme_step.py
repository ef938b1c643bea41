"""The offloaded optimizer step with its state in host memory against the state in files
(``offload="optimizer-nvme"``, runtime/nvme.py) on this machine's disk: one process, ZeRO-2 of one
rank, AdamW in fp32 over ``--chunks`` chunks of ``--numel`` elements in all.

    .venv/bin/python -m benchmarks.bench_nvme_step [--numel 50000000] [--chunks 8] [--dir DIR]

Prints seconds per ``step()`` (fastest of 3 after a warm-up), the state bytes read and written
per step and the rate they moved at (the step's whole time counted, so a lower bound on the
disk's). ``--dir``: where the state files go (default: a temporary directory).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

from runtime.optim import make_optimizer
from runtime.zero import ShardedOptimizer


def one(mode: str, numel: int, chunks: int, directory) -> tuple[float, dict]:
    params = [nn.Parameter(torch.full((numel // chunks,), 0.5)) for _ in range(chunks)]
    opt = ShardedOptimizer([[p] for p in params], None, 2, make_optimizer("adamw", 1e-3), offload=mode,
                           offload_dir=directory if mode == "optimizer-nvme" else None)
    best = float("inf")
    for i in range(4):
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        opt.grads_accumulated(params)   # written without autograd: reported (ZeRO-2 streams them)
        opt.reset_comm_stats()
        t = time.perf_counter()
        opt.step()
        if i:
            best = min(best, time.perf_counter() - t)
    io = opt.nvme_bytes()
    opt.close()
    return best, io


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=50_000_000)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(store, 'pg')}", rank=0, world_size=1)
        print(f"AdamW fp32, {args.numel:,} elements in {args.chunks} chunks, {torch.get_num_threads()} torch threads")
        for mode in ("optimizer", "optimizer-nvme"):
            t, io = one(mode, args.numel, args.chunks, args.dir)
            moved = io["read"] + io["write"]
            rate = f", {moved / t / 1e9:.2f} GB/s of state read + written" if moved else ""
            print(f"  {mode:15s} {t:.3f} s/step{rate} "
                  f"(read {io['read'] / 1e6:.0f} MB, write {io['write'] / 1e6:.0f} MB)")
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
