"""Plan six published Hugging Face configs (benchmarks/hf_configs.py, written to config.json files,
nothing downloaded) on dgx-h100 presets through ``autopar.models.from_hf_config`` and print, per
model: parameters, nodes, trace / plan / total seconds (total includes building the meta model),
the chosen degrees, the predicted step time and peak memory per device.

    PYTHONPATH=. python benchmarks/bench_hf_configs.py [--only Llama-3-8B,Qwen2-7B] [--profile DIR]

``--profile DIR`` writes one cProfile file per model (``DIR/<model>.prof``).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import re
import tempfile
import time
import warnings

import autopar
from autopar.errors import PlanError
from autopar.models import from_hf_config
from benchmarks.hf_configs import CONFIGS, write_config

# model -> (seq, global batch in sequences, nodes, dtype override)
CASES = {
    "Llama-3-8B": (4096, 512, 2, None),
    "Qwen2-7B": (4096, 512, 2, None),
    "Mistral-7B": (4096, 512, 2, None),
    "Gemma-2-9B": (4096, 512, 2, "bf16"),     # its config.json says float32; trained in bf16
    "Mixtral-8x7B": (4096, 1024, 8, None),
    "Llama-3-70B": (4096, 1024, 8, None),
}


def run_one(name: str, directory: str) -> dict:
    seq, batch, nodes, dtype = CASES[name]
    t0 = time.perf_counter()
    built = from_hf_config(write_config(name, directory), seq=seq, batch=batch, dtype=dtype)
    t_build = time.perf_counter() - t0
    cluster = autopar.Cluster.preset("dgx-h100", nodes=nodes)
    row = {"model": name, "params": sum(p.numel() for p in built.model.parameters()) / 1e9, "nodes": nodes,
           "seq": seq, "batch": batch, "build": t_build}
    try:
        plan = autopar.plan(built.model, built.inputs, cluster, precision=built.precision)
    except PlanError as e:   # e.g. no plan fits: reported as the row's result
        smallest = re.search(r"smallest peak memory any plan reaches is ([0-9.]+ \w+)", str(e))
        what = f"no plan fits; smallest peak {smallest.group(1)}" if smallest else str(e)[:200]
        return {**row, "trace": float("nan"), "plan": float("nan"), "total": time.perf_counter() - t0,
                "error": f"{type(e).__name__}: {what}"}
    total = time.perf_counter() - t0
    d = plan.degrees
    return {**row, "trace": plan.stats["trace_seconds"],
            "plan": total - t_build - plan.stats["trace_seconds"], "total": total,
            "degrees": f"dp={d['dp']} tp={d['tp']} pp={d['pp']} sp={d.get('sp', 1)} zero={d['zero']} "
                       f"mb={d.get('num_micro_batches', 1)}",
            "step": plan.step_time, "peak": plan.peak_memory / 2**30, "mfu": plan.mfu}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None, help="comma-separated model names")
    ap.add_argument("--profile", default=None, help="write DIR/<model>.prof (cProfile)")
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else list(CASES)
    warnings.simplefilter("ignore")   # the replicate-fallback warnings of mask-building ops
    print(f"load before: {open('/proc/loadavg').read().split()[:3]}  ({os.cpu_count()} cores)")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name in names:
            if name not in CONFIGS:
                raise SystemExit(f"unknown model {name}: {', '.join(CASES)}")
            if args.profile:
                os.makedirs(args.profile, exist_ok=True)
                prof = cProfile.Profile()
                row = prof.runcall(run_one, name, d)
                prof.dump_stats(os.path.join(args.profile, f"{name}.prof"))
            else:
                row = run_one(name, d)
            rows.append(row)
            print(_row(row), flush=True)
    print(f"load after: {open('/proc/loadavg').read().split()[:3]}")
    print()
    print("| model | params | nodes | seq × batch | trace s | plan s | total s | chosen degrees | predicted step "
          "| peak memory | MFU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(_row(r))


def _row(r: dict) -> str:
    head = (f"| {r['model']} | {r['params']:.2f} B | {r['nodes']} | {r['seq']} × {r['batch']} | {r['trace']:.1f} "
            f"| {r['plan']:.1f} | {r['total']:.1f} |")
    if "error" in r:
        return f"{head} {r['error']} | | | |"
    return f"{head} {r['degrees']} | {r['step']:.2f} s | {r['peak']:.1f} GiB | {r['mfu'] * 100:.1f}% |"


if __name__ == "__main__":
    main()
