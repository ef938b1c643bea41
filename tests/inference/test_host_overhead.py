"""The host (Python / dispatch) overhead term of the inference prices (inference_cost.py, "Host
overhead"): added to each stage's kernels on a synchronous device, max(host, kernels) otherwise,
0 for the GPU presets (their prices unchanged), and measured for the cpu preset by
autopar/execution/calibrate_forward.py; and the skinny-GEMM floor measured with it."""
from __future__ import annotations

import dataclasses
import math

import pytest

import autopar
from autopar.errors import ClusterError
from autopar.inference.inference_cost import Pricer
from autopar.inference.model_shape import ModelShape
from autopar.models.hf_config import from_hf_config

LLAMA3_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
              "intermediate_size": 28672, "num_attention_heads": 64, "num_hidden_layers": 80,
              "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# prices before the host term (commit 8757662): prefill(4, 2, 1, 1024), decode(8, 1, 16, 2048),
# decode_in_flight(2, 2, 8, 2048), mixed(4, 1, ((256, 0), (128, 512)), 8, 1024)
BEFORE = {"dgx-a100": (0.17817586436107546, 0.024996512157551797, 0.04476490473880033, 0.07859694522718086),
          "dgx-h100": (0.07781871957428063, 0.014597794897433129, 0.027574227417623106, 0.03999069077963009)}


@pytest.fixture(scope="module")
def shape():
    return ModelShape.of(from_hf_config(dict(LLAMA3_70B), seq=16, batch=1))


def _with_host(cluster, layer, forward, synchronous):
    return dataclasses.replace(cluster, device=dataclasses.replace(
        cluster.device, host_layer_overhead=layer, host_forward_overhead=forward, host_synchronous=synchronous))


@pytest.mark.parametrize("preset", sorted(BEFORE))
def test_gpu_presets_price_as_before(shape, preset):
    cl = autopar.Cluster.preset(preset)
    assert (cl.device.host_layer_overhead, cl.device.host_forward_overhead, cl.device.host_synchronous) == (0, 0, False)
    # BEFORE was priced with the head's whole logits all-gathered (now gathered_logits=True); the
    # default prices the distributed argmax's 2 numbers per row per rank: a little less
    p = Pricer(cl, shape, "bf16", gathered_logits=True)
    got = (p.prefill(4, 2, 1, 1024), p.decode(8, 1, 16, 2048), p.decode_in_flight(2, 2, 8, 2048),
           p.mixed(4, 1, ((256, 0), (128, 512)), 8, 1024))
    assert got == pytest.approx(BEFORE[preset], rel=1e-12)
    argmax = Pricer(cl, shape, "bf16")
    assert argmax.decode(8, 1, 16, 2048) < p.decode(8, 1, 16, 2048)
    assert argmax.decode(8, 1, 16, 2048) == pytest.approx(p.decode(8, 1, 16, 2048), rel=0.01)


def test_synchronous_host_adds_per_layer_and_per_forward(shape):
    cl = autopar.Cluster.preset("dgx-h100")
    base = Pricer(cl, shape, "bf16")
    p = Pricer(_with_host(cl, 1e-3, 2e-3, True), shape, "bf16")
    # one stage of 80 layers: + 80 x 1 ms + 2 ms, whatever the iteration
    assert p.decode(8, 1, 16, 2048) == pytest.approx(base.decode(8, 1, 16, 2048) + 0.082, rel=1e-12)
    assert p.prefill(8, 1, 1, 512) == pytest.approx(base.prefill(8, 1, 1, 512) + 0.082, rel=1e-12)
    assert p.mixed(8, 1, ((64, 0),), 4, 300) == pytest.approx(base.mixed(8, 1, ((64, 0),), 4, 300) + 0.082,
                                                              rel=1e-12)
    # two stages of 40: each + 40 ms + 2 ms (a forward each), the pass + 84 ms
    stages, before = p.decode_stages(4, 2, 8, 2048), base.decode_stages(4, 2, 8, 2048)
    assert stages == pytest.approx([b + 0.042 for b in before], rel=1e-12)


def test_asynchronous_host_is_hidden_unless_it_is_the_longer(shape):
    cl = autopar.Cluster.preset("dgx-h100")
    base = Pricer(cl, shape, "bf16")
    small = Pricer(_with_host(cl, 1e-7, 1e-6, False), shape, "bf16")   # 9 us of host: kernels dominate
    assert small.decode(8, 1, 16, 2048) == base.decode(8, 1, 16, 2048)
    big = Pricer(_with_host(cl, 1e-3, 2e-3, False), shape, "bf16")     # 82 ms of host: it dominates
    assert base.decode(8, 1, 1, 2048) < 0.082
    assert big.decode(8, 1, 1, 2048) == pytest.approx(0.082, rel=1e-12)
    assert big.decode_stages(4, 2, 1, 2048) == pytest.approx([0.042, 0.042], rel=1e-12)


def test_skinny_gemm_floor_prices_uncached_weights(shape):
    cl = autopar.Cluster.preset("dgx-h100")
    base = Pricer(cl, shape, "bf16")
    dev = dataclasses.replace(cl.device, skinny_gemm_bandwidth=1e9, skinny_gemm_flops=1e12)
    p = Pricer(dataclasses.replace(cl, device=dev), shape, "bf16")
    # [4, 8192] x [8192, 1024] in bf16: 2 (4 x 8192 + 8192 x 1024 + 4 x 1024) bytes at 1 GB/s
    # + 2 x 4 x 8192 x 1024 FLOPs at 1 TFLOP/s: far above the roofline, so the floor is the price
    nbytes, flops = 2 * (4 * 8192 + 8192 * 1024 + 4 * 1024), 2 * 4 * 8192 * 1024
    assert p.gemm(4, 8192, 1024) == pytest.approx(nbytes / 1e9 + flops / 1e12, rel=1e-12)
    assert base.gemm(4, 8192, 1024) < p.gemm(4, 8192, 1024)
    # GEMMs of SKINNY_ROWS rows or more keep the GEMM curve
    assert p.gemm(512, 8192, 1024) == base.gemm(512, 8192, 1024)


def test_cpu_figures_are_measured_constants_and_bad_figures_are_refused():
    from autopar.cluster_presets import CPU_HOST_OVERHEAD, CPU_SKINNY_GEMM, cpu_host_device
    cpu = autopar.Cluster.preset("cpu")   # the preset carries this machine's figures
    plain = dataclasses.replace(cpu.device, host_layer_overhead=0.0, host_forward_overhead=0.0, host_synchronous=False,
                                skinny_gemm_bandwidth=0.0, skinny_gemm_flops=0.0)
    d = cpu_host_device(plain)
    assert d == cpu.device
    assert d.host_synchronous and (d.host_layer_overhead, d.host_forward_overhead) == CPU_HOST_OVERHEAD
    assert (d.skinny_gemm_bandwidth, d.skinny_gemm_flops) == CPU_SKINNY_GEMM and min(CPU_SKINNY_GEMM) > 0
    with pytest.raises(ClusterError, match="host_layer_overhead"):
        dataclasses.replace(d, host_layer_overhead=-1e-3)
    with pytest.raises(ClusterError, match="host_forward_overhead"):
        dataclasses.replace(d, host_forward_overhead=math.inf)


def test_a_cluster_file_carries_the_figures(tmp_path):
    """The figures survive the cluster's YAML round trip (plans embed it) and a file may set them."""
    import yaml

    from autopar.cluster_schema import cluster_dict, read_cluster_file
    cpu = autopar.Cluster.preset("cpu")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cluster_dict(cpu.name, cpu.nodes, cpu.devices_per_node, cpu.device,
                                                cpu.intra_link, cpu.inter_link, cpu.backend)))
    assert read_cluster_file(path)["device"] == cpu.device
    text = path.read_text().replace("host_synchronous: true", "host_synchronous: 1")
    path.write_text(text)
    with pytest.raises(ClusterError, match="host_synchronous"):
        read_cluster_file(path)


def test_calibration_returns_positive_finite_figures():
    from autopar.execution.calibrate_forward import measure_forward_overhead
    layer, forward = measure_forward_overhead(reps=8)
    assert math.isfinite(layer) and math.isfinite(forward)
    assert 0 < layer < 0.1 and 0 <= forward < 0.1


def test_skinny_gemm_calibration_returns_positive_finite_rates():
    from autopar.execution.calibrate_forward import measure_skinny_gemm
    bandwidth, rate = measure_skinny_gemm(reps=3)
    assert math.isfinite(bandwidth) and 1e7 < bandwidth < 1e13
    assert math.isfinite(rate) and 0 <= rate < 1e14
