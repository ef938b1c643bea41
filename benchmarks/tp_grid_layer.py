"""One pre-LN transformer layer under 1D (Megatron), 2D, 2.5D and 3D tensor parallelism, run on
forked gloo ranks, its collectives counted by COMM_STATS: the measured side of
benchmarks/bench_tp_grid.py's "bytes per step" table.

The layer is the one tests/runtime/test_tp_grid_ops.py checks against one process (without its embedding
and classifier): x + Wo attn(Wqkv LN(x) + bqkv) + bo, then x + W2 gelu(W1 LN(x) + b1) + b2, causal
attention, every linear with a bias. Shapes are parameters here (that test fixes tiny ones) so that
the same layer also splits 8 ways in 1D, which needs heads divisible by 8. Every rank takes its
block of the same global tensors (runtime/grid.take with the runtime's own block specs); values are
not compared here (tests/runtime/test_tp_grid_ops.py does that for the grid modes, on the same code paths).

1D is Megatron-LM's split, hand-written with runtime/collectives.py: QKV and W1 column-parallel
(QKV columns grouped by head, runtime/split_attention.qkv_column_order), Wo and W2 row-parallel;
``copy`` before each column-parallel linear (identity forward, all_reduce of the input gradient
backward), ``all_reduce`` after each row-parallel one; LayerNorms and the row-parallel biases
replicated. One step = forward + backward of sum(output) (the gradient of a sum is ones: correct
for a replicated output in 1D and for each rank's block in the grid modes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from runtime import matmul3d, summa, tesseract
from runtime import collectives as C
from runtime.collectives import COMM_STATS
from runtime.grid import take
from runtime.split_attention import local_attention, qkv_column_order

AXES = ("x", "y", "z")
EPS = 1e-5


@dataclass(frozen=True)
class Shape:
    batch: int = 8
    seq: int = 8
    hidden: int = 64
    heads: int = 8
    ffn: int = 256

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


def global_params(sh: Shape, seed: int = 0) -> tuple[dict, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    h, f = sh.hidden, sh.ffn
    p = {"ln1_w": 1 + 0.1 * r(h), "ln1_b": 0.1 * r(h), "wqkv": r(h, 3 * h) / h ** 0.5, "bqkv": 0.1 * r(3 * h),
         "wo": r(h, h) / h ** 0.5, "bo": 0.1 * r(h), "ln2_w": 1 + 0.1 * r(h), "ln2_b": 0.1 * r(h),
         "w1": r(h, f) / h ** 0.5, "b1": 0.1 * r(f), "w2": r(f, h) / f ** 0.5, "b2": 0.1 * r(h)}
    return p, r(sh.tokens, h)


def _qkv_grouped(p: dict, sh: Shape, blocks: int) -> dict:
    order = qkv_column_order(sh.hidden, sh.heads, blocks)
    return {k: (v[..., order] if k in ("wqkv", "bqkv") else v) for k, v in p.items()}


# ------------------------------------------------------------------ 1D (Megatron)

def _megatron_local(p: dict, x: torch.Tensor, sh: Shape, rank: int, world: int):
    p = _qkv_grouped(p, sh, world)
    col = lambda t: torch.chunk(t, world, dim=-1)[rank].contiguous()   # noqa: E731
    row = lambda t: torch.chunk(t, world, dim=0)[rank].contiguous()    # noqa: E731
    local = {"wqkv": col(p["wqkv"]), "bqkv": col(p["bqkv"]), "wo": row(p["wo"]), "w1": col(p["w1"]),
             "b1": col(p["b1"]), "w2": row(p["w2"])}
    for k in ("ln1_w", "ln1_b", "ln2_w", "ln2_b", "bo", "b2"):
        local[k] = p[k].clone()
    return local, x.clone()


def megatron_layer(x, p, sh: Shape, group):
    h, hd = sh.hidden, sh.hidden // sh.heads
    a = F.layer_norm(x, (h,), p["ln1_w"], p["ln1_b"], EPS)
    a = C.copy(a, group, "tp") @ p["wqkv"] + p["bqkv"]
    a = local_attention(a, sh.seq, hd)
    x = x + C.all_reduce(a @ p["wo"], group, "tp") + p["bo"]
    a = F.layer_norm(x, (h,), p["ln2_w"], p["ln2_b"], EPS)
    a = F.gelu(C.copy(a, group, "tp") @ p["w1"] + p["b1"])
    return x + C.all_reduce(a @ p["w2"], group, "tp") + p["b2"]


# ------------------------------------------------------------------ 2D / 2.5D / 3D

def _grid(mode: str, q: int, d: int):
    from runtime.grid import Grid2D, Grid25D, Grid3D
    return Grid2D(q) if mode == "2d" else Grid25D(q, d) if mode == "2.5d" else Grid3D(q)


def _specs(mode: str, grid) -> dict:
    if mode == "3d":
        a1, a2, M3 = AXES, matmul3d.swap(AXES), matmul3d
        ln = M3.vector_spec(grid, a2)
        return {"x": M3.act_spec(grid, a1), "ln1_w": ln, "ln1_b": ln, "ln2_w": ln, "ln2_b": ln,
                "wqkv": M3.weight_spec(grid, a1), "bqkv": M3.vector_spec(grid, a1),
                "wo": M3.weight_spec(grid, a2), "bo": M3.vector_spec(grid, a2),
                "w1": M3.weight_spec(grid, a1), "b1": M3.vector_spec(grid, a1),
                "w2": M3.weight_spec(grid, a2), "b2": M3.vector_spec(grid, a2)}
    mod = summa if mode == "2d" else tesseract
    vec, w = mod.vector_spec(grid), mod.weight_spec(grid)
    out = {k: (w if k.startswith("w") else vec) for k in
           ("ln1_w", "ln1_b", "wqkv", "bqkv", "wo", "bo", "ln2_w", "ln2_b", "w1", "b1", "w2", "b2")}
    out["x"] = mod.act_spec(grid)
    return out


def grid_layer(mode: str, grid, x, p, sh: Shape):
    hd = sh.hidden // sh.heads
    if mode == "3d":
        M3, a1, a2 = matmul3d, AXES, matmul3d.swap(AXES)
        a = M3.layer_norm(x, p["ln1_w"], p["ln1_b"], grid, a1, EPS)
        a = local_attention(M3.linear(a, p["wqkv"], p["bqkv"], grid, a1), sh.seq, hd)
        x = x + M3.linear(a, p["wo"], p["bo"], grid, a2)
        a = M3.layer_norm(x, p["ln2_w"], p["ln2_b"], grid, a1, EPS)
        return x + M3.linear(F.gelu(M3.linear(a, p["w1"], p["b1"], grid, a1)), p["w2"], p["b2"], grid, a2)
    mod = summa if mode == "2d" else tesseract
    a = mod.layer_norm(x, p["ln1_w"], p["ln1_b"], grid, EPS)
    a = local_attention(mod.linear(a, p["wqkv"], p["bqkv"], grid), sh.seq, hd)
    x = x + mod.linear(a, p["wo"], p["bo"], grid)
    a = mod.layer_norm(x, p["ln2_w"], p["ln2_b"], grid, EPS)
    return x + mod.linear(F.gelu(mod.linear(a, p["w1"], p["b1"], grid)), p["w2"], p["b2"], grid)


# ------------------------------------------------------------------ one rank

def rank_step(rank: int, world: int, mode: str, q: int, d: int, sh: Shape) -> dict:
    """One forward + backward on this rank: bytes and calls per (group, kind), local sizes."""
    torch.set_num_threads(1)
    gp, gx = global_params(sh)
    if mode == "1d":
        p, x = _megatron_local(gp, gx, sh, rank, world)
        run = lambda x_, p_: megatron_layer(x_, p_, sh, dist.group.WORLD)   # noqa: E731
    else:
        grid = _grid(mode, q, d)
        specs = _specs(mode, grid)
        p = {k: take(v, specs[k]) for k, v in _qkv_grouped(gp, sh, q).items()}
        x = take(gx, specs["x"])
        run = lambda x_, p_: grid_layer(mode, grid, x_, p_, sh)   # noqa: E731
    p = {k: v.requires_grad_() for k, v in p.items()}
    x.requires_grad_()
    run(x, p).sum().backward()   # warm-up (lazy imports), then the counted step
    COMM_STATS.reset()
    y = run(x, p)
    y.sum().backward()
    return {"by_kind": COMM_STATS.snapshot_by_kind(), "calls": COMM_STATS.calls(),
            "param_numel": sum(t.numel() for t in p.values()), "act_numel": y.numel()}
