"""Predicted per-layer step time of 1D (Megatron), 2D (SUMMA), 2.5D (Tesseract) and 3D tensor
parallelism for one pre-LN transformer layer, priced with autopar's cost model (torch-free).

What it owns: the local shapes each mode computes on, the collectives each mode issues (2D / 2.5D
/ 3D from solver/tp_grid_cost.py exactly; 1D = Megatron's four all-reduces, built here in the same
``Collective`` form), and the process-grid placement on a cluster's nodes. Pricing is autopar's:
``cost.compute_time`` / ``fwd_bwd_compute`` for every kernel (GEMMs by the profile's
GEMM-by-intensity curve for the *local* block shape; memory-bound kernels by bytes) and
``cost.Collectives`` for every collective on the link its group lies on.

Layer: x + Wo attn(Wqkv LN(x)), then x + W2 gelu(W1 LN(x)); biases in every linear (the grid modes
gather / reduce-scatter them, tp_grid_cost counts it). m = batch x seq tokens of the whole
tensor-parallel group, h hidden, f MLP hidden, a heads, P ranks.

Local GEMMs per linear Y[m, n] = X[m, k] W[k, n] (forward; backward = 2 kernels of the same three
shapes, ``fwd_bwd_compute(weight_grad=True)``):
    1D    column-parallel (m, k, n/P) or row-parallel (m, k/P, n): one GEMM
    2D    q SUMMA steps of (m/q, k/q, n/q)
    2.5D  q SUMMA steps of (m/(dq), k/q, n/q)
    3D    one GEMM of (m/q, k/q, n/q) (gathered X_ab and W_bc, partial Y_ac)
Attention's two batched matmuls run locally on (sequences, heads) = (b, a/P) in 1D, (b/q, a/q)
in 2D, (b/(dq), a/q) in 2.5D, (b/q^2, a/q) in 3D: the same FLOPs per rank in every mode.
Memory-bound kernels (each forward and backward, bytes = read + write): two LayerNorms (2 passes),
two residual adds (3), GELU (2 on the MLP hidden), softmax (2 on the scores). In 1D the LayerNorms
and residuals work on the full replicated [m, h] activation - Megatron's duplicated work - in the
grid modes on 1/P of it.

Collectives: no overlap with compute (the papers' implementations issue blocking collectives).
autopar's model has no ``reduce``; SUMMA's reduce is priced as a broadcast (a pipelined ring reduce
moves the same bytes the other way). Placement: the grid is laid over ranks row-major (the
runtime's DeviceMesh), ranks over nodes node-major, so the fastest-varying axis - "row" in 2D /
2.5D, "z" in 3D, the whole group in 1D - is the one inside a node (autopar.mesh.Mesh.placement).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.cluster import Cluster
from autopar.pricing.cost import Collectives, fwd_bwd_compute, gemm_intensity, profile_of
from autopar.mesh import Mesh
from solver import tp_grid_cost as tgc
from solver.tp_grid_cost import Collective

AXES3 = ("x", "y", "z")


@dataclass(frozen=True)
class Setting:
    name: str
    batch: int      # sequences (or images) per step, whole tensor-parallel group
    seq: int        # tokens per sequence
    hidden: int
    heads: int
    ffn: int
    elem: int = 2   # bytes per element (fp16)
    dtype: str = "fp16"

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


@dataclass(frozen=True)
class Mode:
    name: str       # "1d" | "2d" | "2.5d" | "3d"
    q: int = 1      # grid side (1D: unused)
    d: int = 1      # 2.5D depth
    p: int = 1      # 1D degree

    @property
    def ranks(self) -> int:
        return {"1d": self.p, "2d": self.q ** 2, "2.5d": self.d * self.q ** 2, "3d": self.q ** 3}[self.name]

    def label(self) -> str:
        return {"1d": f"1D p={self.p}", "2d": f"2D q={self.q}", "2.5d": f"2.5D q={self.q} d={self.d}",
                "3d": f"3D q={self.q}"}[self.name]


# ------------------------------------------------------------------ grid placement

def grid_mesh(mode: Mode, devices_per_node: int) -> tuple[Mesh, dict[str, int]]:
    """The grid as an autopar Mesh (same axis order as runtime/grid.py) and group label -> axis."""
    if mode.name == "1d":
        shape, names = (mode.p,), ("tp",)
    elif mode.name == "2d":
        shape, names = (mode.q, mode.q), ("col", "row")
    elif mode.name == "2.5d":
        shape, names = (mode.d, mode.q, mode.q), ("depth", "col", "row")
    elif mode.name == "3d":
        shape, names = (mode.q,) * 3, AXES3
    else:
        raise ValueError(f"mode {mode.name!r}; expected 1d, 2d, 2.5d or 3d")
    return Mesh(shape, names, devices_per_node), {n: i for i, n in enumerate(names)}


def placement(mode: Mode, devices_per_node: int) -> dict[str, tuple[int, int]]:
    """group label -> (ranks of one group inside a node, nodes one group spans)."""
    mesh, axis = grid_mesh(mode, devices_per_node)
    return {g: (mesh.placement(a).intra, mesh.placement(a).inter) for g, a in axis.items()}


# ------------------------------------------------------------------ collectives per mode

def megatron_1d(m: int, h: int, p: int, elem: int) -> list[Collective]:
    """Megatron-LM's layer: all_reduce of the [m, h] output of each row-parallel linear (attention
    projection, MLP down) forward, and of the input gradient at each column-parallel linear (QKV,
    MLP up) backward. Nothing else moves (LayerNorm and biases of row-parallel linears are
    replicated, their gradients identical on every rank)."""
    s = m * h * elem
    return [Collective("all_reduce", "tp", p, s, 2, "forward"),
            Collective("all_reduce", "tp", p, s, 2, "backward")]


def layer_collectives(st: Setting, mode: Mode) -> list[Collective]:
    if mode.name == "1d":
        return megatron_1d(st.tokens, st.hidden, mode.p, st.elem)
    return tgc.transformer_layer(mode.name, st.tokens, st.hidden, st.ffn, mode.q, mode.d, st.elem, AXES3)


# ------------------------------------------------------------------ compute per mode

def _linears(st: Setting) -> list[tuple[int, int, str]]:
    """(k, n, kind) of the layer's four linears; kind: Megatron's column / row split."""
    h, f = st.hidden, st.ffn
    return [(h, 3 * h, "col"), (h, h, "row"), (h, f, "col"), (f, h, "row")]


def local_gemms(st: Setting, mode: Mode) -> list[tuple[int, dict]]:
    """(count, letter sizes) of every forward GEMM one rank runs: linears then attention."""
    m, q, d, P = st.tokens, mode.q, mode.d, mode.ranks
    out = []
    for k, n, kind in _linears(st):
        if mode.name == "1d":
            sizes = {"m": m, "k": k, "n": n // P} if kind == "col" else {"m": m, "k": k // P, "n": n}
            out.append((1, sizes))
        elif mode.name == "2d":
            out.append((q, {"m": m // q, "k": k // q, "n": n // q}))
        elif mode.name == "2.5d":
            out.append((q, {"m": m // (d * q), "k": k // q, "n": n // q}))
        else:
            out.append((1, {"m": m // q, "k": k // q, "n": n // q}))
    seqs = {"1d": st.batch, "2d": st.batch // q, "2.5d": st.batch // (d * q), "3d": st.batch // (q * q)}[mode.name]
    heads = st.heads // (P if mode.name == "1d" else q)
    dh, s = st.hidden // st.heads, st.seq
    bh = seqs * heads
    out.append((1, {"b": bh, "m": s, "k": dh, "n": s}))     # scores = Q K^T
    out.append((1, {"b": bh, "m": s, "k": s, "n": dh}))     # context = P V
    return out


def _gemm_seconds(sizes: dict, st: Setting, cluster: Cluster) -> tuple[float, float]:
    """(forward, backward) seconds of one GEMM with these local sizes."""
    flops = 2.0 * math.prod(sizes.values())
    b = sizes.get("b", 1)
    nbytes = st.elem * b * (sizes["m"] * sizes["k"] + sizes["k"] * sizes["n"] + sizes["m"] * sizes["n"])
    tensors = ["bmk", "bkn", "bmn"] if "b" in sizes else ["mk", "kn", "mn"]
    ai = gemm_intensity(sizes, tensors, st.elem)
    return fwd_bwd_compute(flops, nbytes, st.dtype, cluster.device, True, ai, profile_of(cluster))


def elementwise_bytes(st: Setting, mode: Mode) -> list[float]:
    """Bytes (read + write) of each memory-bound kernel one rank runs forward (see module doc)."""
    m, h, f, P = st.tokens, st.hidden, st.ffn, mode.ranks
    act = m * h * st.elem * (1.0 if mode.name == "1d" else 1.0 / P)     # 1D: replicated [m, h]
    mlp = m * f * st.elem / P
    scores = st.batch * st.heads * st.seq * st.seq * st.elem / P
    return [2 * act, 2 * act, 3 * act, 3 * act, 2 * mlp, 2 * scores]    # LN, LN, add, add, GELU, softmax


def compute_seconds(st: Setting, mode: Mode, cluster: Cluster) -> dict[str, float]:
    """{"gemm": s, "elementwise": s} for one forward + backward of the layer on one rank."""
    gemm = 0.0
    for count, sizes in local_gemms(st, mode):
        fwd, bwd = _gemm_seconds(sizes, st, cluster)
        gemm += count * (fwd + bwd)
    cal = profile_of(cluster)
    ew = 0.0
    for nbytes in elementwise_bytes(st, mode):
        fwd, bwd = fwd_bwd_compute(0.0, nbytes, st.dtype, cluster.device, False, None, cal)
        ew += fwd + bwd
    return {"gemm": gemm, "elementwise": ew}


# ------------------------------------------------------------------ communication

PRICED_AS = {"reduce": "broadcast"}


def comm_seconds(colls: list[Collective], mode: Mode, cluster: Cluster) -> dict[str, float]:
    """Seconds per group label, every collective priced on its group's mesh axis."""
    mesh, axis = grid_mesh(mode, cluster.devices_per_node)
    price = Collectives(cluster, mesh)
    out: dict[str, float] = {}
    for c in colls:
        t = c.count * price(PRICED_AS.get(c.kind, c.kind), c.nbytes, axis[c.group])
        out[c.group] = out.get(c.group, 0.0) + t
    return out


@dataclass(frozen=True)
class Prediction:
    mode: Mode
    gemm: float
    elementwise: float
    comm: dict
    comm_bytes: int

    @property
    def compute(self) -> float:
        return self.gemm + self.elementwise

    @property
    def comm_total(self) -> float:
        return sum(self.comm.values())

    @property
    def step(self) -> float:
        return self.compute + self.comm_total


def predict(st: Setting, mode: Mode, cluster: Cluster) -> Prediction:
    if mode.ranks != cluster.num_devices:
        raise ValueError(f"{mode.label()} needs {mode.ranks} ranks; the cluster has {cluster.num_devices}")
    colls = layer_collectives(st, mode)
    c = compute_seconds(st, mode, cluster)
    return Prediction(mode, c["gemm"], c["elementwise"], comm_seconds(colls, mode, cluster),
                      sum(x.count * x.nbytes for x in colls))


def speedup(a: Prediction, b: Prediction) -> float:
    """How much faster ``a`` is than ``b``: T_b / T_a (the papers' "1.48x over Megatron")."""
    return b.step / a.step


# Bytes one rank sends on the wire per counted byte (COMM_STATS counts the tensor: all_reduce the
# tensor, all_gather the output, reduce_scatter the input, broadcast / reduce the tensor on every
# rank), for ring algorithms on p ranks; a pipelined ring broadcast or reduce sends (p-1) tensors
# in all, (p-1)/p per rank on average.
WIRE = {"all_reduce": lambda p: 2 * (p - 1) / p, "all_gather": lambda p: (p - 1) / p,
        "reduce_scatter": lambda p: (p - 1) / p, "broadcast": lambda p: (p - 1) / p,
        "reduce": lambda p: (p - 1) / p}


def wire_bytes(totals: dict, sizes: dict[str, int]) -> float:
    """Ring wire bytes per rank of (group, kind) -> (calls, counted bytes) totals."""
    return sum(WIRE[kind](sizes[group]) * nbytes for (group, kind), (_, nbytes) in totals.items())


def group_sizes(mode: Mode) -> dict[str, int]:
    mesh, axis = grid_mesh(mode, 1)
    return {g: mesh.shape[a] for g, a in axis.items()}


# The published 64-GPU speedups (issue 8): (faster, slower) -> ratio
PUBLISHED = {("2d", "1d"): 1.48, ("2.5d", "1d"): 1.38, ("2.5d", "2d"): 1.53, ("3d", "1d"): 2.32, ("3d", "2d"): 1.57}
SOURCES = {("2d", "1d"): "Optimus (Xu et al.)",
           ("2.5d", "1d"): "Tesseract (Wang et al.)", ("2.5d", "2d"): "Tesseract (Wang et al.)",
           ("3d", "1d"): "3D (Bian et al.)", ("3d", "2d"): "3D (Bian et al.)"}

MODES_64 = {"1d": Mode("1d", p=64), "2d": Mode("2d", q=8), "2.5d": Mode("2.5d", q=4, d=4), "3d": Mode("3d", q=4)}
