"""The curves a calibration profile keeps, fitted to measured points: GEMM rate by arithmetic
intensity (``fit_gemm``), collective bus bandwidth non-decreasing in size (``isotonic``) with times
that never fall as messages grow (``monotone_times``), and duplicate sizes merged by median
(``collapse_points``). Pure arithmetic on (x, y) points.
"""
from __future__ import annotations

import math
import statistics


def collapse_points(points, key_digits: int = 2):
    """Sorted (x, y) with duplicate x merged by median; monotone-free (measurements as they are)."""
    by = {}
    for x, y in points:
        by.setdefault(round(x, key_digits), []).append(y)
    return tuple(sorted((x, statistics.median(ys)) for x, ys in by.items()))


def isotonic(points):
    """Pool-adjacent-violators: the non-decreasing (in size) bus bandwidth closest to the
    measured points (larger messages never get slower per byte; single readings on a loaded
    machine do)."""
    blocks = []   # [sum, count, xs]
    for x, y in points:
        blocks.append([y, 1, [x]])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s2, c2, x2 = blocks.pop()
            blocks[-1][0] += s2
            blocks[-1][1] += c2
            blocks[-1][2] += x2
    return tuple((x, s / c) for s, c, xs in blocks for x in xs)


def fit_gemm(points):
    """Least-squares fit (log rates) of rate(AI) = R · AI^p / (AI^p + k^p), the form of
    autoparallel's H100 fit, to the measured (intensity, FLOP/s) points: one smooth monotone curve
    instead of single noisy shapes (on a loaded CPU one shape can read 4x off its neighbours)."""
    best = None
    xs = [a for a, _ in points]
    ly = [math.log(r) for _, r in points]
    for p in (0.5, 0.75, 1.0, 1.47, 2.0, 3.0):
        for k in [min(xs) * 2 ** (i / 4) for i in range(-8, 40)]:
            g = [math.log(a ** p / (a ** p + k ** p)) for a in xs]
            logR = statistics.mean(y - gi for y, gi in zip(ly, g))
            sse = sum((y - gi - logR) ** 2 for y, gi in zip(ly, g))
            if best is None or sse < best[0]:
                best = (sse, p, k, math.exp(logR))
    _, p, k, R = best
    grid = sorted({min(xs) / 4, *[min(xs) * 2 ** i for i in range(0, 16) if min(xs) * 2 ** i <= max(xs) * 4]})
    return tuple((a, R * a ** p / (a ** p + k ** p)) for a in grid)


def monotone_times(points, factor: float = 1.0):
    """(bytes, bus bandwidth) points whose times (``factor`` · bytes / bandwidth) never fall as the
    message grows: each time becomes the least of its own and every larger message's (a smaller
    message never takes longer; a measured one does when another rank's skew falls into its
    loops: 2 gloo processes, a 1 KB all-reduce read 1.4 ms where 8 KB read 0.6 ms).
    Then ``isotonic`` on the bandwidths."""
    pts = sorted(points)
    times = [factor * x / y for x, y in pts]
    for i in range(len(times) - 2, -1, -1):
        times[i] = min(times[i], times[i + 1])
    return isotonic([(x, factor * x / t) for (x, _), t in zip(pts, times)])
