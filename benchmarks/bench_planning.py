"""Planning time: trace + strategies + solve, against the targets of the planner issue.

    .venv/bin/python -m benchmarks.bench_planning [--skip-175b]

Prints, per case, the wall time split into trace and search, the target and the ratio
time / target (<= 1.00 meets the target).
"""
from __future__ import annotations

import argparse
import time

import autopar
from autopar.models import ZOO
from autopar.trace import trace

CASES = [
    # name, factory, kwargs, cluster preset, nodes, constraints, target seconds
    ("GPT-2 12L h384 s32 on a 2x2 mesh", "gpt2", dict(n_layer=12, d_model=384, n_head=6, seq=32, batch=8,
                                                       vocab=50304), "dgx-a100", dict(devices=4),
     {"dp": 2, "tp": 2}, 3.0),
    ("GPT-2 12L h384 s32, 4 devices, free search", "gpt2", dict(n_layer=12, d_model=384, n_head=6, seq=32, batch=8,
                                                                 vocab=50304), "dgx-a100", dict(devices=4), None, 3.0),
    ("GPT-2 XL on 2 DGX-A100 nodes", "gpt2_xl", {}, "dgx-a100", dict(nodes=2), None, 60.0),
    ("GPT-3 175B (96L h12288 s2048 B1536) on 128 DGX-A100 nodes", "gpt3", {}, "dgx-a100", dict(nodes=128), None, 60.0),
]


def run(case) -> dict:
    name, factory, kwargs, preset, ckw, constraints, target = case
    t0 = time.perf_counter()
    model, batch = ZOO[factory](device="meta", **kwargs)
    t1 = time.perf_counter()
    graph = trace(model, batch)
    t2 = time.perf_counter()
    plan = autopar.plan(model, batch, autopar.Cluster.preset(preset, **ckw), constraints=constraints, traced=graph)
    t3 = time.perf_counter()
    total = t3 - t1
    return dict(name=name, build=t1 - t0, trace=t2 - t1, search=t3 - t2, total=total, target=target,
                ratio=total / target, plan=plan)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--skip-175b", action="store_true")
    args = ap.parse_args(argv)
    # warm torch.export's imports so the first case is not charged ~2 s of module loading
    m, b = ZOO["mlp"]()
    trace(m, b)
    print(f"{'case':58} {'trace':>7} {'search':>7} {'total':>7} {'target':>7} {'ratio':>6}  plan")
    for case in CASES:
        if args.skip_175b and "175B" in case[0]:
            continue
        r = run(case)
        d = r["plan"].degrees
        print(f"{r['name']:58} {r['trace']:6.2f}s {r['search']:6.2f}s {r['total']:6.2f}s {r['target']:6.0f}s "
              f"{r['ratio']:6.2f}  dp={d['dp']} tp={d['tp']} zero={d['zero']} mbs={d['micro_batch_size']} "
              f"ckpt={d['checkpoint']} step={r['plan'].step_time:.4g}s MFU={r['plan'].mfu:.1%}", flush=True)


if __name__ == "__main__":
    main()
