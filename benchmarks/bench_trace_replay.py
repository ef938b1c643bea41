"""The trace simulation (autopar/inference/trace.py ``simulate``) against the server's own batcher.

    PYTHONPATH=. python benchmarks/bench_trace_replay.py [--requests 40 --rate 20]

A synthetic Poisson trace is replayed in real time against ``autopar.inference.batcher.Batcher``
(the server's static batching, one replica) whose generate call sleeps a fixed prefill and decode
time per step; each request's TTFT (queueing + the batch's prefill) and end-to-end latency are
measured and compared with ``simulate``'s prediction for the same trace, prices and batch_wait.
This checks the batching/queueing model only: the step prices are given, not the engine's.
"""
from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np
import torch

from autopar.inference.batcher import Batcher
from autopar.inference.trace import simulate, synthetic_trace

PREFILL, DECODE = 0.020, 0.004   # seconds: a batch's prefill and one decode step


async def _replay(trace, batch_size: int, batch_wait: float):
    def generate(ids, new, mask, sampling):
        time.sleep(PREFILL + (new - 1) * DECODE)
        return torch.zeros(ids.shape[0], ids.shape[1] + new, dtype=torch.long)

    b = Batcher(generate, batch_size, batch_wait)
    b.start()
    t0 = time.perf_counter()
    ttft, latency = np.zeros(len(trace)), np.zeros(len(trace))

    async def one(i):
        await asyncio.sleep(max(0.0, t0 + trace.arrivals[i] - time.perf_counter()))
        sent = time.perf_counter()
        done = await b.submit([1] * int(trace.prompt_lens[i]), int(trace.output_lens[i]))
        # first token: the batch's start + its prefill (the batcher answers at the batch's end)
        ttft[i] = done.queued_s + PREFILL
        latency[i] = done.queued_s + PREFILL + (int(trace.output_lens[i]) - 1) * DECODE
        return time.perf_counter() - sent
    await asyncio.gather(*(one(i) for i in range(len(trace))))
    await b.stop()
    return ttft, latency


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--batch-wait", type=float, default=0.01)
    args = ap.parse_args()
    tr = synthetic_trace(args.requests, args.rate, prompt_lens=[16, 32, 64], output_lens=[4, 8, 16], seed=0)
    ttft, latency = asyncio.run(_replay(tr, args.batch, args.batch_wait))
    sim = simulate(tr, lambda b, s: PREFILL, lambda b, c: DECODE, 1, args.batch, args.batch_wait)
    print(f"{args.requests} requests at {args.rate}/s, batch {args.batch}, batch_wait {args.batch_wait * 1e3:.0f} ms, "
          f"prefill {PREFILL * 1e3:.0f} ms, decode step {DECODE * 1e3:.0f} ms")
    print("| quantity | measured (batcher) | simulated | measured / simulated |")
    print("|---|---|---|---|")
    for name, meas in (("ttft", ttft), ("latency", latency)):
        for q in (50, 90, 99):
            m, s = float(np.percentile(meas, q)), float(np.percentile(sim["arrays"][name], q))
            print(f"| {name} p{q} | {m * 1e3:.1f} ms | {s * 1e3:.1f} ms | {m / s:.2f}x |")


if __name__ == "__main__":
    main()
