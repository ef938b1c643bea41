"""Every kernel compiled for and run on a CUDA device (not the interpreter), fp32 and bf16, at
moderate Llama-like sizes, against its reference; skipped without CUDA.

Tolerances as in the interpreter tests (per kernel), the bf16 ones at 2 ulps of bf16."""
from __future__ import annotations

import pytest
import torch

from runtime.kernels import available, interpreted, kernel_stats, reset_kernel_stats
from runtime.kernels.adamw import adamw_reference, adamw_step
from runtime.kernels.geglu import geglu, geglu_reference
from runtime.kernels.layer_norm import layer_norm, layer_norm_reference
from runtime.kernels.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from runtime.kernels.rms_norm import rms_norm, rms_norm_reference
from runtime.kernels.swiglu import swiglu, swiglu_reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _rel_close(a, b, rel, what):
    a, b = a.float(), b.float()
    err = (a - b).abs().max().item()
    scale = b.abs().max().item()
    assert err <= rel * scale + 1e-6, f"{what}: max abs diff {err} > {rel} * {scale}"


def test_compiled_not_interpreted():
    assert available() and not interpreted()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [67, 2048, 4096])
def test_rms_norm_cuda(dtype, hidden):
    torch.manual_seed(0)
    x = torch.randn(513, hidden, device="cuda", dtype=dtype, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).requires_grad_()
    reset_kernel_stats()
    y, h = rms_norm(x, w, 1e-5, r)
    yr, hr = rms_norm_reference(x, w, 1e-5, r)
    torch.testing.assert_close(y, yr, **TOL[dtype])
    torch.testing.assert_close(h, hr, **TOL[dtype])
    gy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, w, r], gy)
    want = torch.autograd.grad(yr, [x, w, r], gy)
    torch.testing.assert_close(got[0], want[0], **TOL[dtype])
    _rel_close(got[1], want[1], 1e-4 if dtype == torch.float32 else 2e-2, "dw")
    torch.testing.assert_close(got[2], want[2], **TOL[dtype])
    assert kernel_stats()["rms_norm"] == 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_cuda(dtype):
    torch.manual_seed(0)
    g = torch.randn(1000, 1377, device="cuda", dtype=dtype, requires_grad=True)
    u = torch.randn(1000, 1377, device="cuda", dtype=dtype, requires_grad=True)
    reset_kernel_stats()
    y = swiglu(g, u)
    yr = swiglu_reference(g, u)
    torch.testing.assert_close(y, yr, **TOL[dtype])
    dy = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, [g, u], dy), torch.autograd.grad(yr, [g, u], dy)):
        torch.testing.assert_close(a, b, **TOL[dtype])
    assert kernel_stats()["swiglu"] == 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [67, 2048])
def test_layer_norm_cuda(dtype, hidden):
    torch.manual_seed(0)
    x = (1 + torch.randn(513, hidden, device="cuda")).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(hidden, device="cuda")).requires_grad_()
    b = (0.1 * torch.randn(hidden, device="cuda")).requires_grad_()
    reset_kernel_stats()
    y = layer_norm(x, w, b, 1e-5)
    yr = layer_norm_reference(x, w, b, 1e-5)
    torch.testing.assert_close(y, yr, **TOL[dtype])
    gy = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, w, b], gy)
    want = torch.autograd.grad(yr, [x, w, b], gy)
    torch.testing.assert_close(got[0], want[0], **TOL[dtype])
    _rel_close(got[1], want[1], 1e-4 if dtype == torch.float32 else 2e-2, "dweight")
    _rel_close(got[2], want[2], 1e-4 if dtype == torch.float32 else 2e-2, "dbias")
    assert kernel_stats()["layer_norm"] == 2


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_geglu_cuda(dtype, approximate):
    torch.manual_seed(0)
    g = (3 * torch.randn(1000, 1377, device="cuda")).to(dtype).requires_grad_()
    u = torch.randn(1000, 1377, device="cuda", dtype=dtype, requires_grad=True)
    reset_kernel_stats()
    y = geglu(g, u, approximate)
    yr = geglu_reference(g, u, approximate)
    torch.testing.assert_close(y, yr, **TOL[dtype])
    dy = torch.randn_like(y)
    for a, c in zip(torch.autograd.grad(y, [g, u], dy), torch.autograd.grad(yr, [g, u], dy)):
        torch.testing.assert_close(a, c, **TOL[dtype])
    assert kernel_stats()["geglu"] == 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_cross_entropy_cuda(dtype):
    torch.manual_seed(0)
    n, d, v = 1000, 512, 32003
    hidden = torch.randn(n, d, device="cuda").to(dtype)
    weight = (0.05 * torch.randn(v, d, device="cuda")).to(dtype)
    targets = torch.randint(0, v, (n,), device="cuda")
    targets[::11] = -100
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    reset_kernel_stats()
    loss = linear_cross_entropy(h, w, targets, chunk_rows=256)
    loss.backward()
    hr = hidden.float().requires_grad_()
    wr = weight.float().requires_grad_()
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = linear_cross_entropy_reference(hr, wr, targets)
        ref.backward()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    rel = 1e-4 if dtype == torch.float32 else 2e-2
    _rel_close(loss, ref, rel, "loss")
    _rel_close(h.grad, hr.grad, rel, "grad_hidden")
    _rel_close(w.grad, wr.grad, rel, "grad_weight")
    assert kernel_stats()["linear_cross_entropy"] == 2 * 4


def test_adamw_cuda():
    torch.manual_seed(0)
    n = 1_000_003
    start = [torch.randn(n, device="cuda"), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")]
    ours = [t.clone() for t in start]
    theirs = [t.clone() for t in start]
    reset_kernel_stats()
    for step in (1, 2, 3):
        grad = torch.randn(n, device="cuda")
        adamw_step(ours[0], grad, ours[1], ours[2], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, step=step)
        adamw_reference(theirs[0], grad.clone(), theirs[1], theirs[2], lr=1e-3, betas=(0.9, 0.95),
                        weight_decay=0.1, step=step)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert kernel_stats()["adamw"] == 3


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_cuda(dtype, head_dim):
    """q of a Llama-like attention ([b, s, h, d] transposed to [b, h, s, d]), Hugging Face's cos/sin."""
    from runtime.kernels.rotary import rotary, rotary_reference
    torch.manual_seed(0)
    b, s, h = 4, 513, 8
    x = torch.randn(b, s, h, head_dim, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
    inv = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim)
    ang = torch.cat([torch.arange(s, device="cuda").float()[:, None] * inv] * 2, -1)
    cos, sin = ang.cos().to(dtype)[None, None], ang.sin().to(dtype)[None, None]
    reset_kernel_stats()
    y = rotary(x, cos, sin)
    yr = rotary_reference(x, cos, sin)
    assert y.stride() == torch.empty_like(x).stride()   # laid out as x
    torch.testing.assert_close(y, yr, **TOL[dtype])
    dy = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(yr, x, dy)[0], **TOL[dtype])
    assert kernel_stats()["rotary"] == 2


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_interleaved_cuda(dtype):
    """The zoo Llama's form: pairs (2i, 2i + 1), tables [s, d/2]; output contiguous."""
    from runtime.kernels.ops import ROTARY_INTERLEAVED
    from runtime.kernels.rotary import rotary_interleaved_reference
    torch.manual_seed(0)
    b, s, h, d = 4, 513, 8, 128
    x = torch.randn(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
    ang = torch.arange(s, device="cuda").float()[:, None] / 10000.0 ** (torch.arange(0, d, 2, device="cuda") / d)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    reset_kernel_stats()
    y = ROTARY_INTERLEAVED(x, cos, sin)
    yr = rotary_interleaved_reference(x, cos, sin)
    assert y.is_contiguous()
    torch.testing.assert_close(y, yr, **TOL[dtype])
    dy = torch.randn_like(y)
    torch.testing.assert_close(torch.autograd.grad(y, x, dy)[0], torch.autograd.grad(yr, x, dy)[0], **TOL[dtype])
    assert kernel_stats()["rotary"] == 2
