"""Sequence-parallel attention ops (runtime/ring_attention.py, runtime/ulysses.py) on 2 and 4 forked
gloo ranks against single-process SDPA.

Every rank builds the same seeded full q, k, v and output gradient, computes the reference
(F.scaled_dot_product_attention in fp64 over the whole sequence, forward and backward), runs the
sequence-parallel op on its own piece and compares its piece of the output and of dq, dk, dv.
Saved-for-backward bytes of ring attention equal ring_attention_saved_bytes; with the transfers
not overlapped (OVERLAP off) the results are bitwise the same. Hybrid (runtime/hybrid_sp.py:
Ulysses over 2 inner ranks x ring over 2 outer ranks) is checked the same way on 4 ranks. The
premise is asserted too: the bytes and messages counted in COMM_STATS equal the closed forms
the planner prices with (ring_attention_bytes, ulysses_bytes, allgather_kv_bytes), and are non-zero.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime import ring_attention as R
from runtime import seq_layout as L
from runtime.collectives import COMM_STATS
from runtime.launch import run_local
from runtime.ring_attention import (allgather_kv_attention, allgather_kv_bytes, block_plan, ring_attention,
                                    ring_attention_bytes, ring_attention_flops, ring_attention_saved_bytes,
                                    ring_attention_time, ring_block_work)
from runtime.ulysses import ulysses_attention, ulysses_bytes
from runtime import hybrid_sp

# Imported before run_local forks: backward lazily imports this sympy-heavy module.
import torch.fx.experimental.symbolic_shapes  # noqa: E402,F401

B, S, D = 2, 16, 8
LABEL = "sp"


def _full(H, Hkv, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64)
    do = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    return q, k, v, do


def _reference(q, k, v, do, causal, scale=None, mask=None):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def _explicit_attention(causal):
    """A model's matmul/softmax attention with repeat_kv (what Ulysses must accept besides SDPA)."""
    def attn(q, k, v):
        g = q.shape[1] // k.shape[1]
        k, v = L.repeat_kv(k, g), L.repeat_kv(v, g)
        s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        if causal:
            n = s.shape[-1]
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(s, -1) @ v
    return attn


# name, op, H, Hkv, causal, layout, dtype, extra
CASES = [
    ("ring causal zigzag gqa", "ring", 4, 2, True, "zigzag", torch.float32, {"tile_rows": 3}),
    ("ring causal contiguous scale", "ring", 4, 4, True, "contiguous", torch.float32, {"tile_rows": 3, "scale": 0.3}),
    ("ring non-causal gqa", "ring", 4, 1, False, "zigzag", torch.float32, {"tile_rows": 3}),
    ("ring causal zigzag fp64", "ring", 2, 2, True, "zigzag", torch.float64, {}),
    ("ring causal zigzag bf16 gqa", "ring", 4, 2, True, "zigzag", torch.bfloat16, {"tile_rows": 3}),
    ("ulysses non-causal scale", "ulysses", 4, 4, False, "contiguous", torch.float32, {"scale": 0.3}),
    ("ulysses causal zigzag gqa", "ulysses", 4, 2, True, "zigzag", torch.float32, {}),
    ("ulysses causal gqa kv<sp explicit", "ulysses", 4, 1, True, "contiguous", torch.float32, {"explicit": True}),
    # a general mask run whole by Ulysses (each rank its heads' rows): shared and per-head
    ("ulysses general mask gqa", "ulysses", 4, 2, False, "contiguous", torch.float32, {"mask": True}),
    ("ulysses per-head mask", "ulysses", 4, 4, False, "contiguous", torch.float32, {"mask": "heads"}),
    ("allgather causal zigzag gqa", "allgather", 4, 2, True, "zigzag", torch.float32, {}),
    ("allgather general mask", "allgather", 4, 2, False, "zigzag", torch.float32, {"mask": True}),
]


HYBRID_CASES = [   # name, H, Hkv, causal
    ("hybrid causal zigzag gqa", 4, 2, True),
    ("hybrid causal kv heads < u", 4, 1, True),
    ("hybrid non-causal", 4, 4, False),
]


def _run_hybrid(case, inner, outer, ri, ui):
    """Ulysses (inner) x ring (outer) against the reference; bytes per axis against hybrid_bytes."""
    name, H, Hkv, causal = case
    Q, K, V, DO = _full(H, Hkv)
    ref = _reference(Q, K, V, DO, causal)
    piece = lambda t: hybrid_sp.shard(t, 2, 2, 2, ri, ui)   # noqa: E731
    q, k, v = (piece(t).float().requires_grad_() for t in (Q, K, V))
    COMM_STATS.reset()
    R.TILE_ELEMENTS, R.TILE_MIN_ROWS = 1 << 20, 8
    out = hybrid_sp.hybrid_attention(q, k, v, inner, outer, is_causal=causal)
    out.backward(piece(DO).float())
    for what, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), ref):
        torch.testing.assert_close(got.double(), piece(want), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name}, {what}: {m}")
    uly, ring = hybrid_sp.hybrid_bytes(B, H, Hkv, S, D, 2, 2, 4)
    got, calls = COMM_STATS.snapshot(), COMM_STATS.calls()
    assert uly.total_bytes > 0 and ring.total_bytes > 0
    assert got == {"sp_u": uly.total_bytes, "sp_r": ring.total_bytes}, (name, got, uly, ring)
    assert sum(n for (lab, _), n in calls.items() if lab == "sp_r") == ring.forward_messages + ring.backward_messages


SUBGROUP_CASES = ("ring causal zigzag gqa", "ring causal contiguous scale", "ulysses causal zigzag gqa")


def _predicted(op, H, Hkv, sp, dtype):
    eb = torch.tensor([], dtype=dtype).element_size()
    if op == "ring":
        return ring_attention_bytes(B, Hkv, S, D, sp, eb)
    if op == "ulysses":
        return ulysses_bytes(B, H, Hkv, S, D, sp, eb)
    return allgather_kv_bytes(B, Hkv, S, D, sp, eb)


def _run_case(case, group):
    """One case on ``group``: compare with the reference, return the bytes and messages counted."""
    import torch.distributed as dist
    name, op, H, Hkv, causal, layout, dtype, extra = case
    sp, me = dist.get_world_size(group), dist.get_rank(group)
    Q, K, V, DO = _full(H, Hkv)
    scale = extra.get("scale")
    mask = None
    if extra.get("mask"):   # a general mask (what ring attention refuses): random, the diagonal kept
        shape = (B, H, S, S) if extra["mask"] == "heads" else (S, S)
        mask = (torch.rand(shape, generator=torch.Generator().manual_seed(5)) < 0.5) | torch.eye(S, dtype=torch.bool)
    ref = _reference(Q, K, V, DO, causal, scale, mask)
    piece = lambda t: L.shard(t, 2, sp, me, layout)   # noqa: E731
    q, k, v = (piece(t).to(dtype).requires_grad_() for t in (Q, K, V))
    COMM_STATS.reset()
    saved = {}
    # tiny score tiles (3 rows, a ragged last one) so that the tiled path is what is tested
    R.TILE_ELEMENTS, R.TILE_MIN_ROWS = (1, extra["tile_rows"]) if "tile_rows" in extra else (1 << 20, 8)
    if op == "ring":
        def pack(t):     # distinct storages saved for backward (q, k, v, output, log-sum-exp)
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = ring_attention(q, k, v, group, is_causal=causal, layout=layout, scale=scale, label=LABEL)
        eb = q.element_size()
        assert sum(saved.values()) == ring_attention_saved_bytes(B, H, Hkv, S, D, sp, eb), (name, saved)
    elif op == "ulysses":
        fn = _explicit_attention(causal) if extra.get("explicit") else None
        out = ulysses_attention(q, k, v, group, is_causal=causal, layout=layout, scale=scale, attn_fn=fn,
                                attn_mask=mask, label=LABEL)
    else:
        local_mask = None if mask is None else mask[L.positions(S, sp, me, layout)]   # my query rows
        out = allgather_kv_attention(q, k, v, group, is_causal=causal, layout=layout, scale=scale,
                                     attn_mask=local_mask, label=LABEL)
    fwd_bytes, fwd_calls = sum(COMM_STATS.snapshot().values()), sum(COMM_STATS.calls().values())
    out.backward(piece(DO).to(dtype))
    total_bytes, total_calls = sum(COMM_STATS.snapshot().values()), sum(COMM_STATS.calls().values())
    tol = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float64: dict(rtol=1e-10, atol=1e-10),
           torch.bfloat16: dict(rtol=2e-2, atol=3e-2)}[dtype]     # bf16: inputs rounded, fp32 inside
    for what, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), ref):
        assert got.dtype == dtype, (name, what, got.dtype)
        torch.testing.assert_close(got.double(), piece(want), **tol, msg=lambda m: f"{name}, {what}: {m}")
    if op == "ring" and sp > 1:   # the same numbers with the transfers not overlapped
        R.OVERLAP = False
        try:
            q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
            out2 = ring_attention(q2, k2, v2, group, is_causal=causal, layout=layout, scale=scale, label="check")
            out2.backward(piece(DO).to(dtype))
        finally:
            R.OVERLAP = True
        assert torch.equal(out2, out) and torch.equal(k2.grad, k.grad), name
    return dict(name=name, pred=_predicted(op, H, Hkv, sp, dtype), fwd_bytes=fwd_bytes,
                fwd_calls=fwd_calls, bytes=total_bytes, calls=total_calls, sp=sp)


def _worker(rank, world):
    import torch.distributed as dist
    torch.set_num_threads(1)
    report = [_run_case(case, None) for case in CASES]
    if world == 4:
        # sp=2 on the strided sub-groups {0, 2} and {1, 3} (the outer axis of a 2 x 2 mesh): group
        # rank != global rank, so the ring's neighbours must be mapped to global ranks
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        mine = groups[rank % 2]
        report += [_run_case(case, mine) for case in CASES if case[0] in SUBGROUP_CASES]
        # hybrid: Ulysses over u = 2 inner ranks {0, 1}, {2, 3}, ring over r = 2 outer ranks {0, 2}, {1, 3}
        inner = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
        for case in HYBRID_CASES:
            _run_hybrid(case, inner, mine, rank // 2, rank % 2)
    # bad input: a general mask under ring attention, heads that do not divide over sp
    q = torch.zeros(B, 6, 4, D)
    with pytest.raises(L.SequenceParallelError, match="supports only no mask or the causal mask"):
        ring_attention(q, q, q, attn_mask=torch.ones(4, S, dtype=torch.bool))
    if world == 4:
        with pytest.raises(L.SequenceParallelError, match="6 heads do not divide by 4"):
            ulysses_attention(q, q, q)
    if world > 1:   # Ulysses attends every position: a mask must span the whole sequence
        q4 = torch.zeros(B, 4, S // world, D)
        with pytest.raises(L.SequenceParallelError, match="must span the whole sequence"):
            ulysses_attention(q4, q4, q4, attn_mask=torch.ones(S // world, S, dtype=torch.bool))
    return report


@pytest.mark.slow
@pytest.mark.parametrize("sp", [1, 2, 4])
def test_sequence_parallel_attention_matches_one_process(sp):
    reports = run_local(_worker, sp, timeout=240)
    for rank, report in enumerate(reports):
        for r in report:
            pred = r["pred"]
            if r["sp"] > 1:
                assert r["bytes"] > 0 and r["calls"] > 0, f"rank {rank}, {r['name']}: nothing was sent"
            assert r["fwd_bytes"] == pred.forward_bytes, (rank, r)
            assert r["bytes"] == pred.total_bytes, (rank, r)
            assert r["fwd_calls"] == pred.forward_messages, (rank, r)
            assert r["calls"] == pred.forward_messages + pred.backward_messages, (rank, r)


# ------------------------------------------------------------------ single process: layouts, plans, errors

def test_zigzag_shard_round_trip_and_positions():
    x = torch.arange(2 * 24).reshape(2, 24)
    pieces = [L.shard(x, 1, 3, r, "zigzag") for r in range(3)]
    assert pieces[0][0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]        # chunks 0 and 5 of 6
    assert pieces[2][0].tolist() == [8, 9, 10, 11, 12, 13, 14, 15]      # chunks 2 and 3
    assert torch.equal(L.unshard(pieces, 1, "zigzag"), x)
    assert torch.equal(L.unshard([L.shard(x, 1, 4, r, "contiguous") for r in range(4)], 1, "contiguous"), x)
    with pytest.raises(L.SequenceParallelError, match="multiple of 8"):
        L.positions(12, 4, 0, "zigzag")


def test_block_plan_balances_causal_work():
    for sp in (2, 4, 8):
        zig = ring_block_work(sp, True, "zigzag")
        per_rank = [sum(w[r] for w in zig) for r in range(sp)]
        assert max(per_rank) == min(per_rank) == 0.75 + 0.5 * (sp - 1)
        con = ring_block_work(sp, True, "contiguous")
        assert [sum(w[r] for w in con) for r in range(sp)] == [1.0 + r for r in range(sp)]
        # every query-key pair at or below the diagonal is covered exactly once over the ring
        for layout in ("zigzag", "contiguous"):
            seen = torch.zeros(4 * sp, 4 * sp, dtype=torch.int64)
            for me in range(sp):
                qpos = L.positions(4 * sp, sp, me, layout)
                for src in range(sp):
                    kpos = L.positions(4 * sp, sp, src, layout)
                    c = 4 * sp // (2 * sp if layout == "zigzag" else sp)
                    for q0, q1, k0, k1, kind in block_plan(me, src, sp, True, layout):
                        for i in qpos[q0 * c:q1 * c]:
                            for j in kpos[k0 * c:k1 * c]:
                                if kind == "full" or j <= i:
                                    seen[i, j] += 1
            assert torch.equal(seen, torch.ones(4 * sp, 4 * sp, dtype=torch.int64).tril())
    f_zig = ring_attention_flops(1, 8, 1024, 64, 4, is_causal=True, layout="zigzag")
    f_con = ring_attention_flops(1, 8, 1024, 64, 4, is_causal=True, layout="contiguous")
    assert f_con[0] / f_zig[0] == pytest.approx(4 / 2.25)


def test_bad_inputs_name_what_is_supported():
    q = torch.zeros(1, 4, 8, 2)
    with pytest.raises(L.SequenceParallelError, match="no mask or the causal mask"):
        ring_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(L.SequenceParallelError, match="unknown sequence layout 'striped'"):
        ring_attention(q, q, q, is_causal=True, layout="striped")
    with pytest.raises(L.SequenceParallelError, match="not a multiple of 3 key/value heads"):
        ring_attention(q, torch.zeros(1, 3, 8, 2), torch.zeros(1, 3, 8, 2))
    with pytest.raises(L.SequenceParallelError, match="heads do not divide by 8"):
        L.check_heads(12, 4, 8, "ulysses_attention")
    assert L.kv_repeat_factor(32, 8, 4) == 1 and L.kv_repeat_factor(32, 8, 16) == 2
    assert L.kv_repeat_factor(12, 4, 6) == 3     # lcm(4, 6) = 12 kv heads, 2 per rank


def test_ring_time_model_limits():
    """Compute-bound: the busiest rank's executed blocks; transfer-bound: one hop per step (sp-1
    K/V hops forward; backward sp-1 K/V and sp dK/dV hops)."""
    sp, b, h, s, d = 4, 1, 8, 1024, 64
    pair = b * h * (s // sp) ** 2 * d
    for layout, blocks in (("zigzag", 0.75 + 0.5 * (sp - 1)), ("contiguous", float(sp))):
        t = ring_attention_time(b, h, h, s, d, sp, 4, is_causal=True, layout=layout, flops_per_s=1e9, bytes_per_s=1e30)
        assert t == pytest.approx(14 * pair * blocks / 1e9)
    hop = 2 * b * h * (s // sp) * d * 4 / 1e6
    t = ring_attention_time(b, h, h, s, d, sp, 4, is_causal=False, flops_per_s=1e30, bytes_per_s=1e6)
    assert t == pytest.approx((sp - 1) * hop + (sp - 1) * hop + sp * hop)
    assert t == pytest.approx(ring_attention_bytes(b, h, s, d, sp, 4).total_bytes / 1e6)
