"""2D tensor parallelism (Optimus, Xu et al. 2021): SUMMA matmul and the layer ops that keep a
transformer block's activations split over a q x q grid (runtime/grid.py Grid2D; 2.5D reuses
the same SUMMA on each of its stacked planes, runtime/tesseract.py).

Layout on rank (i, j) of the plane:
    activation X [tokens, h]   block (i, j): tokens split over the column group (i), h over the
                               row group (j); 1/q^2 per rank (1/(d q^2) in 2.5D: tokens split d*q)
    weight     W [in, out]     block (i, j) (Y = X W, the papers' orientation; nn.Linear.weight.T)
    vector     b [out]         block j of q, split again over the column group: piece i of q
                               (1/q^2 per rank), gathered over the column group when used

SUMMA (q steps; per step one row broadcast and one column broadcast, then a local GEMM):
    C = A B     step l: A_il along row i, B_lj along column j, C_ij += A_il B_lj
    dA = dC B^T step l: B_lj along column j, P = dC_ij B_lj^T reduced along row i onto (i, l)
    dB = A^T dC step l: A_il along row i,    P = A_il^T dC_ij reduced along column j onto (l, j)
Per rank and linear, forward + backward: 4q broadcasts and 2q reduces (solver/tp_grid_cost.py
prices exactly these). Only the local A and B blocks are saved for backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime import collectives as C
from runtime.grid import broadcast, check_divisible, reduce
from runtime.split_loss import split_cross_entropy
from runtime.split_norm import split_layer_norm


def _summa_ab(a, b, g):
    """C_ij = sum_l A_il B_lj (a: [T, k/q] my A block, b: [k/q, n/q] my B block)."""
    out = a.new_zeros(a.shape[0], b.shape[1])
    for l in range(g.q):
        a_l = broadcast(a if g.j == l else None, a.shape, a.dtype, g.row_src(l), g.row_group, "row")
        b_l = broadcast(b if g.i == l else None, b.shape, b.dtype, g.col_src(l), g.col_group, "col")
        out += a_l @ b_l
    return out


def _summa_abt(dc, b, g):
    """dA_ij = sum_l dC_il B_jl^T (dc: [T, n/q], b: [k/q, n/q]); result [T, k/q]."""
    out = None
    for l in range(g.q):
        b_l = broadcast(b if g.i == l else None, b.shape, b.dtype, g.col_src(l), g.col_group, "col")
        part = reduce(dc @ b_l.t(), g.row_src(l), g.row_group, "row")
        if part is not None:
            out = part
    return out


def _summa_atb(a, dc, g):
    """dB_ij = sum_l A_li^T dC_lj (a: [T, k/q], dc: [T, n/q]); result [k/q, n/q]."""
    out = None
    for l in range(g.q):
        a_l = broadcast(a if g.j == l else None, a.shape, a.dtype, g.row_src(l), g.row_group, "row")
        part = reduce(a_l.t() @ dc, g.col_src(l), g.col_group, "col")
        if part is not None:
            out = part
    return out


class _Summa(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, grid):
        ctx.grid = grid
        ctx.save_for_backward(a, b)
        return _summa_ab(a, b, grid)

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        dc = dc.contiguous()
        da = _summa_abt(dc, b, ctx.grid) if ctx.needs_input_grad[0] else None
        db = _summa_atb(a, dc, ctx.grid) if ctx.needs_input_grad[1] else None
        return da, db, None


def matmul(x: torch.Tensor, w: torch.Tensor, grid) -> torch.Tensor:
    """Y = X W on the plane: ``x`` my block [..., k/q] (leading dims = my tokens), ``w`` my block
    [k/q, n/q]; returns my block [..., n/q] of Y."""
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"SUMMA matmul: local input block has {x.shape[-1]} features, weight block {w.shape[0]}")
    lead = x.shape[:-1]
    y = _Summa.apply(x.reshape(-1, x.shape[-1]), w, grid)
    return y.reshape(*lead, w.shape[1])


def gather_vector(piece: torch.Tensor, grid) -> torch.Tensor:
    """Column block j of a vector parameter from its q pieces on my column (backward:
    reduce_scatter over the column, summing the per-row-block partial gradients)."""
    return C.all_gather(piece, 0, grid.col_group, "col")


def linear(x, w, b, grid):
    """Y = X W + b with activations and parameters 2D-split (b: my 1/q^2 piece, or None)."""
    y = matmul(x, w, grid)
    return y if b is None else y + gather_vector(b, grid)


def layer_norm(x, gamma, beta, grid, eps: float = 1e-5):
    """LayerNorm over the hidden dim, which is split over the row group: statistics are summed
    along the grid row (runtime/split_norm.py); gamma/beta are my 1/q^2 pieces."""
    return split_layer_norm(x, gather_vector(gamma, grid), gather_vector(beta, grid),
                            grid.row_group, "row", x.shape[-1] * grid.q, eps)


def embedding(ids, table, grid):
    """Embedding of my tokens' ids into my hidden block j: ``table`` is my [V, h/q^2] piece
    (piece j*q + i of the hidden dim), gathered over my column to [V, h/q] (backward:
    reduce_scatter of the table gradient, partial over the column's token blocks)."""
    return F.embedding(ids, C.all_gather(table, 1, grid.col_group, "col"))


def cross_entropy(logits, target, grid):
    """Per-token loss of my [my tokens, C/q] logits block (classes split over the row group,
    e.g. the output of ``linear`` with a [h, C] classifier); ``target`` holds my tokens' class
    ids. Complete and identical along my grid row (runtime/split_loss.py)."""
    return split_cross_entropy(logits, target, grid.j, grid.row_group, "row")


# ------------------------------------------------------------------ block specs (sharding)

def act_spec(grid):
    """Block of a [tokens, h] activation on my rank: tokens piece i of q, h piece j of q."""
    return ((grid.i, grid.q), (grid.j, grid.q))


def weight_spec(grid):
    return ((grid.i, grid.q), (grid.j, grid.q))


def vector_spec(grid):
    """Piece j*q + i of q*q (block j, then piece i within it, matching gather_vector)."""
    return ((grid.j * grid.q + grid.i, grid.q * grid.q),)


def table_spec(grid):
    """Block of a [V, h] embedding table: all rows, hidden piece j*q + i of q*q."""
    return (None, (grid.j * grid.q + grid.i, grid.q * grid.q))


def check_shapes(tokens: int, dims: dict[str, int], q: int) -> None:
    """Clear errors before running: tokens and every hidden size must split over q (and the
    vectors over q*q)."""
    check_divisible("tokens", tokens, q, "2D: rows over the grid's column groups")
    for name, n in dims.items():
        check_divisible(name, n, q * q, "2D: q column blocks, each split over q rows for vectors")
