"""Ring attention on CPU (gloo, forked ranks): measured time against the same attention with
all-gathered K/V, load-balanced (zig-zag) causal against unbalanced (contiguous) causal, and what
overlapping the transfers buys.

    .venv/bin/python -m benchmarks.bench_ring_attention [--nprocs 4] [--seq 2048] [--repeats 7]

Each variant is one forward + backward of attention over a sequence split on ``nprocs`` ranks
(fp32, batch 1, 8 heads, head dim 64 by default). Variants run round-robin (A, B, C, ... A, B, C)
after one warm-up round; each run starts after a barrier, and its time is the slowest rank's
(all-reduce MAX). Columns: median forward and forward+backward times over the repeats; a ratio is
the median of the per-round ratios (neighbouring runs, which cancels the machine's slow drifts; the
cores are shared), with its interquartile range in brackets. Every rank uses 1 thread.

Bytes per rank of the last run are counted in COMM_STATS and compared with the closed forms
(ring_attention_bytes, allgather_kv_bytes, ulysses_bytes); the compute ratio of the two causal
layouts predicted from the executed block plans (ring_attention_flops) is printed beside the
measured one. Besides wall time, the CPU time of the busiest rank (time.process_time, all-reduce
MAX) is shown: with more ranks than free cores (this machine) a rank that waits frees its core for
the others, so wall time follows the total work of all ranks, while the busiest rank's CPU time
shows the imbalance that wall time shows when every rank has a core of its own. The last two
rows time the local kernels alone (no communication, same number of
query-key pairs per rank as the non-causal rows): the ring's tiled matmul/softmax against PyTorch's
fused SDPA, which the all-gather baseline calls. Last, the compute part of ``ring_attention_time``
(FLOP rate taken from the kernel-only row) is compared with the busiest rank's CPU time.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402

from runtime import ring_attention as R  # noqa: E402
from runtime import seq_layout as L  # noqa: E402
from runtime.collectives import COMM_STATS  # noqa: E402
from runtime.launch import run_local  # noqa: E402
from runtime.ulysses import ulysses_attention, ulysses_bytes  # noqa: E402

VARIANTS = [
    # name, op, causal, layout, overlap
    ("ring, non-causal", "ring", False, "zigzag", True),
    ("all-gather K/V, non-causal", "allgather", False, "zigzag", True),
    ("ring, causal zig-zag (balanced)", "ring", True, "zigzag", True),
    ("ring, causal contiguous (unbalanced)", "ring", True, "contiguous", True),
    ("all-gather K/V, causal zig-zag", "allgather", True, "zigzag", True),
    ("ring, causal zig-zag, no overlap", "ring", True, "zigzag", False),
    ("Ulysses, causal", "ulysses", True, "zigzag", True),
    # the local kernels alone: each rank on its own 1-rank group over a sequence of S/sqrt(sp), so
    # S²/sp query-key pairs, as many as one rank computes in the non-causal rows above
    ("kernel only: ring's tiles, 1 rank", "ring1", False, "zigzag", True),
    ("kernel only: SDPA, 1 rank", "sdpa1", False, "zigzag", True),
]

PAIRS = [
    ("ring, non-causal", "all-gather K/V, non-causal"),
    ("ring, causal zig-zag (balanced)", "all-gather K/V, causal zig-zag"),
    ("ring, causal contiguous (unbalanced)", "ring, causal zig-zag (balanced)"),
    ("ring, causal zig-zag, no overlap", "ring, causal zig-zag (balanced)"),
    ("Ulysses, causal", "ring, causal zig-zag (balanced)"),
    ("kernel only: ring's tiles, 1 rank", "kernel only: SDPA, 1 rank"),
]


def _run(op, causal, layout, q, k, v, solo):
    if op == "ring1":
        return R.ring_attention(q, k, v, solo, label="solo")
    if op == "sdpa1":
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    if op == "ring":
        return R.ring_attention(q, k, v, is_causal=causal, layout=layout, label="sp")
    if op == "allgather":
        return R.allgather_kv_attention(q, k, v, is_causal=causal, layout=layout, label="sp")
    return ulysses_attention(q, k, v, is_causal=causal, layout=layout, label="sp")


def _rank(rank, world, cfg):
    torch.set_num_threads(1)
    sp = dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    B, H, Hkv, S, D = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["seq"], cfg["head_dim"]
    q = torch.randn(B, H, S // sp, D, generator=g)
    k = torch.randn(B, Hkv, S // sp, D, generator=g)
    v = torch.randn(B, Hkv, S // sp, D, generator=g)
    do = torch.randn(B, H, S // sp, D, generator=g)
    solo = [dist.new_group([r]) for r in range(sp)][rank]     # every rank creates every group
    n1 = round(S / sp ** 0.5)                                      # n1² = S²/sp pairs
    single = [torch.randn(B, H if i in (0, 3) else Hkv, n1, D, generator=g) for i in range(4)]
    fwd = {name: [] for name, *_ in VARIANTS}
    tot = {name: [] for name, *_ in VARIANTS}
    cpu = {name: [] for name, *_ in VARIANTS}
    moved = {}
    for rnd in range(cfg["repeats"] + 1):
        for name, op, causal, layout, overlap in VARIANTS:
            ins = single if op in ("ring1", "sdpa1") else (q, k, v, do)
            qq, kk, vv = (t.clone().requires_grad_() for t in ins[:3])
            R.OVERLAP = overlap
            COMM_STATS.reset()
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            out = _run(op, causal, layout, qq, kk, vv, solo)
            t1 = time.perf_counter()
            out.backward(ins[3])
            t2, c2 = time.perf_counter(), time.process_time()
            R.OVERLAP = True
            moved[name] = (sum(COMM_STATS.snapshot().values()), sum(COMM_STATS.calls().values()))
            slowest = torch.tensor([t1 - t0, t2 - t0, c2 - c0], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if rnd:   # round 0 warms up
                fwd[name].append(slowest[0].item())
                tot[name].append(slowest[1].item())
                cpu[name].append(slowest[2].item())
    return fwd, tot, cpu, moved


def _quartiles(xs):
    if len(xs) < 4:
        return min(xs), max(xs)
    qs = statistics.quantiles(xs, n=4)
    return qs[0], qs[2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args(argv)
    cfg = dict(batch=a.batch, heads=a.heads, kv_heads=a.kv_heads, seq=a.seq, head_dim=a.head_dim, repeats=a.repeats)
    sp = a.nprocs
    L.check_seq(a.seq, sp, "zigzag")
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    results = run_local(_rank, sp, (cfg,), timeout=1800)
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    fwd, tot, cpu, _ = results[0]
    print(f"sp={sp} ranks (gloo, 1 thread each), batch {a.batch}, heads {a.heads}, kv heads {a.kv_heads}, "
          f"seq {a.seq} ({a.seq // sp} per rank), head dim {a.head_dim}, fp32, {a.repeats} rounds after 1 warm-up")
    print(f"load average before: {' '.join(load_before)}, after: {' '.join(load_after)} (1/5/15 min)\n")
    eb = 4
    pred = {"ring": R.ring_attention_bytes(a.batch, a.kv_heads, a.seq, a.head_dim, sp, eb),
            "allgather": R.allgather_kv_bytes(a.batch, a.kv_heads, a.seq, a.head_dim, sp, eb),
            "ulysses": ulysses_bytes(a.batch, a.heads, a.kv_heads, a.seq, a.head_dim, sp, eb)}
    print("| variant | forward ms | fwd+bwd ms | busiest rank's CPU ms, fwd+bwd "
          "| MB per rank (measured / predicted) | messages |")
    print("|---|---|---|---|---|---|")
    for name, op, *_ in VARIANTS:
        got = [r[3][name] for r in results]
        p = pred.get(op, R.Traffic(0, 0, 0, 0))
        assert all(b == p.total_bytes for b, _ in got), (name, got, p)
        print(f"| {name} | {1e3 * statistics.median(fwd[name]):.1f} | {1e3 * statistics.median(tot[name]):.1f} "
              f"| {1e3 * statistics.median(cpu[name]):.1f} "
              f"| {got[0][0] / 1e6:.2f} / {p.total_bytes / 1e6:.2f} | {got[0][1]} |")
    print("\n| ratio | fwd+bwd wall, median [IQR] | forward only wall | busiest rank's CPU, fwd+bwd |")
    print("|---|---|---|---|")
    for x, y in PAIRS:
        r = [u / w for u, w in zip(tot[x], tot[y])]
        rf = [u / w for u, w in zip(fwd[x], fwd[y])]
        rc = [u / w for u, w in zip(cpu[x], cpu[y])]
        lo, hi = _quartiles(r)
        print(f"| {x} / {y} | {statistics.median(r):.2f} [{lo:.2f}–{hi:.2f}] | {statistics.median(rf):.2f} "
              f"| {statistics.median(rc):.2f} |")
    fz = R.ring_attention_flops(a.batch, a.heads, a.seq, a.head_dim, sp, is_causal=True, layout="zigzag")
    fc = R.ring_attention_flops(a.batch, a.heads, a.seq, a.head_dim, sp, is_causal=True, layout="contiguous")
    print(f"\npredicted compute ratio contiguous / zig-zag (busiest rank, executed block plans): {fc[0] / fz[0]:.2f}")
    # The time model's compute part against the busiest rank's CPU time: the FLOP rate is the one the
    # ring's kernel reached alone on one rank (no communication, same pairs per rank as non-causal).
    n1 = round(a.seq / sp ** 0.5)
    rate = 14 * a.batch * a.heads * n1 * n1 * a.head_dim / statistics.median(cpu["kernel only: ring's tiles, 1 rank"])
    print(f"\nring_attention_time (compute part; rate {rate / 1e9:.1f} GFLOP/s from the kernel-only row) "
          f"against the busiest rank's CPU time:\n")
    print("| variant | predicted ms | measured ms | error |")
    print("|---|---|---|---|")
    for name, op, causal, layout, _ in VARIANTS:
        if op != "ring":
            continue
        t = R.ring_attention_time(a.batch, a.heads, a.kv_heads, a.seq, a.head_dim, sp, eb, is_causal=causal,
                                  layout=layout, flops_per_s=rate, bytes_per_s=float("inf"))
        m = statistics.median(cpu[name])
        print(f"| {name} | {1e3 * t:.1f} | {1e3 * m:.1f} | {100 * (t / m - 1):+.0f}% |")


if __name__ == "__main__":
    main()
