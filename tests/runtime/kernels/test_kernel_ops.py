"""The RMSNorm, LayerNorm and GeGLU custom operators (runtime/kernels/ops.py) and their fusion
(autopar/frontend/fuse.py): the operator equals its plain-torch reference forward and backward,
through the Triton kernels (interpreter) and through the torch body (``use_triton`` off, as on a
CPU without the interpreter); the fake impls give the statistics' shapes; fusion rewrites
aten.layer_norm, aten.native_layer_norm (only its output read) and gelu(gate) * up, and leaves a
norm without a bias, or one whose statistics are read, alone.

Tolerances: fp32, 1e-5 (abs and rel) for outputs and dx / dgate / dup, 1e-4 for dweight / dbias."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import runtime.kernels.ops as O
from autopar.frontend.fuse import fuse
from runtime.kernels import kernel_stats, reset_kernel_stats

aten = torch.ops.aten


@pytest.fixture(params=["triton", "torch"])
def path(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(O, "use_triton", lambda x: False)
    reset_kernel_stats()
    return request.param


def test_layer_norm_op_matches_reference(device, path):
    torch.manual_seed(0)
    x = (1 + 2 * torch.randn(3, 5, 37, device=device)).requires_grad_()
    w = torch.randn(37, device=device, requires_grad=True)
    b = torch.randn(37, device=device, requires_grad=True)
    y = O.LAYER_NORM(x, w, b, 1e-5)
    ref = F.layer_norm(x, (37,), w, b, 1e-5)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(ref)
    got, want = torch.autograd.grad(y, [x, w, b], dy), torch.autograd.grad(ref, [x, w, b], dy)
    for name, a, c in zip(("dx", "dweight", "dbias"), got, want):
        tol = 1e-5 if name == "dx" else 1e-4
        torch.testing.assert_close(a, c, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")
    assert kernel_stats()["layer_norm"] == (2 if path == "triton" else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_op_matches_reference(device, path, dtype):
    """One output; the backward kernel recomputes rstd from x (no statistic saved). bf16: 2e-2,
    its dweight 5e-2."""
    torch.manual_seed(0)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    x = torch.randn(3, 5, 37, device=device).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(37, device=device)).requires_grad_()
    y = O.RMS_NORM(x, w, 1e-6)
    xf = x.float()
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    assert y.dtype == torch.float32   # promote(x, weight), as the decomposed norm's
    torch.testing.assert_close(y, ref, **tol)
    dy = torch.randn_like(ref)
    got, want = torch.autograd.grad(y, [x, w], dy), torch.autograd.grad(ref, [x, w], dy)
    for name, a, c in zip(("dx", "dweight"), got, want):
        dw_tol = 1e-4 if dtype == torch.float32 else 5e-2   # a sum over rows
        t = tol if name == "dx" else dict(rtol=dw_tol, atol=dw_tol)
        torch.testing.assert_close(a, c, **t, msg=lambda m: f"{name}: {m}")
    assert kernel_stats()["rms_norm"] == (2 if path == "triton" else 0)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_geglu_op_matches_reference(device, path, approximate):
    torch.manual_seed(0)
    gate = (3 * torch.randn(7, 45, device=device)).requires_grad_()
    up = torch.randn(7, 45, device=device, requires_grad=True)
    y = O.GEGLU(gate, up, approximate)
    ref = F.gelu(gate, approximate=approximate) * up
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(ref)
    got, want = torch.autograd.grad(y, [gate, up], dy), torch.autograd.grad(ref, [gate, up], dy)
    for name, a, c in zip(("dgate", "dup"), got, want):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert kernel_stats()["geglu"] == (2 if path == "triton" else 0)


def test_fake_impls_give_shapes_and_dtypes():
    x = torch.empty(2, 3, 8, device="meta", dtype=torch.bfloat16)
    w = torch.empty(8, device="meta")
    y = O.LAYER_NORM(x, w, w, 1e-5)
    assert y.shape == x.shape and y.dtype == torch.bfloat16
    assert O.GEGLU(x, x, "tanh").shape == x.shape
    assert torch.Tag.pointwise in O.GEGLU.tags   # elementwise: the grid runs it on each rank's blocks


def _graph(fn, *inputs) -> fx.GraphModule:
    gm = fx.symbolic_trace(fn)
    FakeTensorProp(gm).propagate(*inputs)
    return gm


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_fusion_reads_keyword_arguments():
    def f(x, w, b, gate, up):
        y = aten.layer_norm.default(x, [8], w, b, eps=0.5)   # an eps far from the default
        return y, aten.mul.Tensor(aten.gelu.default(gate, approximate="tanh"), up)

    inputs = (torch.randn(4, 8), torch.randn(8), torch.randn(8), torch.randn(4, 6), torch.randn(4, 6))
    gm = _graph(f, *inputs)
    want = gm(*inputs)
    assert fuse(gm) == {"layer_norm": 1, "geglu": 1}
    for a, c in zip(gm(*inputs), want):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


def test_fusion_of_native_layer_norm_and_geglu_keeps_the_result():
    def f(x, w, b, gate, up):
        y = aten.native_layer_norm.default(x, [8], w, b, 1e-5)[0]
        return y, aten.mul.Tensor(aten.gelu.default(gate, approximate="tanh"), up)

    inputs = (torch.randn(4, 8), torch.randn(8), torch.randn(8), torch.randn(4, 6), torch.randn(4, 6))
    gm = _graph(f, *inputs)
    want = gm(*inputs)
    assert fuse(gm) == {"layer_norm": 1, "geglu": 1}
    assert O.LAYER_NORM in _targets(gm) and O.GEGLU in _targets(gm)
    assert aten.native_layer_norm.default not in _targets(gm) and aten.gelu.default not in _targets(gm)
    for a, c in zip(gm(*inputs), want):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


def test_norms_the_kernel_does_not_cover_stay_unfused():
    def f(x, w, b):
        no_bias = aten.layer_norm.default(x, [8], w, None, 1e-5)
        two_dims = aten.layer_norm.default(x, [4, 8], None, None, 1e-5)
        out, mean, rstd = aten.native_layer_norm.default(x, [8], w, b, 1e-5)
        return no_bias, two_dims, out, mean    # the statistics read: not fused

    gm = _graph(f, torch.randn(2, 4, 8), torch.randn(8), torch.randn(8))
    assert fuse(gm) == {}
    assert O.LAYER_NORM not in _targets(gm)
