"""Inference planning on request traces (autopar/inference/trace.py): a model's configuration
chosen on one DGX node for a trace at its recorded rate and faster, each configuration serving the
whole trace in simulation.

    PYTHONPATH=. python benchmarks/bench_inference_trace.py --trace PATH.csv [--trace ...]
        [--models Llama-3-8B Llama-3-70B] [--scales 1 2 4] [--slo ttft=2s,tpot=200ms]
        [--batching static|continuous]

Traces: CSV files of ``arrived_at,num_prefill_tokens,num_decode_tokens`` (e.g. the converted
Splitwise traces in Vidur's repository, data/processed_traces/). ``--batching``: how each
configuration serves the trace in simulation (``plan_inference(batching=)``). Models: the config.json values of
benchmarks/hf_configs.py, built on meta. Everything is a prediction (no GPU here).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import autopar
from autopar.errors import PlanError
from autopar.inference.planner import plan_inference
from autopar.inference.trace import load_trace
from autopar.models.hf_config import from_hf_config
from benchmarks.hf_configs import write_config


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", action="append", required=True)
    ap.add_argument("--models", nargs="*", default=["Llama-3-8B", "Llama-3-70B"])
    ap.add_argument("--scales", nargs="*", type=float, default=[1.0, 2.0, 4.0])
    ap.add_argument("--cluster", default="dgx-a100")
    ap.add_argument("--slo", default="ttft=2s,tpot=200ms")
    ap.add_argument("--batching", choices=("static", "continuous"), default="static")
    args = ap.parse_args(argv)
    slo = dict(kv.split("=") for kv in args.slo.split(","))
    cluster = autopar.Cluster.preset(args.cluster, nodes=1)
    d = tempfile.mkdtemp()
    print(open("/proc/loadavg").read().strip(), f"batching={args.batching}")
    print("| trace | rate /s | model | chosen | TTFT p50 / p90 / p99 | TPOT p99 | tokens/s | planned in |\n"
          "|---|---|---|---|---|---|---|---|")
    for path in args.trace:
        trace = load_trace(path)
        for name in args.models:
            model = from_hf_config(write_config(name, d), seq=16, batch=1).model
            for f in args.scales:
                t = trace.scaled(f)
                t0 = time.perf_counter()
                meets = "meets"
                try:
                    p = plan_inference(model, None, cluster, trace=t, slo=slo, batching=args.batching)
                except PlanError:   # no configuration meets the targets: the least P90 latency instead
                    p, meets = plan_inference(model, None, cluster, trace=t, batching=args.batching), "misses"
                sv, pr = p.predictions["served"], p.predictions
                print(f"| {Path(path).stem} | {t.stats()['rate']:.2f} | {name} | tp={p.tp} pp={p.pp} dp={p.dp} batch "
                      f"{p.batch_size} ({meets} the slo) | "
                      + " / ".join(f"{sv['ttft'][q] * 1e3:.0f}" for q in ("p50", "p90", "p99"))
                      + f" ms | {sv['tpot']['p99'] * 1e3:.1f} ms | {pr['tokens_per_s']:.0f} | "
                      f"{time.perf_counter() - t0:.1f} s |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
