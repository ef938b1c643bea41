"""benchmarks/kernel_bench.py end to end at small sizes (CPU under the interpreter, or CUDA):
every case and variant runs, agrees with eager, and the table prints; torch.compile left out
(its CPU compile takes minutes here). Without CUDA, main() says it is skipped and returns 0."""
from __future__ import annotations

import torch

from benchmarks import kernel_bench

SMALL = dict(rms_norm=[(33, 67)], swiglu=(17, 130), layer_norm=(33, 67), geglu=(17, 130),
             linear_cross_entropy=(40, 32, 300), adamw=5000, rotary=(2, 3, 7, 16), softmax=(9, 13))


def test_kernel_bench_small(device):
    rows = kernel_bench.bench_kernels(device, sizes=SMALL, reps=2, compile=False)
    seen = {(r["kernel"], r["variant"]) for r in rows}
    for kernel in ("rms_norm", "swiglu", "layer_norm", "geglu", "linear_cross_entropy", "adamw", "rotary", "softmax"):
        assert {(kernel, "eager"), (kernel, "triton")} <= seen
    for r in rows:
        assert r["note"] == "" and r["ms"] is not None, r
        assert r["max_abs_diff"] < 0.1, r   # bf16 cases: a few ulps
    table = kernel_bench.table(rows)
    assert table.count("\n") == len(rows) + 1


def test_kernel_bench_main_without_cuda(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kernel_bench.main() == 0
    assert "needs a CUDA device; skipped" in capsys.readouterr().out
