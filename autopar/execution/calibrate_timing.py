"""How calibration times a call: the fastest single call (``seconds_per_call``) and a call run
back to back long enough that time-sharing shows (``sustained_seconds_per_call``, ``SUSTAIN``).
Torch-free: the caller passes its device's ``sync``.
"""
from __future__ import annotations

import time


def seconds_per_call(fn, repeats: int, sync) -> float:
    """Seconds of one call, fastest of ``repeats``: the machine's own speed, not other users' load."""
    return sustained_seconds_per_call(fn, repeats, sync, 1)


def sustained_seconds_per_call(fn, repeats: int, sync, calls: int) -> float:
    """Seconds per call of ``fn`` run ``calls`` times back to back, fastest of ``repeats``. With
    ``calls`` chosen so one timing spans several scheduler slices, processes that
    share a core are seen sharing it: a single short call runs inside one slice at the
    full core's speed, which a training step of many calls does not get."""
    fn()
    sync()
    ts = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        ts.append((time.perf_counter() - t0) / calls)
    return min(ts)


# one sustained timing lasts at least this long: several CFS slices (3-4 ms each when a few
# processes share a core), so time-sharing averages in
SUSTAIN = 0.02
