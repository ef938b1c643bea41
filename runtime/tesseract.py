"""2.5D tensor parallelism (Tesseract, Wang et al. 2021) on d stacked q x q planes
(runtime/grid.py Grid25D).

The input is split over depth as well: a [tokens, h] activation is cut into d*q row blocks and
q column blocks, and plane k holds row blocks k*q .. k*q+q-1, so each rank keeps 1/(d q^2) of
every activation. Weights are split q x q as in 2D and replicated over depth (1/q^2 per rank,
the papers' "Memory (parameters) O(1/q^2)"); each plane runs SUMMA (runtime/summa.py) on its
own rows, and the weight gradients - partial over depth, since each plane saw a different part
of the tokens - are all-reduced over the depth group in backward (``copy`` over depth: identity
forward, all_reduce backward). So per linear the SUMMA traffic of 2D on d-times smaller
activation blocks, plus one depth all_reduce of the weight block (and of the bias piece).
"""
from __future__ import annotations

from runtime import collectives as C
from runtime import summa
from runtime.grid import check_divisible
from runtime.split_norm import split_layer_norm


def _replicated(p, grid):
    """A depth-replicated parameter: its gradient is summed over the d planes."""
    return C.copy(p, grid.depth_group, "depth")


def matmul(x, w, grid):
    """Y = X W: ``x`` my [tokens/(d q), k/q] block, ``w`` my [k/q, n/q] block (same on every plane)."""
    return summa.matmul(x, _replicated(w, grid), grid)


def linear(x, w, b, grid):
    y = matmul(x, w, grid)
    return y if b is None else y + summa.gather_vector(_replicated(b, grid), grid)


def layer_norm(x, gamma, beta, grid, eps: float = 1e-5):
    g = summa.gather_vector(_replicated(gamma, grid), grid)
    b = summa.gather_vector(_replicated(beta, grid), grid)
    return split_layer_norm(x, g, b, grid.row_group, "row", x.shape[-1] * grid.q, eps)


def embedding(ids, table, grid):
    """As summa.embedding, the table replicated over depth (its gradient all-reduced there)."""
    return summa.embedding(ids, _replicated(table, grid), grid)


cross_entropy = summa.cross_entropy   # classes over the row group, tokens over depth x column


def act_spec(grid):
    """Tokens: row block k*q + i of d*q; hidden: block j of q."""
    return ((grid.k * grid.q + grid.i, grid.d * grid.q), (grid.j, grid.q))


weight_spec = summa.weight_spec
table_spec = summa.table_spec
vector_spec = summa.vector_spec


def check_shapes(tokens: int, dims: dict[str, int], q: int, d: int) -> None:
    check_divisible("tokens", tokens, d * q, "2.5D: rows over depth x column groups")
    for name, n in dims.items():
        check_divisible(name, n, q * q, "2.5D: q column blocks, each split over q rows for vectors")
