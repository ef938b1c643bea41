"""Saved activations of one Megatron-LM layer at full scale: the plan's prediction, the bytes
saved_tensors_hooks measures on the plan's per-rank program (meta tensors, CUDA kernels
emulated, collectives stubbed: tests/helpers/saved_activations.py), and the closed form of Korthikanti
et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Section 4):
sbh(10 + 24/t + 5as/(ht)) bytes per layer for tensor parallelism t without sequence parallelism
(t = 1: sbh(34 + 5as/h)), 16-bit activations and 1-byte dropout masks.

    .venv/bin/python -m benchmarks.bench_activation_memory
"""
from __future__ import annotations

import time
import warnings

import torch

import autopar
from autopar.models.megatron import megatron_layer
from autopar.frontend.trace import trace
from tests.helpers.saved_activations import rank_saved_bytes

SHAPES = {"22B (h 6144, a 64, s 2048)": dict(hidden=6144, heads=64, seq=2048),
          "GPT-2 XL (h 1600, a 25, s 1024)": dict(hidden=1600, heads=25, seq=1024)}
GIB = 2 ** 30


def closed_form(c, tp):
    s, b, h, a = c["seq"], 1, c["hidden"], c["heads"]
    return s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))


def main():
    warnings.simplefilter("ignore", UserWarning)
    print(f"{'layer':32} {'attention':9} {'tp':>3} {'predicted':>10} {'measured':>10} {'pred/meas':>9} "
          f"{'closed form':>11} {'meas/closed':>11} {'seconds':>7}")
    for label, c in SHAPES.items():
        for attention in ("explicit", "sdpa"):
            model, inputs = megatron_layer(attention=attention, dtype=torch.bfloat16, **c)
            traced = trace(model, inputs)
            for tp in (1, 8):
                if c["heads"] % tp:
                    continue
                t0 = time.perf_counter()
                cons = {"dp": 1, "tp": tp, "zero": 0, "checkpoint": "none", "num_micro_batches": 1}
                if tp > 1:
                    cons["tp_mode"] = "1d"
                plan = autopar.plan(model, inputs, autopar.Cluster.preset("dgx-a100", devices=tp), traced=traced,
                                    precision="bf16", constraints=cons, policy="megatron")
                pred = plan.data["predictions"]["memory_breakdown"]["activations"]
                meas = rank_saved_bytes(model, inputs, plan, traced, rank=0)
                cf = closed_form(c, tp)
                print(f"{label:32} {attention:9} {tp:>3} {pred / GIB:>8.4f}Gi {meas / GIB:>8.4f}Gi {pred / meas:>9.4f} "
                      f"{cf / GIB:>9.4f}Gi {meas / cf:>11.4f} {time.perf_counter() - t0:>7.2f}")


if __name__ == "__main__":
    main()
