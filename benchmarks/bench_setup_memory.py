"""Peak memory per rank while ``autopar.compile`` sets a model up (issue 11).

Each rank resets its peak-RSS mark (``/proc/self/clear_refs`` 5) just before compile and reads
``VmHWM`` right after, so the figure is what set-up added above the process's resting size
(torch imported, the model object built). glibc is told to map every tensor of 1 MB or more on
its own (``mallopt(M_MMAP_THRESHOLD)``), so freed tensors leave the RSS and the peak follows live
memory. Compared with the bound the set-up promises: this
rank's shards + the largest single parameter + a small constant.

    .venv/bin/python -m benchmarks.bench_setup_memory [--world 4] [--mode init|hf|real]

``real``: a materialized model (weights=None; every rank holds the whole model before compile, as
the old path required); ``init``: built on meta, weights="init"; ``hf``: built on meta, loaded from
a Hugging Face-style safetensors checkpoint (written once by the parent).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import tempfile

import torch

MB = 2 ** 20
# GPT-2-style: 8 layers, d=512, vocab 16384: 134 MB of fp32 parameters, wte (32 MB) the largest.
SHAPE = dict(n_layer=8, d_model=512, n_head=8, vocab=16384, seq=64, batch=8)


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _measure(rank, world, mode, plan_json, ckpt, shape):
    import autopar
    from autopar.models.gpt2 import gpt

    torch.set_num_threads(1)
    # Tensors of 1 MB and more get their own mapping, returned to the system when freed: the peak
    # RSS then follows live memory, not what glibc's heap kept after earlier frees.
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)   # M_MMAP_THRESHOLD
    model, batch = gpt(device="cpu" if mode == "real" else "meta", seed=0, **shape)
    if mode != "real":
        batch = tuple(torch.zeros(x.shape, dtype=x.dtype) for x in batch)
    full = sum(p.numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    with open("/proc/self/clear_refs", "w") as f:   # reset the peak-RSS mark to the current RSS
        f.write("5")
    base = _rss("VmRSS")
    kw = {} if mode == "real" else {"weights": "init" if mode == "init" else ckpt}
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), optimizer="sgd", lr=0.1, momentum=0.9, **kw)
    peak = _rss("VmHWM") - base
    held = _rss("VmRSS") - base   # what stays: parameter blocks, optimizer buffers, program
    shards = sum(p.numel() * 4 for p in cm.params.values())
    return dict(peak=peak, held=held, shards=shards, largest=largest, full=full)


def run(world=4, mode="init", shape=None, constraints=None):
    import autopar
    from autopar.models.gpt2 import gpt
    from runtime.launch import run_local

    shape = dict(SHAPE if shape is None else shape)
    model, batch = gpt(device="meta", seed=0, **shape)
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=world), optimizer="sgd",
                        precision="fp32", constraints=constraints or {"tp": world, "num_micro_batches": 1},
                        policy="megatron")
    with tempfile.TemporaryDirectory() as d:
        if mode == "hf":
            from safetensors.torch import save_file
            real, _ = gpt(device="cpu", seed=0, **shape)
            sd = {k: v.contiguous() for k, v in real.state_dict().items() if k != "head.weight"}   # tied
            save_file(sd, os.path.join(d, "model.safetensors"))
            del real, sd
        return run_local(_measure, world, args=(mode, plan.to_json(), d, shape), timeout=600)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--mode", default="all")
    a = ap.parse_args()
    print("| set-up | rank | peak added (MB) | held after (MB) | param shards (MB) "
          "| largest param (MB) | whole model (MB) |")
    print("|---|---|---|---|---|---|---|")
    for mode in (["real", "init", "hf"] if a.mode == "all" else [a.mode]):
        for r, m in enumerate(run(a.world, mode)):
            print(f"| {mode} | {r} | {m['peak'] / MB:.1f} | {m.get('held', 0) / MB:.1f} | {m['shards'] / MB:.1f} | "
                  f"{m['largest'] / MB:.1f} | "
                  f"{m['full'] / MB:.1f} |")


if __name__ == "__main__":
    main()
