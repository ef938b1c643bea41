"""Offload in the search (autopar/pricing/offload.py, autopar/search/configurations.py): chosen
only where it wins or nothing else fits, priced bytes on each pool, pins and their errors, the
cluster's host description, old plan files, and DeepSpeed's memory estimator term by term."""
from __future__ import annotations

import warnings

import pytest

import autopar
from autopar.cluster import Cluster
from autopar.hardware import Host
from autopar.errors import ClusterError, ConstraintError, MemoryBudgetError
from autopar.models.gpt2 import gpt2
from autopar.models.llama import llama
from autopar.plans.plan_schema import PLAN_VERSION, migrate
from autopar.pricing.offload import host_bytes_per_element, offload_price


@pytest.fixture(scope="module")
def small():
    warnings.simplefilter("ignore")
    model, batch = llama(n_layer=8, d_model=128, ffn_hidden=352, vocab=256, seq=16, batch=8)
    numel = sum(p.numel() for p in model.parameters())
    return model, batch, numel, Cluster.preset("dgx-a100", devices=2)


@pytest.fixture(scope="module")
def plans(small):
    model, batch, _, cluster = small
    return {off: autopar.plan(model, batch, cluster, constraints=None if off is None else {"offload": off, "dp": 2})
            for off in (None, "optimizer", "optimizer+params")}


def test_free_search_keeps_the_optimizer_on_the_device_when_it_fits(plans):
    free = plans[None]
    assert free.degrees["offload"] == "none" and "offload" not in free.data["predictions"]
    # the premise: the offloaded plans are slower, and hold less on the device
    for off in ("optimizer", "optimizer+params"):
        assert plans[off].degrees["offload"] == off
        assert plans[off].step_time > free.step_time
        assert plans[off].peak_memory < free.peak_memory


def test_free_search_offloads_when_nothing_else_fits(small, plans):
    model, batch, _, cluster = small
    budget = plans["optimizer"].peak_memory
    with pytest.raises(MemoryBudgetError):
        autopar.plan(model, batch, cluster, memory_budget=budget, constraints={"offload": "none"})
    got = autopar.plan(model, batch, cluster, memory_budget=budget)
    assert got.degrees["offload"] == "optimizer"
    assert got.step_time <= plans["optimizer"].step_time
    # tighter still: below the least peak of any plan offloading the optimizer alone, only the
    # parameters' shards on the host too fit
    floor_opt = plans_peak_floor(model, batch, cluster, offload="optimizer")
    floor_params = plans_peak_floor(model, batch, cluster, offload="optimizer+params")
    assert floor_params < floor_opt - 1
    got = autopar.plan(model, batch, cluster, memory_budget=floor_opt - 1)
    assert got.degrees["offload"] == "optimizer+params" and got.degrees["zero"] == 3
    assert got.peak_memory <= floor_opt - 1


def test_free_search_offloads_the_fewest_chunks_that_fit(small, plans):
    """Gemini's rule: between the least peak without offload and the fully offloaded plan's
    peak, the free plan keeps part of the optimizer on the device: a fraction strictly between 0
    and 1, its peak at the budget, faster than offloading everything, its host bytes and copies
    that fraction of the full offload's."""
    model, batch, _, cluster = small
    full = plans["optimizer"]
    floor = plans_peak_floor(model, batch, cluster)
    budget = (full.peak_memory + floor) // 2
    got = autopar.plan(model, batch, cluster, memory_budget=budget, constraints={"dp": 2})
    off, whole = got.predictions["offload"], full.predictions["offload"]
    assert got.degrees["offload"] == "optimizer" and got.degrees["zero"] == full.degrees["zero"]
    assert 0 < off["fraction"] < 1
    assert got.peak_memory <= budget
    assert got.step_time < full.step_time
    for k in ("host_bytes", "d2h_bytes", "h2d_bytes"):
        assert off[k] == pytest.approx(whole[k] * off["fraction"], rel=1e-3, abs=2)


def test_offloaded_bytes_per_pool(small, plans):
    """Device: the optimizer state leaves, and at ZeRO 2-3 the gradient shards (streamed to the
    host); host: master 4 + AdamW state 8 + bf16 staging 2 + fp32 gradient sum 4 per shard element (+ the bf16
    parameter shard with "optimizer+params"); copies per step: the shard down, the update up."""
    _, _, numel, _ = small
    p = plans["optimizer"]
    d, mb, off = p.degrees, p.memory_breakdown, p.data["predictions"]["offload"]
    assert d["zero"] == 2 and d["dp"] == 2 and d["tp"] == 1
    assert mb["optimizer"] == 0 and mb["grads"] == 0
    shard = numel / 2
    assert off["host_bytes"] == pytest.approx(shard * 18, abs=4)
    assert off["d2h_bytes"] == pytest.approx(shard * 2 * d["num_micro_batches"], abs=4)
    assert off["h2d_bytes"] == pytest.approx(shard * 2, abs=4)
    assert off["target"] == "host" and off["fraction"] == 1.0
    assert off["host_budget"] == 2 * 10**12 // 2   # the node's 2 TB over its 2 ranks
    q = plans["optimizer+params"]
    assert q.memory_breakdown["params"] < 0.01 * mb["params"]   # buffers only
    qo = q.data["predictions"]["offload"]
    assert qo["host_bytes"] == pytest.approx(shard * 20, abs=4)
    assert qo["h2d_bytes"] == pytest.approx(shard * 2 * 2 * q.degrees["num_micro_batches"], abs=4)


def test_offload_priced_no_faster_than_the_device_step():
    """A one-element tensor: the fixed host cost the device step pays is paid offloaded too."""
    c = Cluster.preset("dgx-a100")
    from autopar.pricing.cost import optimizer_step_time
    fixed = optimizer_step_time(1, "adamw", "bf16", c.device)
    assert offload_price(1, "adamw", "bf16", c, 2, 1, fixed).seconds > fixed
    big = offload_price(1e9, "adamw", "bf16", c, 2, 1, fixed)
    assert big.seconds >= big.cpu_seconds > optimizer_step_time(1e9, "adamw", "bf16", c.device)


def test_pins_and_their_errors(small):
    model, batch, _, cluster = small
    gloo = Cluster.preset("cpu", devices=2)   # devices in host memory: the free search never offloads
    assert autopar.plan(model, batch, gloo, memory_budget=plans_peak_floor(model, batch, gloo)).degrees[
        "offload"] == "none"
    assert autopar.plan(model, batch, gloo, constraints={"offload": "optimizer"}).degrees["offload"] == "optimizer"
    assert autopar.Constraints(offload=True).offload == "optimizer"
    assert autopar.Constraints(offload=False).offload == "none"
    bare = Cluster.from_dict({k: v for k, v in cluster.to_dict().items() if k != "host"})
    assert bare.host is None
    with pytest.raises(ConstraintError, match="describes no host"):
        autopar.plan(model, batch, bare, constraints={"offload": "optimizer"})
    assert autopar.plan(model, batch, bare).degrees["offload"] == "none"   # unpinned: never offloads there


def plans_peak_floor(model, batch, cluster, offload="none") -> int:
    """The least peak of any plan with that offload (the MemoryBudgetError's figure)."""
    with pytest.raises(MemoryBudgetError) as ei:
        autopar.plan(model, batch, cluster, memory_budget=1000, constraints={"offload": offload})
    return ei.value.min_peak_bytes


def test_cluster_host_yaml(tmp_path):
    c = Cluster.from_dict({"preset": "dgx-a100", "host": {"memory": "1TB", "copy_bandwidth": "20GB/s",
                                                          "cpu_bandwidth": "200GB/s"}})
    assert c.host == Host(10**12, 20e9, 200e9, 8)
    c.to_yaml(tmp_path / "c.yaml")
    assert Cluster.from_yaml(tmp_path / "c.yaml") == c
    with pytest.raises(ClusterError, match="host.copy_bandwidth"):
        Cluster.from_dict({"preset": "dgx-a100", "host": {"memory": "1TB", "copy_bandwidth": "fast",
                                                          "cpu_bandwidth": "200GB/s"}})
    with pytest.raises(ClusterError, match="unknown key 'mem'"):
        Cluster.from_dict({"preset": "dgx-a100", "host": {"mem": "1TB"}})
    for name in ("dgx-a100", "dgx-h100", "tacc-longhorn", "dgx2-v100", "workstation-4090", "cpu"):
        assert Cluster.preset(name).host is not None, name


def test_version_2_plans_read_as_version_3():
    old = {"version": 2, "degrees": {"tp_mode": "1d", "offload": False}}
    new = migrate(old)
    assert new["version"] == PLAN_VERSION == 3 and new["degrees"]["offload"] == "none"
    assert new["migrated_from"] == 2 and old["degrees"]["offload"] is False   # not modified in place
    v1 = migrate({"version": 1, "degrees": {"tp_mode": "2d", "offload": False}})
    assert v1["degrees"] == {"tp_mode": "2d-reshard", "offload": "none"} and v1["migrated_from"] == 1


def test_deepspeed_estimator_term_by_term():
    """DeepSpeed's estimator for 2,851M parameters on 8 GPUs (facts.md): ZeRO-2 + optimizer
    offload 5.31 GB per GPU, 127.48 GB host; ZeRO-3 + full offload 71.71 GB host. The plan's
    breakdown per parameter element, read from a GPT planned with those pins on one DGX-A100:
    per GPU 2 bytes (bf16 parameters; gradients streamed to the host) = DeepSpeed's 2 Ψ; host per
    node 18 bytes (master 4 + Adam 8 + fp32 gradient sum 4 + bf16 staging 2), where DeepSpeed
    charges max(4 × GPUs, 16) × 1.5 = 48 (every process's own fp32 copy of the whole model at
    start-up, which meta-device set-up never makes, and a 1.5 buffer factor); with the parameters
    too, 20 bytes (+ the bf16 shard) against DeepSpeed's 18 (its 16 + the bf16 parameters,
    the staging inside its 1.5 factor), and on the GPU the largest
    block gathered (4 bytes per element of it) = DeepSpeed's 4 x largest layer."""
    warnings.simplefilter("ignore")
    model, batch = gpt2(n_layer=2, d_model=256, n_head=4, seq=64, batch=8, vocab=1024, device="meta")
    numel = sum(p.numel() for p in model.parameters())
    c = Cluster.preset("dgx-a100")
    p2 = autopar.plan(model, batch, c, constraints={"dp": 8, "zero": 2, "offload": "optimizer"})
    mb = p2.memory_breakdown
    per_element_device = (mb["params"] + mb["grads"] + mb["optimizer"]) / numel
    per_element_host = p2.data["predictions"]["offload"]["host_bytes"] * 8 / numel
    assert per_element_device == pytest.approx(2, rel=1e-3)
    assert per_element_host == pytest.approx(18, rel=1e-3) == host_bytes_per_element("adamw", "bf16", True)
    psi = 2851e6
    assert round(per_element_device * psi / 2**30, 2) == 5.31   # DeepSpeed's figure, reproduced
    assert round(psi * max(4 * 8, 16) * 1.5 / 2**30, 2) == 127.45   # their formula (facts.md rounds 127.48)
    p3 = autopar.plan(model, batch, c, constraints={"dp": 8, "zero": 3, "offload": "optimizer+params"})
    host3 = p3.data["predictions"]["offload"]["host_bytes"] * 8 / numel
    assert host3 == pytest.approx(20, rel=1e-3)
    assert round(psi * 18 * 1.5 / 2**30, 2) == 71.69   # DeepSpeed's 71.71 with its 1.5 factor
    mb3 = p3.memory_breakdown
    assert mb3["params"] + mb3["grads"] + mb3["optimizer"] < 0.01 * numel   # buffers only
    # DeepSpeed's GPU term, 4 bytes x the largest layer: the largest chunk (a block) gathered in
    # bf16 with its bf16 gradient
    block = sum(q.numel() for q in model.blocks[0].parameters())
    assert mb3["gathered"] == pytest.approx(4 * block, rel=1e-3)


def test_host_memory_too_small_is_said(small):
    """A pinned offload the node's host memory cannot hold: a MemoryBudgetError that names the
    host memory needed and each rank's share, not a complaint about the degrees."""
    import dataclasses
    model, batch, _, cluster = small
    tiny = dataclasses.replace(cluster, host=Host(2 * 2**20, 25e9, 100e9, 2))   # 1 MiB per rank
    with pytest.raises(MemoryBudgetError, match="of host memory per rank, more than each rank's share") as ei:
        autopar.plan(model, batch, tiny, constraints={"offload": "optimizer"})
    assert "1.00 MiB" in str(ei.value)
    # unpinned, the same cluster plans without offload
    assert autopar.plan(model, batch, tiny).degrees["offload"] == "none"
