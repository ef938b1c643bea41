"""The host (Python / dispatch) overhead of one forward of a Hugging Face decoder, as the inference
pricer adds it to every iteration (autopar/inference/inference_cost.py, "Host overhead"):
``measure_forward_overhead`` -> (seconds per decoder layer, seconds per forward); and the rate of
skinny GEMMs over uncached weights (``measure_skinny_gemm`` -> (bytes/s, FLOP/s)), the floor the
pricer puts under a decode step's projections on a CPU.

A tiny model's decode step is not spent in its kernels: each decoder layer runs a dozen Python
modules (norms, projections, rotary, attention, the cache update), each a few torch dispatches,
and the step around them (the model's own set-up, the mask, the LM head, the engine's sampling)
costs about as much again. The figures are measured where kernels cost ~nothing: the iteration
engine's decode step (what the server runs, autopar/inference/iteration_engine.py ``_decode``,
reproduced by ``_Decoder``) of a Llama of hidden 16 with 1 and ``LAYERS[1]`` decoder layers, two
sequences of a few tokens; the slope over layers is the per-layer figure, the intercept the
per-forward one.

Each figure is a median over steps (the first steps, which pay one-time costs, dropped) and over
three rounds: the host work is what the machine's load slows, and the median is what the served
steps see at the load the calibration ran under. About 2-4 s on one core after the imports
(transformers' imports and a first forward take 5-15 s more in a fresh process).
"""
from __future__ import annotations

import math
import statistics
import time

LAYERS = (1, 5)          # decoder layers of the two models timed
TINY = dict(d_model=16, n_head=2, n_kv_heads=1, ffn_hidden=32, vocab=32)
WARMUP = 5


class _Decoder:
    """The iteration engine's decode step (autopar/inference/iteration_engine.py ``_decode``:
    each row's last token, the attention mask grown by a column, per-row positions, a batched
    ``DynamicCache``, each row's next token taken greedily) on a tiny Llama of ``n_layer`` layers,
    ``rows`` prompts of 8 tokens prefilled together. Written here, not imported: calibration sits
    below the inference package (docs/architecture.md, "Package imports")."""

    def __init__(self, n_layer: int, steps: int, rows: int = 2):
        import torch
        from transformers import DynamicCache

        from autopar.models.hf import hf_llama

        self.model = hf_llama(n_layer=n_layer, seq=8 + steps + 2, **TINY)[0].model.eval()
        ids = torch.tensor([[1 + (r + k) % (TINY["vocab"] - 1) for k in range(8)] for r in range(rows)])
        self.mask = torch.ones_like(ids)
        self.cache = DynamicCache()
        logits = self._forward(input_ids=ids, attention_mask=self.mask)
        self.tokens = [int(logits[r, -1].argmax(-1)) for r in range(rows)]

    def _forward(self, **inputs):
        try:
            return self.model(**inputs, cache=self.cache, use_cache=True).logits
        except TypeError:   # transformers before the ``cache`` argument
            return self.model(**inputs, past_key_values=self.cache, use_cache=True).logits

    def step(self) -> None:
        import torch
        rows, width = self.mask.shape
        ids = torch.tensor([[t] for t in self.tokens], dtype=torch.long)
        lengths = self.mask.sum(-1)
        self.mask = torch.cat([self.mask, self.mask.new_ones(rows, 1)], dim=1)
        logits = self._forward(input_ids=ids, attention_mask=self.mask, position_ids=lengths[:, None],
                               cache_position=torch.tensor([width]))[:, -1]
        self.tokens = [int(logits[r].float().argmax(-1)) for r in range(rows)]


def _step_seconds(reps: int) -> list[list[float]]:
    """Seconds of each of ``reps`` decode steps of each model of ``LAYERS``, their steps
    interleaved (both see the same load)."""
    import torch

    with torch.inference_mode():
        engines = [_Decoder(n, WARMUP + reps) for n in LAYERS]
    times = [[] for _ in engines]
    with torch.inference_mode():
        for k in range(WARMUP + reps):
            for engine, out in zip(engines, times):
                t0 = time.perf_counter()
                engine.step()
                if k >= WARMUP:
                    out.append(time.perf_counter() - t0)
    return times


def measure_forward_overhead(reps: int = 30, rounds: int = 3) -> tuple[float, float]:
    """(per_layer, per_forward) seconds of host work in one decode step of the engine (module
    doc): per round, the slope is the median over steps of (the ``LAYERS[1]``-layer step - the
    1-layer step taken next to it) / the layers between, the intercept the 1-layer steps' median
    less one layer; the median over ``rounds`` rounds of each (a step preempted by another process
    moves one round's figures, not the result). The per-layer figure is floored at 1 ns and the
    per-forward one at 0 (noise can make the intercept negative)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as the server runs (serve_process: OMP_NUM_THREADS=1)
    slopes, intercepts = [], []
    try:
        for _ in range(rounds):
            few, many = _step_seconds(reps)
            slope = statistics.median(b - a for a, b in zip(few, many)) / (LAYERS[1] - LAYERS[0])
            slopes.append(slope)
            intercepts.append(statistics.median(few) - LAYERS[0] * slope)
    finally:
        torch.set_num_threads(threads)
    return max(statistics.median(slopes), 1e-9), max(statistics.median(intercepts), 0.0)


SKINNY = dict(k=256, n=1024, count=32, rows=(1, 16))   # 32 weights of 1 MiB (fp32): past the caches


def measure_skinny_gemm(reps: int = 9) -> tuple[float, float]:
    """(bytes/s, FLOP/s) of skinny GEMMs over weights that are not in cache, as a decode step's
    projections read them: the median seconds of a pass of ``count`` fp32 linears [rows, k] x
    [k, n] over distinct weights (32 MiB in all) at 1 and 16 rows, fitted to t = bytes /
    bandwidth + FLOPs / rate (the 1-row pass is the weights' streaming, the 16-row one adds the
    arithmetic). One thread; about 1 s."""
    import torch

    k, n, count, (r1, r2) = SKINNY["k"], SKINNY["n"], SKINNY["count"], SKINNY["rows"]
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) for _ in range(count)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def pass_seconds(rows: int) -> float:
        x = torch.randn(rows, k, generator=gen)
        times = []
        with torch.inference_mode():
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                for w in weights:
                    torch.nn.functional.linear(x, w)
                times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])
    try:
        t1, t2 = pass_seconds(r1), pass_seconds(r2)
    finally:
        torch.set_num_threads(threads)
    params = count * k * n
    flops = 2 * params * (r2 - r1)
    rate = flops / (t2 - t1) if t2 > t1 else math.inf
    stream = t1 - 2 * params * r1 / rate
    nbytes = 4 * (params + count * r1 * (k + n))
    bandwidth = nbytes / stream if stream > 0 else nbytes / t1
    return bandwidth, (rate if math.isfinite(rate) else 0.0)


if __name__ == "__main__":
    import transformers  # noqa: F401  (imports outside the timing)

    import autopar.models.hf  # noqa: F401
    t0 = time.perf_counter()
    layer, forward = measure_forward_overhead()
    bw, rate = measure_skinny_gemm()
    print(f"per layer {layer * 1e6:.0f} us, per forward {forward * 1e6:.0f} us, skinny GEMMs {bw / 1e9:.2f} GB/s "
          f"+ {rate / 1e9:.1f} GFLOP/s ({time.perf_counter() - t0:.1f} s)")
