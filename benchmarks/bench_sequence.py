"""Sequence parallelism in the free search (issue 7): the longest sequence of a Llama-2-7B shape
(autopar.models.llama.llama_7b: 32 layers, d 4096, 32 heads, n_kv_heads=32, bf16, AdamW) that
plans on A100-80GB nodes with tensor parallelism only against the full search.

* "TP only": ``constraints={"sp": 1}`` (no sequence axis; tensor parallelism with Megatron-SP,
  data parallelism, ZeRO, recompute and pipelining are all still searched).
* "free": no constraints: the same search, and when nothing fits memory the retry with a
  sequence axis of every size (Ulysses / ring / K/V all-gather per attention op, ILP's choice;
  autopar/search/sequence_search.py ``search_with_sp``).

Global batch: one sequence per node (1 on 8 GPUs, 8 on 64), so data parallelism cannot take
more than a node per sequence. Sequences are powers of two from 4k up; the free search is only
planned from the first length TP only cannot fit (below it, it returns the same plan). Published
reference gains in sequence length: ring self-attention 3.0x (Li et al. 2021, "Sequence
Parallelism: Long Sequence Training from System Perspective", against Megatron tensor
parallelism), DeepSpeed-Ulysses 4x (Jacobs et al. 2023, "sequences 4x longer than existing
systems").

    .venv/bin/python -m benchmarks.bench_sequence [--nodes 1 8] [--max-seq 1048576]
    .venv/bin/python -m benchmarks.bench_sequence --llama3-128k

``--llama3-128k``: a Llama-3-8B shape (32 layers, d 4096, 32 heads, 8 KV heads, FFN 14336,
vocabulary 128256) at 128K tokens on 2 DGX-H100 nodes, global batch 2 (one sequence per node),
free search: the plan, its predicted step time and MFU, and the mode of every attention op.
"""
from __future__ import annotations

import argparse
import time

import autopar
from autopar.errors import MemoryBudgetError
from autopar.models.llama import llama_7b

PUBLISHED = "ring self-attention 3.0x (Li et al. 2021), DeepSpeed-Ulysses 4x (Jacobs et al. 2023)"


def fits(seq: int, nodes: int, constraints: dict | None):
    """(plan or None, seconds, smallest peak bytes when it does not fit)."""
    model, inputs = llama_7b(seq=seq, batch=nodes)
    cluster = autopar.Cluster.preset("dgx-a100", nodes=nodes)
    t0 = time.perf_counter()
    try:
        plan = autopar.plan(model, inputs, cluster, constraints=constraints)
        return plan, time.perf_counter() - t0, None
    except MemoryBudgetError as e:
        return None, time.perf_counter() - t0, e.min_peak_bytes


def _deg(plan) -> str:
    d = plan.degrees
    sp = f" sp={d['sp']}({d['sp_mode']})" if d["sp_mode"] not in (None, "megatron") else ""
    return f"dp={d['dp']} tp={d['tp']}{sp} pp={d['pp']} zero={d['zero']} ckpt={d['checkpoint']}"


def longest(nodes: int, max_seq: int, constraints, start: int = 4096, log=print):
    best, seq = None, start
    while seq <= max_seq:
        plan, secs, floor = fits(seq, nodes, constraints)
        log(f"  nodes={nodes} seq={seq:>7} {constraints or 'free'}: "
            + (f"fits, {_deg(plan)}, step {plan.step_time:.3g} s" if plan else
               f"no plan (smallest peak {floor / 2**30:.1f} GiB)") + f"  [{secs:.0f} s planning]")
        if plan is None:
            return best, seq
        best = (seq, plan)
        seq *= 2
    return best, seq


def attention_modes(plan) -> dict[str, int]:
    """How many attention ops run each way: the special op of an SDPA strategy (ring, Ulysses), a
    head-split explicit core, or an attention kept whole / K/V all-gathered on the sequence."""
    from autopar.rules.sequence_heads import HEAD_TAG
    out: dict[str, int] = {}
    for op in plan.data["ops"]:
        if op["rule"] == "sdpa" or op.get("special") or HEAD_TAG in op["strategy"]:
            key = ",".join(op.get("special") or []) or ("ulysses (heads)" if HEAD_TAG in op["strategy"] else
                                                        f"sdpa {op['strategy']}")
            out[key] = out.get(key, 0) + 1
    return out


def llama3_128k() -> None:
    from autopar.models.llama import llama
    model, inputs = llama(n_layer=32, n_head=32, n_kv_heads=8, d_model=4096, ffn_hidden=14336, vocab=128256,
                          seq=131072, batch=2, device="meta")
    cluster = autopar.Cluster.preset("dgx-h100", nodes=2)
    t0 = time.perf_counter()
    plan = autopar.plan(model, inputs, cluster)
    secs = time.perf_counter() - t0
    pr = plan.predictions
    print(f"Llama-3-8B shape, 128K tokens x 2, 2 x DGX-H100 (16 GPUs), free search: planned in {secs:.0f} s")
    print(f"  plan: {_deg(plan)}, micro-batch {plan.degrees['micro_batch_size']} x "
          f"{plan.degrees['num_micro_batches']}; step {plan.step_time:.3g} s, MFU {pr['mfu']:.1%}, "
          f"peak {plan.peak_memory / 2**30:.1f} GiB")
    print(f"  attention ops: {attention_modes(plan)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-seq", type=int, default=1 << 20)
    ap.add_argument("--llama3-128k", action="store_true", help="only the Llama-3-8B 128K plan (module doc)")
    args = ap.parse_args()
    if args.llama3_128k:
        llama3_128k()
        return
    rows = []
    for nodes in args.nodes:
        tp, first_fail = longest(nodes, args.max_seq, {"sp": 1})
        free = tp
        if first_fail <= args.max_seq:
            more, _ = longest(nodes, args.max_seq, None, start=first_fail)
            free = more or tp
        rows.append((nodes, tp, free))
    print("\n| GPUs | global batch | longest seq, TP only | plan | longest seq, free search | plan | ratio |")
    print("|---|---|---|---|---|---|---|")
    for nodes, tp, free in rows:
        def cell(r):
            return ("none", "-") if r is None else (f"{r[0] // 1024}k", _deg(r[1]))
        ratio = f"{free[0] / tp[0]:.1f}x" if tp and free else "-"
        print(f"| {8 * nodes} | {nodes} | {' | '.join(cell(tp))} | {' | '.join(cell(free))} | {ratio} |")
    print(f"\npublished: {PUBLISHED}; lengths capped at {args.max_seq // 1024}k")


if __name__ == "__main__":
    main()
