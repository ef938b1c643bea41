"""Ring attention: attention over a sequence-split group whose K/V blocks travel around the ring.

``ring_attention(q, k, v, group, is_causal=..., layout=...)`` takes q [B, H, S/sp, D] and k, v
[B, Hkv, S/sp, D] (grouped-query attention when Hkv < H, query head h reading kv head h // (H/Hkv)),
all split on the sequence in ``layout`` (runtime/seq_layout.py: "zigzag" or "contiguous"), and
returns this rank's rows of softmax(q kᵀ · scale [+ causal mask]) v, [B, H, S/sp, D].

Forward: sp steps. At step t a rank holds the K/V block of group rank (me - t) mod sp; it posts the
send of that block to the next rank and the receive of the following block from the previous rank
(isend/irecv, one message of stacked K and V), computes on the block it holds while they travel,
and merges the block's result into its output by online softmax (log-sum-exp in fp32, fp64 for
fp64 inputs). Under a causal mask only the pieces of a block that some query sees are computed:
with "zigzag" every rank does half a block per step (one early and one late chunk), with
"contiguous" rank r does r full blocks and the last rank waits on nobody — the imbalance the
benchmark shows (benchmarks/bench_ring_attention.py).

Backward (its own, no autograd graph through the loop): the same ring, recomputing each block's
probabilities from the saved log-sum-exp. dQ stays local; the dK/dV accumulator of a block travels
with it (one hop behind the K/V block, so its transfer overlaps the next block's compute) and after
sp hops arrives back at the block's owner.

Bytes sent per rank (all to the next rank; messages counted in ``COMM_STATS`` under ``label``,
kinds "ring_kv" and "ring_dkv") are given in closed form by ``ring_attention_bytes``; compute per
rank and step by ``ring_block_work`` (the executed rectangles), a time model by
``ring_attention_time``. ``allgather_kv_attention`` is the baseline (and the way to apply a general
mask): all-gather K/V, local attention, reduce-scatter dK/dV; bytes by ``allgather_kv_bytes``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime import seq_layout as L
from runtime.collectives import COMM_STATS, all_gather
from runtime.seq_layout import Traffic

_KV_TAG, _DKV_TAG = 71, 72   # distinct tags: a K/V block and a dK/dV block can travel at once

# Post the next block's transfer before computing on the current one. The benchmark switches this
# off to measure what the overlap buys (benchmarks/bench_ring_attention.py); results are identical.
OVERLAP = True


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------ which pieces of a block are computed

def _chunk_ids(rank: int, sp: int, is_causal: bool, layout: str) -> list[int]:
    """Global chunk indices a rank holds, in local order (one chunk = everything when non-causal)."""
    if not is_causal:
        return [0]
    return [rank] if layout == "contiguous" else [rank, 2 * sp - 1 - rank]


def block_plan(me: int, src: int, sp: int, is_causal: bool, layout: str) -> list[tuple[int, int, int, int, str]]:
    """Rectangles (q0, q1, k0, k1, kind) in units of local chunks that rank ``me`` computes against the
    K/V block of rank ``src``: kind "full" (every query sees every key) or "diag" (same chunk: causal
    triangle). Pieces no query sees are left out; adjacent full pieces are merged into one matmul."""
    qc, kc = _chunk_ids(me, sp, is_causal, layout), _chunk_ids(src, sp, is_causal, layout)
    if not is_causal:
        return [(0, 1, 0, 1, "full")]
    rows = []
    for a, gq in enumerate(qc):
        b = 0
        while b < len(kc):
            if kc[b] < gq:
                b1 = b
                while b1 < len(kc) and kc[b1] < gq:   # local neighbours: one slice, one matmul
                    b1 += 1
                rows.append((a, a + 1, b, b1, "full"))
                b = b1
            else:
                if kc[b] == gq:
                    rows.append((a, a + 1, b, b + 1, "diag"))
                b += 1
    merged: list[tuple[int, int, int, int, str]] = []
    for r in rows:   # stack full pieces of consecutive query chunks with the same key range
        if (merged and r[4] == "full" and merged[-1][4] == "full" and merged[-1][1] == r[0]
                and merged[-1][2:4] == r[2:4]):
            merged[-1] = (merged[-1][0], r[1], r[2], r[3], "full")
        else:
            merged.append(r)
    return merged


def ring_block_work(sp: int, is_causal: bool, layout: str) -> list[list[float]]:
    """work[t][r]: the fraction of a full (S/sp × S/sp) query-key block rank r computes at step t,
    as executed (causal diagonal pieces count in full: they are computed, then masked)."""
    nch = len(_chunk_ids(0, sp, is_causal, layout))
    return [[sum((q1 - q0) * (k1 - k0) for q0, q1, k0, k1, _ in block_plan(r, (r - t) % sp, sp, is_causal, layout))
             / (nch * nch) for r in range(sp)] for t in range(sp)]


# ------------------------------------------------------------------ closed forms for the planner

def ring_attention_bytes(batch: int, kv_heads: int, seq: int, head_dim: int, sp: int, dtype_bytes: int,
                         accum_bytes: int | None = None) -> Traffic:
    """Bytes each rank sends (to its ring successor) in ring attention over a full sequence ``seq``.
    Forward: sp-1 K/V blocks (input dtype). Backward: sp-1 K/V blocks again, and sp dK/dV
    accumulators in the accumulation dtype (fp32; fp64 for fp64 inputs: ``accum_bytes``, default
    max(dtype_bytes, 4)). The query heads do not travel, so GQA sends only its kv heads."""
    if sp == 1:
        return Traffic(0, 0, 0, 0)
    accum = max(dtype_bytes, 4) if accum_bytes is None else accum_bytes
    block = 2 * batch * kv_heads * (seq // sp) * head_dim
    return Traffic((sp - 1) * block * dtype_bytes, (sp - 1) * block * dtype_bytes + sp * block * accum,
                   sp - 1, 2 * sp - 1)


def allgather_kv_bytes(batch: int, kv_heads: int, seq: int, head_dim: int, sp: int, dtype_bytes: int) -> Traffic:
    """Per-rank bytes of ``allgather_kv_attention`` in the COMM_STATS convention (runtime/collectives.py):
    forward all_gather of stacked K/V (the gathered buffer), backward reduce_scatter (its input)."""
    if sp == 1:
        return Traffic(2 * batch * kv_heads * seq * head_dim * dtype_bytes,
                       2 * batch * kv_heads * seq * head_dim * dtype_bytes, 1, 1)
    full = 2 * batch * kv_heads * seq * head_dim * dtype_bytes
    return Traffic(full, full, 1, 1)


def ring_attention_saved_bytes(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, sp: int,
                               dtype_bytes: int) -> int:
    """Bytes ring attention saves for backward per rank: q, k, v and the output (input dtype) and the
    log-sum-exp (fp32; fp64 for fp64 inputs)."""
    sl = seq // sp
    return (batch * (2 * heads + 2 * kv_heads) * sl * head_dim * dtype_bytes
            + batch * heads * sl * max(dtype_bytes, 4))


def ring_attention_flops(batch: int, heads: int, seq: int, head_dim: int, sp: int, *, is_causal: bool,
                         layout: str = "zigzag") -> tuple[int, int]:
    """(forward, backward) matmul FLOPs of the busiest rank, as executed: per query-key pair 4·D
    forward (q kᵀ, p v) and 10·D backward (recomputed q kᵀ, dV, dP, dQ, dK)."""
    sl = seq // sp
    work = ring_block_work(sp, is_causal, layout)
    busiest = max(sum(work[t][r] for t in range(sp)) for r in range(sp))
    pairs = batch * heads * sl * sl * busiest
    return round(4 * head_dim * pairs), round(10 * head_dim * pairs)


def ring_attention_time(batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, sp: int,
                        dtype_bytes: int, *, is_causal: bool, layout: str = "zigzag", flops_per_s: float,
                        bytes_per_s: float, latency_s: float = 0.0, backward: bool = True) -> float:
    """Seconds for one forward (and backward) under a simple overlapped model: the ring moves in lock
    step, so each step costs the slowest rank's max(block compute, one hop of transfer)."""
    sl = seq // sp
    work = ring_block_work(sp, is_causal, layout)
    pair = batch * heads * sl * sl
    block = 2 * batch * kv_heads * sl * head_dim
    kv_hop = latency_s + block * dtype_bytes / bytes_per_s if sp > 1 else 0.0
    dkv_hop = latency_s + block * max(dtype_bytes, 4) / bytes_per_s if sp > 1 else 0.0
    total = 0.0
    for t in range(sp):
        w = max(work[t]) * pair * head_dim
        kv = kv_hop if t < sp - 1 else 0.0       # the last step receives no K/V block
        total += max(4 * w / flops_per_s, kv)
        if backward:                             # every step passes a dK/dV accumulator on
            total += max(10 * w / flops_per_s, kv + dkv_hop)
    return total


# ------------------------------------------------------------------ the ring

class _Ring:
    def __init__(self, group, label: str):
        self.group = group if group is not None else dist.group.WORLD
        self.sp, self.me, self.label = dist.get_world_size(self.group), dist.get_rank(self.group), label
        self.next = dist.get_global_rank(self.group, (self.me + 1) % self.sp)
        self.prev = dist.get_global_rank(self.group, (self.me - 1) % self.sp)

    def shift(self, send: torch.Tensor, kind: str, tag: int):
        """Post send(next) and recv(prev); returns (receive buffer, send work, recv work)."""
        send = send.contiguous()
        recv = torch.empty_like(send)
        COMM_STATS.add(self.label, kind, send.numel() * send.element_size())
        return recv, dist.isend(send, self.next, group=self.group, tag=tag), \
            dist.irecv(recv, self.prev, group=self.group, tag=tag)


def _wait(works: list) -> None:
    """Wait for each work once (waiting twice on a finished gloo send blocks until timeout)."""
    while works:
        works.pop().wait()


# Scores are computed in row tiles of about this many elements (4 MiB in fp32): the softmax's
# elementwise passes then run on rows still in cache instead of streaming a whole (S/sp)² block
# through memory several times, and tiles stay large enough that per-op overhead does not dominate
# (measured on CPU, 1 thread, B·H = 8, 1024 keys: 2^18-2^21 elements 1.5-2x faster than the whole
# block at once, 2^14 slower than it).
TILE_ELEMENTS = 1 << 20
TILE_MIN_ROWS = 8


def _tiles(rect, c, n_batch_heads):
    """Row tiles of one rectangle: (query rows, key rows, causal mask or None) with the mask
    True where a key lies after the query (same chunk: the diagonal piece)."""
    q0, q1, k0, k1, kind = rect
    keys = slice(k0 * c, k1 * c)
    m = (k1 - k0) * c
    step = max(TILE_MIN_ROWS, TILE_ELEMENTS // max(1, n_batch_heads * m))
    for r0 in range(q0 * c, q1 * c, step):
        r1 = min(r0 + step, q1 * c)
        mask = None
        if kind == "diag":
            mask = torch.arange(m).unsqueeze(0) > torch.arange(r0 - q0 * c, r1 - q0 * c).unsqueeze(1)
        yield slice(r0, r1), keys, mask


def _fwd_tile(q5s, kc, vc, out, lse, rows, keys, mask):
    """Merge one tile's attention into (out, lse) by online softmax."""
    s = torch.matmul(q5s[..., rows, :], kc[..., keys, :].transpose(-1, -2))     # [B, Hkv, g, n, m]
    if mask is not None:
        s.masked_fill_(mask, float("-inf"))
    mx = s.amax(dim=-1, keepdim=True)       # every row sees at least its own position: finite
    s.sub_(mx).exp_()
    l = s.sum(dim=-1, keepdim=True)
    bout = torch.matmul(s, vc[..., keys, :]).div_(l)
    blse = (mx + torch.log(l)).squeeze(-1)
    old = lse[..., rows]
    new = torch.logaddexp(old, blse)
    out[..., rows, :] = (out[..., rows, :] * torch.exp(old - new).unsqueeze(-1)
                         + bout * torch.exp(blse - new).unsqueeze(-1))
    lse[..., rows] = new


def _bwd_tile(q5s, do5, delta, lse, kc, vc, dq5, dkv, scale, rows, keys, mask):
    """One tile's contributions to dQ (local) and to the travelling dK/dV accumulator."""
    qs, dos = q5s[..., rows, :], do5[..., rows, :]
    p = torch.matmul(qs, kc[..., keys, :].transpose(-1, -2))                    # recomputed scores
    if mask is not None:
        p.masked_fill_(mask, float("-inf"))
    p.sub_(lse[..., rows].unsqueeze(-1)).exp_()                               # probabilities
    dkv[1][..., keys, :] += torch.matmul(p.transpose(-1, -2), dos).sum(2)     # GQA: sum the group
    ds = torch.matmul(dos, vc[..., keys, :].transpose(-1, -2))                # dP
    ds.sub_(delta[..., rows].unsqueeze(-1)).mul_(p)                           # dS = P ∘ (dP - δ)
    dq5[..., rows, :] += torch.matmul(ds, kc[..., keys, :]).mul_(scale)
    dkv[0][..., keys, :] += torch.matmul(ds.transpose(-1, -2), qs).sum(2)     # q pre-scaled


def _start_kv_hop(ring, kv):
    """Post the next K/V hop (send mine on, receive the previous rank's); with OVERLAP it runs
    while the current block is computed, otherwise it completes here."""
    nxt, ws, wr = ring.shift(kv, "ring_kv", _KV_TAG)
    pending = [ws, wr]
    if not OVERLAP:
        _wait(pending)
    return nxt, pending


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, label, is_causal, layout, scale):
        ring = _Ring(group, label)
        sp, me = ring.sp, ring.me
        B, H, Sl, D = q.shape
        Hkv = k.shape[1]
        g = H // Hkv
        cdt = _compute_dtype(q.dtype)
        c = Sl // len(_chunk_ids(me, sp, is_causal, layout))
        q5s = q.to(cdt).reshape(B, Hkv, g, Sl, D) * scale      # scores = (q·scale) kᵀ
        out = torch.zeros(B, Hkv, g, Sl, D, dtype=cdt, device=q.device)
        lse = torch.full((B, Hkv, g, Sl), float("-inf"), dtype=cdt, device=q.device)
        kv = torch.stack([k, v])
        for t in range(sp):
            src = (me - t) % sp
            if t < sp - 1:
                nxt, pending = _start_kv_hop(ring, kv)
            kc, vc = kv[0].to(cdt).unsqueeze(2), kv[1].to(cdt).unsqueeze(2)
            for rect in block_plan(me, src, sp, is_causal, layout):
                for rows, keys, mask in _tiles(rect, c, B * H):
                    _fwd_tile(q5s, kc, vc, out, lse, rows, keys, mask)
            if t < sp - 1:
                _wait(pending)
                kv = nxt
        o = out.reshape(B, H, Sl, D)
        # Laid out like q, as SDPA's CPU kernel and the planner's memory model lay its output out:
        # a q that is a transposed (b, s, h, d) projection (Hugging Face Llama after RoPE) makes
        # the caller's ``o.transpose(1, 2).contiguous()`` a view of this saved tensor, not a copy.
        o = o.to(q.dtype) if q.is_contiguous() else torch.empty_like(q).copy_(o)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.group, ctx.label, ctx.is_causal, ctx.layout, ctx.scale = group, label, is_causal, layout, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        ring = _Ring(ctx.group, ctx.label)
        sp, me, scale = ring.sp, ring.me, ctx.scale
        B, H, Sl, D = q.shape
        Hkv = k.shape[1]
        g = H // Hkv
        cdt = _compute_dtype(q.dtype)
        c = Sl // len(_chunk_ids(me, sp, ctx.is_causal, ctx.layout))
        q5s = q.to(cdt).reshape(B, Hkv, g, Sl, D) * scale
        do5 = do.to(cdt).reshape(B, Hkv, g, Sl, D)
        delta = (do5 * o.to(cdt).reshape(B, Hkv, g, Sl, D)).sum(-1)    # rowsum(dO ∘ O)
        dq5 = torch.zeros_like(q5s)
        kv = torch.stack([k, v])
        incoming = None           # (buffer, recv work) of the dK/dV accumulator coming from prev
        sending = None            # send work of my last accumulator
        dkv = None
        for t in range(sp):
            src = (me - t) % sp
            if t < sp - 1:
                nxt, pending = _start_kv_hop(ring, kv)
            kc, vc = kv[0].to(cdt).unsqueeze(2), kv[1].to(cdt).unsqueeze(2)
            dkv = torch.zeros(2, B, Hkv, Sl, D, dtype=cdt, device=q.device)
            for rect in block_plan(me, src, sp, ctx.is_causal, ctx.layout):
                for rows, keys, mask in _tiles(rect, c, B * H):
                    _bwd_tile(q5s, do5, delta, lse, kc, vc, dq5, dkv, scale, rows, keys, mask)
            if incoming is not None:      # the accumulator of this block so far, from the ranks before me
                incoming[1].wait()
                dkv += incoming[0]
            if sending is not None:
                sending.wait()
            if sp > 1:                    # pass it on; after sp hops it is back at the block's owner
                buf, sending, wr2 = ring.shift(dkv, "ring_dkv", _DKV_TAG)
                incoming = (buf, wr2)
            if t < sp - 1:
                _wait(pending)
                kv = nxt
        if sp > 1:
            incoming[1].wait()
            sending.wait()
            dkv = incoming[0]
        dq = dq5.reshape(B, H, Sl, D).to(q.dtype)
        return dq, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def _check(q, k, v, sp, is_causal, layout, attn_mask, op):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise L.SequenceParallelError(f"{op}: {name} must be [batch, heads, seq/sp, head_dim], "
                                          f"got shape {tuple(t.shape)}")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[3] != k.shape[3]:
        raise L.SequenceParallelError(
            f"{op}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} disagree (need the same batch, "
            f"local sequence and head_dim, and k.shape == v.shape)")
    L.check_heads(q.shape[1], k.shape[1], None, op)
    L.check_mask(attn_mask, is_causal, op)
    L.check_layout(layout)
    if is_causal:
        L.check_seq(q.shape[2] * sp, sp, layout, "the sequence length (local length × sp)")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, is_causal: bool = False,
                   layout: str = "zigzag", scale: float | None = None, attn_mask=None,
                   label: str = "sp") -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, K/V rotating around ``group``.
    q [B, H, S/sp, D], k/v [B, Hkv, S/sp, D] split on the sequence in ``layout`` (only matters under
    ``is_causal``). ``attn_mask`` must be None (or "none"/"causal"); no dropout."""
    sp = dist.get_world_size(group) if dist.is_initialized() else 1
    _check(q, k, v, sp, is_causal, layout, attn_mask, "ring_attention")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not dist.is_initialized():
        raise L.SequenceParallelError("ring_attention needs an initialised process group (torch.distributed)")
    return _RingAttention.apply(q, k, v, group, label, bool(is_causal), layout, scale)


def allgather_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, is_causal: bool = False,
                           layout: str = "zigzag", scale: float | None = None, attn_mask: torch.Tensor | None = None,
                           label: str = "sp") -> torch.Tensor:
    """The baseline to ring attention: all-gather K/V over ``group`` (backward: reduce-scatter of
    dK/dV), then SDPA of the local queries over the full sequence. ``attn_mask`` may be a general
    boolean mask (True = attend) for the local queries against the keys in natural order,
    broadcastable to [B, H, S/sp, S]."""
    sp, me = dist.get_world_size(group), dist.get_rank(group)
    _check(q, k, v, sp, is_causal, layout, None, "allgather_kv_attention")
    S = q.shape[2] * sp
    kv = all_gather(torch.stack([k, v]), 3, group, label)            # [2, B, Hkv, S, D], rank order
    reorder = is_causal or attn_mask is not None
    if reorder and sp > 1:
        kv = kv.index_select(3, L.inverse_order(S, sp, layout).to(q.device))
    mask = attn_mask
    if is_causal:
        causal = L.positions(S, sp, me, layout).unsqueeze(1) >= torch.arange(S).unsqueeze(0)
        mask = causal.to(q.device) if mask is None else (mask & causal.to(q.device))
    return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])
