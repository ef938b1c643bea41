"""Where the unpinned search picks 2D / 2.5D / 3D tensor parallelism (issue 8, benchmarks).

For each (model, cluster) case: ``autopar.plan`` UNPINNED (the ILP's 1D / 2d-reshard meshes and
the grid modes of autopar/search/grid_search.py compete by predicted step time under the memory
budget), then each grid mode pinned (``constraints={"tp_mode": m}``), and a table of the
winner's tp_mode, its step time, and the best grid mode's step time relative to the winner.

Clusters: ``dgx-a100`` (8 GPUs / node) and ``tacc-longhorn`` (4 V100 / node) at 8 .. 1024 GPUs,
each with its own links (NVLink-class) and with slow links (PCIe/Ethernet-class):
  * intra-node PCIe Gen4 x16: 16 GT/s x 16 lanes x 128/130 / 8 = 31.5 GB/s per direction (PCI-SIG,
    PCIe 4.0 base specification); x 0.76 (the A100 preset's measured/nominal bus-bandwidth ratio,
    autopar/cluster_presets.py) = 24 GB/s ring bus bandwidth;
  * inter-node 100 Gb Ethernet (IEEE 802.3 100GBASE) = 12.5 GB/s line rate x 0.9 (the presets'
    achieved/line ratio) = 11.25 GB/s, ONE port per node shared by its GPUs (1.4 GB/s per GPU on
    8-GPU nodes, 2.8 on 4-GPU nodes).
The built-in GPU profiles price collectives by their calibration curves, not by ``Cluster``'s
``Link`` figures, so a slow cluster gets both: Links replaced (for ``describe``) and the profile's
intra / inter curves rebuilt with autopar.profile's own construction (``_same_latency``: the A100
NVLink ramp's small-message times with the new plateau), exactly as the V100 profile is built.

Models (meta device, dropout 0, fused SDPA attention, which the grid lowering accepts): GPTs of
2 layers at a fixed global batch (strong scaling: on 1024 GPUs data parallelism alone cannot
use every GPU). bf16, AdamW, the device memory as budget.

    .venv/bin/python -m benchmarks.bench_tp_grid_where            # every case: slow (over 10 minutes on 2 shared cores)
    .venv/bin/python -m benchmarks.bench_tp_grid_where --quick    # 8 and 64 GPUs only, about 5 minutes
    .venv/bin/python -m benchmarks.bench_tp_grid_where --gpus 16 256 1024 --models 0   # the rest
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import autopar
from autopar.cluster import Cluster
from autopar.hardware import Link
from autopar.pricing.cost import profile_of
from autopar.errors import PlanError
from autopar.models.gpt2 import gpt
from autopar.profile import A100_NVLINK_AR8, LinkCurves, _same_latency
from autopar.frontend.trace import trace
from codegen.grid_layout import GRID_MODES

PCIE4_X16_BUS = 31.5e9 * 0.76     # 24 GB/s (module doc)
ETH_100G_PER_NODE = 12.5e9 * 0.9  # 11.25 GB/s per node, shared by its GPUs

MODELS = (
    # name, gpt kwargs
    ("GPT h2048 s1024 b256", dict(n_layer=2, d_model=2048, n_head=16, seq=1024, batch=256)),
    ("GPT h8192 s2048 b64", dict(n_layer=2, d_model=8192, n_head=64, seq=2048, batch=64)),
)
SIZES = {"dgx-a100": (8, 16, 64, 256, 1024), "tacc-longhorn": (8, 64, 1024)}
QUICK = {"dgx-a100": (8, 64), "tacc-longhorn": (8, 64)}


def slow_links(cluster: Cluster) -> Cluster:
    """``cluster`` with PCIe Gen4 x16 inside a node and one 100 GbE port per node between nodes."""
    per_gpu = ETH_100G_PER_NODE / cluster.devices_per_node
    cal = profile_of(cluster)
    n = cluster.devices_per_node
    cal = dataclasses.replace(
        cal, name=cal.name + "+pcie/eth",
        intra=LinkCurves((("all_reduce", n, _same_latency(A100_NVLINK_AR8, PCIE4_X16_BUS)),), hop_latency=1.9e-6),
        inter=LinkCurves((("all_reduce", 2, _same_latency(A100_NVLINK_AR8, per_gpu)),), hop_latency=4.0e-6))
    return dataclasses.replace(cluster, name=cluster.name + "-pcie-eth", intra_link=Link(PCIE4_X16_BUS, 1e-5),
                               inter_link=Link(per_gpu, 2e-5), calibration=cal)


def clusters(quick: bool, only=None):
    for preset, sizes in (QUICK if quick else SIZES).items():
        per_node = Cluster.preset(preset).devices_per_node
        for n in sizes:
            if only and n not in only:
                continue
            base = Cluster.preset(preset, nodes=n // per_node)
            yield preset, n, "NVLink/IB", base
            yield preset, n, "PCIe/Eth", slow_links(base)


def run_case(model, inputs, traced, cluster, time_limit: float) -> dict:
    t0 = time.perf_counter()
    auto = autopar.plan(model, inputs, cluster, traced=traced, time_limit=time_limit)
    t_auto = time.perf_counter() - t0
    grids = {}
    for m in GRID_MODES:
        try:
            p = autopar.plan(model, inputs, cluster, traced=traced, constraints={"tp_mode": m})
            grids[m] = p
        except PlanError as e:   # no q^2 / q^2 d / q^3 grid, a split that does not divide, or out of memory
            grids[m] = str(e).splitlines()[0][:60]
    return {"auto": auto, "t_auto": t_auto, "t_all": time.perf_counter() - t0, "grids": grids}


def degrees(p) -> str:
    d = p.degrees
    s = f"dp{d['dp']}"
    if d["tp"] > 1:
        s += f" tp{d['tp']}" + (f"{d['tp_shape']}" if d["tp_shape"] else "")
    if d["pp"] > 1:
        s += f" pp{d['pp']}"
    if d["zero"]:
        s += f" z{d['zero']}"
    if d["checkpoint"] not in ("none", None):
        s += " ckpt"
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="autopar.plan time_limit "
                         "(default none: with a limit, a solve that runs out raises; see RESULTS.md)")
    ap.add_argument("--gpus", type=int, nargs="*", help="only these cluster sizes")
    ap.add_argument("--models", type=int, nargs="*", help="only these MODELS indices (0, 1)")
    args = ap.parse_args()
    print("| model | cluster | GPUs | links | chosen tp_mode | chosen degrees | step ms | best grid mode | "
          "grid / chosen | 2d ms | 2.5d ms | 3d ms | plan s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i, (mname, kw) in enumerate(MODELS):
        if args.models and i not in args.models:
            continue
        model, inputs = gpt(vocab=50304, device="meta", **kw)
        traced = trace(model, inputs)
        for preset, n, links, cluster in clusters(args.quick, args.gpus):
            r = run_case(model, inputs, traced, cluster, args.time_limit)
            auto = r["auto"]
            ok = {m: p for m, p in r["grids"].items() if not isinstance(p, str)}
            best = min(ok, key=lambda m: ok[m].step_time) if ok else None
            cells = []
            for m in GRID_MODES:
                p = r["grids"][m]
                cells.append(f"{p.step_time * 1e3:.1f} {p.degrees['tp_shape']}" if m in ok
                             else ("no grid" if "devices" in p or "grid" in p else "n/a: " + p[:40]))
            rel = f"{ok[best].step_time / auto.step_time:.2f}x" if best else "-"
            print(f"| {mname} | {preset} | {n} | {links} | {auto.degrees['tp_mode']} | {degrees(auto)} | "
                  f"{auto.step_time * 1e3:.1f} | {best or '-'} | {rel} | " + " | ".join(cells)
                  + f" | {r['t_auto']:.1f} + {r['t_all'] - r['t_auto']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
