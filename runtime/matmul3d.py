"""3D tensor parallelism (Bian et al. 2021) on a q x q x q grid (runtime/grid.py Grid3D).

A linear Y = X W [m, k] x [k, n] names three grid axes ``axes = (am, ak, an)``: rank with
coordinates (a, b, c) on them computes the block product X_ab W_bc of m-block a, k-block b,
n-block c. Nothing is stored twice: each operand is split over a different pair of axes.
    X  [m/q^2, k/q]   m-block a, piece c within it (rows a*q + c of q^2); k-block b
    W  [k/q, n/q^2]   k-block b; n-block c, piece a within it (cols c*q + a of q^2)
    Y  [m/q^2, n/q]   m-block a, piece b within it (rows a*q + b);        n-block c
Forward: all_gather X over an (-> X_ab), all_gather W over am (-> W_bc), GEMM, reduce_scatter
the partial Y over ak. Backward: all_gather dY over ak, dX = dY W^T reduce_scattered over an,
dW = X^T dY reduce_scattered over am. Six collectives of 1/q^3-sized pieces per linear, the
paper's count. The gathered X_ab and W_bc are saved for backward (q times a stored block);
``regather=True`` saves only the local blocks and gathers them again in backward (two more
all_gathers, saved activations 1/q^3).

Y's layout is X's with the roles of ak and an swapped, so the next linear uses
``axes = (am, an, ak)`` - a transformer block alternates the two (``swap``), and its output
has the input's layout again (residuals add locally).

Vectors (bias, LayerNorm weights) of an n-block c hold piece a*q + b of q^2 of it (1/q^3 per
rank), gathered over ak then am. LayerNorm's statistics are summed over the axis that splits
the hidden dim (ak for the linear that follows).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from runtime import collectives as C
from runtime.grid import check_divisible
from runtime.split_loss import split_cross_entropy
from runtime.split_norm import split_layer_norm


# Called inside the Function's forward/backward, where autograd is off: plain counted collectives.
def _ag(t, dim, g, axis):
    return C.all_gather(t.contiguous(), dim, g.group(axis), axis)


def _rs(t, dim, g, axis):
    return C.reduce_scatter(t.contiguous(), dim, g.group(axis), axis)


class _Matmul3D(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, grid, axes, regather):
        am, ak, an = axes
        xg, wg = _ag(x, 0, grid, an), _ag(w, 1, grid, am)
        ctx.grid, ctx.axes, ctx.regather = grid, axes, regather
        ctx.save_for_backward(*((x, w) if regather else (xg, wg)))
        return _rs(xg @ wg, 0, grid, ak)

    @staticmethod
    def backward(ctx, dy):
        am, ak, an = ctx.axes
        g = ctx.grid
        xg, wg = ctx.saved_tensors
        if ctx.regather:
            xg, wg = _ag(xg, 0, g, an), _ag(wg, 1, g, am)
        dyg = _ag(dy.contiguous(), 0, g, ak)
        dx = _rs(dyg @ wg.t(), 0, g, an)
        dw = _rs(xg.t() @ dyg, 1, g, am)
        return dx, dw, None, None, None


def swap(axes):
    """The next linear's axes: the output's hidden dim is split over ``an``."""
    am, ak, an = axes
    return (am, an, ak)


def matmul(x, w, grid, axes, regather: bool = False):
    lead = x.shape[:-1]
    y = _Matmul3D.apply(x.reshape(-1, x.shape[-1]), w, grid, tuple(axes), regather)
    return y.reshape(*lead, y.shape[-1])


def gather_vector(piece, grid, axes):
    """n-block of a vector from its q^2 pieces: gather over ak, then over am (backward:
    reduce_scatter over am, then over ak - the rows are split over both)."""
    am, ak, _ = axes
    inner = C.all_gather(piece, 0, grid.group(ak), ak)
    return C.all_gather(inner, 0, grid.group(am), am)


def linear(x, w, b, grid, axes, regather: bool = False):
    y = matmul(x, w, grid, axes, regather)
    return y if b is None else y + gather_vector(b, grid, axes)


def layer_norm(x, gamma, beta, grid, axes, eps: float = 1e-5):
    """LayerNorm of an activation laid out as the input of a linear with ``axes`` (hidden dim
    split over ak). The vectors are laid out for that hidden dim: n-block = ak coordinate."""
    am, ak, an = axes
    vaxes = (am, an, ak)     # the vector's pieces as if it were the output of the previous linear
    return split_layer_norm(x, gather_vector(gamma, grid, vaxes), gather_vector(beta, grid, vaxes),
                            grid.group(ak), ak, x.shape[-1] * grid.q, eps)


def embedding(ids, table, grid, axes):
    """Embedding laid out as the input of a linear with ``axes`` (hidden block ak): ``table`` is
    my [V, h/q^3] piece (piece am*q + an of block ak), gathered over an, then am (backward:
    reduce_scatter over am, then an - my tokens are split over both)."""
    am, _, an = axes
    t = C.all_gather(table, 1, grid.group(an), an)
    return F.embedding(ids, C.all_gather(t, 1, grid.group(am), am))


def cross_entropy(logits, target, grid, axes):
    """Per-token loss of logits laid out as the output of a linear with ``axes`` (classes over
    an, tokens over am, ak); complete and identical over the an group."""
    return split_cross_entropy(logits, target, grid.coord(axes[2]), grid.group(axes[2]), axes[2])


def act_spec(grid, axes):
    """Block of an activation laid out as the input of a linear with ``axes``."""
    am, ak, an = axes
    q, c = grid.q, grid.coord
    return ((c(am) * q + c(an), q * q), (c(ak), q))


def table_spec(grid, axes):
    am, ak, an = axes
    q, c = grid.q, grid.coord
    return (None, (c(ak) * q * q + c(am) * q + c(an), q ** 3))


def weight_spec(grid, axes):
    am, ak, an = axes
    q, c = grid.q, grid.coord
    return ((c(ak), q), (c(an) * q + c(am), q * q))


def vector_spec(grid, axes):
    """Piece of the output vector (bias) of a linear with ``axes``: block an, piece am*q + ak."""
    am, ak, an = axes
    q, c = grid.q, grid.coord
    return ((c(an) * q * q + c(am) * q + c(ak), q ** 3),)


def check_shapes(tokens: int, dims: dict[str, int], q: int) -> None:
    check_divisible("tokens", tokens, q * q, "3D: rows over two grid axes")
    for name, n in dims.items():
        check_divisible(name, n, q ** 3, "3D: weights' columns over two axes, vectors over three")
