"""Calibration profiles: YAML round trip, cluster files referencing them, the cost model using
them, and `autopar calibrate` end to end on 2 gloo processes."""
import dataclasses

import pytest

from autopar.cluster import Cluster
from autopar.pricing.cost import Collectives, compute_time, profile_of
from autopar.errors import ClusterError
from autopar.mesh import Mesh
from autopar.profile import Calibration, interp

PROFILE = {
    "name": "test", "source": "hand-written", "gemm_dtype": "fp32",
    "gemm": [[1, 1e9], [10, 8e9], [100, 2e10]], "gemm_latency": "20us",
    "memory": [[1e3, 1e8], [1e6, 5e9], [1e8, 8e9]], "kernel_overhead": "3us", "overlap_slowdown": 0.3,
    "links": {"intra": {"hop_latency": "10us", "curves": {
        "all_reduce@2": [[1e3, 1e6], [1e6, 5e8], [1e8, 1e9]],
        "all_gather@2": [[1e3, 2e6], [1e8, 2e9]],
        "all_reduce@4": [[1e3, 5e5], [1e8, 6e8]]}}},
}


def test_interp_log_log_clamped():
    t = ((1.0, 10.0), (100.0, 1000.0))
    assert interp(t, 0.5) == 10.0 and interp(t, 1e4) == 1000.0
    assert interp(t, 10.0) == pytest.approx(100.0)


def test_profile_round_trips_through_yaml(tmp_path):
    cal = Calibration.from_dict(PROFILE)
    assert cal.gemm_latency == pytest.approx(20e-6) and cal.overlap_slowdown == 0.3
    cal.to_yaml(tmp_path / "p.yaml")
    back = Calibration.from_yaml(tmp_path / "p.yaml")
    assert back == cal and hash(back) == hash(cal)
    assert Calibration.from_dict(cal.to_dict()) == cal


def test_cluster_file_references_profile(tmp_path):
    Calibration.from_dict(PROFILE).to_yaml(tmp_path / "prof.yaml")
    (tmp_path / "cluster.yaml").write_text("preset: cpu\ndevices: 4\ncalibration: prof.yaml\n")
    c = Cluster.from_yaml(tmp_path / "cluster.yaml")
    assert c.num_devices == 4 and c.calibration == Calibration.from_dict(PROFILE)
    assert profile_of(c) is c.calibration
    # the plan JSON form (to_dict) keeps the profile inline and reads back equal
    assert Cluster.from_dict(c.to_dict()) == c
    # an uncalibrated cluster writes no calibration key (plan JSON unchanged)
    assert "calibration" not in Cluster.preset("cpu").to_dict()
    (tmp_path / "bad.yaml").write_text("preset: cpu\ncalibration: missing.yaml\n")
    with pytest.raises(ClusterError, match="missing.yaml"):
        Cluster.from_yaml(tmp_path / "bad.yaml")
    bad = dict(PROFILE, memory=[[1, -2]])
    with pytest.raises(ClusterError, match="memory"):
        Calibration.from_dict(bad)
    # with_calibration takes a profile's path too; anything else is a clear error, not a deep one
    assert Cluster.preset("cpu").with_calibration(tmp_path / "prof.yaml").calibration == c.calibration
    assert Cluster.preset("cpu").with_calibration(str(tmp_path / "prof.yaml")).calibration == c.calibration
    with pytest.raises(TypeError, match="Calibration or a profile's path"):
        Cluster.preset("cpu").with_calibration({"gemm": []})


def test_cost_model_uses_the_profile():
    c = Cluster.preset("cpu", devices=4).with_calibration(Calibration.from_dict(PROFILE))
    dev = c.device
    cal = c.calibration
    # a GEMM at intensity 10 runs at the table's 8 GFLOP/s plus the GEMM latency
    assert compute_time(8e9, 0, "fp32", dev, intensity=10, calibration=cal) == pytest.approx(1 + 20e-6)
    # a memory-bound kernel of 1e6 bytes at 5 GB/s plus the kernel overhead
    assert compute_time(0, 1e6, "fp32", dev, calibration=cal) == pytest.approx(1e6 / 5e9 + 3e-6)
    # collectives: all_reduce on 2 ranks at 1e6 bytes: factor 1 · S / busbw
    comm2 = Collectives(c, Mesh((2, 2), ("dp", "tp"), 4))
    assert comm2("all_reduce", 1e6, 1) == pytest.approx(1e6 / 5e8)
    assert comm2("all_gather", 1e8, 1) == pytest.approx(0.5 * 1e8 / 2e9)
    # a 4-rank all_reduce uses the curve measured on 4 ranks
    comm4 = Collectives(c, Mesh((4,), ("dp",), 4))
    assert comm4("all_reduce", 1e8, 0) == pytest.approx(1.5 * 1e8 / 6e8)
    # reduce_scatter has no curve of its own: all_reduce's, same group size
    assert comm2("reduce_scatter", 1e6, 1) == pytest.approx(0.5 * 1e6 / 5e8)


def test_measured_backward_ratios_per_op():
    """A profile's per-op backward ratios (what `autopar calibrate` measures: on a CPU SDPA's
    backward is several times its forward) replace the generic 2x / backward_ratio for that op
    only, and survive the YAML round trip."""
    from autopar.pricing.cost import fwd_bwd_compute
    cal = Calibration.from_dict(dict(PROFILE, backward_ratio=1.5, backward_ratios={"sdpa": 5.0, "gelu": 2.6}))
    dev = Cluster.preset("cpu").device
    f, b = fwd_bwd_compute(1e6, 1e6, "fp32", dev, True, 10.0, cal, op="sdpa")
    assert b == pytest.approx(5.0 * f)
    f, b = fwd_bwd_compute(1e6, 1e6, "fp32", dev, True, 10.0, cal, op="linear")   # no ratio: 2x
    assert b == pytest.approx(2.0 * f)
    f, b = fwd_bwd_compute(0, 1e6, "fp32", dev, False, None, cal, op="gelu")
    assert b == pytest.approx(2.6 * f)
    f, b = fwd_bwd_compute(0, 1e6, "fp32", dev, False, None, cal, op="tanh")      # the median ratio
    assert b == pytest.approx(1.5 * f)
    f, b = fwd_bwd_compute(0, 1e6, "fp32", dev, False, None, cal)                 # old call signature
    assert b == pytest.approx(1.5 * f)
    assert Calibration.from_dict(cal.to_dict()) == cal
    with pytest.raises(ClusterError, match="backward_ratios"):
        Calibration.from_dict(dict(PROFILE, backward_ratios={"sdpa": -1}))


@pytest.mark.slow
def test_autopar_calibrate_end_to_end(tmp_path):
    from autopar.cli import main
    out = tmp_path / "p.yaml"
    assert main(["calibrate", "-n", "2", "--sweep", "tiny", "--repeats", "2", "-o", str(out)]) == 0
    cal = Calibration.from_yaml(out)
    assert cal.gemm_dtype == "fp32" and all(r > 0 for _, r in cal.gemm)
    assert {"sdpa", "gelu", "layer_norm", "dropout"} <= {r for r, _ in cal.backward_ratios}
    # on a CPU: tiny ops' floors and the runtime's host work per step (a minimal model run on the
    # two processes, measured minus predicted): a positive time, well under a second
    assert {"linear", "gelu"} <= {r for r, _, _ in cal.op_floors}
    assert 0 < cal.step_overhead < 0.5, cal.step_overhead
    assert {"layer_norm", "softmax", "cross_entropy"} <= {r for r, _ in cal.op_rates}
    # the host figures offload is priced with, both processes copying / stepping at once
    assert 0.1e9 < cal.host_copy_bandwidth < 1000e9 and 0.1e9 < cal.host_cpu_bandwidth < 1000e9
    kinds = {k for k, _, _ in cal.intra.curves}
    assert {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"} <= kinds
    (tmp_path / "c.yaml").write_text(f"preset: cpu\ndevices: 2\ncalibration: {out.name}\n")
    c = Cluster.from_yaml(tmp_path / "c.yaml")
    assert Collectives(c, Mesh((2,), ("dp",), 2))("all_reduce", 1e5, 0) > 0


# ---- the calibrated model against published tables (docs/cost-model.md, benchmarks/RESULTS.md) ----

@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason=(
    "held out, not fitted: since memory-bound kernels are priced at bf16 bytes (they were priced at "
    "the traced fp32 bytes, 2x too slow) and the row is planned as 2021 Megatron ran it (no SP, "
    "per-head QKV, gradient all-reduce after backward), the 1.7B row predicts ~169 TF/s against "
    "137 (+23%): the model is optimistic at tp=1 (GEMMs at 0.859 of peak and memory-bound kernels "
    "at 0.9 of HBM on these shapes); see benchmarks/RESULTS-history.md section 3c"))
def test_narayanan_held_out_row_within_15_percent():
    """Narayanan et al. SC'21 Table 1, 1.7B (t=1, 32 A100s, batch 512): 137 TF/s per GPU. Held
    out: no constant was fitted to it."""
    from benchmarks.bench_published import _plan, megatron_2021, paper_flops
    with megatron_2021():
        p = _plan("dgx-a100", 32, 24, 2304, 24, 2048, 512, 51200, 1, "full", explicit=True, overlap=False)
    tf = paper_flops(512, 2048, 24, 2304, 51200) / p.step_time / 32 / 1e12
    assert abs(tf / 137.0 - 1) <= 0.15, tf


@pytest.mark.slow
def test_korthikanti_layer_within_15_percent():
    """Korthikanti et al. 2022 Table 4: a 22B layer (t=8, A100, micro-batch 4), 19.6 ms fwd+bwd."""
    from benchmarks.bench_published import _plan, megatron_2021
    per = {}
    for l in (2, 3):   # 3 layers − 2 layers, as benchmarks/bench_published.py counts a layer
        with megatron_2021():
            tb = _plan("dgx-a100", 8, l, 6144, 64, 2048, 4, 51200, 8, "none", explicit=True,
                       overlap=False).predictions["time_breakdown"]
        per[l] = tb["compute"] + tb["recompute"] + tb["op_comm"] + tb["reshard_comm"]
    assert abs((per[3] - per[2]) / 19.6e-3 - 1) <= 0.15


def test_op_floors_round_trip_and_bound_tiny_ops(tmp_path):
    """``op_floors``: a rule's least forward / backward time (what a tiny op costs the host on a
    CPU) bounds its price from below; large ops keep their roofline price; views stay views."""
    from autopar.pricing.cost import fwd_bwd_compute
    cal = Calibration.from_dict(dict(PROFILE, op_floors={"gelu": ["30us", "70us"], "linear": [16e-6, 6e-5]}))
    assert cal.floor_for("gelu") == (pytest.approx(30e-6), pytest.approx(70e-6))
    assert cal.floor_for("softmax") == (0.0, 0.0)
    cal.to_yaml(tmp_path / "p.yaml")
    assert Calibration.from_yaml(tmp_path / "p.yaml") == cal
    dev = Cluster.preset("cpu").device
    base = Calibration.from_dict(PROFILE)
    f, b = fwd_bwd_compute(1024.0, 8192.0, "fp32", dev, False, calibration=cal, op="gelu")
    f0, b0 = fwd_bwd_compute(1024.0, 8192.0, "fp32", dev, False, calibration=base, op="gelu")
    assert f0 < 30e-6 and (f, b) == (pytest.approx(30e-6), pytest.approx(70e-6))
    big = fwd_bwd_compute(1e12, 1e10, "fp32", dev, False, calibration=cal, op="gelu")
    assert big == fwd_bwd_compute(1e12, 1e10, "fp32", dev, False, calibration=base, op="gelu")
    assert fwd_bwd_compute(0.0, 0.0, "fp32", dev, False, calibration=cal, op="gelu")[0] == cal.view_overhead
    with pytest.raises(ClusterError, match="op_floors"):
        Calibration.from_dict(dict(PROFILE, op_floors={"gelu": [1e-6]}))


def test_calibrate_measures_op_floors_on_cpu():
    """``autopar calibrate`` on a CPU writes a floor per chained rule, forward and backward, each
    a positive time of tens of microseconds at most a few milliseconds."""
    import torch
    from autopar.execution.calibrate_ops import measure_op_floors
    from autopar.execution.calibrate_timing import seconds_per_call
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as calibrate's ranks measure (two threads on a busy 2-core machine: ms per op)
    try:
        floors = measure_op_floors(lambda f: seconds_per_call(f, 5, lambda: None), torch.float32, torch.device("cpu"))
    finally:
        torch.set_num_threads(threads)
    assert set(floors) >= {"linear", "gelu", "add", "layer_norm", "softmax"}
    for rule, (f, b) in floors.items():
        assert 0 < f < 5e-3 and 0 <= b < 5e-3, (rule, f, b)
    assert floors["linear"][1] > floors["linear"][0]   # two GEMMs and a bias sum in backward


def test_step_overhead_is_priced_once_per_step_with_the_loss():
    """``step_overhead`` (the runtime's host work per step outside the program) adds to the
    predicted step exactly once, shown apart in compute_by_rule, and hides no gradient
    communication (it is not backward compute)."""
    import autopar
    from autopar.models import ZOO
    base = Calibration.from_dict(PROFILE)
    over = dataclasses.replace(base, step_overhead=3e-3)
    model, batch = ZOO["mlp"](device="meta")
    plans = {}
    for cal in (base, over):
        cluster = Cluster.preset("cpu", devices=2).with_calibration(cal)
        plans[cal] = autopar.plan(model, batch, cluster, precision="fp32",
                                  constraints={"dp": 2, "tp": 1, "zero": 0, "num_micro_batches": 1})
    a, b = plans[base], plans[over]
    assert a.degrees == b.degrees
    assert b.step_time == pytest.approx(a.step_time + 3e-3, rel=1e-9)
    assert b.predictions["compute_by_rule"]["step host work"] == pytest.approx(3e-3)
    assert "step host work" not in a.predictions["compute_by_rule"]
    assert (b.predictions["time_breakdown"]["grad_comm_exposed"]
            == pytest.approx(a.predictions["time_breakdown"]["grad_comm_exposed"]))
    assert Calibration.from_dict(over.to_dict()) == over


def test_op_rates_price_a_rules_flops_at_its_measured_rate():
    """``op_rates``: a rule's forward FLOP/s as its OpSpec counts FLOPs (a layer norm counts 8 an
    element and runs vectorized): its arithmetic is priced at that rate, other rules keep
    ``vector_rate``. A contraction is priced at the GEMM curve unless its rule was measured (SDPA
    is a contraction but its kernel is no GEMM of its intensity: its own rate wins)."""
    from autopar.pricing.cost import compute_time
    base = Calibration.from_dict(dict(PROFILE, vector_rate=1e9))
    cal = dataclasses.replace(base, op_rates=(("layer_norm", 1e10),))
    assert Calibration.from_dict(cal.to_dict()) == cal
    dev = Cluster.preset("cpu").device
    flops = 8e7   # arithmetic-bound at either rate (1 byte moved)
    slow = compute_time(flops, 1.0, "fp32", dev, calibration=cal, op="softmax")
    fast = compute_time(flops, 1.0, "fp32", dev, calibration=cal, op="layer_norm")
    assert slow - cal.kernel_overhead == pytest.approx(flops / 1e9)
    assert fast - cal.kernel_overhead == pytest.approx(flops / 1e10)
    gemm = compute_time(flops, 1.0, "fp32", dev, intensity=50.0, calibration=cal, op="linear")
    assert gemm == compute_time(flops, 1.0, "fp32", dev, intensity=50.0, calibration=base, op="linear")
    measured = compute_time(flops, 1.0, "fp32", dev, intensity=50.0, calibration=cal, op="layer_norm")
    assert measured == fast != gemm
    with pytest.raises(ClusterError, match="op_rates"):
        Calibration.from_dict(dict(PROFILE, op_rates={"layer_norm": 0}))


def test_collective_curves_never_price_a_smaller_message_slower():
    """A 1 KB all-reduce read 1.4 ms where 8 KB read 0.6 ms (another rank's skew in its loops):
    the fitted curve takes each size's time as the least of its own and every larger size's, so a
    smaller message never costs more; a curve already monotone in time is kept as measured."""
    from autopar.execution.calibrate_fit import monotone_times
    f = 1.0   # all_reduce over 2 ranks: bus bytes = bytes
    measured = [(1024.0, 1024 / 1.4e-3), (8192.0, 8192 / 0.6e-3), (65536.0, 65536 / 1.4e-3),
                (524288.0, 524288 / 1.8e-3)]
    fitted = monotone_times(measured, f)
    times = [x * f / y for x, y in fitted]
    assert times == sorted(times)
    assert times[0] == pytest.approx(0.6e-3) and times[1] == pytest.approx(0.6e-3)
    assert times[2:] == pytest.approx([1.4e-3, 1.8e-3])
    clean = [(1024.0, 1e6), (8192.0, 4e6), (65536.0, 2e7)]
    assert [y for _, y in monotone_times(clean, f)] == pytest.approx([y for _, y in clean])


def test_host_figures_round_trip_and_bad_values(tmp_path):
    """``host_copy_bandwidth`` / ``host_cpu_bandwidth`` (what `autopar calibrate` measures for
    offload): optional, None when absent, numbers or quantities, YAML round trip, clear errors."""
    assert Calibration.from_dict(PROFILE).host_copy_bandwidth is None
    assert Calibration.from_dict(PROFILE).host_cpu_bandwidth is None
    assert "host_cpu_bandwidth" not in Calibration.from_dict(PROFILE).to_dict()
    cal = Calibration.from_dict(dict(PROFILE, host_copy_bandwidth="12.5GB/s", host_cpu_bandwidth=8e9))
    assert (cal.host_copy_bandwidth, cal.host_cpu_bandwidth) == (12.5e9, 8e9)
    cal.to_yaml(tmp_path / "p.yaml")
    assert Calibration.from_yaml(tmp_path / "p.yaml") == cal
    assert Calibration.from_dict(cal.to_dict()) == cal
    for key, bad in [("host_copy_bandwidth", -1.0), ("host_copy_bandwidth", "fast"), ("host_cpu_bandwidth", 0),
                     ("host_cpu_bandwidth", True), ("host_cpu_bandwidth", "3s"), ("host_cpu_bandwidth", float("inf"))]:
        with pytest.raises(ClusterError, match=f"calibration.{key}: got .*expected a bandwidth > 0"):
            Calibration.from_dict(dict(PROFILE, **{key: bad}))


def test_calibrate_measures_host_copy_and_cpu_step():
    """The host figures `autopar calibrate` measures on a CPU (one process: what `measure` runs
    on each rank, timed here alone): positive and plausible bytes/s."""
    import torch
    from autopar.execution.calibrate_host import measure_host_rates
    from autopar.execution.calibrate_timing import seconds_per_call
    copy, cpu = measure_host_rates(torch.device("cpu"), lambda f: seconds_per_call(f, 3, lambda: None))
    assert 0.1e9 < copy < 1000e9, copy
    assert 0.1e9 < cpu < 1000e9, cpu


def test_measured_host_figures_price_offload():
    """A profile's measured host figures replace the cluster Host's in offload's price: the CPU
    step at ``host_cpu_bandwidth`` per rank (not divided by the node's ranks again), the copies
    at ``host_copy_bandwidth``; a profile without them leaves the Host's figures."""
    from autopar.pricing.offload import host_rates, host_step_bytes_per_element, offload_price
    c = Cluster.preset("cpu", devices=2)
    n, per = 1e8, host_step_bytes_per_element("adamw", "bf16")
    assert per == 28 + 12   # torch's fused CPU AdamW (each tensor once) + the upcast and the cast back
    plain = c.with_calibration(Calibration.from_dict(PROFILE))
    assert host_rates(plain) == host_rates(c) == (c.host.copy_bandwidth, c.host.cpu_bandwidth / 2)
    base = offload_price(n, "adamw", "bf16", plain, zero=2)
    assert base.cpu_seconds == pytest.approx(n * per / (c.host.cpu_bandwidth / 2))
    assert base.copy_seconds == pytest.approx(n * 2 / c.host.copy_bandwidth)
    fast = offload_price(n, "adamw", "bf16", c.with_calibration(
        Calibration.from_dict(dict(PROFILE, host_cpu_bandwidth=4e9))), zero=2)
    slow = offload_price(n, "adamw", "bf16", c.with_calibration(
        Calibration.from_dict(dict(PROFILE, host_cpu_bandwidth=2e9))), zero=2)
    assert fast.cpu_seconds == pytest.approx(n * per / 4e9)
    assert slow.cpu_seconds == pytest.approx(2 * fast.cpu_seconds)
    assert fast.copy_seconds == base.copy_seconds   # the Host's copy bandwidth stays
    copy = offload_price(n, "adamw", "bf16", c.with_calibration(
        Calibration.from_dict(dict(PROFILE, host_copy_bandwidth=1e9))), zero=2, micro_batches=2)
    assert copy.copy_seconds == pytest.approx(n * 2 * 2 / 1e9) and copy.cpu_seconds == base.cpu_seconds
