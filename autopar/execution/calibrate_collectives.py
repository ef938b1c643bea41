"""The collectives calibration measures (``KINDS``, their bus-bandwidth ``FACTOR``) and how: one
call of the runtime's own collective code (``collective_call``), timed inside a compute +
collective loop with no barrier (``seconds_in_loop``), as a training step meets it.
"""
from __future__ import annotations

import time

from runtime import collectives as rc

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
          "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
          "broadcast": lambda n: 1.0}

# the compute between two collectives of the timing loop: ~0.2 ms on a CPU core (a few
# hundred µs of kernels separate the collectives of a tensor-parallel step on this scale)
COLL_WORK = {False: (160, 160), True: (2048, 2048)}
COLL_CALLS = 8   # collectives per timing loop


def seconds_in_loop(fn, work, repeats: int, sync) -> list[float]:
    """Seconds per collective as a training step meets it, one figure per loop (``repeats``
    loops): ``COLL_CALLS`` × (``work``; ``fn``) back to back with no barrier, each collective call
    timed on its own (so the wait for the slowest rank of the group, which compute skew and
    time-shared cores cause, is included and the compute is not), averaged."""
    fn()
    sync()
    out = []
    for _ in range(repeats):
        total = 0.0
        for _ in range(COLL_CALLS):
            work()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            total += time.perf_counter() - t0
        out.append(total / COLL_CALLS)
    return out


def collective_call(kind, numel, n, dtype, device, group):
    """One collective of ``numel`` elements (the larger buffer) run by the runtime's own code
    (runtime/collectives.py: list all_gather + concatenation, gloo's reduce-scatter as an
    all-reduce, list all_to_all), so the profile prices what training runs."""
    import torch
    import torch.distributed as dist

    x = torch.randn(numel, dtype=dtype, device=device)
    if kind == "all_reduce":
        return lambda: rc._raw_all_reduce(x, group, "calibrate")
    if kind == "broadcast":
        src = dist.get_global_rank(group, 0) if group is not None else 0
        return lambda: dist.broadcast(x, src=src, group=group)
    if kind == "all_gather":
        shard = torch.randn(numel // n, dtype=dtype, device=device)
        return lambda: rc._raw_all_gather(shard, 0, group, "calibrate")
    if kind == "reduce_scatter":
        return lambda: rc._raw_reduce_scatter(x, 0, group, "calibrate")
    return lambda: rc._raw_all_to_all(x, 0, 0, group, "calibrate")


