"""The ``tacc-longhorn`` preset (4 × V100 per node, issue 8): it loads, carries the cited figures
(docs/cost-model.md, "V100 (tacc-longhorn)"), prices with its own V100 profile, and plans a model."""
from __future__ import annotations

import pytest

import autopar
from autopar.cluster import Cluster
from autopar.pricing.cost import Collectives, compute_time, gemm_intensity, profile_of
from autopar.errors import ClusterError
from autopar.mesh import Mesh
from autopar.models import ZOO


def test_preset_has_the_cited_figures():
    c = Cluster.preset("tacc-longhorn", nodes=16)
    assert c.num_devices == 64 and c.devices_per_node == 4
    d = c.device
    assert "V100" in d.name
    assert d.peak("fp16") == 125e12          # tensor cores (NVIDIA, Programming Tensor Cores in CUDA 9)
    assert d.peak("fp32") == 15.7e12         # CUDA cores, no TF32 on Volta
    assert d.memory_bytes == 16_000_000_000 and d.hbm_bandwidth == 900e9   # OLCF V100 guide
    assert c.intra_link.bandwidth == 38e9    # 0.76 x 50 GB/s NVLink 2.0 (two bricks)
    assert c.inter_link.bandwidth == 5.6e9   # 0.9 x 2 EDR ports / 4 GPUs
    # round trip through the cluster-file schema
    assert Cluster.from_dict(c.to_dict()) == c


def test_preset_rejects_more_than_four_gpus_per_node():
    with pytest.raises(ClusterError, match="nodes=2"):
        Cluster.preset("tacc-longhorn", devices=8)


def test_v100_profile_prices_from_v100_rates():
    c = Cluster.preset("tacc-longhorn", nodes=2)
    cal = profile_of(c)
    assert cal is not None and cal.name == "v100-public" and cal.gemm_dtype == "fp16"
    # a large fp16 GEMM runs near (below) 0.8 x 125 TF, never above the peak
    n = 8192
    sizes = {"m": n, "k": n, "n": n}
    t = compute_time(2 * n ** 3, 2 * 3 * n * n, "fp16", c.device,
                     gemm_intensity(sizes, ["mk", "kn", "mn"], 2))
    rate = 2 * n ** 3 / t
    assert 0.6 * 125e12 < rate < 0.8 * 125e12
    # a 1 GiB all-reduce inside a node runs at the 38 GB/s plateau; across nodes it is slower
    mesh_in = Mesh((2, 4), ("dp", "tp"), 4)
    mesh_across = Mesh((4, 2), ("tp", "dp"), 4)
    comm = Collectives(c, mesh_in)
    s = 2 ** 30
    t_in = comm("all_reduce", s, 1)
    assert t_in == pytest.approx(2 * 3 / 4 * s / 38e9, rel=0.05)
    assert Collectives(c, mesh_across)("all_reduce", s, 0) > t_in


def test_preset_plans_a_small_model():
    model, inputs = ZOO["mlp"]()
    plan = autopar.plan(model, inputs, Cluster.preset("tacc-longhorn", nodes=1), precision="bf16")
    d = plan.degrees
    assert d["dp"] * d["tp"] * d.get("pp", 1) == 4
    assert plan.step_time > 0 and plan.cluster == Cluster.preset("tacc-longhorn", nodes=1)
