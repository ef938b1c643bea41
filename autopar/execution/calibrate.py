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

The timers are ``calibrate_timing.py``, the fitted curves ``calibrate_fit.py``, the collectives
``calibrate_collectives.py``, the host figures ``calibrate_host.py`` and the per-rule figures
``calibrate_ops.py``.
"""
from __future__ import annotations

import math
import os
import statistics
import time

from autopar.execution.calibrate_collectives import COLL_WORK, FACTOR, KINDS, collective_call, seconds_in_loop
from autopar.execution.calibrate_fit import collapse_points, fit_gemm, monotone_times
from autopar.execution.calibrate_host import measure_host_rates
from autopar.execution.calibrate_ops import measure_backward_ratios, measure_op_floors, measure_op_rates
from autopar.execution.calibrate_timing import SUSTAIN, seconds_per_call, sustained_seconds_per_call
from autopar.execution.step_overhead import measure as step_overhead
from autopar.pricing.cost import gemm_intensity
from autopar.profile import Calibration
from runtime.collectives import COMM_STATS
from runtime.launch import run_local

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


# elements of the elementwise-arithmetic timing on a GPU (measure)
VECTOR_NUMEL_GPU = 2**26


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
            return agreed(sustained_seconds_per_call(fn, reps, sync, calls))
        t = seconds_per_call(fn, max(reps, 5), sync) if rank == 0 else 0.0
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
    backward_ratios = measure_backward_ratios(ratio, dtype, device, large=gpu)
    op_rates = {} if gpu else measure_op_rates(timed, dtype, device)
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
    host_copy_bandwidth, host_cpu_bandwidth = measure_host_rates(
        device, lambda fn: agreed(seconds_per_call(fn, 3, barrier)))
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
    op_floors = {} if gpu else measure_op_floors(timed, dtype, device)
    # collectives: world group and groups of 2 consecutive ranks, each timed as a training step
    # meets it (seconds_in_loop): the runtime's own collective code, back to back with compute between,
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
                fn = collective_call(kind, numel, n, dtype, device, group)
                barrier()
                # the fastest loop at its slowest rank's time (each rank's own fastest are
                # different loops, and the slowest of those is faster than any loop was)
                t = min(slowest(seconds_in_loop(fn, lambda: torch.mm(work_a, work_a), repeats, sync)))
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
        t_alone = agreed(seconds_per_call(loop, repeats, sync))
        t_comm = agreed(seconds_per_call(lambda: dist.all_reduce(buf), repeats, barrier))

        def both():
            w = dist.all_reduce(buf, async_op=True)
            loop()
            w.wait()
        t_both = agreed(seconds_per_call(both, repeats, barrier))
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
           "memory": [list(p) for p in collapse_points(memory, 0)], "kernel_overhead": kernel_overhead,
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
