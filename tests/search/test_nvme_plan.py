"""NVMe offload in the search (autopar/pricing/offload.py ``nvme=``, autopar/search/configurations.py):
the optimizer state on the node's NVMe, priced by its read and write per step; chosen only where
the host cannot hold the state; pinned without an NVMe in the cluster, a clear error; the
cluster's ``nvme:`` description and presets."""
from __future__ import annotations

import dataclasses
import warnings

import pytest

import autopar
from autopar.cluster import Cluster
from autopar.hardware import Host, Nvme
from autopar.errors import ClusterError, ConstraintError
from autopar.models.llama import llama
from autopar.pricing.offload import NVME_LATENCY, offload_price


@pytest.fixture(scope="module")
def small():
    warnings.simplefilter("ignore")
    model, batch = llama(n_layer=8, d_model=128, ffn_hidden=352, vocab=256, seq=16, batch=8)
    return model, batch, Cluster.preset("dgx-a100", devices=2)


@pytest.fixture(scope="module")
def plans(small):
    model, batch, cluster = small
    return {off: autopar.plan(model, batch, cluster, constraints={"offload": off, "dp": 2, "zero": 2})
            for off in ("optimizer", "optimizer-nvme")}


def test_nvme_price_terms():
    """Per element of the shard (AdamW, bf16, ZeRO-2 streamed): 8 bytes of state on the drives,
    read and written each step at the rank's share; the host keeps master 4 + staging 2 + the
    streamed sum 4; pipelined with the CPU step, plus one chunk's I/O start."""
    c = Cluster.preset("dgx-a100", devices=8)
    n = 1e9
    host = offload_price(n, "adamw", "bf16", c, zero=2)
    nvme = offload_price(n, "adamw", "bf16", c, zero=2, nvme=True)
    _, read, write = c.nvme.per_rank()
    assert (read, write) == (25e9 / 8, 12e9 / 8)
    assert nvme.nvme_bytes == 8 * n and host.nvme_bytes == 0
    assert nvme.nvme_seconds == pytest.approx(8 * n / read + 8 * n / write)
    assert nvme.host_bytes == 10 * n and host.host_bytes == 18 * n
    assert nvme.seconds == pytest.approx(max(nvme.cpu_seconds, nvme.copy_seconds, nvme.nvme_seconds) + NVME_LATENCY
                                         + 2 * 10e-6)
    assert nvme.seconds > host.seconds
    with pytest.raises(ConstraintError, match="describes no NVMe"):
        offload_price(n, "adamw", "bf16", dataclasses.replace(c, nvme=None), zero=2, nvme=True)


def test_pinned_nvme_plan_holds_the_state_on_the_drives(plans):
    host, nvme = plans["optimizer"], plans["optimizer-nvme"]
    ph, pn = host.predictions["offload"], nvme.predictions["offload"]
    assert nvme.degrees["offload"] == "optimizer-nvme" and pn["target"] == "nvme" and ph["target"] == "host"
    assert "nvme_bytes" not in ph and pn["nvme_bytes"] > 0 and pn["nvme_budget"] == 15.36e12 / 2
    # AdamW bf16 streamed: host 18 B per element, NVMe 8 of them (the state), host 10
    assert ph["host_bytes"] == pytest.approx(pn["host_bytes"] + pn["nvme_bytes"], rel=1e-6)
    assert pn["nvme_bytes"] == pytest.approx(ph["host_bytes"] * 8 / 18, rel=1e-6)
    assert nvme.step_time > host.step_time   # never the faster of the two


def test_free_search_keeps_the_state_in_host_memory_when_it_fits(small, plans):
    model, batch, cluster = small
    got = autopar.plan(model, batch, cluster, memory_budget=plans["optimizer"].peak_memory)
    assert got.degrees["offload"] == "optimizer"


def test_free_search_puts_the_state_on_nvme_when_the_host_is_too_small(small, plans):
    """The host's share per rank between what NVMe offload and host offload keep there, the
    device too small for the optimizer: the search keeps the state on the drives."""
    model, batch, cluster = small
    need_host = plans["optimizer"].predictions["offload"]["host_bytes"]
    need_nvme = plans["optimizer-nvme"].predictions["offload"]["host_bytes"]
    per_rank = (need_host + need_nvme) // 2
    small_host = dataclasses.replace(cluster, host=Host(2 * per_rank, cluster.host.copy_bandwidth,
                                                        cluster.host.cpu_bandwidth, 2))
    budget = plans["optimizer"].peak_memory
    got = autopar.plan(model, batch, small_host, memory_budget=budget)
    assert got.degrees["offload"] == "optimizer-nvme", got.degrees
    assert got.predictions["offload"]["host_bytes"] <= per_rank < need_host
    # the premise: with its NVMe taken away, nothing fits
    with pytest.raises(autopar.MemoryBudgetError):
        autopar.plan(model, batch, dataclasses.replace(small_host, nvme=None), memory_budget=budget)


def test_pinned_nvme_without_nvme_is_a_clear_error(small):
    model, batch, cluster = small
    with pytest.raises(ConstraintError, match="offload='optimizer-nvme' cannot be met: cluster 'dgx-a100' describes "
                                              "no NVMe"):
        autopar.plan(model, batch, dataclasses.replace(cluster, nvme=None), constraints={"offload": "optimizer-nvme"})
    with pytest.raises(ConstraintError, match="describes no NVMe"):
        autopar.plan(model, batch, Cluster.preset("dgx-h100", devices=2), constraints={"offload": "optimizer-nvme"})


def test_cluster_nvme_yaml(tmp_path):
    c = Cluster.from_dict({"preset": "dgx-h100", "nvme": {"capacity": "30TB", "read_bandwidth": "50GB/s",
                                                          "write_bandwidth": "25GB/s"}})
    assert c.nvme == Nvme(30 * 10**12, 50e9, 25e9, 8)
    assert c.nvme.per_rank() == (30e12 / 8, 50e9 / 8, 25e9 / 8)
    c.to_yaml(tmp_path / "c.yaml")
    assert Cluster.from_yaml(tmp_path / "c.yaml") == c
    with pytest.raises(ClusterError, match="nvme.read_bandwidth"):
        Cluster.from_dict({"preset": "dgx-a100", "nvme": {"capacity": "1TB", "read_bandwidth": "fast",
                                                          "write_bandwidth": "1GB/s"}})
    with pytest.raises(ClusterError, match="unknown key 'size'"):
        Cluster.from_dict({"preset": "dgx-a100", "nvme": {"size": "1TB"}})
    assert Cluster.preset("dgx-a100").nvme == Nvme(15_360_000_000_000, 25e9, 12e9, 8)
    assert Cluster.preset("cpu").nvme is not None   # the local disk: what the gloo tests pin
    for name in ("dgx-h100", "tacc-longhorn", "dgx2-v100", "workstation-4090"):
        assert Cluster.preset(name).nvme is None, name   # none published that we could source


def test_free_search_offloads_parameters_and_puts_the_state_on_nvme(small):
    """ZeRO-Infinity's offload of both ("optimizer+params-nvme", ZeRO-3): the device too small for
    any plan that keeps its parameters, the host's share between what "optimizer+params-nvme" and
    "optimizer+params" keep there: the parameter shards on the host, the state on the drives."""
    model, batch, cluster = small
    pinned = {off: autopar.plan(model, batch, cluster, constraints={"offload": off, "dp": 2, "zero": 3})
              for off in ("optimizer+params", "optimizer+params-nvme")}
    need_host = pinned["optimizer+params"].predictions["offload"]["host_bytes"]
    need_nvme = pinned["optimizer+params-nvme"].predictions["offload"]
    assert need_nvme["target"] == "nvme" and need_nvme["nvme_bytes"] > 0
    assert need_host == pytest.approx(need_nvme["host_bytes"] + need_nvme["nvme_bytes"], rel=1e-6)
    with pytest.raises(autopar.MemoryBudgetError) as ei:   # the least peak of a plan keeping its parameters
        autopar.plan(model, batch, cluster, memory_budget=1000, constraints={"offload": "optimizer"})
    budget = ei.value.min_peak_bytes - 1
    per_rank = (need_host + need_nvme["host_bytes"]) // 2
    small_host = dataclasses.replace(cluster, host=Host(2 * per_rank, cluster.host.copy_bandwidth,
                                                        cluster.host.cpu_bandwidth, 2))
    got = autopar.plan(model, batch, small_host, memory_budget=budget)
    assert got.degrees["offload"] == "optimizer+params-nvme" and got.degrees["zero"] == 3, got.degrees
    assert got.peak_memory <= budget
    with pytest.raises(ConstraintError, match="'optimizer\\+params-nvme' and zero=2 contradict"):
        autopar.plan(model, batch, cluster, constraints={"offload": "optimizer+params-nvme", "zero": 2})
