"""Peak extra memory per rank while ``compiled.save`` and ``compiled.load`` run (issue 30).

Four gloo ranks train an MLP of growing size (zoo ``mlp``, d_in = hidden = d_out = H, built on
meta, ``weights="init"``) under dp=4 ZeRO-3 with SGD + momentum, one step, then save and load.
Each rank resets its peak-RSS mark (``/proc/self/clear_refs`` 5) just before the call and reads
``VmHWM`` after it: the figure is what the call added above the rank's resident size. glibc maps
every tensor of 1 MB or more on its own (``mallopt(M_MMAP_THRESHOLD)``), so freed tensors leave
the RSS and the peak follows live memory (as benchmarks/bench_setup_memory.py). Two barriers
before each call release what the last step's collectives still held (without them a rank's
resident size dropped by ~60 MB inside the save, hiding or shifting its peak).

``--plan 2d`` trains the same model under a 2D (SUMMA, q=2) grid plan on the 4 ranks instead: each
rank holds a quarter block of every weight (of its stored, transposed form) and its momentum;
``--plan 2.5d`` (q=2, depth world/4) and ``--plan 3d`` (q=2 with ``--world 8``) the other grids.

Compared with the bound the sharded path keeps: this rank's shard (parameters + optimizer state
it holds) + the largest tensor. ``--path old`` runs the full-tensor path (every parameter and
optimizer state gathered to full size on every rank: ``AUTOPAR_CHECKPOINT_FULL=1``, the path
main used before issue 30, grid plans included).

    PYTHONPATH=. .venv/bin/python -m benchmarks.bench_checkpoint_memory [--sizes 64,128,256,512] [--path new|old|both]
        [--plan dp|2d|2.5d|3d] [--world N]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import tempfile
import time

import torch

MB = 2 ** 20
# parameter MB (fp32) -> (H, n_layer): (n_layer + 1) linears of H x H (+ bias)
SIZES = {64: (2048, 3), 128: (2048, 7), 256: (4096, 3), 512: (4096, 7)}


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _peak(fn):
    import gc

    import torch.distributed as dist

    # Buffers the last step's collectives still hold are released at the next collective: settle
    # them first, or the call's peak is measured from a resident size that then drops.
    dist.barrier()
    gc.collect()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:   # reset the peak-RSS mark to the current RSS
        f.write("5")
    base = _rss("VmRSS")
    t0 = time.perf_counter()
    fn()
    return _rss("VmHWM") - base, time.perf_counter() - t0


def _measure(rank, world, path, plan_json, directory, h, n_layer):
    import autopar
    from autopar.models import ZOO

    torch.set_num_threads(1)
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)   # M_MMAP_THRESHOLD
    if path == "old":
        os.environ["AUTOPAR_CHECKPOINT_FULL"] = "1"
    model, batch = ZOO["mlp"](d_in=h, hidden=h, n_layer=n_layer, d_out=h, batch=8, device="meta")
    batch = (torch.zeros(batch[0].shape), torch.zeros(batch[1].shape, dtype=torch.long))
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), optimizer="sgd", lr=0.01, momentum=0.9,
                         weights="init")
    cm.step(*batch)
    held = cm.opt.state_bytes()
    shard = held["params"] + held["optimizer"]
    largest = max(p.numel() * 4 for p in model.parameters())
    full = sum(p.numel() * 4 for p in model.parameters())
    save_peak, save_s = _peak(lambda: cm.save(directory))
    load_peak, load_s = _peak(lambda: cm.load(directory))
    return dict(save=save_peak, load=load_peak, save_s=save_s, load_s=load_s, shard=shard, largest=largest,
                full=full)


PLANS = {"dp": lambda world: {"dp": world, "tp": 1, "zero": 3, "num_micro_batches": 1},
         "2d": lambda world: {"tp_mode": "2d", "tp_shape": [round(world ** 0.5)] * 2, "num_micro_batches": 1},
         "2.5d": lambda world: {"tp_mode": "2.5d", "tp_shape": [2, 2, world // 4], "num_micro_batches": 1},
         "3d": lambda world: {"tp_mode": "3d", "tp_shape": [round(world ** (1 / 3))] * 3, "num_micro_batches": 1}}


def run(size_mb: int, path: str, world: int = 4, shape: tuple[int, int] | None = None, plan_kind: str = "dp"):
    """Per-rank measurements (dicts, rank order) for a model of ``SIZES[size_mb]`` or ``shape`` (H, layers)
    under ``PLANS[plan_kind]``."""
    import autopar
    from autopar.models import ZOO
    from runtime.launch import run_local

    h, n_layer = shape or SIZES[size_mb]
    model, batch = ZOO["mlp"](d_in=h, hidden=h, n_layer=n_layer, d_out=h, batch=8, device="meta")
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=world), optimizer="sgd",
                        precision="fp32", constraints=PLANS[plan_kind](world))
    assert plan_kind == "dp" or plan.degrees.get("tp_mode") == plan_kind, plan.degrees
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as d:
        return run_local(_measure, world, args=(path, plan.to_json(), os.path.join(d, "ck"), h, n_layer),
                         timeout=1200, pg_timeout=600)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64,128,256,512")
    ap.add_argument("--path", default="both")
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--plan", default="dp", choices=list(PLANS))
    a = ap.parse_args()
    print(f"plan: {a.plan} {PLANS[a.plan](a.world)}")
    print("| path | params (MB) | rank | save: peak added (MB) | load: peak added (MB) | shard (MB) | "
          "largest tensor (MB) | bound shard + largest (MB) | save / load (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size in (int(s) for s in a.sizes.split(",")):
        for path in (["new", "old"] if a.path == "both" else [a.path]):
            for r, m in enumerate(run(size, path, a.world, plan_kind=a.plan)):
                print(f"| {path} | {m['full'] / MB:.0f} | {r} | {m['save'] / MB:.1f} | {m['load'] / MB:.1f} | "
                      f"{m['shard'] / MB:.1f} | {m['largest'] / MB:.1f} | {(m['shard'] + m['largest']) / MB:.1f} | "
                      f"{m['save_s']:.2f} / {m['load_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
