"""benchmarks/bench_tp_grid.py's pure parts: the per-layer step-time model of 1D / 2D / 2.5D / 3D
against an independent closed-form computation on a toy cluster (uncalibrated roofline and ring
alpha-beta: every term by hand), the placement of grid axes on nodes, the wire-byte factors, the
collectives it prices equal solver/tp_grid_cost.py's; and (slow) the bytes the CPU benchmark
measures on gloo ranks equal the prediction."""
from __future__ import annotations

import math

import pytest

from autopar.cluster import Cluster
from autopar.hardware import Device, FrozenMap, Link
from autopar.pricing.cost import efficiency
from benchmarks import tp_grid_predict as tp
from benchmarks.tp_grid_predict import Mode, Setting
from solver import tp_grid_cost as tgc

PEAK, HBM, OVER = 1e12, 1e11, 1e-6
B_INTRA, A_INTRA = 1e10, 2e-6
# a device no built-in profile knows: the uncalibrated model of cost.py's docstring
TOY = Cluster("toy", 1, 4, Device("toy", FrozenMap({"bf16": PEAK, "fp16": PEAK, "fp32": PEAK}), 10 ** 9, HBM,
                                  kernel_overhead=OVER), Link(B_INTRA, A_INTRA), Link(1e9, 5e-6), "nccl")
ST = Setting("toy", batch=4, seq=4, hidden=16, heads=4, ffn=32, elem=2)


def _kernel(flops, nbytes):
    t_math = flops / (PEAK * efficiency(flops, PEAK)) if flops else 0.0
    return max(t_math, nbytes / HBM) + OVER


def _gemm(m, k, n, b=1):
    """forward + backward (2 kernels of the same shapes) of one [b] x [m, k] x [k, n] GEMM"""
    return 3 * _kernel(2 * b * m * k * n, ST.elem * b * (m * k + k * n + m * n))


def _layer_compute(seqs, heads, linears, act, P):
    m, h, f, s = ST.tokens, ST.hidden, ST.ffn, ST.seq
    dh = h // ST.heads
    t = sum(linears) + _gemm(s, dh, s, seqs * heads) + _gemm(s, s, dh, seqs * heads)
    mlp, scores = m * f * ST.elem / P, ST.batch * ST.heads * s * s * ST.elem / P
    for nbytes in (2 * act, 2 * act, 3 * act, 3 * act, 2 * mlp, 2 * scores):
        t += 2 * _kernel(0, nbytes)        # forward + backward of a memory-bound kernel
    return t


def _ring(kind, nbytes, n):
    if kind == "all_reduce":
        return 2 * (n - 1) / n * nbytes / B_INTRA + 2 * (n - 1) * A_INTRA
    if kind in ("broadcast", "reduce"):
        return nbytes / B_INTRA + (n - 1) * A_INTRA
    return (n - 1) / n * nbytes / B_INTRA + (n - 1) * A_INTRA


def _expected_1d(p):
    m, h, f, e = ST.tokens, ST.hidden, ST.ffn, ST.elem
    linears = [_gemm(m, h, 3 * h // p), _gemm(m, h // p, h), _gemm(m, h, f // p), _gemm(m, f // p, h)]
    compute = _layer_compute(ST.batch, ST.heads // p, linears, m * h * e, p)
    return compute + 4 * _ring("all_reduce", m * h * e, p)      # Megatron: 2 forward + 2 backward


def _expected_2d(q):
    """SUMMA by the papers' algorithm: per linear 3 passes of q row calls on the activation block
    and 3 of q column calls on the weight block (broadcast, reduce, broadcast), the bias gathered
    and reduce-scattered over the column; LayerNorm statistics all-reduced over the row (2 forward,
    one of twice the size backward), its two vectors gathered / reduce-scattered."""
    m, h, f, e = ST.tokens, ST.hidden, ST.ffn, ST.elem
    comm = 0.0
    for k, n in ((h, 3 * h), (h, h), (h, f), (f, h)):
        comm += 3 * q * _ring("broadcast", (m // q) * (k // q) * e, q)
        comm += 3 * q * _ring("broadcast", (k // q) * (n // q) * e, q)
        comm += _ring("all_gather", n // q * e, q) + _ring("reduce_scatter", n // q * e, q)
    for _ in range(2):
        comm += 2 * _ring("all_reduce", m // q * e, q) + _ring("all_reduce", 2 * m // q * e, q)
        comm += 2 * (_ring("all_gather", h // q * e, q) + _ring("reduce_scatter", h // q * e, q))
    linears = [q * _gemm(m // q, k // q, n // q) for k, n in ((h, 3 * h), (h, h), (h, f), (f, h))]
    return _layer_compute(ST.batch // q, ST.heads // q, linears, m * h * e / q ** 2, q * q) + comm


def test_2d_over_1d_is_the_independent_compute_plus_comm_sum():
    p1, p2 = tp.predict(ST, Mode("1d", p=4), TOY), tp.predict(ST, Mode("2d", q=2), TOY)
    e1, e2 = _expected_1d(4), _expected_2d(2)
    assert p1.step == pytest.approx(e1, rel=1e-12)
    assert p2.step == pytest.approx(e2, rel=1e-12)
    assert tp.speedup(p2, p1) == pytest.approx(e1 / e2, rel=1e-12)
    assert p1.comm_total > 0 and p2.comm_total > 0 and set(p2.comm) == {"row", "col"}


def test_priced_collectives_are_tp_grid_costs():
    st = Setting("gpt", 32, 512, 4096, 64, 16384)
    for name, mode in tp.MODES_64.items():
        colls = tp.layer_collectives(st, mode)
        if name == "1d":
            assert tgc.totals(colls) == {("tp", "all_reduce"): (4, 4 * st.tokens * st.hidden * st.elem)}
        else:
            assert colls == tgc.transformer_layer(name, st.tokens, st.hidden, st.ffn, mode.q, mode.d, st.elem,
                                                  ("x", "y", "z"))
        assert tp.predict(st, mode, Cluster.preset("tacc-longhorn", nodes=16)).comm_bytes == \
            sum(b for _, b in tgc.totals(colls).values())
    # the per-linear table the papers print, from the same functions (q=4 as on 64 GPUs)
    n = 64
    assert tgc.paper_bandwidth(tgc.linear_2d(n, n, n, 8, 2, bias=False), n * n * 2) == tgc.table_2d(8)[0]
    assert tgc.paper_bandwidth(tgc.linear_3d(n, n, n, 4, 2, bias=False), n * n * 2) == tgc.table_3d(4)[0]


def test_placement_on_64_v100s_puts_the_fastest_axis_inside_a_node():
    pl = {k: tp.placement(m, 4) for k, m in tp.MODES_64.items()}
    assert pl["1d"] == {"tp": (4, 16)}
    assert pl["2d"] == {"col": (1, 8), "row": (4, 2)}
    assert pl["2.5d"] == {"depth": (1, 4), "col": (1, 4), "row": (4, 1)}
    assert pl["3d"] == {"x": (1, 4), "y": (1, 4), "z": (4, 1)}
    assert all(m.ranks == 64 for m in tp.MODES_64.values())
    with pytest.raises(ValueError, match="needs 64 ranks"):
        tp.predict(ST, tp.MODES_64["2d"], TOY)


def test_wire_bytes_and_published_ratios():
    assert tp.wire_bytes({("tp", "all_reduce"): (4, 800)}, {"tp": 8}) == pytest.approx(1400)
    assert tp.wire_bytes({("row", "broadcast"): (2, 100), ("col", "reduce_scatter"): (1, 30)},
                         {"row": 2, "col": 3}) == pytest.approx(50 + 20)
    assert tp.group_sizes(Mode("2.5d", q=2, d=3)) == {"depth": 3, "col": 2, "row": 2}
    assert tp.PUBLISHED == {("2d", "1d"): 1.48, ("2.5d", "1d"): 1.38, ("2.5d", "2d"): 1.53,
                            ("3d", "1d"): 2.32, ("3d", "2d"): 1.57}


def test_grid_modes_do_less_duplicated_elementwise_work():
    """1D's LayerNorms and residuals run on the full [m, h] activation on every rank."""
    c = tp.compute_seconds(ST, Mode("1d", p=4), TOY)["elementwise"]
    assert c > tp.compute_seconds(ST, Mode("2d", q=2), TOY)["elementwise"]
    assert math.isclose(sum(tp.elementwise_bytes(ST, Mode("2d", q=2))[:4]),
                        sum(tp.elementwise_bytes(ST, Mode("1d", p=4))[:4]) / 4)


@pytest.mark.slow
@pytest.mark.parametrize("mode,n,q,d", [("1d", 8, 1, 1), ("2d", 4, 2, 1), ("2.5d", 8, 2, 2), ("3d", 8, 2, 1)])
def test_cpu_benchmark_measures_the_predicted_bytes(mode, n, q, d):
    from benchmarks.bench_tp_grid import measure, predicted_totals
    from benchmarks.tp_grid_layer import Shape
    meas = measure(mode, n, q, d, Shape())
    assert meas == predicted_totals(mode, n, q, d, Shape())
    groups = {g for g, _ in meas}
    assert groups == ({"tp"} if mode == "1d" else {"x", "y", "z"} if mode == "3d"
                      else {"row", "col"} | ({"depth"} if mode == "2.5d" else set()))
