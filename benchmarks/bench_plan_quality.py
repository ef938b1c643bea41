"""Plan quality: the automatic plan's predicted step time divided by the best Megatron-style
configuration found by a grid over dp × tp × ZeRO × micro-batch size × checkpointing, every
grid point priced by the same cost model with Megatron's per-op policy (each linear column- or
row-parallel on one tensor-parallel axis). A ratio above 1.00 would mean the search missed a
configuration a person could have written by hand.

    .venv/bin/python -m benchmarks.bench_plan_quality [--quick]
"""
from __future__ import annotations

import argparse
import itertools
import time

import autopar
from autopar.errors import PlanError
from autopar.models import ZOO
from autopar.frontend.batching import global_batch
from autopar.frontend.trace import trace

MODELS = {
    "gpt2": dict(n_layer=4),
    "llama": {},
    "bert": {},
    "vit": {},
    "mlp": {},
    "gpt2_small": dict(batch=32),
    "gpt2_medium": dict(batch=64),
}
CLUSTERS = {
    "dgx-a100 x1": ("dgx-a100", dict(nodes=1)),
    "dgx-a100 x2": ("dgx-a100", dict(nodes=2)),
    "dgx-h100 x1": ("dgx-h100", dict(nodes=1)),
    "cpu x4": ("cpu", dict(devices=4)),
}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def megatron_grid(model, batch, graph, cluster):
    """Every Megatron-style configuration: (best step time, its constraints, points tried)."""
    n = cluster.num_devices
    B = global_batch(graph)
    best, best_cfg, tried = None, None, 0
    for tp in [t for t in divisors(n) if t <= cluster.devices_per_node]:
        dp = n // tp
        if B % dp:
            continue
        for zero, ckpt in itertools.product((0, 1, 2, 3) if dp > 1 else (0,), ("none", "full")):
            for mbs in divisors(B // dp):
                if mbs & (mbs - 1) and mbs != B // dp:
                    continue   # powers of two and the whole per-rank batch, as people pick them
                cons = {"dp": dp, "tp": tp, "tp_mode": "1d", "zero": zero, "checkpoint": ckpt,
                        "micro_batch_size": mbs}
                tried += 1
                try:
                    p = autopar.plan(model, batch, cluster, constraints=cons, traced=graph, policy="megatron")
                except PlanError:
                    continue
                if best is None or p.step_time < best:
                    best, best_cfg = p.step_time, cons
    return best, best_cfg, tried


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny models on two clusters only")
    args = ap.parse_args(argv)
    models = {k: v for k, v in MODELS.items() if not args.quick or k in ("gpt2", "mlp")}
    clusters = {k: v for k, v in CLUSTERS.items() if not args.quick or k in ("dgx-a100 x1", "cpu x4")}
    print(f"{'model':12} {'cluster':12} {'auto step':>11} {'grid best':>11} {'ratio':>6} {'grid pts':>8}  "
          f"auto plan | best grid point")
    worst = 0.0
    for name, kw in models.items():
        model, batch = ZOO[name](device="meta", **kw)
        graph = trace(model, batch)
        for cname, (preset, ckw) in clusters.items():
            cluster = autopar.Cluster.preset(preset, **ckw)
            t0 = time.perf_counter()
            auto = autopar.plan(model, batch, cluster, traced=graph)
            grid, cfg, tried = megatron_grid(model, batch, graph, cluster)
            if grid is None:
                print(f"{name:12} {cname:12} {auto.step_time:10.4g}s {'none fits':>11}")
                continue
            ratio = auto.step_time / grid
            worst = max(worst, ratio)
            d = auto.degrees
            print(f"{name:12} {cname:12} {auto.step_time:10.4g}s {grid:10.4g}s {ratio:6.3f} {tried:8d}  "
                  f"dp={d['dp']} tp={d['tp']}{d['tp_shape']} z={d['zero']} mbs={d['micro_batch_size']} "
                  f"ck={d['checkpoint']} | dp={cfg['dp']} tp={cfg['tp']} z={cfg['zero']} "
                  f"mbs={cfg['micro_batch_size']} ck={cfg['checkpoint']}  ({time.perf_counter() - t0:.0f}s)",
                  flush=True)
    print(f"worst ratio auto / best Megatron-style grid point: {worst:.3f} (target <= 1.00)")


if __name__ == "__main__":
    main()
