"""Dropout fused with the residual add (runtime/kernels/dropout_add.py, ``autopar.dropout_add``).

The kernel draws its mask from Triton's Philox keyed by (seed, flat index); ``philox_reference``
is the same generator in plain torch, so the kernel and the reference are compared bit for bit on
the mask (fp32 outputs exactly, bf16 within 2e-2: the interpreter truncates fp32 -> bf16). The mask
is NOT torch's dropout stream: training with kernels="triton" and dropout active cannot equal
kernels="torch" (aten.dropout). What is checked instead: on 1 and 2 gloo ranks (dp, tp) the
Triton plan trains equal to the same fused plan run by the ops' plain-torch bodies (the reference
mask), tensor-parallel replicas draw the same mask (parameters stay identical), the loss
decreases, and a region recomputed under activation checkpointing draws
the mask again (the same gradients as without checkpointing)."""
from __future__ import annotations


import pytest
import torch
import torch.nn as nn

import autopar
import runtime.rng as RNG
from autopar.frontend.trace import trace
from runtime.kernels import kernel_stats, reset_kernel_stats
from runtime.kernels import ops as K
from runtime.kernels.dropout_add import (BLOCK, dropout_add, dropout_add_reference, keep_mask_reference,
                                         philox_reference, scale_of)
from runtime.launch import run_local
from tests.helpers.kernels import needs_kernels

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP otherwise

TOL = {torch.float32: dict(rtol=0, atol=0), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _seed(v=0x1234_5678_9ABC_DEF):
    return torch.tensor([v], dtype=torch.int64)


def test_philox_reference_is_tritons_philox(device):
    """tl.randint's words (a one-block kernel) equal philox_reference's bit for bit."""
    import triton
    import triton.language as tl

    @triton.jit
    def words(SEED, OUT, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(OUT + offs, tl.randint(tl.load(SEED), offs).to(tl.int64) & 0xFFFFFFFF, mask=offs < n)

    for v in (0, 1, 2 ** 62 - 1, 0x1234_5678_9ABC_DEF):
        out = torch.empty(100, dtype=torch.int64, device=device)
        words[(1,)](_seed(v).to(device), out, 100, BLOCK=128)
        assert torch.equal(out.cpu(), philox_reference(_seed(v), 100)), v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 7, 13), (3, 13, 7)])
def test_dropout_add_matches_reference(device, dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    r = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    seed = _seed().to(device)
    reset_kernel_stats()
    y = dropout_add(x, r, 0.3, seed)
    want = dropout_add_reference(x, r, 0.3, seed)
    torch.testing.assert_close(y, want, **TOL[dtype])
    dy = torch.randn_like(y)
    dx, dr = torch.autograd.grad(y, [x, r], dy)
    keep = keep_mask_reference(seed, shape, 0.3)
    torch.testing.assert_close(dx, torch.where(keep, dy.float() * scale_of(0.3), 0.0).to(dtype), **TOL[dtype])
    assert torch.equal(dr, dy)
    assert kernel_stats()["dropout_add"] == 2


def test_mask_rate_scale_and_seeds():
    n = 4 * BLOCK + 3
    x, r = torch.ones(n), torch.zeros(n)
    y = dropout_add(x, r, 0.25, _seed(7))
    kept = y != 0
    assert abs(kept.float().mean().item() - 0.75) < 0.03
    torch.testing.assert_close(y[kept], torch.full_like(y[kept], 1 / 0.75))
    assert torch.equal(y, dropout_add(x, r, 0.25, _seed(7)))        # a replica / a recomputation
    assert not torch.equal(y, dropout_add(x, r, 0.25, _seed(8)))    # another block
    assert torch.equal(dropout_add(x, r, 0.0, _seed(7)), x)         # p = 0 keeps everything


def test_non_contiguous_inputs(device):
    torch.manual_seed(1)
    x = torch.randn(13, 7, device=device).t().requires_grad_()
    r = torch.randn(7, 26, device=device)[:, ::2]
    assert not x.is_contiguous() and not r.is_contiguous()
    seed = _seed().to(device)
    torch.testing.assert_close(dropout_add(x, r, 0.5, seed), dropout_add_reference(x, r, 0.5, seed), rtol=0, atol=0)


def test_operator_draws_its_seed_from_the_seeded_generator():
    """Under runtime.rng.seeded (what a rank's program wraps random ops in) the same key gives the
    same mask, another block key another one; the user's stream does not move. The plain-torch body
    (the ops on meta, or without Triton) draws the same mask as the kernel."""
    RNG.set_seed(3)
    x, r = torch.randn(8, 13), torch.randn(8, 13)
    op = K.DROPOUT_ADD
    state = torch.get_rng_state()
    reset_kernel_stats()
    a = RNG.seeded(op, 1, 5, ((0, 0),), x, r, 0.5, True)
    assert kernel_stats()["dropout_add"] == 1
    assert torch.equal(a, RNG.seeded(op, 1, 5, ((0, 0),), x, r, 0.5, True))
    assert not torch.equal(a, RNG.seeded(op, 1, 5, ((0, 1),), x, r, 0.5, True))
    assert torch.equal(state, torch.get_rng_state())
    K_use = K.use_triton
    try:
        K.use_triton = lambda t: False
        assert torch.equal(a, RNG.seeded(op, 1, 5, ((0, 0),), x, r, 0.5, True))
    finally:
        K.use_triton = K_use
    assert torch.equal(op(x, r, 0.0, True), r + x) and torch.equal(op(x, r, 0.5, False), r + x)
    assert op(torch.empty(4, 5, device="meta"), torch.empty(4, 5, device="meta"), 0.1, True).shape == (4, 5)


class Block(nn.Module):
    def __init__(self, d, p):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(self.fc2(torch.relu(self.fc1(x))))


class Net(nn.Module):
    """Two residual MLP blocks, each x + dropout(mlp(x)), as a transformer's residual stream."""

    def __init__(self, d=32, p=0.2):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d, p) for _ in range(2)])

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return (x - y).pow(2).mean()


def _net():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return Net(), (torch.randn(8, 6, 32, generator=g), torch.randn(8, 6, 32, generator=g))


def test_fused_in_the_traced_graph_and_planned():
    model, batch = _net()
    traced = trace(model, batch, kernels=True)
    assert traced.fused == {"dropout_add": 2}
    assert not any(n.target is torch.ops.aten.dropout.default for n in traced.gm.graph.nodes)
    for b in model.blocks:
        b.drop.p = 0.0   # inactive dropout: nothing to fuse
    assert "dropout_add" not in trace(model, batch, kernels=True).fused
    model, batch = _net()
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2), constraints={"tp": 2},
                        kernels="triton")
    assert plan.fused == {"dropout_add": 2}


def _train(rank, world, constraints, kernels, reference=False):
    import runtime.kernels as RK
    if reference:   # the fused plan run by the operators' plain-torch bodies (the reference mask)
        K.use_triton = lambda t: False
    torch.manual_seed(0)
    model, batch = _net()
    compiled = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), batch, optimizer="sgd", lr=0.2,
                               momentum=0.9, plan_options={"constraints": constraints}, kernels=kernels)
    RK.reset_kernel_stats()
    losses = [compiled.step(*batch) for _ in range(4)]
    state = {k: v.detach().float().numpy().copy() for k, v in compiled.full_state_dict().items()}
    local = {k: p.detach().numpy().copy() for k, p in compiled.params.items()}
    return losses, state, compiled.kernel_stats(), local



@pytest.mark.slow
@pytest.mark.parametrize("world, constraints", [(1, {}), (2, {"dp": 2}), (2, {"tp": 2}),
                                                (2, {"dp": 2, "checkpoint": "full"})],
                         ids=["one", "dp", "tp", "dp-checkpoint"])
def test_training_with_the_kernel_equals_the_reference_mask(world, constraints):
    needs_kernels()
    ref = run_local(_train, world, (constraints, "triton", True), timeout=600)
    got = run_local(_train, world, (constraints, "triton"), timeout=600)
    for (losses, state, stats, _), (rl, rs, rstats, _) in zip(got, ref):
        assert stats["dropout_add"] > 0 and rstats["dropout_add"] == 0, (stats, rstats)
        for a, b in zip(losses, rl):
            assert abs(a - b) < 1e-5 * max(1.0, abs(b)), (losses, rl)
        assert losses[-1] < losses[0], losses
        for k, v in rs.items():
            torch.testing.assert_close(torch.from_numpy(state[k]), torch.from_numpy(v), atol=1e-5, rtol=1e-5, msg=k)
    if constraints.get("checkpoint"):   # recomputed masks: the same training as without checkpointing
        model, batch = _net()
        plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2), constraints=constraints,
                            kernels="triton")
        assert plan.data["stages"][0]["checkpoint"] == {"blocks": True}
        plain = run_local(_train, world, ({"dp": 2}, "triton"), timeout=600)
        for a, b in zip(got[0][0], plain[0][0]):
            assert abs(a - b) < 1e-5 * max(1.0, abs(b))
    if constraints.get("tp"):   # replicas: the parameters replicated over tp are identical on both ranks
        same = [k for k in got[0][3] if got[0][3][k].shape == got[1][3][k].shape
                and (got[0][3][k] == got[1][3][k]).all()]
        assert same, "no parameter replicated over tp stayed identical"


@pytest.mark.parametrize("precision,constraints", [("fp32", {"dp": 1, "tp": 1}), ("bf16", {"dp": 1, "tp": 1}),
                                                   ("fp32", {"tp": 2})], ids=["fp32", "bf16", "fp32-tp2"])
def test_saved_bytes_of_fused_softmax_and_dropout_add_equal_the_prediction(precision, constraints):
    """GPT-2 with explicit attention and dropout 0.1, Triton kernels: the fused softmax saves its
    output, dropout_add an 8-byte seed; the plan's saved activations equal what rank 0's program
    saves, run on meta under CUDA kernels (tests/helpers/saved_activations.py), within 2%."""
    from autopar.models import ZOO
    from tests.helpers.saved_activations import rank_saved_bytes

    model, inputs = ZOO["gpt2"](device="meta", seq=32, batch=2, dropout=0.1, attention="explicit")
    cluster = autopar.Cluster.preset("dgx-a100", devices=constraints.get("tp", 1))
    plan = autopar.plan(model, inputs, cluster, precision=precision, kernels="triton",
                        constraints={**constraints, "checkpoint": "none", "num_micro_batches": 1})
    assert plan.fused == {"layer_norm": 5, "softmax": 2, "dropout_add": 4, "linear_cross_entropy": 1}
    traced = trace(model, inputs, kernels=True)
    predicted = plan.data["predictions"]["memory_breakdown"]["activations"]
    measured = rank_saved_bytes(model, inputs, plan, traced, rank=0, cuda=True)
    assert predicted == pytest.approx(measured, rel=2e-2)


def test_the_grid_refuses_the_fused_dropout_as_it_refuses_atens():
    """2D tensor parallelism runs no active dropout (each rank would draw its own mask for one
    value): the fused op is refused alike, not run unseeded."""
    from codegen.grid_local import GridLoweringError
    model, batch = _net()
    with pytest.raises((GridLoweringError, autopar.PlanError), match="random op|dropout"):
        autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=4), constraints={"tp_mode": "2d"},
                     kernels="triton")
    with pytest.raises((GridLoweringError, autopar.PlanError), match="random op|dropout"):
        autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=4), constraints={"tp_mode": "2d"},
                     kernels="torch")
