"""Softmax kernels (runtime/kernels/softmax.py) against softmax_reference and torch's softmax:
output and gradient, fp32 and bf16, odd row lengths (S = 7, 13: not powers of two), masked rows
(-inf, as a causal masked_fill writes), non-contiguous input; the fused operator
``autopar.softmax`` (runtime/kernels/ops.py) and its fusion in explicit attention
(autopar/frontend/fuse.py), and training with it equal to torch ops.

Tolerances: fp32 1e-5 (abs and rel); bf16 2e-2 (the interpreter rounds fp32 -> bf16 by
truncation, CUDA to nearest)."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.frontend.trace import trace
from autopar.models import ZOO
from runtime.kernels import kernel_stats, reset_kernel_stats
from runtime.kernels import ops as K
from runtime.kernels.softmax import softmax, softmax_reference
from runtime.launch import run_local
from tests.helpers.kernels import TINY, TRAIN_STEPS, needs_kernels, warm_up_planning

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP otherwise

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _causal(x):
    s, t = x.shape[-2:]
    keep = torch.ones(s, t, dtype=torch.bool, device=x.device).tril()
    return x.masked_fill(~keep, float("-inf"))


def _check(x, fn=softmax):
    y = fn(x)
    r = softmax_reference(x)
    assert y.dtype == r.dtype and y.shape == r.shape
    torch.testing.assert_close(y, r, **TOL[x.dtype])
    dy = torch.randn_like(r)
    (got,) = torch.autograd.grad(y, [x], dy)
    (want,) = torch.autograd.grad(torch.softmax(x.float(), -1).to(x.dtype), [x], dy)
    torch.testing.assert_close(got, want, **TOL[x.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("s", [7, 13])
def test_softmax_matches_reference(device, dtype, s):
    torch.manual_seed(0)
    x = _causal(3 * torch.randn(2, 3, s, s, device=device, dtype=dtype)).detach().requires_grad_()
    reset_kernel_stats()
    _check(x)
    assert kernel_stats()["softmax"] == 2   # forward and backward


def test_softmax_non_contiguous_input(device):
    torch.manual_seed(1)
    x = torch.randn(2, 13, 3, 7, device=device).transpose(1, 2).requires_grad_()   # [2, 3, 13, 7], strided
    assert not x.is_contiguous()
    _check(x)


def test_fully_masked_row_is_nan_as_torch():
    x = torch.zeros(2, 5)
    x[1] = float("-inf")
    y = softmax(x)
    assert torch.isnan(y[1]).all() and torch.isnan(torch.softmax(x, -1)[1]).all()
    torch.testing.assert_close(y[0], torch.full((5,), 0.2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_operator_matches_torch(device, dtype):
    torch.manual_seed(2)
    x = _causal(torch.randn(3, 13, 13, device=device, dtype=dtype)).detach().requires_grad_()
    reset_kernel_stats()
    _check(x, K.SOFTMAX)
    assert kernel_stats()["softmax"] == 2
    meta = K.SOFTMAX(torch.empty(3, 7, device="meta", dtype=dtype))   # planning: the plain-torch body
    assert meta.shape == (3, 7) and meta.dtype == dtype


def test_explicit_attention_softmax_is_fused_and_planned():
    """GPT-2 with explicit attention: masked_fill(scores, ~causal, -inf) -> softmax(-1) becomes
    autopar.softmax (one per layer); SDPA attention has no softmax to fuse. The fused softmax is
    still the attention core's anchor (autopar/rules/attention_core.py) and keeps its last dim whole."""
    from autopar.rules.attention_core import is_anchor
    model, batch = ZOO["gpt2"](attention="explicit")
    traced = trace(model, batch, kernels=True)
    nodes = [n for n in traced.gm.graph.nodes if n.target is K.SOFTMAX]
    assert len(nodes) == 2 and all(is_anchor(n) for n in nodes)
    assert not any(n.target in (torch.ops.aten.softmax.int, torch.ops.aten._softmax.default)
                   for n in traced.gm.graph.nodes)
    assert "softmax" not in trace(*ZOO["gpt2"](), kernels=True).fused
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2), constraints={"tp": 2},
                        kernels="triton")
    assert plan.fused == {"layer_norm": 5, "softmax": 2, "linear_cross_entropy": 1}
    ops = [o for o in plan.ops if o["target"] == "autopar.softmax.default"]
    assert len(ops) == 2


def _train(rank, world, constraints, kernels):
    import runtime.kernels as RK
    torch.manual_seed(0)
    model, batch = ZOO["gpt2"](attention="explicit", **TINY)   # softmax rows of 8: the block whole
    compiled = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), batch, optimizer="sgd", lr=0.5,
                               momentum=0.9, plan_options={"constraints": constraints}, kernels=kernels)
    RK.reset_kernel_stats()
    losses = [compiled.step(*batch) for _ in range(TRAIN_STEPS)]
    state = {k: v.detach().float().numpy().copy() for k, v in compiled.full_state_dict().items()}
    return losses, state, compiled.kernel_stats()


@pytest.mark.slow
@pytest.mark.parametrize("world, constraints", [(1, {}), (2, {"dp": 2}), (2, {"tp": 2})], ids=["one", "dp", "tp"])
def test_training_with_the_softmax_kernel_equals_torch_ops(world, constraints):
    needs_kernels()
    warm_up_planning()
    ref = run_local(_train, world, (constraints, "torch"), timeout=600)[0]
    assert len(ref[0]) == TRAIN_STEPS
    for losses, state, stats in run_local(_train, world, (constraints, "triton"), timeout=600):
        assert stats["softmax"] > 0 and stats["layer_norm"] > 0, stats
        for a, b in zip(losses, ref[0]):
            assert abs(a - b) < 1e-4 * max(1.0, abs(b)), (losses, ref[0])
        for k, v in ref[1].items():
            torch.testing.assert_close(torch.from_numpy(state[k]), torch.from_numpy(v), atol=1e-4, rtol=1e-4, msg=k)


@pytest.mark.slow
def test_hf_bloom_eager_attention_trains_with_the_softmax_kernel_equal_to_torch_ops():
    """BLOOM's eager attention (ALiBi scores, softmax in x's dtype) gets its 2 softmaxes fused."""
    pytest.importorskip("transformers")
    from tests.runtime.kernels.test_kernels_training import _check_equal
    needs_kernels()
    _check_equal(1, {}, name="hf_bloom", families=("layer_norm", "softmax"))
