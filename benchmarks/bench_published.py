"""Predicted throughput of published large-scale training configurations, priced with
``constraints=`` (and Megatron's per-op policy), against the published figures.

Source: D. Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", SC'21 (arXiv:2104.04473), Table 1 — the rows without pipeline parallelism.
GPT models, sequence 2048, vocabulary 51,200, global batch 512, A100-80GB DGX nodes,
mixed precision, full activation recomputation. Throughput is counted as in the paper:
F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) FLOPs per step (recomputation included), divided by
the step time and the number of GPUs.

    .venv/bin/python -m benchmarks.bench_published
"""
from __future__ import annotations

import time

import autopar
from autopar.models import ZOO

ROWS = [
    # params, heads, hidden, layers, tp, gpus, batch, published TFLOP/s per GPU
    ("1.7B", 24, 2304, 24, 1, 32, 512, 137.0),
    ("3.6B", 32, 3072, 30, 2, 64, 512, 138.0),
    ("7.5B", 32, 4096, 36, 4, 128, 512, 142.0),
]
SEQ, VOCAB = 2048, 51200


def paper_flops(B, s, l, h, V) -> float:
    return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def main():
    print(f"{'model':6} {'GPUs':>5} {'tp':>3} {'dp':>4} {'mbs':>4} {'pred step':>10} {'pred TF/s/GPU':>14} "
          f"{'published':>10} {'ratio':>6}   automatic plan on the same cluster")
    for name, heads, h, l, tp, gpus, B, published in ROWS:
        model, batch = ZOO["gpt2"](device="meta", n_layer=l, d_model=h, n_head=heads, seq=SEQ, batch=B, vocab=VOCAB)
        cluster = autopar.Cluster.preset("dgx-a100", nodes=gpus // 8)
        from autopar.trace import trace
        graph = trace(model, batch)
        t0 = time.perf_counter()
        pinned = autopar.plan(model, batch, cluster, traced=graph, policy="megatron",
                              constraints={"tp": tp, "dp": gpus // tp, "tp_mode": "1d", "zero": 0,
                                           "checkpoint": "full"})
        tf = paper_flops(B, SEQ, l, h, VOCAB) / pinned.step_time / gpus / 1e12
        auto = autopar.plan(model, batch, cluster, traced=graph)
        tfa = paper_flops(B, SEQ, l, h, VOCAB) / auto.step_time / gpus / 1e12
        d, da = pinned.degrees, auto.degrees
        print(f"{name:6} {gpus:5d} {tp:3d} {d['dp']:4d} {d['micro_batch_size']:4d} {pinned.step_time:9.3f}s "
              f"{tf:14.1f} {published:10.1f} {tf / published:6.2f}   step {auto.step_time:.3f}s "
              f"(x{pinned.step_time / auto.step_time:.2f} faster than pinned): dp={da['dp']} tp={da['tp']} "
              f"z={da['zero']} mbs={da['micro_batch_size']} ck={da['checkpoint']}  ({time.perf_counter() - t0:.0f}s)",
              flush=True)


if __name__ == "__main__":
    main()
