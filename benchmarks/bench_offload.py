"""The largest GPT that plans, with and without offload, on one V100 32 GB, one A100 80 GB, one
RTX 4090 24 GB and one 8 x A100 80 GB node (docs/offload.md), next to the published figures of
ZeRO-Offload and Colossal-AI's Gemini.

    .venv/bin/python -m benchmarks.bench_offload [--only v100 a100 4090 a100x8] [--quick] [--no-checks]
                                                 [--modes none optimizer free]

Models: GPT-3-like shapes (autopar.models.gpt2.gpt on the meta device: seq 1024, vocab 51,200,
fused SDPA attention, tied head) scaled by depth and width, ``SHAPES`` from 0.35B to 175B (the
GPT-3 paper's table and shapes between), batch 8 sequences per device, bf16, AdamW; everything
but the offload pin (micro-batching, ZeRO stage, checkpointing, tp/pp/sp on the 8-GPU node) is
the search's choice. Per case and offload mode (``"none"`` pinned; ``"optimizer"`` pinned:
ZeRO-Offload's design; ``"free"``: nothing pinned, the search offloads where it must, including
``"optimizer+params"``), a binary search over the shape list finds the largest shape that plans;
the next shape's failure is reported with its reason: the device (MemoryBudgetError's smallest
peak) or the host (the node's host memory below the bytes any offloaded plan keeps there: 18 B
per parameter for "optimizer" on one device, ZeRO-2 streamed, 14 on several (ZeRO-1); 20 B with
"optimizer+params"; 8 B less each with the state on NVMe, "-nvme", where the preset has NVMe),
with what the planner's error said.
Every attempt is printed as it runs, then the table and the ratio "largest with offload /
largest without" against the published figures.

Checks (``--no-checks`` skips them): at the largest shape without offload, the free search keeps
offload "none" and "optimizer" pinned is not predicted faster; the free search's largest shape is
also the largest "optimizer+params" ("-nvme" with NVMe) pinned reaches (the next shape fails pinned too); TFLOP/s per
device below the device's bf16 peak. ``--quick``: modes none and free only, no checks.
Planning times are wall times on the machine that runs it (the load average is printed first).
"""
from __future__ import annotations

import argparse
import datetime
import os
import time
import warnings

import autopar
from autopar.errors import ConstraintError, MemoryBudgetError
from autopar.frontend.fuse import uses_kernels
from autopar.frontend.trace import trace
from autopar.models import ZOO
from autopar.models.gpt2 import gpt
from autopar.pricing.offload import host_bytes_per_element, working_bytes

SEQ, VOCAB, BATCH_PER_DEVICE = 1024, 51200, 8
PRECISION, OPTIMIZER = "bf16", "adamw"

# (label, n_layer, d_model, n_head): GPT-3 (Brown et al. 2020, Table 2.1) 350M-13B and 175B, and
# shapes between (head dims 64 to 128), ordered by parameters (about +25% a step).
SHAPES = [
    ("350M", 24, 1024, 16),
    ("760M", 24, 1536, 16),
    ("1.3B", 24, 2048, 16),
    ("1.6B", 24, 2304, 18),
    ("2.0B", 24, 2560, 20),
    ("2.7B", 32, 2560, 32),
    ("3.8B", 32, 3072, 24),
    ("5.1B", 32, 3584, 28),
    ("6.7B", 32, 4096, 32),
    ("8.3B", 40, 4096, 32),
    ("9.9B", 48, 4096, 32),
    ("13B", 40, 5120, 40),
    ("15B", 48, 5120, 40),
    ("20B", 44, 6144, 48),
    ("25B", 56, 6144, 48),
    ("30B", 48, 7168, 56),
    ("40B", 48, 8192, 64),
    ("52B", 64, 8192, 64),
    ("65B", 80, 8192, 64),
    ("82B", 80, 9216, 72),
    ("101B", 80, 10240, 80),
    ("121B", 96, 10240, 80),
    ("146B", 96, 11264, 88),
    ("175B", 96, 12288, 96),
]

# key, description, preset, devices (None: the preset's node)
CASES = [
    ("v100", "1x V100 32 GB (dgx2-v100: 1.5 TB host, 6 GB/s PCIe, 179 GB/s CPU)", "dgx2-v100", 1),
    ("a100", "1x A100 80 GB (dgx-a100: 2 TB host, 12.5 GB/s, 290 GB/s)", "dgx-a100", 1),
    ("4090", "1x RTX 4090 24 GB (workstation-4090: 128 GB host, 25 GB/s, 63 GB/s)", "workstation-4090", None),
    ("a100x8", "8x A100 80 GB, one DGX A100 node (2 TB host shared, 250 GB per rank)", "dgx-a100", None),
]

PUBLISHED = """Published, for comparison (GPT-2-like models, mixed precision, Adam):
- ZeRO-Offload (Ren et al., USENIX ATC'21): 13B parameters trainable on one 32 GB V100 (optimizer
  offloaded to a DGX-2's host), 40 TFLOP/s for a 10B model on that GPU; PyTorch DDP alone: about
  1.4B on the same GPU ("10x larger").
- Colossal-AI Gemini (heterogeneous memory manager): 20x larger GPT-2 than PyTorch on one GPU
  (and 120x with NVMe offload; autopar models NVMe on presets that describe it: dgx-a100)."""


def cluster_of(case):
    _, _, preset, devices = case
    return autopar.Cluster.preset(preset, devices=devices) if devices else autopar.Cluster.preset(preset)


class Models:
    """Each shape's model and traced graph, built once per batch and reused by every mode."""

    def __init__(self):
        self.cache = {}

    def get(self, i, batch, backend):
        key = (i, batch, backend)
        if key not in self.cache:
            _, n_layer, d_model, n_head = SHAPES[i]
            t = time.perf_counter()
            model, inputs = gpt(n_layer=n_layer, d_model=d_model, n_head=n_head, seq=SEQ, batch=batch, vocab=VOCAB,
                                device="meta")
            graph = trace(model, inputs, kernels=uses_kernels("auto", backend))
            params = sum(p.numel() for p in model.parameters())   # the tied head counted once
            self.cache.clear()   # one shape at a time: graphs of 100B+ models are not small
            self.cache[key] = (model, inputs, graph, params, time.perf_counter() - t)
        return self.cache[key]


def host_need_per_param(mode: str, devices: int) -> int:
    """Host bytes per parameter that the least offloaded plan of ``mode`` keeps on a node (every
    rank's shard): master 4 + AdamW state 8 + gradient staging 2, + the fp32 sum 4 of streamed
    gradients (ZeRO 2-3, and any offloaded plan on one data-parallel rank), + 2 for the
    working-dtype parameters with "optimizer+params" (ZeRO-3, streamed). "optimizer" on several
    devices may be ZeRO-1 (not streamed). The "-nvme" modes keep the AdamW state on the NVMe
    drives instead (8 bytes less)."""
    nvme = mode.endswith("-nvme")
    if mode.startswith("optimizer+params"):
        return host_bytes_per_element(OPTIMIZER, PRECISION, streamed=True, nvme=nvme) + working_bytes(PRECISION)
    return host_bytes_per_element(OPTIMIZER, PRECISION, streamed=devices == 1, nvme=nvme)


def attempt(models, case, i, mode):
    """Plan shape ``i`` on ``case`` with ``mode`` ("none", "optimizer", "optimizer+params" pinned,
    or "free"); a dict with the plan or the reason nothing fits."""
    cluster = cluster_of(case)
    batch = BATCH_PER_DEVICE * cluster.num_devices
    traced_before = (i, batch, cluster.backend) in models.cache
    model, inputs, graph, params, trace_s = models.get(i, batch, cluster.backend)
    t = time.perf_counter()
    out = dict(shape=i, mode=mode, params=params, plan=None)
    try:
        out["plan"] = autopar.plan(model, inputs, cluster, optimizer=OPTIMIZER, precision=PRECISION, traced=graph,
                                   constraints=None if mode == "free" else {"offload": mode})
    except (MemoryBudgetError, ConstraintError) as e:
        out["why"] = why_not(cluster, params, mode, e)
    out["seconds"] = time.perf_counter() - t + (0.0 if traced_before else trace_s)
    p = out["plan"]
    label = SHAPES[i][0]
    if p is None:
        print(f"  {case[0]:7} {mode:16} {label:>5} ({params / 1e9:6.2f}B)  no plan  {out['seconds']:6.1f}s  "
              f"{out['why']}", flush=True)
    else:
        d = p.degrees
        print(f"  {case[0]:7} {mode:16} {label:>5} ({params / 1e9:6.2f}B)  plans    {out['seconds']:6.1f}s  "
              f"offload={d['offload']} zero={d['zero']} dp={d['dp']} tp={d['tp']} pp={d.get('pp', 1)} sp={d.get('sp')} "
              f"mbs={d['micro_batch_size']}x{d['num_micro_batches']} ckpt={d['checkpoint']} step={p.step_time:.4g}s "
              f"peak={p.peak_memory / 2**30:.1f}GiB host/rank={host_bytes(p) / 1e9:.1f}GB", flush=True)
    return out


def why_not(cluster, params, mode, err) -> str:
    """Why nothing plans: the host when the least any offloaded plan keeps there
    (``host_need_per_param``) exceeds the node's host memory (the planner's error then states
    the smallest device peak of the plans that remain, or, pinned, that no configuration
    satisfies the constraints), else the device (MemoryBudgetError's smallest peak)."""
    if isinstance(err, MemoryBudgetError) and err.min_peak_bytes and err.budget_bytes:
        said = f"device: smallest peak {err.min_peak_bytes / 2**30:.0f} GiB > {err.budget_bytes / 2**30:.1f} GiB"
    else:
        said = f"{type(err).__name__}: {str(err)[:110]}..."
    if mode == "none" or cluster.host is None:
        return said
    node = cluster.host.memory_bytes
    free = ("optimizer", "optimizer+params") + (("optimizer-nvme", "optimizer+params-nvme")
                                                if cluster.nvme is not None else ())
    needs = [(m, host_need_per_param(m, cluster.num_devices)) for m in (free if mode == "free" else (mode,))]
    over = [(m, per) for m, per in needs if per * params / cluster.nodes > node]
    if not over:
        return said
    what = ", ".join(f"{m} >= {per} B/param = {per * params / cluster.nodes / 1e12:.2f} TB" for m, per in over)
    return f"host ({node / 1e12:.2f} TB/node): {what}; planner said {said}"


def host_bytes(plan) -> float:
    off = plan.predictions.get("offload")
    return float(off["host_bytes"]) if off else 0.0


def tflops(plan, cluster) -> float:
    return plan.predictions["model_flops"] / plan.step_time / cluster.num_devices / 1e12


def largest(models, case, mode, lo=-1, hi=len(SHAPES)):
    """Binary search over SHAPES: ``lo`` plans (or -1), ``hi`` does not (or len). Returns the
    largest index that plans (with its attempt) and the first failing attempt above it."""
    tried = {}
    while hi - lo > 1:
        mid = (lo + hi) // 2
        tried[mid] = attempt(models, case, mid, mode)
        if tried[mid]["plan"] is not None:
            lo = mid
        else:
            hi = mid
    if lo >= 0 and (lo not in tried or tried[lo]["plan"] is None):
        tried[lo] = attempt(models, case, lo, mode)
    return (tried.get(lo) if lo >= 0 else None), tried.get(hi), lo


def row(case, mode, best, fail, seconds) -> str:
    nxt = "" if fail is None else f"{SHAPES[fail['shape']][0]}: {fail['why']}"
    if best is None:
        return f"| {case[0]} | {mode} | none fits | | | | | | | | | {seconds:.0f} | {nxt} |"
    p, cluster = best["plan"], cluster_of(case)
    d = p.degrees
    par = f"dp{d['dp']} tp{d['tp']} pp{d.get('pp', 1)}" + (
        f" sp{d['sp']} ({d.get('sp_mode')})" if (d.get("sp") or 1) > 1 else "")
    return (f"| {case[0]} | {mode} | {SHAPES[best['shape']][0]} ({SHAPES[best['shape']][1]}L, "
            f"d{SHAPES[best['shape']][2]}) | {best['params'] / 1e9:.2f} | {d['offload']} | {d['zero']} | {par}, "
            f"{d['micro_batch_size']}x{d['num_micro_batches']}, ckpt {d['checkpoint']} | {p.step_time:.3g} | "
            f"{tflops(p, cluster):.1f} | {p.peak_memory / 2**30:.1f} | {host_bytes(p) / 1e9:.0f} | "
            f"{best['seconds']:.1f} | {seconds:.0f} | {nxt} |")


def run_case(case, modes, checks, models):
    cluster = cluster_of(case)
    print(f"\n{case[1]}: {cluster.num_devices} device(s), batch {BATCH_PER_DEVICE * cluster.num_devices} x {SEQ}",
          flush=True)
    results, notes = {}, []
    lo = -1
    for mode in modes:
        t = time.perf_counter()
        best, fail, idx = largest(models, case, mode, lo=lo)
        results[mode] = (best, fail, time.perf_counter() - t)
        if mode == "none" and best is not None and checks:
            notes += check_no_offload(models, case, best)
        lo = max(lo, idx)   # a mode that may offload reaches at least what "none" (and "optimizer") reach
    if checks and "free" in results and results["free"][0] is not None:
        notes += check_free_boundary(models, case, results["free"])
    for mode, (best, _, _) in results.items():
        if best is not None:
            peak = cluster.device.peak_flops[PRECISION]
            tf = tflops(best["plan"], cluster)
            if tf * 1e12 > peak:
                notes.append(f"SUSPICIOUS {case[0]} {mode}: {tf:.1f} TFLOP/s per device above the "
                             f"{peak / 1e12:.0f} TFLOP/s peak")
    return results, notes


def check_no_offload(models, case, best) -> list[str]:
    """At the largest shape without offload: the free search keeps offload off; offload pinned is
    not predicted faster."""
    notes = []
    base = best["plan"]
    free = attempt(models, case, best["shape"], "free")
    if free["plan"] is None or free["plan"].degrees["offload"] != "none":
        notes.append(f"SUSPICIOUS {case[0]} {SHAPES[best['shape']][0]}: the free search offloads "
                     f"({free['plan'] and free['plan'].degrees['offload']}) where offload 'none' plans")
    elif free["plan"].step_time > base.step_time * (1 + 1e-9):
        notes.append(f"SUSPICIOUS {case[0]}: free plan {free['plan'].step_time:.4g}s slower than 'none' pinned "
                     f"{base.step_time:.4g}s")
    off = attempt(models, case, best["shape"], "optimizer")
    if off["plan"] is None:
        notes.append(f"SUSPICIOUS {case[0]} {SHAPES[best['shape']][0]}: 'optimizer' pinned does not plan where "
                     f"'none' does ({off.get('why')})")
    else:
        r = off["plan"].step_time / base.step_time
        notes.append(f"{'SUSPICIOUS ' if r < 1 else ''}{case[0]} {SHAPES[best['shape']][0]}: offload 'optimizer' "
                     f"pinned {off['plan'].step_time:.4g}s vs 'none' {base.step_time:.4g}s (x{r:.2f}), free "
                     f"search picks offload={free['plan'] and free['plan'].degrees['offload']}")
    return notes


def check_free_boundary(models, case, result) -> list[str]:
    best, fail, _ = result
    i = best["shape"] + 1
    if i >= len(SHAPES):
        return []
    # the mode that holds the least on the device and, with NVMe, on the host
    mode = "optimizer+params-nvme" if cluster_of(case).nvme is not None else "optimizer+params"
    pinned = attempt(models, case, i, mode)
    if pinned["plan"] is not None:
        return [f"SUSPICIOUS {case[0]} {SHAPES[i][0]}: {mode!r} pinned plans where the free search found nothing"]
    return [f"{case[0]} {SHAPES[i][0]}: {mode!r} pinned does not plan either ({pinned['why']})"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", choices=[c[0] for c in CASES], help="cases to run (default: all)")
    ap.add_argument("--modes", nargs="*", choices=["none", "optimizer", "optimizer+params", "optimizer-nvme",
                                                  "optimizer+params-nvme", "free"],
                    help="offload modes searched, in this order (default: none optimizer free; --quick: none free)")
    ap.add_argument("--quick", action="store_true", help="modes none and free only, no checks")
    ap.add_argument("--no-checks", action="store_true", help="skip the consistency checks")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    modes = args.modes or (["none", "free"] if args.quick else ["none", "optimizer", "free"])
    checks = not (args.quick or args.no_checks)
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load average "
          f"{os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}, {os.cpu_count()} cores")
    print(f"GPT shapes (seq {SEQ}, vocab {VOCAB}, batch {BATCH_PER_DEVICE}/device), {PRECISION}, {OPTIMIZER}; "
          f"modes {' '.join(modes)}")
    m, b = ZOO["mlp"]()
    trace(m, b)   # warm torch.export's imports
    models = Models()
    t0 = time.perf_counter()
    cases = [c for c in CASES if not args.only or c[0] in args.only]
    all_results, all_notes = {}, []
    for case in cases:
        all_results[case[0]], notes = run_case(case, modes, checks, models)
        all_notes += notes
    print("\n| case | offload pinned | largest shape | params (B) | plan offload | ZeRO | mesh, mbs x micro, ckpt "
          "| step (s) | TFLOP/s/dev | peak (GiB) | host/rank (GB) | plan (s) | search (s) | next shape: why not |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        for mode, (best, fail, secs) in all_results[case[0]].items():
            print(row(case, mode, best, fail, secs))
    print("\n| case | largest, offload none (B) | largest with offload (B) | ratio |")
    print("|---|---|---|---|")
    for case in cases:
        res = all_results[case[0]]
        base = res.get("none", (None,))[0]
        offl = [r[0] for k, r in res.items() if k != "none" and r[0] is not None]
        top = max(offl, key=lambda r: r["params"]) if offl else None
        b_, t_ = (base["params"] / 1e9 if base else 0.0), (top["params"] / 1e9 if top else 0.0)
        print(f"| {case[1]} | {b_:.2f} | {t_:.2f} ({top and top['plan'].degrees['offload']}) | "
              f"{t_ / b_ if b_ else float('nan'):.1f}x |")
    print("\n" + PUBLISHED)
    if all_notes:
        print("\nChecks:")
        for n in all_notes:
            print(f"- {n}")
    print(f"\ntotal {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
