"""The rotary position embedding kernel (runtime/kernels/rotary.py) against rotary_reference: output
and gradients, fp32 and bf16, odd shapes, x transposed from [batch, seq, heads, head_dim], cos/sin
broadcast as Hugging Face makes them and cos/sin that need a gradient; the ``autopar.rotary``
operator (Triton and torch bodies, fake); its fusion in Hugging Face Llama's traced graph (2 per
layer: q and k), its plans and priced saved bytes; and Llama training with the kernels equal to
torch ops on 1 and 2 gloo ranks.

Tolerances: fp32 1e-5 (abs and rel); bf16 2 bf16 ulps (rtol 2e-2, atol 2e-2 on values of order 1:
the kernel rounds once from fp32, eager bf16 after each of the product and the sum; the
interpreter rounds fp32 -> bf16 by truncation)."""
from __future__ import annotations

import pytest
import torch

from runtime.kernels import kernel_stats, reset_kernel_stats
from runtime.kernels.rotary import rotary, rotary_reference
from tests.helpers.kernels import needs_kernels

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _tables(b, s, d, dtype, device, theta=10000.0):
    """Hugging Face's cos/sin: [b, 1, s, d] (positions per batch row), both halves equal."""
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=device).float() / d)
    pos = torch.arange(s, device=device).float()[None].expand(b, s)
    ang = torch.cat([pos[..., None] * inv] * 2, -1)
    return ang.cos().to(dtype)[:, None], ang.sin().to(dtype)[:, None]


def _check(x, cos, sin, tables_grad=False):
    y = rotary(x, cos, sin)
    r = rotary_reference(x, cos, sin)
    assert y.dtype == r.dtype and y.shape == r.shape and y.stride() == torch.empty_like(x).stride()   # laid out as x
    tol = TOL[x.dtype]
    torch.testing.assert_close(y, r, **tol)
    dy = torch.randn_like(r)
    wrt = [x, cos, sin] if tables_grad else [x]
    got = torch.autograd.grad(y, wrt, dy)
    want = torch.autograd.grad(r, wrt, dy)
    for name, a, b in zip(("dx", "dcos", "dsin"), got, want):
        # the tables' gradients sum over batch and heads: bf16 rounding of more terms
        t = tol if name == "dx" or x.dtype == torch.float32 else dict(rtol=5e-2, atol=1e-1)
        torch.testing.assert_close(a, b, **t, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_matches_reference(device, dtype, head_dim):
    torch.manual_seed(0)
    reset_kernel_stats()
    b, h, s = 2, 4, 16
    x = torch.randn(b, s, h, head_dim, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
    assert not x.is_contiguous()   # as after q_proj(x).view(b, s, h, d).transpose(1, 2)
    cos, sin = _tables(b, s, head_dim, dtype, device)
    _check(x, cos, sin)
    assert kernel_stats()["rotary"] == 2   # forward and backward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_odd_shapes_and_arbitrary_tables(device, dtype):
    """seq 7, heads 3, head_dim 10 (half 5: masked lanes); cos/sin random with unequal halves (the
    backward is the exact transpose, not the equal-halves shortcut) and [1, 1, s, d]."""
    torch.manual_seed(1)
    x = torch.randn(3, 3, 7, 10, device=device, dtype=dtype, requires_grad=True)
    cos = torch.randn(1, 1, 7, 10, device=device, dtype=dtype)
    sin = torch.randn(1, 1, 7, 10, device=device, dtype=dtype)
    _check(x, cos, sin)
    _check(torch.randn(5, 7, 10, device=device, dtype=dtype, requires_grad=True), cos[0], sin[0])   # 3-d
    _check(torch.randn(2, 2, 3, 7, 10, device=device, dtype=dtype, requires_grad=True), cos, sin)   # 5-d


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_tables_that_need_a_gradient(device, dtype):
    torch.manual_seed(2)
    x = torch.randn(2, 7, 3, 16, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
    cos = torch.randn(2, 1, 7, 16, device=device, dtype=dtype, requires_grad=True)
    sin = torch.randn(1, 1, 7, 16, device=device, dtype=dtype, requires_grad=True)
    _check(x, cos, sin, tables_grad=True)


def test_rotary_rejects_odd_head_dim_and_bad_tables(device):
    with pytest.raises(ValueError, match="even"):
        rotary(torch.randn(2, 3, 5, device=device), torch.randn(3, 5, device=device), torch.randn(3, 5, device=device))
    with pytest.raises(RuntimeError):
        rotary(torch.randn(2, 3, 4, device=device), torch.randn(5, 4, device=device), torch.randn(5, 4, device=device))


# ------------------------------------------------------------------------------ interleaved form
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, tables", [((2, 16, 4, 64), (16, 32)), ((3, 7, 3, 10), (1, 1, 7, 5))],
                         ids=["llama-like", "odd"])
def test_rotary_interleaved_matches_reference(device, dtype, shape, tables):
    """GPT-J / Meta Llama's pairs (2i, 2i + 1) with tables of width d/2 (the zoo's Llama): x
    transposed from [b, s, h, d]; output contiguous, as the stack + flatten it replaces; tables
    with gradients too."""
    from runtime.kernels import ops
    from runtime.kernels.rotary import rotary_interleaved_reference
    torch.manual_seed(4)
    reset_kernel_stats()
    x = torch.randn(*shape, device=device, dtype=dtype).transpose(1, 2).requires_grad_()
    cos = torch.randn(*tables, device=device, dtype=dtype, requires_grad=True)
    sin = torch.randn(*tables, device=device, dtype=dtype, requires_grad=True)
    y = ops.ROTARY_INTERLEAVED(x, cos, sin)
    r = rotary_interleaved_reference(x, cos, sin)
    assert y.dtype == r.dtype and y.shape == r.shape and y.is_contiguous() and r.is_contiguous()
    torch.testing.assert_close(y, r, **TOL[dtype])
    dy = torch.randn_like(r)
    for name, a, b in zip(("dx", "dcos", "dsin"), torch.autograd.grad(y, [x, cos, sin], dy),
                          torch.autograd.grad(r, [x, cos, sin], dy)):
        t = TOL[dtype] if name == "dx" or dtype == torch.float32 else dict(rtol=5e-2, atol=1e-1)
        torch.testing.assert_close(a, b, **t, msg=lambda m: f"{name}: {m}")
    assert kernel_stats()["rotary"] == 2
    with torch.no_grad():
        monkey = ops.ROTARY_INTERLEAVED(x.detach().to("meta"), cos.detach().to("meta"), sin.detach().to("meta"))
    assert monkey.shape == x.shape and monkey.is_contiguous()


def test_zoo_llama_fuses_its_interleaved_rotary():
    from autopar.frontend.trace import trace
    from autopar.models import ZOO
    g = trace(*ZOO["llama"](), kernels=True)
    assert g.fused == {"rms_norm": 5, "swiglu": 2, "rotary": 4, "linear_cross_entropy": 1}
    nodes = list(g.gm.graph.nodes)
    assert sum(str(n.target) == "autopar.rotary_interleaved.default" for n in nodes) == 4
    assert not any(n.target is torch.ops.aten.stack.default for n in nodes)


# ------------------------------------------------------------------------------ the operator
@pytest.mark.parametrize("triton_body", [True, False])
def test_rotary_operator_bodies_and_fake(device, monkeypatch, triton_body):
    from runtime.kernels import ops
    if not triton_body:   # the plain-torch bodies (meta, a CPU without the interpreter)
        monkeypatch.setattr(ops, "use_triton", lambda x: False)
    torch.manual_seed(3)
    x = torch.randn(2, 7, 3, 16, device=device).transpose(1, 2).requires_grad_()
    cos, sin = (t.requires_grad_() for t in _tables(2, 7, 16, torch.float32, device))
    reset_kernel_stats()
    y = ops.ROTARY(x, cos, sin)
    r = rotary_reference(x, cos, sin)
    torch.testing.assert_close(y, r, **TOL[torch.float32])
    dy = torch.randn_like(r)
    for a, b in zip(torch.autograd.grad(y, [x, cos, sin], dy), torch.autograd.grad(r, [x, cos, sin], dy)):
        torch.testing.assert_close(a, b, **TOL[torch.float32])
    assert kernel_stats()["rotary"] == (2 if triton_body else 0)
    meta = ops.ROTARY(x.to("meta"), cos.to("meta"), sin.to("meta").to(torch.float64))
    assert meta.shape == x.shape and meta.dtype == torch.float64


def test_rotary_operator_saves_only_the_tables():
    """x is not kept for backward (the rotation's transpose needs cos and sin only), unless the
    tables need a gradient."""
    from autopar.pricing.saved_probe import saved_bytes
    from runtime.kernels import ops
    x = torch.randn(2, 4, 8, 16, requires_grad=True)
    cos, sin = _tables(1, 8, 16, torch.float32, "cpu")
    assert saved_bytes(lambda: ops.ROTARY(x, cos, sin)) == 2 * cos.numel() * 4
    cg, sg = cos.clone().requires_grad_(), sin.clone().requires_grad_()
    assert saved_bytes(lambda: ops.ROTARY(x, cg, sg)) == 2 * cos.numel() * 4 + x.numel() * 4


# ------------------------------------------------------------------------------ fusion and plans
def _hf_llama(**kw):
    pytest.importorskip("transformers")
    from autopar.models import HF_ZOO
    return HF_ZOO["hf_llama"](**kw)


def test_hugging_face_llama_fuses_rotary_on_q_and_k():
    from autopar.frontend.trace import trace
    model, batch = _hf_llama()
    g = trace(model, batch, kernels=True)
    assert g.fused == {"rms_norm": 5, "swiglu": 2, "rotary": 4, "linear_cross_entropy": 1}   # 2 layers: q and k each
    aten = torch.ops.aten
    nodes = list(g.gm.graph.nodes)
    assert not any(n.target in (aten.neg.default,) for n in nodes)   # rotate_half is gone
    for n in nodes:
        if str(n.target) == "autopar.rotary.default":
            assert tuple(n.meta["val"].shape) == tuple(n.args[0].meta["val"].shape)
            assert "self_attn" in str(n.meta.get("nn_module_stack", "")), n.meta.keys()


def test_rotary_fuses_in_any_operand_order_but_not_with_an_intermediate_read_elsewhere():
    import torch.nn as nn

    from autopar.frontend.trace import trace

    def rotate_half(x):
        return torch.cat((-x[..., 4:], x[..., :4]), dim=-1)

    class Net(nn.Module):
        def __init__(self, leak, swap=False):
            super().__init__()
            self.lin, self.leak, self.swap = nn.Linear(8, 8), leak, swap
            cos, sin = _tables(1, 6, 8, torch.float32, "cpu")
            self.register_buffer("cos", cos[0, 0])
            self.register_buffer("sin", sin[0, 0])

        def forward(self, x):
            h = self.lin(x)
            r = rotate_half(h)
            y = (self.sin * r + self.cos * h) if self.swap else (h * self.cos + r * self.sin)
            return (y.sum() + r.sum()) if self.leak else y.sum()

    x = torch.randn(3, 6, 8)
    assert trace(Net(False), (x,), kernels=True).fused == {"rotary": 1}
    assert trace(Net(False, swap=True), (x,), kernels=True).fused == {"rotary": 1}   # operands in any order
    assert trace(Net(True), (x,), kernels=True).fused == {}
    net = Net(False, swap=True)
    g = trace(net, (x,), kernels=True)
    (rot,) = [n for n in g.gm.graph.nodes if str(n.target) == "autopar.rotary.default"]
    assert rot.args[0].target is torch.ops.aten.linear.default   # x, then cos, then sin
    assert [a.name for a in rot.args[1:]] == [g.gm.graph.find_nodes(op="placeholder")[i].name
                                             for i in (2, 3)], rot.args


@pytest.mark.parametrize("constraints", [{"tp": 2}, {"tp": 2, "sp": 2, "sp_mode": "megatron"},
                                         {"sp": 2, "sp_mode": "ulysses"}, {"tp_mode": "2d"}],
                         ids=["tp", "megatron-sp", "ulysses", "2d"])
def test_rotary_plans_never_split_the_head_dim(constraints):
    import autopar
    devices = 4 if "tp_mode" in constraints else 2
    model, batch = _hf_llama()
    plan = autopar.plan(model, batch, autopar.Cluster.preset("dgx-a100", devices=devices), constraints=constraints,
                        kernels="triton")
    rot = [o for o in plan.ops if o["target"] == "autopar.rotary.default"]
    assert len(rot) == 4
    for o in rot:
        if "tp_mode" in constraints:
            assert o["strategy"] == "2d: local", o
        else:
            assert o["inputs"][0]["dims"][-1] == [], o   # the head dim whole


def test_rotary_plan_saves_what_the_fused_program_saves(monkeypatch):
    """The priced saved bytes of Hugging Face Llama traced with the kernels (one device) equal the
    bytes autograd keeps running that fused graph (rotary keeps cos and sin, not q and k), and equal
    the same trace with rotary left unfused (there too only the tables are kept: the products
    with the tables keep the tables, neg / cat / slice nothing)."""
    import autopar.frontend.fuse as fuse_mod
    from autopar.cluster import Cluster
    from autopar.frontend.trace import trace
    from autopar.mesh import Mesh
    from autopar.pricing.price import Settings, price
    from autopar.pricing.saved_probe import saved_bytes
    from autopar.rules.candidates import candidates

    def predicted(graph):
        c = candidates(graph, Mesh((1,), ("dp",), devices_per_node=1))
        P = price(c, Cluster.preset("cpu", devices=1), Settings(optimizer="sgd", precision="fp32"), edges=False)
        return sum(float(arr[0]) for arr in P.saved.values() if len(arr))

    def measured(graph):
        names = [n.name for n in graph.gm.graph.nodes if n.op == "placeholder"]
        params = [graph.value_of(model, graph.param_fqn[n]) for n in names if n in graph.param_fqn]
        args = params + list(batch)
        assert len(args) == len(names)
        return saved_bytes(lambda: graph.gm(*args), exclude=params)

    model, batch = _hf_llama()
    fused = trace(model, batch, kernels=True)
    assert fused.fused["rotary"] == 4
    pred = predicted(fused)
    assert pred == pytest.approx(measured(fused), rel=0.02)
    monkeypatch.setattr(fuse_mod, "_rotary_match", lambda node: None)
    unfused = trace(model, batch, kernels=True)
    assert "rotary" not in unfused.fused
    assert pred == pytest.approx(predicted(unfused), rel=1e-9)
    assert pred == pytest.approx(measured(unfused), rel=0.02)


def test_fused_rotary_is_priced_as_one_memory_bound_pass(monkeypatch):
    """One op reading x, cos and sin and writing y (3 flops an element: memory-bound): the plan with
    rotary fused is faster than the same plan with its seven ops (mul, two slices, neg, cat, mul,
    add), each a kernel launch and a pass over q or k."""
    import autopar
    import autopar.frontend.fuse as fuse_mod
    from autopar.frontend.trace import trace
    from autopar.rules.ops_kernels import rotary as rule

    model, batch = _hf_llama(device="meta", seq=256, batch=4, d_model=1024, n_head=16, n_kv_heads=8,
                             ffn_hidden=2816)
    cluster = autopar.Cluster.preset("dgx-a100", devices=1)
    g = trace(model, batch, kernels=True)
    node = next(n for n in g.gm.graph.nodes if str(n.target) == "autopar.rotary.default")
    spec = rule(node)
    x, cos, sin = (a.meta["val"] for a in node.args)
    assert spec.bytes == 4 * (2 * x.numel() + cos.numel() + sin.numel())   # fp32: x, y, cos, sin
    assert spec.flops == 3 * x.numel() and spec.unsplittable >= {spec.inputs[0][-1]}
    fused = autopar.plan(model, batch, cluster, traced=g)
    monkeypatch.setattr(fuse_mod, "_rotary_match", lambda node: None)
    unfused = autopar.plan(model, batch, cluster, traced=trace(model, batch, kernels=True))
    assert fused.step_time < unfused.step_time, (fused.step_time, unfused.step_time)


def _rank0_saved(kernels, precision, constraints, devices, **kw):
    """(predicted, measured) activation bytes of rank 0 of a plan of hf_llama on meta, the program
    run under CUDA kernels (tests/helpers/saved_activations.py)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    import autopar
    from autopar.frontend.trace import trace
    from helpers.saved_activations import rank_saved_bytes
    model, inputs = _hf_llama(device="meta", **kw)
    plan = autopar.plan(model, inputs, autopar.Cluster.preset("dgx-a100", devices=devices), precision=precision,
                        kernels=kernels, constraints={**constraints, "checkpoint": "none", "num_micro_batches": 1})
    assert ("rotary" in plan.fused) == (kernels == "triton")
    traced = trace(model, inputs, kernels=kernels == "triton")
    pred = plan.data["predictions"]["memory_breakdown"]["activations"]
    return pred, rank_saved_bytes(model, inputs, plan, traced, rank=0, cuda=True)


@pytest.mark.parametrize("precision, constraints", [("fp32", {"dp": 1, "tp": 1}), ("bf16", {"dp": 1, "tp": 1}),
                                                    ("fp32", {"tp": 2})], ids=["fp32", "bf16", "tp2"])
def test_rotary_plans_saved_bytes_equal_rank_programs(precision, constraints):
    """Plans with the rotary kernel: the predicted activations equal what rank 0's program saves
    (within 2%; measured 0.003% apart)."""
    pred, meas = _rank0_saved("triton", precision, constraints, constraints.get("tp", 1),
                              seq=32, batch=2, d_model=128, n_head=4, ffn_hidden=352)
    assert pred == pytest.approx(meas, rel=2e-2)


def test_rotary_split_on_the_sequence_adds_no_memory_error():
    """Ulysses (rotary split on the sequence, cos / sin too): the prediction is off by the same
    bytes with the kernels as with torch ops (17 KB of 0.7-0.9 MB, from elsewhere in the program)."""
    errs = {}
    for k in ("torch", "triton"):
        pred, meas = _rank0_saved(k, "fp32", {"sp": 2, "sp_mode": "ulysses"}, 2)
        errs[k] = pred - meas
    assert errs["triton"] == errs["torch"], errs


# ------------------------------------------------------------------------------ training

@pytest.mark.slow
@pytest.mark.parametrize("name, world, constraints, families",
                         [("hf_llama", 1, {}, ("rotary", "rms_norm", "swiglu")),
                          ("hf_llama", 2, {"dp": 2}, ("rotary", "rms_norm", "swiglu")),
                          ("hf_llama", 2, {"tp": 2}, ("rotary", "rms_norm", "swiglu")),
                          ("hf_llama", 2, {"tp": 2, "sp": 2, "sp_mode": "megatron"}, ("rotary",)),
                          ("hf_llama", 2, {"sp": 2, "sp_mode": "ulysses"}, ("rotary",)),
                          ("hf_llama", 4, {"tp_mode": "2d", "tp_shape": [2, 2]}, ("rotary", "swiglu")),
                          ("hf_gpt_neox", 1, {}, ("rotary", "layer_norm")),
                          ("llama", 1, {}, ("rotary", "rms_norm", "swiglu"))],
                         ids=["hf_llama-1-process", "hf_llama-dp", "hf_llama-tp", "hf_llama-megatron-sp",
                              "hf_llama-ulysses", "hf_llama-2d", "hf_gpt_neox-partial-rotary",
                              "llama-interleaved"])
def test_hugging_face_models_train_with_the_rotary_kernel_equal_to_torch_ops(name, world, constraints, families):
    """Hugging Face Llama (full-head rotary) and GPT-NeoX (rotary_pct 0.25: the kernel on the
    rotated slice of each head) trained with the kernels equal to torch ops; Megatron-SP splits the
    rotary on heads, Ulysses on the sequence (cos and sin with it); on the 2D grid (4 ranks) it runs
    locally on each rank's blocks. The zoo's Llama (interleaved rotary): its plan kinds are trained
    in test_kernels_training.py; here one process."""
    from tests.runtime.kernels.test_kernels_training import _check_equal
    needs_kernels()
    pytest.importorskip("transformers")
    from tests.helpers.kernels import TINY
    sizes = {} if "tp_mode" in constraints else TINY   # the grid's 4 ranks: the zoo's batch and sequence
    _check_equal(world, constraints, name=name, families=families, sizes=sizes)
