"""The host (Python / dispatch) overhead of one forward of a Hugging Face decoder, as the inference
pricer adds it to every iteration (autopar/inference/inference_cost.py, "Host overhead"):
``measure_forward_overhead`` -> (seconds per decoder layer, seconds per forward).

A tiny model's decode step is not spent in its kernels: each decoder layer runs a dozen Python
modules (norms, projections, rotary, attention, the cache update), each a few torch dispatches,
and the step around them (the model's own set-up, the mask, the LM head, the engine's sampling)
costs about as much again. The figures are measured where kernels cost ~nothing: an
``IterationEngine`` decode step (what the server runs, autopar/inference/iteration_engine.py) of
a Llama of hidden 16 with 1 and ``LAYERS[1]`` decoder layers, two sequences of a few tokens; the
slope over layers is the per-layer figure, the intercept the per-forward one.

Each figure is the median of ``reps`` steps' seconds (the first steps, which pay one-time costs,
dropped): the host work is what the machine's load slows, and the median is what the served steps
see at the load the calibration ran under. About 1-2 s on one core.
"""
from __future__ import annotations

import statistics
import time

LAYERS = (1, 5)          # decoder layers of the two models timed
TINY = dict(d_model=16, n_head=2, n_kv_heads=1, ffn_hidden=32, vocab=32)
WARMUP = 5


def _engine(n_layer: int, steps: int, rows: int = 2):
    from autopar.inference.iteration_engine import IterationEngine
    from autopar.models.hf import hf_llama

    model = hf_llama(n_layer=n_layer, seq=8 + steps + 2, **TINY)[0].eval()
    engine = IterationEngine(model, slots=rows, prompt_len=8, max_new_tokens=steps + 1)
    for r in range(rows):
        engine.add([1 + (r + k) % (TINY["vocab"] - 1) for k in range(8)], steps + 1)
    engine.step()   # admissions: the prefills, then the first decode step
    return engine


def _step_seconds(reps: int) -> list[float]:
    """Median seconds of a decode step of each model of ``LAYERS``, their steps interleaved (both
    see the same load)."""
    import torch

    engines = [_engine(n, WARMUP + reps) for n in LAYERS]
    times = [[] for _ in engines]
    with torch.inference_mode():
        for k in range(WARMUP + reps):
            for engine, out in zip(engines, times):
                t0 = time.perf_counter()
                engine.step()
                if k >= WARMUP:
                    out.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def measure_forward_overhead(reps: int = 30) -> tuple[float, float]:
    """(per_layer, per_forward) seconds of host work in one decode step of the engine (module
    doc); both floored at 0 (noise can make the intercept negative), the per-layer figure > 0."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as the server runs (serve_process: OMP_NUM_THREADS=1)
    try:
        few, many = _step_seconds(reps)
    finally:
        torch.set_num_threads(threads)
    per_layer = max((many - few) / (LAYERS[1] - LAYERS[0]), 1e-9)
    return per_layer, max(few - LAYERS[0] * per_layer, 0.0)


if __name__ == "__main__":
    import autopar.inference.iteration_engine  # noqa: F401  (imports outside the timing)
    import autopar.models.hf  # noqa: F401
    t0 = time.perf_counter()
    layer, forward = measure_forward_overhead()
    print(f"per layer {layer * 1e6:.0f} us, per forward {forward * 1e6:.0f} us "
          f"({time.perf_counter() - t0:.1f} s)")
