"""Cluster presets, YAML/dict round trips, unit parsing and validation errors."""
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.cluster import Cluster
from autopar.cluster_presets import PRESETS
from autopar.hardware import Device, FrozenMap, Link
from autopar.units import parse_quantity
from autopar.errors import ClusterError, PlanError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "cluster.yaml"


# ---- presets -------------------------------------------------------------------------------

def test_dgx_a100_figures():
    c = Cluster.preset("dgx-a100", nodes=4)
    assert (c.nodes, c.devices_per_node, c.num_devices, c.backend) == (4, 8, 32, "nccl")
    d = c.device
    assert d.peak_flops["bf16"] == 312e12 and d.peak_flops["fp16"] == 312e12
    assert d.peak_flops["fp32"] == 156e12          # TF32 dense
    assert d.memory_bytes == 80_000_000_000
    assert d.hbm_bandwidth == 2.039e12
    assert c.intra_link == Link(230e9, 5e-6)
    assert c.inter_link.bandwidth == 200e9 / 8       # one HDR NIC per GPU
    assert c.inter_link.latency == pytest.approx(1e-5)


def test_dgx_h100_figures():
    c = Cluster.preset("dgx-h100", nodes=2)
    assert c.num_devices == 16
    assert c.device.peak("bf16") == 989e12
    assert c.device.hbm_bandwidth == 3.35e12
    assert c.device.memory_bytes == 80_000_000_000
    assert c.intra_link.bandwidth == 370e9
    assert c.inter_link.bandwidth == 48e9
    # H100 beats A100 on every figure
    a = Cluster.preset("dgx-a100")
    for dt in ("bf16", "fp16", "fp32"):
        assert c.device.peak(dt) > a.device.peak(dt)


def test_cpu_preset():
    c = Cluster.preset("cpu", devices=4)
    assert (c.nodes, c.devices_per_node, c.num_devices, c.backend) == (1, 4, 4, "gloo")
    assert c.device.memory_bytes == 4 * 2**30
    assert c.device.kernel_overhead < Cluster.preset("dgx-a100").device.kernel_overhead
    assert Cluster.preset("cpu").num_devices == 2


def test_partial_dgx_node_and_limits():
    assert Cluster.preset("dgx-a100", devices=4).num_devices == 4
    with pytest.raises(ClusterError, match="nodes=2"):
        Cluster.preset("dgx-a100", devices=16)
    with pytest.raises(ClusterError, match="nodes"):
        Cluster.preset("dgx-a100", nodes=0)
    with pytest.raises(ClusterError, match="one machine"):
        Cluster.preset("cpu", nodes=2, devices=2)


def test_unknown_preset_lists_presets():
    with pytest.raises(ClusterError) as e:
        Cluster.preset("dgx-a10")
    msg = str(e.value)
    assert "dgx-a100" in msg and "dgx-h100" in msg and "cpu" in msg and "did you mean" in msg
    assert isinstance(e.value, PlanError)


def test_hashable_and_meshes():
    a, b = Cluster.preset("dgx-a100", nodes=2), Cluster.preset("dgx-a100", nodes=2)
    assert a == b and hash(a) == hash(b)
    assert a != Cluster.preset("dgx-a100", nodes=3)
    assert {a: 1}[b] == 1
    meshes = a.meshes()
    assert meshes and all(m.size == 16 and m.devices_per_node == 8 for m in meshes)
    assert len({m.shape for m in meshes}) == len(meshes)
    assert len(a.meshes(max_model_axes=1)) < len(meshes)


def test_frozen_map():
    m = FrozenMap({"b": 2.0, "a": 1.0})
    assert list(m) == ["a", "b"] and m["b"] == 2.0 and len(m) == 2
    assert m == {"a": 1.0, "b": 2.0} and hash(m) == hash(FrozenMap({"a": 1.0, "b": 2.0}))
    with pytest.raises(KeyError):
        m["c"]
    with pytest.raises(AttributeError):
        m.x = 1
    with pytest.raises(ClusterError, match="no peak_flops for dtype 'int8'"):
        Cluster.preset("cpu").device.peak("int8")


# ---- round trips ---------------------------------------------------------------------------

@pytest.mark.parametrize("name,nodes,devices", [("dgx-a100", 1, None), ("dgx-a100", 4, None),
                                                ("dgx-h100", 2, None), ("cpu", 1, 8), ("dgx-h100", 1, 2)])
def test_round_trips(tmp_path, name, nodes, devices):
    c = Cluster.preset(name, nodes=nodes, devices=devices)
    assert Cluster.from_dict(c.to_dict()) == c
    # through JSON, as embedded in a Plan
    assert Cluster.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    path = tmp_path / "c.yaml"
    c.to_yaml(path)
    assert Cluster.from_yaml(path) == c
    assert Cluster.from_yaml(str(path)).to_dict() == c.to_dict()


@settings(deadline=None, max_examples=40)
@given(nodes=st.integers(1, 64), per_node=st.integers(1, 16),
       flops=st.floats(1e6, 1e18), mem=st.integers(1, 10**13),
       bw=st.floats(1e3, 1e14), lat=st.floats(0, 1e-2), backend=st.sampled_from(["nccl", "gloo"]))
def test_round_trip_property(tmp_path_factory, nodes, per_node, flops, mem, bw, lat, backend):
    dev = Device("x", FrozenMap({"bf16": flops, "fp16": flops * 2, "fp32": flops / 3}), mem, bw * 7)
    c = Cluster("prop", nodes, per_node, dev, Link(bw, lat), Link(bw / 5, lat * 2), backend)
    assert Cluster.from_dict(c.to_dict()) == c
    path = tmp_path_factory.mktemp("rt") / "c.yaml"
    c.to_yaml(path)
    assert Cluster.from_yaml(path) == c


def test_example_file_is_two_dgx_a100_nodes():
    c = Cluster.from_yaml(EXAMPLE)
    p = Cluster.preset("dgx-a100", nodes=2)
    assert c.name == "dgx-a100-2node"
    assert (c.nodes, c.devices_per_node, c.device, c.intra_link, c.inter_link, c.backend) == \
           (p.nodes, p.devices_per_node, p.device, p.intra_link, p.inter_link, p.backend)


def test_preset_with_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("preset: dgx-a100\nnodes: 4\ndevice: {memory: 40GB}\nlinks: {inter: {bandwidth: 100Gb/s}}\n")
    c = Cluster.from_yaml(f)
    base = Cluster.preset("dgx-a100", nodes=4)
    assert c.name == "dgx-a100" and c.num_devices == 32
    assert c.device.memory_bytes == 40_000_000_000
    assert c.device.peak_flops == base.device.peak_flops
    assert c.inter_link == Link(12.5e9, base.inter_link.latency)
    assert c.intra_link == base.intra_link
    f.write_text("preset: dgx-h100\ndevices: 32\n")
    assert Cluster.from_yaml(f).nodes == 4
    f.write_text("preset: cpu\ndevices: 4\n")
    c = Cluster.from_yaml(f)
    assert c == Cluster.preset("cpu", devices=4)


def test_minimal_single_node_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("nodes: 1\ndevices_per_node: 2\nbackend: gloo\n"
                 "device: {memory: 8GiB, peak_flops: {bf16: 1T, fp32: 500G}, hbm_bandwidth: 20GB/s}\n"
                 "links: {intra: {bandwidth: 1GB/s, latency: 50us}}\n")
    c = Cluster.from_yaml(f)
    assert c.name == "custom" and c.device.memory_bytes == 8 * 2**30
    assert c.device.peak("fp16") == 1e12            # defaults to bf16
    assert c.device.kernel_overhead == 5e-6
    assert c.inter_link == c.intra_link == Link(1e9, 5e-5)


# ---- units ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value,kind,expected", [
    ("80GB", "bytes", 80e9), ("80GiB", "bytes", 80 * 2**30), ("512 MB", "bytes", 512e6), (1024, "bytes", 1024),
    ("1.5TB", "bytes", 1.5e12), ("312T", "flops", 312e12), ("312TFLOPS", "flops", 312e12),
    ("50 GFLOP/s", "flops", 50e9), ("3.12e14", "flops", 3.12e14), ("600GB/s", "bandwidth", 600e9),
    ("200Gb/s", "bandwidth", 25e9), ("400Gbps", "bandwidth", 50e9), ("2.039TB/s", "bandwidth", 2.039e12),
    ("5us", "time", 5e-6), ("5µs", "time", 5e-6), ("10ms", "time", 1e-2), ("500ns", "time", 5e-7),
    ("1e-5", "time", 1e-5), ("2s", "time", 2.0),
])
def test_units(value, kind, expected):
    assert parse_quantity(value, kind) == expected


@pytest.mark.parametrize("value,kind", [("80XB", "bytes"), ("80G", "bytes"), ("fast", "bandwidth"),
                                        ("5 parsecs", "time"), (True, "bytes"), ([1], "flops"),
                                        ("600GB", "bandwidth"), (None, "time")])
def test_bad_units(value, kind):
    with pytest.raises(ValueError, match="expected"):
        parse_quantity(value, kind)


@settings(deadline=None, max_examples=60)
@given(x=st.integers(1, 10**6), prefix=st.sampled_from([("k", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12)]))
def test_unit_scaling_property(x, prefix):
    p, mult = prefix
    assert parse_quantity(f"{x}{p}B", "bytes") == pytest.approx(x * mult, rel=1e-15)
    assert parse_quantity(f"{x}{p}B/s", "bandwidth") == pytest.approx(8 * parse_quantity(f"{x}{p}b/s", "bandwidth"))


# ---- validation errors name the file, the field, the value and what is expected ---------------

GOOD = """\
nodes: 2
devices_per_node: 8
device:
  memory: 80GB
  peak_flops: {bf16: 312T, fp32: 156T}
  hbm_bandwidth: 2039GB/s
links:
  intra: {bandwidth: 230GB/s, latency: 5us}
  inter: {bandwidth: 200Gb/s, latency: 10us}
"""


def _error(tmp_path, text: str) -> str:
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(ClusterError) as e:
        Cluster.from_yaml(f)
    msg = str(e.value)
    assert str(f) in msg, msg
    return msg


def test_good_file_parses(tmp_path):
    f = tmp_path / "good.yaml"
    f.write_text(GOOD)
    assert Cluster.from_yaml(f).num_devices == 16


def test_missing_field(tmp_path):
    msg = _error(tmp_path, GOOD.replace("  hbm_bandwidth: 2039GB/s\n", ""))
    assert "device.hbm_bandwidth" in msg and "missing" in msg


def test_missing_inter_link_on_multi_node(tmp_path):
    msg = _error(tmp_path, GOOD.replace("  inter: {bandwidth: 200Gb/s, latency: 10us}\n", ""))
    assert "links.inter" in msg and "missing" in msg


def test_negative_bandwidth(tmp_path):
    msg = _error(tmp_path, GOOD.replace("230GB/s", "-230GB/s"))
    assert "links.intra.bandwidth" in msg and "-230GB/s" in msg and "> 0" in msg


def test_zero_memory(tmp_path):
    msg = _error(tmp_path, GOOD.replace("memory: 80GB", "memory: 0"))
    assert "device.memory" in msg and "> 0" in msg


def test_unknown_key_suggests(tmp_path):
    msg = _error(tmp_path, GOOD.replace("hbm_bandwidth", "hbm_bandwith"))
    assert "device.hbm_bandwith" in msg and "did you mean 'hbm_bandwidth'" in msg
    msg = _error(tmp_path, "devices_per_nod: 8\n" + GOOD)
    assert "did you mean 'devices_per_node'" in msg


def test_bad_unit(tmp_path):
    msg = _error(tmp_path, GOOD.replace("latency: 5us", "latency: 5 fortnights"))
    assert "links.intra.latency" in msg and "fortnights" in msg and "5us" in msg


def test_not_a_mapping(tmp_path):
    msg = _error(tmp_path, "- just\n- a list\n")
    assert "mapping" in msg
    msg = _error(tmp_path, GOOD.split("links:")[0] + "links: 3\n")
    assert "links: got 3" in msg and "mapping" in msg
    msg = _error(tmp_path, "")
    assert "mapping" in msg


def test_invalid_yaml(tmp_path):
    msg = _error(tmp_path, "nodes: [1, 2\n")
    assert "invalid YAML" in msg


def test_nonexistent_file(tmp_path):
    with pytest.raises(ClusterError, match="does not exist") as e:
        Cluster.from_yaml(tmp_path / "nope.yaml")
    assert "nope.yaml" in str(e.value) and "dgx-a100" in str(e.value)


def test_devices_not_divisible(tmp_path):
    msg = _error(tmp_path, GOOD.replace("nodes: 2\n", "devices: 12\n"))
    assert "devices" in msg and "multiple of devices_per_node (8)" in msg
    msg = _error(tmp_path, "devices: 24\n" + GOOD)
    assert "2 × 8 = 16" in msg


def test_bad_counts_and_backend(tmp_path):
    assert "nodes" in _error(tmp_path, GOOD.replace("nodes: 2", "nodes: 1.5"))
    assert "devices_per_node" in _error(tmp_path, GOOD.replace("devices_per_node: 8", "devices_per_node: 0"))
    msg = _error(tmp_path, "backend: mpi\n" + GOOD)
    assert "backend" in msg and "nccl" in msg and "gloo" in msg


def test_unknown_dtype_and_missing_dtype(tmp_path):
    msg = _error(tmp_path, GOOD.replace("fp32: 156T", "fp32: 156T, fp8: 600T"))
    assert "device.peak_flops.fp8" in msg
    msg = _error(tmp_path, GOOD.replace("bf16: 312T, ", ""))
    assert "device.peak_flops.bf16" in msg and "missing" in msg


def test_unknown_preset_in_file(tmp_path):
    msg = _error(tmp_path, "preset: dgx-h10\n")
    assert "preset" in msg and "did you mean 'dgx-h100'" in msg and "cpu" in msg


def test_from_dict_errors_name_source():
    with pytest.raises(ClusterError, match=r"<cluster dict>: links.intra.latency"):
        d = Cluster.preset("cpu").to_dict()
        d["links"]["intra"]["latency"] = "soon"
        Cluster.from_dict(d)
    with pytest.raises(ClusterError, match="mapping"):
        Cluster.from_dict("dgx-a100")


def test_direct_construction_is_validated():
    d = Cluster.preset("cpu").device
    with pytest.raises(ClusterError, match="bandwidth"):
        Link(0, 1e-6)
    with pytest.raises(ClusterError, match="latency"):
        Link(1e9, -1)
    with pytest.raises(ClusterError, match="backend"):
        Cluster("x", 1, 1, d, Link(1, 0), Link(1, 0), "mpi")
    with pytest.raises(ClusterError, match="peak_flops"):
        Device("x", {"bf16": 1.0}, 1, 1.0)
    with pytest.raises(ClusterError, match="memory_bytes"):
        Device("x", {"bf16": 1.0, "fp16": 1.0, "fp32": 1.0}, -1, 1.0)
    assert math.isclose(d.peak("fp32"), 50e9)
    assert set(PRESETS) == {"dgx-a100", "dgx-h100", "tacc-longhorn", "dgx2-v100", "workstation-4090", "cpu"}
