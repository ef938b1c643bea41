"""Request traces for inference planning, and the serving simulation that prices a configuration
on one.

A ``RequestTrace`` is each request's arrival time (s), prompt length and output length (tokens):
``load_trace`` reads the CSV format of Vidur's processed traces (``arrived_at``,
``num_prefill_tokens``, ``num_decode_tokens``; e.g. its converted Splitwise conversation and code
traces), ``synthetic_trace`` draws Poisson arrivals with lengths resampled from given ones.

``simulate`` serves a trace the way autopar's server does (autopar/inference/batcher.py): each
of ``replicas`` takes, when free, up to ``batch_size`` waiting requests in arrival order (waiting
``batch_wait`` after taking the first for others to join, as the batcher does), pads their prompts
to the longest, runs the prefill (``prefill(batch, prompt)`` seconds), then decode steps until the
batch's longest output is done (each ``decode(batch, context)`` seconds, priced at the batch's mean
context: the prompt plus half its longest output). A request's first token comes at the end of the
prefill, its last after
its own output length in steps. Prompt and context lengths are priced rounded up to ``BUCKET``
tokens, so the prices of a long trace are a few hundred calls. It returns per-request TTFT
(queueing included), time per output token and end-to-end latency, their percentiles, and the
output tokens per second over the trace (``served``). ``simulate_continuous``
(autopar/inference/continuous.py) serves a trace with continuous batching instead.
"""
from __future__ import annotations

import csv
import heapq
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from autopar.errors import PlanError

COLUMNS = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")
BUCKET = 64


@dataclass(frozen=True)
class RequestTrace:
    arrivals: np.ndarray      # seconds, non-decreasing
    prompt_lens: np.ndarray   # tokens
    output_lens: np.ndarray   # tokens

    def __len__(self) -> int:
        return len(self.arrivals)

    def stats(self) -> dict:
        """Requests, duration, rate and length percentiles (what a plan records of its trace)."""
        span = float(self.arrivals[-1] - self.arrivals[0]) if len(self) > 1 else 0.0

        def pct(a):
            return {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)} | {"max": int(a.max())}
        return {"requests": len(self), "seconds": span, "rate": (len(self) - 1) / span if span > 0 else 0.0,
                "prompt": pct(self.prompt_lens), "output": pct(self.output_lens)}

    def scaled(self, factor: float) -> "RequestTrace":
        """The same requests arriving ``factor`` times as fast."""
        return RequestTrace(self.arrivals / factor, self.prompt_lens, self.output_lens)

    def head(self, n: int) -> "RequestTrace":
        return RequestTrace(self.arrivals[:n], self.prompt_lens[:n], self.output_lens[:n])


def _checked(arrivals, prompts, outputs, where: str) -> RequestTrace:
    a = np.asarray(arrivals, dtype=float)
    p = np.asarray(prompts, dtype=np.int64)
    o = np.asarray(outputs, dtype=np.int64)
    if not len(a):
        raise PlanError(f"{where}: the trace has no requests")
    if (a < 0).any() or (np.diff(a) < 0).any():
        raise PlanError(f"{where}: arrival times must be non-negative and in order")
    if (p < 1).any() or (o < 1).any():
        raise PlanError(f"{where}: every request needs a prompt and an output of at least one token")
    return RequestTrace(a - a[0], p, o)


def load_trace(path) -> RequestTrace:
    """A trace from a CSV file with the columns ``COLUMNS`` (Vidur's processed traces)."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        raise PlanError(f"cannot read the trace {path}: {e}") from None
    missing = [c for c in COLUMNS if not rows or c not in rows[0]]
    if missing:
        raise PlanError(f"trace {path}: columns {', '.join(missing)} are missing; a trace has "
                        f"{', '.join(COLUMNS)} (arrival seconds, prompt tokens, output tokens)")
    try:
        cols = [[float(r[c]) for r in rows] for c in COLUMNS]
    except ValueError as e:
        raise PlanError(f"trace {path}: {e}") from None
    return _checked(*cols, where=f"trace {path}")


def synthetic_trace(n: int, rate: float, prompt_lens, output_lens, seed: int = 0) -> RequestTrace:
    """``n`` requests arriving as a Poisson process of ``rate`` per second, their prompt and output
    lengths drawn (with replacement) from ``prompt_lens`` and ``output_lens``."""
    if n < 1 or rate <= 0:
        raise PlanError(f"a synthetic trace needs n >= 1 and rate > 0, got n={n}, rate={rate}")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    return _checked(arrivals, rng.choice(np.asarray(prompt_lens), n), rng.choice(np.asarray(output_lens), n),
                    where="synthetic trace")


def bucket(tokens: float) -> int:
    """``tokens`` rounded up to ``BUCKET`` (the lengths prices are asked at)."""
    return int(math.ceil(tokens / BUCKET) * BUCKET)


def simulate(trace: RequestTrace, prefill, decode, replicas: int, batch_size: int,
             batch_wait: float = 0.0) -> dict:
    """Serve ``trace`` (module doc). ``prefill(batch, prompt)`` and ``decode(batch, context)`` are
    seconds; returns percentiles of ttft, tpot and latency (s), tokens_per_s and the arrays."""
    prefill, decode = lru_cache(maxsize=None)(prefill), lru_cache(maxsize=None)(decode)
    n = len(trace)
    a, p, o = trace.arrivals, trace.prompt_lens, trace.output_lens
    ttft, tpot, done = np.zeros(n), np.zeros(n), np.zeros(n)
    free = [(0.0, r) for r in range(replicas)]   # (free at, replica)
    heapq.heapify(free)
    i = 0
    while i < n:
        at, r = heapq.heappop(free)
        deadline = max(at, a[i]) + batch_wait   # taken from the queue, the first waits batch_wait ...
        last = i + batch_size - 1              # ... unless the batch fills before
        start = max(at, a[i], a[last]) if last < n and a[last] <= deadline else deadline
        j = i + 1
        while j < n and j - i < batch_size and a[j] <= start:
            j += 1
        rows = j - i
        prompt = bucket(p[i:j].max())
        longest = int(o[i:j].max())
        first = start + prefill(rows, prompt)
        step = decode(rows, bucket(prompt + longest / 2))
        ttft[i:j] = first - a[i:j]
        done[i:j] = first + (o[i:j] - 1) * step
        tpot[i:j] = np.where(o[i:j] > 1, step, 0.0)
        heapq.heappush(free, (first + (longest - 1) * step, r))
        i = j
    return served(trace, ttft, tpot, done)


def served(trace: RequestTrace, ttft: np.ndarray, tpot: np.ndarray, done: np.ndarray) -> dict:
    """A simulation's result from each request's TTFT, time per output token and finish time (s):
    percentiles of ttft, tpot (of outputs longer than one token) and latency, output tokens per
    second over the trace, and the arrays."""
    a, o = trace.arrivals, trace.output_lens
    latency = done - a
    span = float(done.max() - a[0]) or 1e-9

    def pct(x):
        return {f"p{q}": float(np.percentile(x, q)) for q in (50, 90, 99)}
    return {"ttft": pct(ttft), "tpot": pct(tpot[o > 1]) if (o > 1).any() else pct(tpot), "latency": pct(latency),
            "tokens_per_s": float(o.sum()) / span, "arrays": {"ttft": ttft, "tpot": tpot, "latency": latency}}


__all__ = ["BUCKET", "COLUMNS", "RequestTrace", "load_trace", "served", "simulate", "synthetic_trace"]
