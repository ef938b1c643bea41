"""``autopar calibrate``: measure this machine and write a calibration profile (autopar/profile.py).

Measures, on every rank at once (so ranks that share cores or memory bandwidth see each other):

* GEMMs over a sweep of shapes (square and narrow, as tensor parallelism makes them): FLOP/s by
  arithmetic intensity (cost.gemm_intensity);
* memory-bound kernels (an elementwise add) by bytes moved, and the cost of a tiny kernel;
* the backward / forward time ratio of common ops (SDPA, GELU, layer norm, softmax, dropout,
  add, mul, cross-entropy, embedding: ``backward_ratios``) and the median over five elementwise
  ops for the rest;
* each collective (all_reduce, all_gather, reduce_scatter, broadcast, all_to_all) by message
  size over the world group and over groups of 2 consecutive ranks (the mesh axes a 2-level
  mesh uses), as nccl-tests bus bandwidth — run by the runtime's own collective code inside a
  compute + collective loop without barriers, so each call includes the wait for the slowest
  rank that a training step's blocking collectives see;
* the slowdown of a GEMM loop while an all-reduce runs behind it (overlap_slowdown);
* the host figures offload is priced with (``host_copy_bandwidth``: a 256 MiB host<->device copy,
  pinned, the slower direction; on a CPU host buffer to host buffer; ``host_cpu_bandwidth``: the
  runtime's AdamW step on 16 Mi fp32 elements on the host), every rank at once, so the CPU
  figure is one rank's share of the node's;
* on a CPU, each measured rule's forward rate in the FLOPs its rule counts (``op_rates``),
  per-rule floors of tiny ops (``op_floors``) and the runtime's host work per training
  step outside the program (``step_overhead``, autopar/execution/step_overhead.py: a minimal
  model planned with the figures above and compiled, each piece of the step's host work timed
  the way the step calls it).

Runs under an initialised process group (torchrun / ``autopar run -n N``: NCCL on GPUs, gloo on
CPUs) or, for the ``cpu`` preset, forks ``nprocs`` local gloo processes itself. CPU compute is
timed on rank 0 alone (fastest single call: robust to other users' load) and divided by the core
share each process gets (cores / local processes, at most 1); GPU compute is timed sustained
(>= 20 ms per timing) on every rank at once, the slowest rank's.
"""
from __future__ import annotations

import math
import os
import statistics
import time

from autopar.execution.step_overhead import measure as step_overhead
from autopar.pricing.cost import gemm_intensity
from autopar.profile import Calibration
from autopar.rules.table import spec_for
from runtime import collectives as rc
from runtime.collectives import COMM_STATS
from runtime.launch import run_local

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
          "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
          "broadcast": lambda n: 1.0}

SWEEPS = {
    # (gemm (M, N, K) shapes, memory-bound sizes in bytes, collective sizes in bytes)
    "tiny": ([(64, 64, 64), (256, 256, 256), (512, 64, 512)],
             [2**14, 2**20], [2**12, 2**18]),
    "cpu": ([(32, 32, 32), (64, 64, 64), (128, 128, 128), (256, 256, 256), (512, 512, 512), (1024, 1024, 1024),
             (1024, 64, 256), (2048, 128, 512), (512, 32, 512), (4096, 16, 64), (256, 1024, 64),
             (2048, 2048, 64), (128, 4096, 128), (4096, 256, 256), (512, 2048, 512)],
            [2**10, 2**13, 2**16, 2**19, 2**21, 2**23, 2**25],
            [2**10, 2**13, 2**16, 2**19, 2**21, 2**23]),
    "gpu": ([(s, s, s) for s in (256, 512, 1024, 2048, 4096, 8192)]
            + [(8192, n, k) for n in (256, 512, 1024) for k in (1024, 4096, 8192)],
            [2**16, 2**20, 2**24, 2**27, 2**29], [2**15, 2**20, 2**22, 2**24, 2**26, 2**28]),
}


def _timed(fn, repeats: int, sync) -> float:
    """Seconds of one call, fastest of ``repeats``: the machine's own speed, not other users' load."""
    return _sustained(fn, repeats, sync, 1)


def _sustained(fn, repeats: int, sync, calls: int) -> float:
    """Seconds per call of ``fn`` run ``calls`` times back to back, fastest of ``repeats``. With
    ``calls`` chosen so one timing spans several scheduler slices (``_calls_for``), processes
    that share a core are seen sharing it: a single short call runs inside one slice at the
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


def _collapse(points, key_digits: int = 2):
    """Sorted (x, y) with duplicate x merged by median; monotone-free (measurements as they are)."""
    by = {}
    for x, y in points:
        by.setdefault(round(x, key_digits), []).append(y)
    return tuple(sorted((x, statistics.median(ys)) for x, ys in by.items()))


def measure(sweep: str = "cpu", repeats: int = 5, dtype=None, device=None) -> dict:
    """Run on every rank of the current process group (or alone). Returns the profile dict on
    rank 0 (others: None)."""
    import torch
    import torch.distributed as dist

    dist_on = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if dist_on else 0
    world = dist.get_world_size() if dist_on else 1
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    barrier = (lambda: (sync(), dist.barrier())) if dist_on else sync
    itemsize = torch.tensor([], dtype=dtype).element_size()
    shapes, mem_sizes, coll_sizes = SWEEPS[sweep]
    agree_on = device if gpu else torch.device("cpu")   # where figures ranks agree on travel (NCCL: the device)

    def slowest(ts: list) -> list:
        """Each figure at its slowest rank's (every rank measured the same things in the same
        order): what a synchronous step, or loop, took for the group."""
        if not dist_on:
            return list(ts)
        x = torch.tensor(ts, dtype=torch.float64, device=agree_on)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return x.tolist()

    def agreed(t: float) -> float:   # the slowest rank's figure
        return slowest([t])[0]

    # The fraction of a core each process gets when all of this machine's processes compute at
    # once: 4 processes on 2 cores get half a core each (1 for GPUs: one device per process).
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = 1.0 if gpu else min(1.0, cores / (local * torch.get_num_threads()))

    def timed(fn, reps=repeats) -> float:
        """Seconds per call. GPU: sustained over SUSTAIN on every rank at once, the slowest
        rank's. CPU: rank 0 alone, fastest single call (the machine's per-core speed; other
        users' load only ever adds time, so the fastest call is the one it spared), divided by
        the core share (time-sharing made explicit: a 20 ms sustained timing saw it too, but
        also every other user's load, and priced compute up to 2x slow under load)."""
        if gpu:
            fn()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            calls = max(1, math.ceil(SUSTAIN / max(agreed(time.perf_counter() - t0), 1e-7)))
            barrier()
            return agreed(_sustained(fn, reps, sync, calls))
        t = _timed(fn, max(reps, 5), sync) if rank == 0 else 0.0
        if dist_on:
            x = torch.tensor([t], dtype=torch.float64)
            dist.broadcast(x, src=0)
            t = float(x)
        return t / share

    def ratio(fw, fb, calls: int = max(2 * repeats, 12)) -> float:
        """Backward / forward time of an op: single calls of forward and forward + backward
        alternately, fastest of each on this rank, averaged over ranks. A ratio of two times
        on the same core: time-sharing cancels out, and single calls are the ones least often
        hit by other processes' load (sustained timings under a changing load were off by 3x)."""
        fw()
        fb()
        t_f = t_fb = math.inf
        for _ in range(calls):
            sync()
            t0 = time.perf_counter()
            fw()
            sync()
            t1 = time.perf_counter()
            fb()
            sync()
            t_f, t_fb = min(t_f, t1 - t0), min(t_fb, time.perf_counter() - t1)
        r = (t_fb - t_f) / t_f
        if dist_on:
            x = torch.tensor([r], dtype=torch.float64, device=agree_on)
            dist.all_reduce(x)
            r = float(x) / world
        return r

    # GEMMs (all ranks at once)
    gemm = []
    for (m, n, k) in shapes:
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        t = timed(lambda: torch.mm(a, b))
        ai = gemm_intensity({"m": m, "n": n, "k": k}, ["mk", "kn", "mn"], itemsize)
        gemm.append((ai, 2.0 * m * n * k / t))
    tiny_a = torch.randn(1, 1, dtype=dtype, device=device)
    gemm_latency = timed(lambda: torch.mm(tiny_a, tiny_a))
    # elementwise arithmetic (pointwise rules count 1 FLOP per element): the median over a mix of
    # cheap and transcendental ops, forward and backward, on 1 Mi elements (a CPU) or 64 Mi (a GPU:
    # at 1 Mi each kernel is its launch, and the rate came out 50x too slow on an H200)
    n_vec = VECTOR_NUMEL_GPU if gpu else 2**20
    x = torch.randn(n_vec, dtype=dtype, device=device, requires_grad=True)
    fwd_t, both_t = [], []
    for f in (torch.exp, torch.tanh, torch.nn.functional.gelu, torch.sigmoid, lambda t: t * t):
        g = torch.ones(n_vec, dtype=dtype, device=device)

        def fw(f=f):
            with torch.no_grad():
                f(x)

        def fb(f=f):
            f(x).backward(g)
        fwd_t.append(timed(fw))
        both_t.append(ratio(fw, fb))
    vector_rate = n_vec / statistics.median(fwd_t)
    backward_ratio = max(1.0, statistics.median(both_t))
    backward_ratios = _backward_ratios(ratio, dtype, device, large=gpu)
    op_rates = {} if gpu else _op_rates(timed, dtype, device)
    # a view (no data moved) still costs a dispatch on the host; on a GPU that overlaps the
    # device's work, on a CPU it does not
    view_overhead = timed(lambda: x.view(-1).t()) / 2 if not gpu else 0.0
    # optimizer: fixed cost per parameter tensor of one AdamW step (torch's single-tensor path,
    # op for op what runtime/optim.py runs), tiny tensors so bytes do not count
    params = [torch.nn.Parameter(torch.randn(16, dtype=torch.float32, device=device)) for _ in range(32)]
    for q in params:
        q.grad = torch.randn_like(q)
    opt = torch.optim.AdamW(params, foreach=False)
    optimizer_overhead = timed(opt.step) / len(params)
    del opt, params
    # the host figures offload is priced with, every rank at once (what offloaded ranks share)
    host_copy_bandwidth, host_cpu_bandwidth = _host_rates(device, lambda fn: agreed(_timed(fn, 3, barrier)))
    # memory-bound: c = a + b moves 3 × size bytes
    memory = []
    for size in mem_sizes:
        numel = max(1, size // itemsize)
        a = torch.randn(numel, dtype=dtype, device=device)
        b = torch.randn(numel, dtype=dtype, device=device)
        out = torch.empty_like(a)
        t = timed(lambda: torch.add(a, b, out=out))
        memory.append((3.0 * numel * itemsize, 3.0 * numel * itemsize / t))
    # per-op overhead as training sees it: a chain of tiny ops through autograd, forward and
    # backward (dispatcher, autograd bookkeeping, launch), per kernel
    chain = 50
    leaf = torch.randn(4, dtype=dtype, device=device, requires_grad=True)

    def ops():
        y = leaf
        for _ in range(chain):
            y = y * 1.0001
        y.sum().backward()
    kernel_overhead = timed(ops) / (2 * chain + 2)
    # per-rule floors (CPU: the host is the device, nothing hides a tiny op's fixed cost)
    op_floors = {} if gpu else _op_floors(timed, dtype, device)
    # collectives: world group and groups of 2 consecutive ranks, each timed as a training step
    # meets it (_in_loop): the runtime's own collective code, back to back with compute between,
    # no barrier, so each call includes waiting for the slowest rank of its group
    curves = []
    groups = {}
    if dist_on and world > 1:
        groups[world] = None
        if world > 2 and world % 2 == 0:
            pairs = [dist.new_group(list(range(i, i + 2))) for i in range(0, world, 2)]
            groups[2] = pairs[rank // 2]
    work_a = torch.randn(*COLL_WORK[gpu], dtype=dtype, device=device)
    for n, group in groups.items():
        for kind in KINDS:
            pts = []
            for size in coll_sizes:
                numel = max(n, size // itemsize // n * n)
                nbytes = numel * itemsize
                fn = _collective(kind, numel, n, dtype, device, group)
                barrier()
                # the fastest loop at its slowest rank's time (each rank's own fastest are
                # different loops, and the slowest of those is faster than any loop was)
                t = min(slowest(_in_loop(fn, lambda: torch.mm(work_a, work_a), repeats, sync)))
                pts.append((float(nbytes), FACTOR[kind](n) * nbytes / t))
            curves.append((kind, n, monotone_times(pts, FACTOR[kind](n))))

    # overlap: a GEMM loop alone vs with a large all-reduce issued behind it
    slowdown = 0.0
    if dist_on and world > 1:
        s = shapes[min(4, len(shapes) - 1)][0]
        a = torch.randn(s, s, dtype=dtype, device=device)
        buf = torch.randn(max(1, coll_sizes[-1] // itemsize), dtype=dtype, device=device)
        reps = 4

        def loop():
            for _ in range(reps):
                torch.mm(a, a)
        barrier()
        t_alone = agreed(_timed(loop, repeats, sync))
        t_comm = agreed(_timed(lambda: dist.all_reduce(buf), repeats, barrier))

        def both():
            w = dist.all_reduce(buf, async_op=True)
            loop()
            w.wait()
        t_both = agreed(_timed(both, repeats, barrier))
        hidden = min(t_alone, t_comm)
        # t_both = max(alone, comm) + slowdown · hidden (cost.exposed_comm's model)
        slowdown = min(0.95, max(0.0, (t_both - max(t_alone, t_comm)) / hidden)) if hidden > 0 else 0.0

    # every rank builds the profile (each figure above is rank 0's or agreed by all): the step
    # overhead's plan and run below need it everywhere
    links = {"hop_latency": 0.0,
             "curves": {f"{k}@{n}": [list(p) for p in t] for k, n, t in curves}} if curves else None
    out = {"name": f"{'gpu' if gpu else 'cpu'}-measured", "source":
           f"autopar calibrate: {world} process(es), {device.type}, {str(dtype).replace('torch.', '')}, "
           f"sweep {sweep}, fastest of {repeats}, compute x {1 / share:g} ({local} process(es) per "
           f"{cores} core(s)), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
           "gemm_dtype": {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype],
           "gemm": [list(p) for p in fit_gemm(gemm)], "gemm_latency": gemm_latency,
           "memory": [list(p) for p in _collapse(memory, 0)], "kernel_overhead": kernel_overhead,
           "overlap_slowdown": slowdown, "vector_rate": vector_rate,
           "optimizer_overhead": optimizer_overhead, "backward_ratio": backward_ratio,
           "view_overhead": view_overhead, "backward_ratios": backward_ratios,
           "host_copy_bandwidth": host_copy_bandwidth, "host_cpu_bandwidth": host_cpu_bandwidth,
           **({"op_floors": op_floors} if op_floors else {}),
           **({"op_rates": op_rates} if op_rates else {})}
    if links:
        out["links"] = {"intra": links}
    else:   # one process: no links measured; a placeholder curve (never used by a 1-rank mesh)
        out["links"] = {"intra": {"curves": {"all_reduce@2": [[1.0, 1e9]]}}}
    if not gpu and dist_on:   # the runtime's host work per step, what the figures above leave unpriced
        out["step_overhead"] = step_overhead(out)
    COMM_STATS.reset()   # the runtime's collectives counted the calibration's bytes
    return out if rank == 0 else None


# the host figures' buffers: large enough that per-call costs vanish and (mostly) past the
# caches, small enough to time in well under a second on a CPU core (a 16 Mi-element AdamW step:
# ~0.1 s, 320 MB with its temporary; a 256 MiB copy: ~40 ms, measured here)
HOST_COPY_BYTES = 256 << 20
HOST_OPT_NUMEL = 16 << 20


def _host_rates(device, together) -> tuple[float, float]:
    """(host_copy_bandwidth, host_cpu_bandwidth) of the profile: bytes/s of one host<->device copy
    of ``HOST_COPY_BYTES`` (GPU: pinned host memory, each direction, the slower kept; CPU: host
    buffer to host buffer, which is what the "device" and "host" pools are there), and bytes/s of
    the step an offloaded AdamW runs on the host (runtime/optim.py ``host_step``: torch's fused
    CPU kernel, fp32) over ``HOST_OPT_NUMEL`` elements, counted as the bytes offload prices it
    with (pricing/offload.py ``host_step_bytes_per_element("adamw", "fp32")``).
    ``together(fn)``: seconds of one call of ``fn`` timed on every rank at once (a barrier
    around each call), fastest of 3, the slowest rank's: each process sees the others
    copying and stepping, so the CPU figure is one rank's share of the node's (each call lasts
    tens of milliseconds or more: processes time-sharing a core are seen sharing it)."""
    import torch

    from autopar.pricing.offload import host_step_bytes_per_element
    from runtime.optim import make_optimizer

    gpu = device.type == "cuda"
    host = torch.empty(HOST_COPY_BYTES, dtype=torch.uint8, pin_memory=gpu).fill_(1)
    other = torch.empty(HOST_COPY_BYTES, dtype=torch.uint8, device=device)
    if gpu:
        t = max(together(lambda: other.copy_(host, non_blocking=True)),
                together(lambda: host.copy_(other, non_blocking=True)))
    else:
        t = together(lambda: other.copy_(host))
    copy = HOST_COPY_BYTES / t
    host = other = None   # freed before the optimizer's buffers are made
    opt = make_optimizer("adamw", 1e-3)
    param = torch.full((HOST_OPT_NUMEL,), 0.5)   # (the step's time does not depend on the values;
    grad = torch.full((HOST_OPT_NUMEL,), 1e-3)   # randn took longer than the timing)
    state = opt.init_state(HOST_OPT_NUMEL)
    t = together(lambda: opt.host_step(param, grad, state, 1))
    return copy, HOST_OPT_NUMEL * host_step_bytes_per_element("adamw", "fp32") / t


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
    import math
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


# the compute between two collectives of the timing loop: ~0.2 ms on a CPU core (a few
# hundred µs of kernels separate the collectives of a tensor-parallel step on this scale)
COLL_WORK = {False: (160, 160), True: (2048, 2048)}
COLL_CALLS = 8   # collectives per timing loop


def _in_loop(fn, work, repeats: int, sync) -> list[float]:
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


def _collective(kind, numel, n, dtype, device, group):
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


# ops whose backward / forward ratio and forward rate are measured (autopar rule name -> (forward
# function, its arguments) on representative activation shapes); the rest use the median ratio
VECTOR_NUMEL_GPU = 2**26


def _rule_ops(dtype, device, large: bool = False) -> dict:
    """One call of each measured rule; ``large``: a GPU's sizes (launch-bound otherwise)."""
    import torch
    import torch.nn.functional as F
    b, s, h, heads = (8, 1024, 2048, 16) if large else (8, 128, 256, 4)
    kw = dict(dtype=dtype, device=device)

    def leaf(*shape):
        return torch.randn(*shape, **kw, requires_grad=True)
    x, y = leaf(b, s, h), leaf(b, s, h)
    w, bias = leaf(h), leaf(h)
    q, k, v = (leaf(b, heads, s, h // heads) for _ in range(3))
    logits = leaf(b * s, 1024)
    target = torch.randint(0, 1024, (b * s,), device=device)
    table = leaf(1024, h)
    idx = torch.randint(0, 1024, (b, s), device=device)
    return {
        "gelu": (F.gelu, (x,)),
        "layer_norm": (lambda x, w, b_: F.layer_norm(x, (h,), w, b_), (x, w, bias)),
        "softmax": (lambda x: torch.softmax(x, -1), (x,)),
        "dropout": (lambda x: F.dropout(x, 0.1, training=True), (x,)),
        "add": (lambda x, y: x + y, (x, y)),
        "mul": (lambda x, y: x * y, (x, y)),
        "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v)),
        "cross_entropy": (F.cross_entropy, (logits, target)),
        "embedding": (lambda i, t: F.embedding(i, t), (idx, table)),
    }


def _backward_ratios(ratio, dtype, device, large: bool = False) -> dict:
    import torch
    out = {}
    for rule, (f, args) in _rule_ops(dtype, device, large).items():
        g = torch.ones_like(f(*args))

        def fw(f=f, args=args):   # with autograd recording, as a training forward runs (SDPA on a
            f(*args)              # CPU takes another kernel under no_grad)

        def fb(f=f, args=args, g=g):
            f(*args).backward(g)
        out[rule] = max(0.1, ratio(fw, fb))
    return out


def _op_rates(timed, dtype, device) -> dict:
    """FLOP/s of each rule's forward as the planner counts its FLOPs: the op traced as the planner
    traces a model (torch.export), its rule's OpSpec FLOPs over the timed forward (with autograd
    recording). Rules whose FLOPs are not what bounds them (memory-bound: add, mul, dropout,
    embedding) still get one; pricing takes the larger of the FLOP and byte times."""
    import torch

    class _Op(torch.nn.Module):
        def __init__(self, f):
            super().__init__()
            self.f = f

        def forward(self, *args):
            return self.f(*args)
    out = {}
    for rule, (f, args) in _rule_ops(dtype, device).items():
        try:
            ep = torch.export.export(_Op(f), tuple(a.detach() for a in args))
            specs = [spec_for(n) for n in ep.graph.nodes if n.op == "call_function"]
        except Exception:   # an op the exporter or the rules cannot take here: no rate, the default
            continue
        flops = sum(sp.flops for sp in specs if sp is not None and sp.rule == rule)
        if flops > 0:
            sets = _cold_copies(args)
            at = [0]

            def call(f=f, sets=sets):   # each call on the next copy: its inputs are not in cache
                at[0] = (at[0] + 1) % len(sets)
                f(*sets[at[0]])
            out[rule] = flops / timed(call)
    return out


# A training step's working set is larger than the CPU's caches: an op meets inputs another op
# wrote a while ago. Timed on one input again and again, a 1 MB GELU runs from cache 2.5x faster
# than in the bench gpt2's step (0.05 ms against 0.13 ms cold, 0.2 ms in the step; measured
# on these CPUs), and every memory-bound rule was priced that much too fast. Cycling through copies
# whose bytes together exceed the last-level cache times each call cold.
COLD_BYTES = 64 << 20


def _cold_copies(args) -> list:
    """Copies of ``args`` (tensors cloned, others shared) totalling at least ``COLD_BYTES``."""
    import torch
    size = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)) or 1
    n = max(2, min(256, -(-COLD_BYTES // size)))
    return [tuple(a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                  for a in args) for _ in range(n)]


# a tiny activation: every op on it is all fixed cost (dispatch, autograd bookkeeping, set-up)
FLOOR_SHAPE = (16, 64)
FLOOR_CHAIN = 16


def _op_floors(timed, dtype, device) -> dict:
    """Least (forward, backward) seconds of one op per rule on a tiny activation, as training runs
    it: a chain of ``FLOOR_CHAIN`` such ops through autograd, each with its own parameters (one
    AccumulateGrad each, as a model's layers), forward alone and forward + backward; the
    backward engine's start is shared by the chain."""
    import torch
    import torch.nn.functional as F
    n, h = FLOOR_SHAPE
    kw = dict(dtype=dtype, device=device)

    def leaves(*shape):
        return [torch.randn(*shape, **kw, requires_grad=True) for _ in range(FLOOR_CHAIN)]
    x0 = torch.randn(n, h, **kw, requires_grad=True)
    ws, bs, zs = leaves(h, h), leaves(h), leaves(n, h)
    ones = [torch.ones(h, **kw, requires_grad=True) for _ in range(FLOOR_CHAIN)]
    steps = {
        "linear": lambda y, i: F.linear(y, ws[i], bs[i]),
        "gelu": lambda y, i: F.gelu(y),
        "add": lambda y, i: y + zs[i],
        "mul": lambda y, i: y * zs[i],
        "layer_norm": lambda y, i: F.layer_norm(y, (h,), ones[i], bs[i]),
        "softmax": lambda y, i: torch.softmax(y, -1),
    }
    out = {}
    for rule, f in steps.items():
        def fw(f=f):
            y = x0
            for i in range(FLOOR_CHAIN):
                y = f(y, i)
            return y

        def fb(fw=fw):
            fw().sum().backward()
        t_f = timed(fw)
        t_fb = timed(fb)
        out[rule] = [t_f / FLOOR_CHAIN, max(0.0, t_fb - t_f) / FLOOR_CHAIN]
    return out


def _local_main(rank, world, sweep, repeats):
    import torch
    torch.set_num_threads(1)   # as forked training ranks run (OpenMP in forked children deadlocks)
    return measure(sweep, repeats)


def calibrate(nprocs: int = 2, sweep: str = "cpu", repeats: int = 5, output=None) -> Calibration:
    """Measure (forking ``nprocs`` local gloo processes unless a process group is already up)
    and return the profile; with ``output`` also write it as YAML (rank 0 only)."""
    import warnings

    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        d = measure(sweep, repeats)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            d = run_local(_local_main, nprocs, (sweep, repeats), timeout=1800)[0]
    if d is None:
        return None
    cal = Calibration.from_dict(d, "autopar calibrate")
    if output:
        cal.to_yaml(output)
    return cal
