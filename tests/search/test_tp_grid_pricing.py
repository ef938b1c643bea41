"""The grid modes' compute is priced like the ILP's (autopar/search/grid_price.py grid_compute): the same
GEMM-by-intensity curve at the local shape a rank's kernel runs on, bf16 bytes and backward
ratio, so the search compares grid and ILP plans like with like.

A 3D grid (q=2) and the ILP's dp=2 x tp=2 x tp2=2 mesh can give a linear the same local GEMM
([m/2, k/2] x [k/2, n/2]): its grid price must be the ILP's price of that strategy, to the last
bit. SUMMA (2D) runs the same work per rank as q smaller GEMMs, which the curve prices slower.
"""
from __future__ import annotations

import pytest

import autopar
from autopar.frontend.batching import infer_batch_dims, input_shapes
from autopar.rules.candidates import candidates
from autopar.pricing.cost import gemm_intensity, profile_of
from autopar.search.grid_price import grid_compute
from autopar.mesh import Mesh
from autopar.models import ZOO
from autopar.pricing.op_base import local_intensity
from autopar.pricing.price import Settings, price
from autopar.frontend.trace import trace
from codegen.grid_layout import Geometry
from codegen.grid_ops import GridProgram


@pytest.fixture(scope="module")
def setup():
    cluster = autopar.Cluster.preset("dgx-a100", nodes=1)
    g = trace(*ZOO["gpt2"]())
    g.batch_dims = infer_batch_dims(input_shapes(g), None)
    return cluster, g, candidates(g, Mesh((1,), ("dp",), cluster.devices_per_node))


def test_a_3d_linear_is_priced_as_the_ilp_prices_the_same_local_gemm(setup):
    cluster, g, one = setup
    cal = profile_of(cluster)
    # the premise: on this cluster a GEMM's rate depends on its intensity (small GEMMs are slower)
    assert cal is not None and cal.gemm[0][1] < 0.5 * cal.gemm[-1][1]
    geo = Geometry("3d", 2)
    prog = GridProgram(g, geo, 8).analyse()
    grid = grid_compute(one, prog, cluster, "bf16", geo)
    mesh = next(m for m in cluster.meshes() if m.shape == (2, 2, 2))
    c = candidates(g, mesh)
    P = price(c, cluster, Settings(), edges=False)
    checked = 0
    for name, (kernels, m, k, n) in prog.gemms.items():
        info = c.nodes[name]
        if info.rep != name:
            continue
        # gpt2: 8 x 16 tokens; a 3D matmul gathers m/q rows, the tied classifier runs on the
        # rank's own token block (m/q^2 rows)
        assert kernels == 1 and m == (128 // 4 if name == "linear_8" else 128 // 2), (name, m)
        bias = ["n"] if len([t for t in info.spec.inputs if t]) == 3 else []
        ai = gemm_intensity({"m": m, "k": k, "n": n}, ["mk", "nk", *bias, "mn"], 2)
        same = [j for j, st in enumerate(info.strategies) if abs(st.work_fraction - 1 / 8) < 1e-12
                and local_intensity(c, info.spec, info, j, mesh, 1, 2) == pytest.approx(ai, rel=1e-12)]
        assert same, name    # the ILP has a strategy running this very kernel
        for j in same:
            assert grid[name][1] == pytest.approx(P.compute[name][j], rel=1e-12), name
        checked += 1
    assert checked >= 5    # the block's four linears and the tied classifier


def test_summa_runs_the_same_work_as_smaller_slower_gemms(setup):
    """2D (q=2, dp=2) and 3D (q=2) give each rank 1/8 of every linear's FLOPs; SUMMA computes it
    as q GEMMs [m/4, k/2] x [k/2, n/2], 3D as one [m/2, k/2] x [k/2, n/2]: lower intensity, so
    more seconds for the same FLOPs."""
    cluster, g, one = setup
    p2 = GridProgram(g, Geometry("2d", 2, 1, 2), 8).analyse()
    p3 = GridProgram(g, Geometry("3d", 2), 8).analyse()
    c2 = grid_compute(one, p2, cluster, "bf16", Geometry("2d", 2, 1, 2))
    c3 = grid_compute(one, p3, cluster, "bf16", Geometry("3d", 2))
    for name in ("linear", "linear_1", "linear_2", "linear_3"):
        (q2, m2, k2, n2), (q3, m3, k3, n3) = p2.gemms[name], p3.gemms[name]
        assert (q2, q3) == (2, 1) and q2 * m2 * k2 * n2 == q3 * m3 * k3 * n3   # same FLOPs per rank
        assert c2[name][1] > c3[name][1] * 1.05, name
