"""Measured step figures next to the plan's predictions, while training: ``compile(log_every=N,
on_step=...)`` and ``CompiledModel.stats()``.

Each ``step`` is timed on every rank (wall clock around the whole step; the returned loss is a
host float, so the step's device work has finished). The first step is left out (warm-up: set-up
when ``compile`` had no example inputs, allocator and kernel warm-up). Over a window of steps:

    step time      mean seconds per step                      plan: predictions.step_time
    tokens/s       tokens per step / step time                plan: tokens per step / predicted step
                   (tokens: the first input's elements when it is an integer tensor of >= 2 dims,
                   e.g. [batch, seq] token ids; otherwise samples/s, samples = the global batch)
    TFLOP/s        model FLOPs per step / (step time × devices): achieved, per device
    MFU            model FLOPs per step / (step time × devices × the device's peak FLOP/s for the
                   plan's precision) — the plan's own definition (autopar/search/predict.py), so the
                   predicted MFU shown is exactly ``plan.mfu``

Model FLOPs are the plan's (``predictions.model_flops``: forward + backward of the traced graph,
recomputation not counted); devices are the plan's world size; the peak is the plan's cluster's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepStats:
    """Figures over the last ``steps`` measured steps, ending at step ``step`` (1-based), each
    with the plan's prediction. ``unit`` is "tokens" or "samples" (what ``throughput`` counts)."""
    step: int
    steps: int
    step_time: float
    predicted_step_time: float
    unit: str
    throughput: float
    predicted_throughput: float
    tflops: float               # achieved model TFLOP/s per device
    predicted_tflops: float
    mfu: float
    predicted_mfu: float

    def line(self) -> str:
        """One printed line: each measured figure with the plan's prediction in brackets."""
        return (f"step {self.step}: {_ms(self.step_time)}/step (plan {_ms(self.predicted_step_time)}), "
                f"{self.throughput:,.0f} {self.unit}/s (plan {self.predicted_throughput:,.0f}), "
                f"{self.tflops:.3g} TFLOP/s per device (plan {self.predicted_tflops:.3g}), "
                f"MFU {100 * self.mfu:.1f}% (plan {100 * self.predicted_mfu:.1f}%) "
                f"[mean of {self.steps} step{'s' if self.steps != 1 else ''}]")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.2f} s"


class StepTimer:
    """Step wall times of one CompiledModel and what a step holds (from the plan and the example batch)."""

    def __init__(self, log_every: int | None, on_step, rank_fn):
        self.log_every, self.on_step, self._rank = log_every, on_step, rank_fn
        self.times: list[float] = []     # every step's seconds, the first (warm-up) included
        self.last: StepStats | None = None
        self._t0 = None

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self, cm) -> None:
        if self._t0 is None:
            return
        self.times.append(time.perf_counter() - self._t0)
        self._t0 = None
        n = len(self.times)
        if self.log_every and n % self.log_every == 0 and n > 1:
            # the window since the last report, the first (warm-up) step left out
            stats = self.stats(cm, min(self.log_every, n - 1))
            self.last = stats
            if self.on_step is not None:
                self.on_step(stats)
            elif self._rank() == 0:
                print(f"autopar: {stats.line()}", flush=True)

    def stats(self, cm, last: int | None = None) -> StepStats | None:
        measured = self.times[1:]
        if not measured:
            return None
        window = measured[-last:] if last else measured
        return figures(cm, len(self.times), len(window), sum(window) / len(window))


def work_per_step(cm) -> tuple[str, float]:
    """("tokens", tokens per step) when the first input is integer with >= 2 dims, else
    ("samples", the global batch)."""
    shape, dtype = cm._example[0]
    if len(shape) >= 2 and not dtype.is_floating_point and dtype != torch.bool:
        return "tokens", float(torch.Size(shape).numel())
    return "samples", float(cm.global_batch)


def figures(cm, step: int, steps: int, step_time: float) -> StepStats:
    plan = cm.plan
    pred = plan.data["predictions"]
    predicted = float(pred["step_time"])
    flops = float(pred.get("model_flops", 0.0))
    devices = plan.world_size
    precision = plan.data.get("settings", {}).get("precision", "fp32")
    peak = plan.cluster.device.peak("bf16" if precision == "bf16" else "fp32")
    unit, work = work_per_step(cm)

    def per_device(t):
        return flops / (t * devices) if t > 0 else 0.0

    return StepStats(step=step, steps=steps, step_time=step_time, predicted_step_time=predicted, unit=unit,
                     throughput=work / step_time if step_time > 0 else 0.0,
                     predicted_throughput=work / predicted if predicted > 0 else 0.0,
                     tflops=per_device(step_time) / 1e12, predicted_tflops=per_device(predicted) / 1e12,
                     mfu=per_device(step_time) / peak, predicted_mfu=float(plan.mfu))
