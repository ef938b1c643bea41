"""Communication of 2D (SUMMA), 2.5D (Tesseract) and 3D tensor parallelism, per rank, without
torch: the exact collectives runtime/summa.py, runtime/tesseract.py, runtime/matmul3d.py and
runtime/split_norm.py issue for one forward + backward, and the papers' per-layer table.

Each function returns a list of ``Collective(kind, group, size, nbytes, count, phase)``:
``count`` calls of ``kind`` over the group labelled ``group`` (``size`` ranks), each moving
``nbytes`` per rank in the runtime's COMM_STATS convention (broadcast, reduce, all_reduce: the
tensor; all_gather: the gathered output; reduce_scatter: the unreduced input). ``totals`` sums
them per (group, kind) into (calls, bytes) - what a run records, compared exactly in
tests/runtime/test_tp_grid_ops.py.

Shapes: a linear is Y[m, n] = X[m, k] W[k, n] with m the tokens of the whole tensor-parallel
group (batch x sequence); ``elem`` bytes per element; vectors (bias, LayerNorm weights) of
length n. Every size must divide as runtime/*.check_shapes demand.

The papers' table (Colossal-AI's documentation of Optimus, Tesseract and 3D, "based on the ring
algorithm", forward + backward of one linear, no bias):
    2D    bandwidth 6(q-1)/q          latency 6(q-1)
    2.5D  bandwidth 3(q-1)(d+1)/(dq)  latency 6(q-1)
    3D    bandwidth 6(q-1)/q^3        latency 6(q-1)
To price in seconds, give each Collective (kind, group size, nbytes) to the planner's collective
time model with the link of the mesh axis its group lies on.

``paper_bandwidth`` / ``paper_latency`` map our collectives onto those units, exactly:
  * bandwidth is in units of S = one whole matrix, the table taking X, W and Y of equal size
    (m = k = n); a call over p ranks whose per-rank block is b elements (broadcast / reduce: the
    tensor; all_gather: the input piece; reduce_scatter: the output piece) counts (p-1)*b.
    2D: 6 SUMMA passes (3 GEMMs x 2 operands) of q calls on blocks S/q^2 -> 6(q-1)/q.
  * latency is in ring hops: an all_gather / reduce_scatter over p ranks is p-1 hops; a SUMMA
    pass of p broadcasts (or reduces), one rooted at each member in turn, is one ring pass of p-1
    hops, so each such call counts (p-1)/p.
  * the table leaves out the gradient all_reduce over depth of 2.5D's depth-replicated weights
    (and biases and LayerNorm): ``paper_*`` take ``groups`` to select the grid plane.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class Collective:
    kind: str      # broadcast | reduce | all_reduce | all_gather | reduce_scatter
    group: str     # COMM_STATS label: row, col, depth (2D/2.5D) or an axis x, y, z (3D)
    size: int      # ranks in the group
    nbytes: int    # per rank per call
    count: int = 1
    phase: str = "forward"

    @property
    def block_bytes(self) -> Fraction:
        """The per-rank block of the call (all_gather: my input; reduce_scatter: my output)."""
        if self.kind in ("all_gather", "reduce_scatter"):
            return Fraction(self.nbytes, self.size)
        return Fraction(self.nbytes)


def _div(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what} = {a} does not split evenly into {b} blocks")
    return a // b


# ------------------------------------------------------------------ 2D / 2.5D (SUMMA planes)

def _summa(m_blk: int, k: int, n: int, q: int, elem: int) -> list[Collective]:
    """One SUMMA linear on a q x q plane; m_blk = my tokens (m/q in 2D, m/(dq) in 2.5D)."""
    a = m_blk * _div(k, q, "in features") * elem      # my block of X (and of dX)
    b = _div(k, q, "in features") * _div(n, q, "out features") * elem   # my block of W (and dW)
    return [
        Collective("broadcast", "row", q, a, q, "forward"),      # C = A B: A_il along rows
        Collective("broadcast", "col", q, b, q, "forward"),      #          B_lj along columns
        Collective("broadcast", "col", q, b, q, "backward"),     # dA = dC B^T: B along columns
        Collective("reduce", "row", q, a, q, "backward"),        #   partial dA reduced along rows
        Collective("broadcast", "row", q, a, q, "backward"),     # dB = A^T dC: A along rows
        Collective("reduce", "col", q, b, q, "backward"),        #   partial dB reduced along columns
    ]


def _plane_vector(n: int, q: int, elem: int) -> list[Collective]:
    """A vector's column block gathered from its q pieces on my column; reduce_scatter back."""
    blk = _div(n, q, "vector length") * elem
    return [Collective("all_gather", "col", q, blk, 1, "forward"),
            Collective("reduce_scatter", "col", q, blk, 1, "backward")]


def _depth_sync(nbytes: int, d: int) -> list[Collective]:
    return [Collective("all_reduce", "depth", d, nbytes, 1, "backward")]


def linear_2d(m: int, k: int, n: int, q: int, elem: int = 4, bias: bool = True) -> list[Collective]:
    out = _summa(_div(m, q, "tokens"), k, n, q, elem)
    return out + (_plane_vector(n, q, elem) if bias else [])


def linear_2p5d(m: int, k: int, n: int, q: int, d: int, elem: int = 4, bias: bool = True) -> list[Collective]:
    out = _summa(_div(m, d * q, "tokens"), k, n, q, elem)
    out += _depth_sync(_div(k, q, "in features") * _div(n, q, "out features") * elem, d)
    if bias:
        out += _plane_vector(n, q, elem) + _depth_sync(_div(n, q * q, "bias") * elem, d)
    return out


def _norm(rows: int, group: str, size: int, elem: int) -> list[Collective]:
    return [Collective("all_reduce", group, size, rows * elem, 2, "forward"),     # sum x, sum (x-mean)^2
            Collective("all_reduce", group, size, 2 * rows * elem, 1, "backward")]  # sum g, sum g*x_hat


def layer_norm_2d(m: int, h: int, q: int, elem: int = 4) -> list[Collective]:
    return _norm(_div(m, q, "tokens"), "row", q, elem) + 2 * _plane_vector(h, q, elem)


def layer_norm_2p5d(m: int, h: int, q: int, d: int, elem: int = 4) -> list[Collective]:
    piece = _div(h, q * q, "LayerNorm size") * elem
    return (_norm(_div(m, d * q, "tokens"), "row", q, elem)
            + 2 * (_plane_vector(h, q, elem) + _depth_sync(piece, d)))


# ------------------------------------------------------------------ 3D

def linear_3d(m: int, k: int, n: int, q: int, elem: int = 4, bias: bool = True,
              axes: tuple[str, str, str] = ("x", "y", "z"), regather: bool = False) -> list[Collective]:
    am, ak, an = axes
    x_ab = _div(m, q, "tokens") * _div(k, q, "in features") * elem       # X_ab, gathered
    w_bc = _div(k, q, "in features") * _div(n, q, "out features") * elem  # W_bc, gathered
    y_ac = _div(m, q, "tokens") * _div(n, q, "out features") * elem       # partial Y, dY gathered
    out = [Collective("all_gather", an, q, x_ab, 1, "forward"),
           Collective("all_gather", am, q, w_bc, 1, "forward"),
           Collective("reduce_scatter", ak, q, y_ac, 1, "forward")]
    if regather:
        out += [Collective("all_gather", an, q, x_ab, 1, "backward"),
                Collective("all_gather", am, q, w_bc, 1, "backward")]
    out += [Collective("all_gather", ak, q, y_ac, 1, "backward"),
            Collective("reduce_scatter", an, q, x_ab, 1, "backward"),
            Collective("reduce_scatter", am, q, w_bc, 1, "backward")]
    return out + (_vector_3d(n, q, elem, axes) if bias else [])


def _vector_3d(n: int, q: int, elem: int, axes) -> list[Collective]:
    am, ak, _ = axes
    inner = _div(n, q * q, "vector length") * elem    # after the gather over ak
    outer = _div(n, q, "vector length") * elem        # after the gather over am
    return [Collective("all_gather", ak, q, inner, 1, "forward"),
            Collective("all_gather", am, q, outer, 1, "forward"),
            Collective("reduce_scatter", am, q, outer, 1, "backward"),
            Collective("reduce_scatter", ak, q, inner, 1, "backward")]


def layer_norm_3d(m: int, h: int, q: int, elem: int = 4,
                  axes: tuple[str, str, str] = ("x", "y", "z")) -> list[Collective]:
    """LayerNorm of the input of a linear with ``axes`` (runtime/matmul3d.layer_norm)."""
    am, ak, an = axes
    return _norm(_div(m, q * q, "tokens"), ak, q, elem) + 2 * _vector_3d(h, q, elem, (am, an, ak))


def swap(axes):
    am, ak, an = axes
    return (am, an, ak)


# ------------------------------------------------------------------ embedding

def embedding(mode: str, vocab: int, h: int, q: int, d: int = 1, elem: int = 4,
              axes: tuple[str, str, str] = ("x", "y", "z")) -> list[Collective]:
    """The table's column block gathered from its pieces (forward) and its gradient
    reduce-scattered back (runtime/*.embedding); 2.5D adds the depth all_reduce of the piece."""
    blk = vocab * _div(h, q, "hidden") * elem
    if mode == "3d":
        am, _, an = axes
        inner = vocab * _div(h, q * q, "hidden") * elem
        return [Collective("all_gather", an, q, inner, 1, "forward"),
                Collective("all_gather", am, q, blk, 1, "forward"),
                Collective("reduce_scatter", am, q, blk, 1, "backward"),
                Collective("reduce_scatter", an, q, inner, 1, "backward")]
    out = [Collective("all_gather", "col", q, blk, 1, "forward"),
           Collective("reduce_scatter", "col", q, blk, 1, "backward")]
    if mode == "2.5d":
        out += _depth_sync(vocab * _div(h, q * q, "hidden") * elem, d)
    return out


# ------------------------------------------------------------------ saved for backward

def saved_linear(mode: str, m: int, k: int, n: int, q: int, d: int = 1, regather: bool = False) -> dict:
    """Shapes of what one matmul saves for backward on each rank: {"activation": (rows, cols),
    "weight": (rows, cols)}. 2D/2.5D save the local blocks (activation 1/q^2, 1/(d q^2)); 3D
    saves the gathered X_ab and W_bc (q times the stored blocks) unless ``regather``, which
    saves the stored 1/q^3 blocks and gathers again in backward."""
    if mode == "2d":
        return {"activation": (m // q, k // q), "weight": (k // q, n // q)}
    if mode == "2.5d":
        return {"activation": (m // (d * q), k // q), "weight": (k // q, n // q)}
    if mode == "3d":
        if regather:
            return {"activation": (m // (q * q), k // q), "weight": (k // q, n // (q * q))}
        return {"activation": (m // q, k // q), "weight": (k // q, n // q)}
    raise ValueError(f"mode {mode!r}; expected '2d', '2.5d' or '3d'")


# ------------------------------------------------------------------ classifier loss

def cross_entropy(mode: str, m: int, q: int, d: int = 1, elem: int = 4,
                  axes: tuple[str, str, str] = ("x", "y", "z")) -> list[Collective]:
    """Cross-entropy on split logits (runtime/split_loss.py): row max, sum of exponentials and
    target logit all-reduced over the group that splits the classes; nothing in backward."""
    if mode == "3d":
        return [Collective("all_reduce", axes[2], q, _div(m, q * q, "tokens") * elem, 3, "forward")]
    rows = _div(m, q if mode == "2d" else d * q, "tokens")
    return [Collective("all_reduce", "row", q, rows * elem, 3, "forward")]


# ------------------------------------------------------------------ a pre-LN MLP block

def mlp_block(mode: str, m: int, h: int, f: int, q: int, d: int = 1, elem: int = 4,
              axes: tuple[str, str, str] = ("x", "y", "z")) -> list[Collective]:
    """x + W2 gelu(W1 LN(x) + b1) + b2 (GELU and the residual add move nothing)."""
    if mode == "2d":
        return layer_norm_2d(m, h, q, elem) + linear_2d(m, h, f, q, elem) + linear_2d(m, f, h, q, elem)
    if mode == "2.5d":
        return (layer_norm_2p5d(m, h, q, d, elem) + linear_2p5d(m, h, f, q, d, elem)
                + linear_2p5d(m, f, h, q, d, elem))
    if mode == "3d":
        return (layer_norm_3d(m, h, q, elem, axes) + linear_3d(m, h, f, q, elem, True, axes)
                + linear_3d(m, f, h, q, elem, True, swap(axes)))
    raise ValueError(f"mode {mode!r}; expected '2d', '2.5d' or '3d'")


def attention_block(mode: str, m: int, h: int, q: int, d: int = 1, elem: int = 4,
                    axes: tuple[str, str, str] = ("x", "y", "z")) -> list[Collective]:
    """x + Wo attention(Wqkv LN(x) + bqkv) + bo; the attention itself is local
    (runtime/split_attention.py: whole sequences and whole heads per rank)."""
    if mode == "2d":
        return layer_norm_2d(m, h, q, elem) + linear_2d(m, h, 3 * h, q, elem) + linear_2d(m, h, h, q, elem)
    if mode == "2.5d":
        return (layer_norm_2p5d(m, h, q, d, elem) + linear_2p5d(m, h, 3 * h, q, d, elem)
                + linear_2p5d(m, h, h, q, d, elem))
    if mode == "3d":
        return (layer_norm_3d(m, h, q, elem, axes) + linear_3d(m, h, 3 * h, q, elem, True, axes)
                + linear_3d(m, h, h, q, elem, True, swap(axes)))
    raise ValueError(f"mode {mode!r}; expected '2d', '2.5d' or '3d'")


def transformer_layer(mode: str, m: int, h: int, f: int, q: int, d: int = 1, elem: int = 4,
                      axes: tuple[str, str, str] = ("x", "y", "z")) -> list[Collective]:
    """A pre-LN transformer layer: attention block, then MLP block."""
    return attention_block(mode, m, h, q, d, elem, axes) + mlp_block(mode, m, h, f, q, d, elem, axes)


# ------------------------------------------------------------------ summaries

def totals(colls: list[Collective]) -> dict[tuple[str, str], tuple[int, int]]:
    """(group, kind) -> (calls, bytes) per rank, as COMM_STATS records them."""
    acc: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for c in colls:
        acc[(c.group, c.kind)][0] += c.count
        acc[(c.group, c.kind)][1] += c.count * c.nbytes
    return {key: (v[0], v[1]) for key, v in acc.items()}


def bytes_per_group(colls: list[Collective]) -> dict[str, int]:
    acc: dict[str, int] = defaultdict(int)
    for c in colls:
        acc[c.group] += c.count * c.nbytes
    return dict(acc)


def group_sizes(colls: list[Collective]) -> dict[str, int]:
    return {c.group: c.size for c in colls}


def paper_bandwidth(colls: list[Collective], matrix_bytes: int, groups=None) -> Fraction:
    """The table's bandwidth in units of one whole matrix (``matrix_bytes``); see module doc."""
    return bandwidth_of_totals(totals(colls), group_sizes(colls), matrix_bytes, groups)


def paper_latency(colls: list[Collective], groups=None) -> Fraction:
    """The table's latency in ring hops; see module doc."""
    return latency_of_totals(totals(colls), group_sizes(colls), groups)


def bandwidth_of_totals(tot: dict[tuple[str, str], tuple[int, int]], sizes: dict[str, int],
                        matrix_bytes: int, groups=None) -> Fraction:
    """``paper_bandwidth`` from (group, kind) -> (calls, bytes) totals - e.g. those a run
    recorded: sum over calls of (p-1) x block needs only the byte totals."""
    w = Fraction(0)
    for (group, kind), (_, nbytes) in tot.items():
        if groups is not None and group not in groups:
            continue
        p = sizes[group]
        block = Fraction(nbytes, p) if kind in ("all_gather", "reduce_scatter") else Fraction(nbytes)
        w += (p - 1) * block
    return w / matrix_bytes


def latency_of_totals(tot: dict[tuple[str, str], tuple[int, int]], sizes: dict[str, int], groups=None) -> Fraction:
    hops = Fraction(0)
    for (group, kind), (calls, _) in tot.items():
        if groups is not None and group not in groups:
            continue
        p = sizes[group]
        hops += calls * (Fraction(p - 1, p) if kind in ("broadcast", "reduce") else Fraction(p - 1))
    return hops


def table_2d(q: int) -> tuple[Fraction, Fraction]:
    """(bandwidth, latency) of the papers' table."""
    return Fraction(6 * (q - 1), q), Fraction(6 * (q - 1))


def table_2p5d(q: int, d: int) -> tuple[Fraction, Fraction]:
    return Fraction(3 * (q - 1) * (d + 1), d * q), Fraction(6 * (q - 1))


def table_3d(q: int) -> tuple[Fraction, Fraction]:
    return Fraction(6 * (q - 1), q ** 3), Fraction(6 * (q - 1))
