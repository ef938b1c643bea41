"""Never worse than a pin (issue 29, item 3): Narayanan et al. SC'21 (arXiv:2104.04473) Table 1,
all ten rows, each Megatron-LM configuration pinned against the free search on the same model,
cluster and cost model (bf16, Adam, DGX-A100 nodes, 80 GB).

Model: GPT with Megatron-LM 2021's explicit attention (benchmarks/bench_published.py
``ExplicitAttention``, dropout 0.1), seq 2048, vocab 51,200, the row's heads / hidden / layers and
global batch. Pinned: ``constraints={"tp": t, "pp": p, "dp": GPUs / (t p)}`` with micro-batch size 1
(pp > 1: ``num_micro_batches`` = batch / dp, each of ``pp_schedule`` 1f1b and interleaved-1f1b,
``checkpoint`` none and full; pp = 1: ``micro_batch_size`` 1, checkpoint none and full); the best
pinned plan that fits is the row's pinned step. Free: ``autopar.plan`` with nothing pinned.
The default policy for both (the search's own; bench_pipeline.py part a prices the pins under
Megatron's policy instead). Planning seconds: the free plan, the trace excluded (given).

    PYTHONPATH=. python benchmarks/bench_never_worse.py [--rows 529.6B 1T] [--free-only]
"""
from __future__ import annotations

import argparse
import time
import types

import autopar
from autopar.frontend.trace import trace
from autopar.models import ZOO
from benchmarks.bench_published import ExplicitAttention

# params, heads, hidden, layers, t, p, GPUs, global batch (Narayanan et al. SC'21, Table 1)
TABLE1 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520),
    ("1T", 160, 25600, 128, 8, 64, 3072, 3072),
]


def model_of(heads, h, layers, batch):
    model, ex = ZOO["gpt2"](device="meta", n_layer=layers, d_model=h, n_head=heads, seq=2048, batch=batch,
                            vocab=51200, dropout=0.1)
    for blk in model.modules():
        if hasattr(blk, "attn") and hasattr(blk, "qkv"):
            blk.attn = types.MethodType(ExplicitAttention.attn, blk)
    return model, ex


def pins(t, p, gpus, batch):
    dp = gpus // (t * p)
    base = {"tp": t, "pp": p, "dp": dp}
    if p == 1:
        return [dict(base, micro_batch_size=1, checkpoint=ck) for ck in ("none", "full")]
    return [dict(base, num_micro_batches=batch // dp, pp_schedule=s, checkpoint=ck)
            for s in ("1f1b", "interleaved-1f1b") for ck in ("none", "full")]


def _deg(d):
    s = f"pp={d['pp']}"
    if d["pp"] > 1:
        s += f" {d['pp_schedule']} m={d['num_micro_batches']}"
    s += f" tp={d['tp']}" + (f" ({d['tp_mode']})" if d.get("tp_mode") not in (None, "1d") else "")
    s += f" dp={d['dp']} zero={d['zero']} ck={d['checkpoint']}"
    if d.get("sp", 1) > 1:
        s += f" sp={d['sp']}"
    if d["pp"] == 1:
        s += f" mbs={d['micro_batch_size']}"
    return s


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="*")
    ap.add_argument("--free-only", action="store_true", help="skip the pinned plans")
    args = ap.parse_args()
    print(open("/proc/loadavg").read().strip())
    print("| row | GPUs | t | p | pinned step | best pin | free step | free / pinned | free degrees | planning |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for name, heads, h, l, t, p, gpus, B in TABLE1:
        if args.rows and name not in args.rows:
            continue
        model, batch = model_of(heads, h, l, B)
        cluster = autopar.Cluster.preset("dgx-a100", nodes=gpus // 8)
        graph = trace(model, batch)
        best = None
        for cons in [] if args.free_only else pins(t, p, gpus, B):
            try:
                pl = autopar.plan(model, batch, cluster, traced=graph, constraints=cons)
            except autopar.PlanError:
                continue
            if best is None or pl.step_time < best[0]:
                best = (pl.step_time, cons)
        t0 = time.perf_counter()
        free = autopar.plan(model, batch, cluster, traced=graph)
        secs = time.perf_counter() - t0
        if best is not None:
            ratio = free.step_time / best[0]
            worst = max(worst, ratio)
            pin = f"{best[1].get('pp_schedule', 'pp=1')} ck={best[1]['checkpoint']}"
            cells = f"{best[0]:.2f} s | {pin} | {free.step_time:.2f} s | {ratio:.3f}"
        else:
            cells = f"— | none fits | {free.step_time:.2f} s | —"
        print(f"| {name} | {gpus} | {t} | {p} | {cells} | {_deg(free.degrees)} | {secs:.1f} s |", flush=True)
    print(f"worst free / pinned: {worst:.3f} (<= 1 required)")
    print(open("/proc/loadavg").read().strip())


if __name__ == "__main__":
    main()
