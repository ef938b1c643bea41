"""Plans with the Triton kernels (``kernels="triton"``): the fused operators in the traced graph
(autopar/frontend/fuse.py), what the planner records, and training on forked gloo ranks under the
Triton interpreter equal to the same plan kind with torch ops, with each kernel family launched."""
from __future__ import annotations


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.errors import ExecutionError
from autopar.models import HF_ZOO, ZOO
from runtime.launch import run_local
from tests.helpers.kernels import TINY, TRAIN_STEPS, needs_kernels, warm_up_planning

STEPS = TRAIN_STEPS


def _llama():
    return ZOO["llama"]()


def test_auto_fuses_on_gpu_clusters_only_and_the_plan_says_so():
    model, batch = _llama()
    gpu = autopar.plan(model, batch, autopar.Cluster.preset("dgx-a100", devices=2))
    cpu = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2))
    assert gpu.kernels == "triton" and gpu.fused == {"rms_norm": 5, "swiglu": 2, "rotary": 4, "linear_cross_entropy": 1}
    assert cpu.kernels == "torch" and cpu.fused == {}
    targets = {o["target"] for o in gpu.ops}
    assert "autopar.rms_norm.default" in targets and "autopar.swiglu.default" in targets
    assert not any("autopar." in o["target"] for o in cpu.ops)
    forced = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2), kernels="triton")
    assert forced.kernels == "triton" and forced.fused == gpu.fused


def test_fused_norm_keeps_its_hidden_dim_whole_under_tensor_parallelism():
    model, batch = _llama()
    plan = autopar.plan(model, batch, autopar.Cluster.preset("dgx-a100", devices=2), constraints={"tp": 2})
    for op in plan.ops:
        if op["target"] == "autopar.rms_norm.default":
            assert op["inputs"][1] in (None, []) or "S" not in str(op["inputs"][1]), op


def test_fused_plan_is_cheaper_and_saves_less():
    """The fused ops move fewer bytes (one pass) and keep fewer tensors than the decomposed ones."""
    model, batch = ZOO["llama"](d_model=256, ffn_hidden=704, n_head=8, n_kv_heads=4, seq=128, batch=8)
    c = autopar.Cluster.preset("dgx-a100", devices=1)
    fused = autopar.plan(model, batch, c, kernels="triton")
    plain = autopar.plan(model, batch, c, kernels="torch")
    assert fused.step_time < plain.step_time
    assert fused.memory_breakdown["activations"] < plain.memory_breakdown["activations"]


def test_bad_kernels_value_is_a_clear_error():
    model, batch = _llama()
    with pytest.raises(autopar.PlanError, match="kernels must be one of"):
        autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2), kernels="cuda")


class GeGLUNet(nn.Module):
    """LayerNorm -> GeGLU MLP (exact gelu) -> LayerNorm -> GeGLU MLP (tanh gelu) -> mean square loss."""

    def __init__(self, d=32, hidden=48):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.gate1, self.up1, self.down1 = nn.Linear(d, hidden), nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.gate2, self.up2, self.down2 = nn.Linear(d, hidden), nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x, y):
        h = self.ln1(x)
        x = x + self.down1(F.gelu(self.gate1(h)) * self.up1(h))
        h = self.ln2(x)
        x = x + self.down2(F.gelu(self.gate2(h), approximate="tanh") * self.up2(h))
        return (x - y).pow(2).mean()


def _geglu_net():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return GeGLUNet(), (torch.randn(8, 6, 32, generator=g), torch.randn(8, 6, 32, generator=g))


def _model(name, sizes=TINY):
    """``sizes``: the training tests' TINY batch and sequence (tests/helpers/kernels.py), {} the zoo's."""
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
        kw = dict(sizes)
        if name == "hf_gemma2" and "seq" in kw:
            kw["window"] = kw["seq"] // 2   # the sliding window still shorter than the sequence
        return HF_ZOO[name](**kw)
    if name == "geglu_net":
        return _geglu_net()
    return ZOO[name](**sizes)


def _train(rank, world, constraints, kernels, optimizer="sgd", name="llama", sizes=TINY):
    import runtime.kernels as K
    torch.manual_seed(0)
    model, batch = _model(name, sizes)
    cluster = autopar.Cluster.preset("cpu", devices=world)
    hp = {"lr": 0.5, "momentum": 0.9} if optimizer == "sgd" else {"lr": 1e-2}
    compiled = autopar.compile(model, cluster, batch, optimizer=optimizer, **hp,
                               plan_options={"constraints": constraints}, kernels=kernels)
    K.reset_kernel_stats()
    losses = [compiled.step(*batch) for _ in range(STEPS)]
    state = {k: v.detach().float().numpy().copy() for k, v in compiled.full_state_dict().items()}   # by value
    return losses, state, compiled.kernel_stats(), compiled.plan.kernels


def _check_equal(world, constraints, name="llama", families=("rms_norm", "swiglu", "rotary"), absent=(),
                 sizes=TINY):
    warm_up_planning()
    ref = run_local(_train, world, (constraints, "torch", "sgd", name, sizes), timeout=600)[0]
    got = run_local(_train, world, (constraints, "triton", "sgd", name, sizes), timeout=600)
    assert len(ref[0]) == len(got[0][0]) == STEPS
    assert ref[3] == "torch" and got[0][3] == "triton"
    for losses, state, stats, _ in got:
        for f in families:
            assert stats[f] > 0, stats   # the kernels ran, on every rank
        for f in absent:
            assert stats[f] == 0, stats
        for a, b in zip(losses, ref[0]):
            assert abs(a - b) < 1e-4 * max(1.0, abs(b)), (losses, ref[0])
        for k, v in ref[1].items():
            torch.testing.assert_close(torch.from_numpy(state[k]), torch.from_numpy(v), atol=1e-4, rtol=1e-4,
                                       msg=k)



@pytest.mark.slow
@pytest.mark.parametrize("constraints", [{"dp": 2}, {"tp": 2}, {"tp": 2, "sp": 2, "sp_mode": "megatron"},
                                         {"sp": 2, "sp_mode": "ulysses"}, {"sp": 2, "sp_mode": "ring"},
                                         {"dp": 2, "zero": 3}, {"pp": 2}, {"dp": 2, "checkpoint": "full"}],
                         ids=["dp", "tp", "megatron-sp", "ulysses-sp", "ring-sp", "zero3", "pp", "checkpoint"])
def test_triton_kernels_train_equal_to_torch_ops(constraints):
    needs_kernels()
    _check_equal(2, constraints)


@pytest.mark.slow
@pytest.mark.parametrize("name, families", [("hf_llama", ("rms_norm", "swiglu", "rotary")),
                                            ("hf_gemma2", ("rms_norm", "geglu", "rotary"))],
                         ids=["hf_llama", "hf_gemma2"])
def test_triton_kernels_train_hugging_face_models_equal_to_torch_ops(name, families):
    """transformers' LlamaRMSNorm (fp32 upcast, weight times the cast-back value) and its
    act_fn(gate) * up MLP are fused (5 norms, 2 SwiGLUs), and its rotary embedding of q and k (4);
    Gemma 2's norms (x * (1 + weight)) and
    its tanh-gelu gated MLP too (9 norms, 2 GeGLUs, 4 rotary); under tensor parallelism."""
    needs_kernels()
    _check_equal(2, {"tp": 2}, name=name, families=families)


@pytest.mark.slow
@pytest.mark.parametrize("mode, name, families, absent", [("2d", "llama", ("swiglu", "rotary"), ("rms_norm",)),
                                                          ("2d", "geglu_net", ("geglu",), ("layer_norm",)),
                                                          ("2d", "gpt2", (), ("layer_norm",)),
                                                          ("3d", "llama", ("swiglu", "rotary"), ("rms_norm",))],
                         ids=["2d-llama", "2d-geglu_net", "2d-gpt2", "3d-llama"])
def test_triton_kernels_train_equal_to_torch_ops_on_the_grid(mode, name, families, absent):
    """2D (SUMMA, 4 ranks) and 3D (8 ranks) tensor parallelism: SwiGLU / GeGLU run their kernels
    on each rank's blocks (they are elementwise); the norms' hidden dim is split over the grid, so
    they run as split norms (statistics all-reduced over the hidden group), no norm kernel."""
    needs_kernels()
    world, shape = {"2d": (4, [2, 2]), "3d": (8, [2, 2, 2])}[mode]
    _check_equal(world, {"tp_mode": mode, "tp_shape": shape}, name=name, families=families, absent=absent,
                 sizes={})   # the zoo's batch and sequence (TINY not tried on 4 and 8 ranks)


def test_fused_ops_run_on_the_grid_not_replicated():
    """Under 2d / 2.5d / 3d the fused norm is the split norm and SwiGLU runs locally on blocks:
    neither falls back to running whole on every rank. The fused LM head + loss
    (autopar.linear_cross_entropy) has no grid lowering yet: it runs replicated there (known gap)."""
    for mode, n in (("2d", 4), ("3d", 8)):
        model, batch = _llama()
        plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=n), constraints={"tp_mode": mode},
                            kernels="triton")
        kinds = {o["node"]: (o["target"], o["strategy"]) for o in plan.ops}
        fused = [(t, s) for t, s in kinds.values() if t.startswith("autopar.")]
        lce = [s for t, s in fused if t == "autopar.linear_cross_entropy.default"]
        assert lce == [f"{mode}: replicated"], lce
        fused = [(t, s) for t, s in fused if t != "autopar.linear_cross_entropy.default"]
        assert len(fused) == 11, kinds   # 5 norms, 2 SwiGLUs, 4 rotary (interleaved)
        for t, s in fused:
            want = "split rms_norm" if t == "autopar.rms_norm.default" else "local"
            assert s == f"{mode}: {want}", (t, s)


def test_layer_norm_and_geglu_are_fused_and_planned():
    """GPT-2's five LayerNorms become autopar.layer_norm; gelu(gate) * up (exact and tanh) becomes
    autopar.geglu; the norm keeps its hidden dim whole under tensor parallelism, and runs as the
    split LayerNorm on the 2D grid."""
    model, batch = ZOO["gpt2"]()
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2), constraints={"tp": 2},
                        kernels="triton")
    assert plan.fused == {"layer_norm": 5, "linear_cross_entropy": 1}
    norms = [o for o in plan.ops if o["target"] == "autopar.layer_norm.default"]
    assert len(norms) == 5 and all("S" not in str(o["inputs"][1:]) for o in norms)
    model, batch = _geglu_net()
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=4), kernels="triton",
                        constraints={"tp_mode": "2d"})
    assert plan.fused == {"layer_norm": 2, "geglu": 2}
    kinds = {o["target"]: o["strategy"] for o in plan.ops if o["target"].startswith("autopar.")}
    assert kinds == {"autopar.layer_norm.default": "2d: split layer_norm", "autopar.geglu.default": "2d: local"}


def test_fused_layer_norm_under_megatron_sp_saves_no_more_than_atens():
    """The fused LayerNorm has one output, as ATen's: the column-parallel linear reading it keeps
    its sequence shard and gathers again in backward (autopar/pricing/regather.py), with no
    getitem between them where the gather could move; and it saves no mean/rstd."""
    acts = {}
    for k in ("torch", "triton"):
        model, batch = ZOO["gpt2"]()
        plan = autopar.plan(model, batch, autopar.Cluster.preset("dgx-a100", devices=2), kernels=k,
                            constraints={"tp": 2, "sp_mode": "megatron"})
        assert all(o["strategy"] == "S(b)@tp" for o in plan.ops if o["rule"] == "layer_norm"), plan.ops
        acts[k] = plan.memory_breakdown["activations"]
    assert acts["triton"] < acts["torch"], acts


def test_fused_norms_have_one_output_read_directly():
    """No getitem between a fused norm and its readers (a plan could put a gather on that edge,
    away from the linear that regathers under Megatron-SP)."""
    from autopar.frontend.trace import trace
    for name in ("llama", "gpt2"):
        g = trace(*ZOO[name](), kernels=True)
        norms = [n for n in g.gm.graph.nodes if str(n.target) in ("autopar.rms_norm.default",
                                                                 "autopar.layer_norm.default")]
        assert len(norms) == 5, name
        for n in norms:
            assert all("getitem" not in str(u.target) for u in n.users), (name, n.name, list(n.users))


def test_hugging_face_models_trace_with_their_norms_and_gated_mlps_fused():
    from autopar.frontend.trace import trace
    pytest.importorskip("transformers")
    lce = {"linear_cross_entropy": 1}   # the LM head and its loss (not Gemma 2's: its logits are soft-capped)
    want = {"hf_bert": {"layer_norm": 6}, "hf_gpt2": {"layer_norm": 5, **lce},
            "hf_bloom": {"layer_norm": 6, "softmax": 2, **lce},
            "hf_gemma2": {"rms_norm": 9, "geglu": 2, "rotary": 4, "softmax": 2}, "hf_t5": {"rms_norm": 12, **lce}}
    for name, fused in want.items():
        model, batch = HF_ZOO[name]()
        assert trace(model, batch, kernels=True).fused == fused, name


@pytest.mark.slow
@pytest.mark.parametrize("world, constraints", [(1, {}), (2, {"tp": 2, "sp": 2, "sp_mode": "megatron"})],
                         ids=["1-process", "megatron-sp"])
def test_gpt2_trains_with_the_layer_norm_kernel_equal_to_torch_ops(world, constraints):
    needs_kernels()
    _check_equal(world, constraints, name="gpt2", families=("layer_norm",))


@pytest.mark.slow
@pytest.mark.parametrize("world, constraints", [(1, {}), (2, {"tp": 2})], ids=["1-process", "tp"])
def test_geglu_net_trains_with_the_kernels_equal_to_torch_ops(world, constraints):
    needs_kernels()
    _check_equal(world, constraints, name="geglu_net", families=("layer_norm", "geglu"))


@pytest.mark.slow
def test_fused_adamw_trains_like_torch_adamw():
    """AdamW's step as one kernel on the flat shards (ZeRO-1 over 2 ranks): losses equal, parameters
    within Adam's fp32 reordering noise."""
    needs_kernels()
    warm_up_planning()
    ref = run_local(_train, 2, ({"dp": 2, "zero": 1}, "torch", "adamw"))[0]
    got = run_local(_train, 2, ({"dp": 2, "zero": 1}, "triton", "adamw"))[0]
    assert got[2]["adamw"] > 0 and ref[2]["adamw"] == 0
    for a, b in zip(got[0], ref[0]):
        assert abs(a - b) < 1e-3 * max(1.0, abs(b)), (got[0], ref[0])
    for k, v in ref[1].items():
        torch.testing.assert_close(torch.from_numpy(got[1][k]), torch.from_numpy(v), atol=1e-3, rtol=1e-3, msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["lamb", "lars"])
def test_fused_trust_ratio_steps_train_like_torch_ops(optimizer):
    """LAMB and LARS kernels on ZeRO-1 shards of 2 ranks (the trust-ratio norms still summed over
    the shards): losses equal, parameters within fp32 reordering noise."""
    needs_kernels()
    warm_up_planning()
    ref = run_local(_train, 2, ({"dp": 2, "zero": 1}, "torch", optimizer))[0]
    got = run_local(_train, 2, ({"dp": 2, "zero": 1}, "triton", optimizer))[0]
    assert got[2][optimizer] > 0 and ref[2][optimizer] == 0
    for a, b in zip(got[0], ref[0]):
        assert abs(a - b) < 1e-3 * max(1.0, abs(b)), (got[0], ref[0])
    for k, v in ref[1].items():
        torch.testing.assert_close(torch.from_numpy(got[1][k]), torch.from_numpy(v), atol=1e-3, rtol=1e-3, msg=k)


def test_fused_adamw_is_priced_as_one_pass():
    from autopar.pricing.cost import optimizer_bytes_per_element
    assert optimizer_bytes_per_element("adamw", "fp32", fused=True) == 28
    assert optimizer_bytes_per_element("adamw", "fp32") == 80
    assert optimizer_bytes_per_element("sgd", "fp32", fused=True) == 20 < optimizer_bytes_per_element("sgd", "fp32")
    assert optimizer_bytes_per_element("lamb", "fp32", fused=True) == 48
    assert optimizer_bytes_per_element("lars", "fp32", fused=True) == 28
    assert optimizer_bytes_per_element("adam", "fp32", fused=True) == optimizer_bytes_per_element("adam", "fp32")


def test_triton_plan_on_the_cpu_without_the_interpreter_is_refused(monkeypatch):
    from autopar.execution.compiled_setup import check_kernels_run
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ExecutionError, match="TRITON_INTERPRET=1"):
        check_kernels_run(torch.device("cpu"))
