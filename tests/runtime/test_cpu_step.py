"""The offloaded optimizer's step on the host (runtime/optim.py ``host_step``): torch's fused CPU
Adam(W) kernel against the flat optimizers' own ops (``step``), within fp32 rounding, on its own
and in an offloaded ZeRO run (runtime/offload.py), where it is what runs by default.

The fused kernel runs only in child processes (``run_local``, hence ``slow``): it starts the
OpenMP thread pool, and a process forked after that (every later ``run_local`` of the same pytest
session) would hang in its first parallel region."""
from __future__ import annotations

import pytest
import torch

from runtime.launch import run_local
from runtime.optim import Adam, Segments, make_optimizer
from runtime.optim_groups import chunk_hparams
from runtime.zero import ShardedOptimizer
from tests.runtime.test_runtime_optim import GLOBAL_BATCH, LR, loss_fn, make_batch, make_model


def _run(name, fused: bool, steps=6, n=10_007, hparams=None, segments=None):
    torch.manual_seed(0)
    opt = make_optimizer(name, 1e-2, weight_decay=0.05)
    opt.cpu_fused = fused
    param, state = torch.randn(n), opt.init_state(n)
    for step in range(1, steps + 1):
        opt.host_step(param, torch.randn(n) * 1e-2, state, step, segments=segments, hparams=hparams)
    return param, state


def _steps(rank, world):
    segs = Segments((0, 4000, 10_007), (0, 1), 2)
    hp = chunk_hparams([(0.0, 0.5, False), (0.1, 1.0, True)], (0.05, 1.0, True))
    out = {name: (_run(name, fused=False), _run(name, fused=True)) for name in ("adamw", "adam")}
    out["groups"] = (_run("adamw", False, segments=segs, hparams=hp), _run("adamw", True, segments=segs, hparams=hp))
    return out


@pytest.mark.slow
def test_fused_host_step_matches_unfused():
    """AdamW, Adam, and AdamW with parameter groups (each segment its own decay and learning-rate
    factor): within fp32 rounding of ``step``'s ops, and not the same bits (another kernel ran)."""
    runs = run_local(_steps, 1, timeout=300)[0]
    for name, ((ref, ref_state), (out, state)) in runs.items():
        assert not torch.equal(out, ref), name
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        for k in ref_state:
            torch.testing.assert_close(state[k], ref_state[k], rtol=1e-5, atol=1e-9)
    assert not torch.allclose(runs["groups"][1][0], runs["adamw"][1][0])   # the settings changed the step


def test_host_step_falls_back_to_step_off_fp32():
    """Not an fp32 CPU buffer (or another optimizer): exactly ``step``."""
    opt = make_optimizer("sgd", 1e-2, momentum=0.9)
    a, b = torch.ones(8), torch.ones(8)
    sa, sb = opt.init_state(8), opt.init_state(8)
    opt.host_step(a, torch.full((8,), 0.5), sa, 1)
    opt.step(b, torch.full((8,), 0.5), sb, 1)
    assert torch.equal(a, b)


def _train(rank, world, offload, fused):
    model = make_model()
    opt_ = make_optimizer("adamw", LR, weight_decay=0.1)
    opt_.cpu_fused = fused
    opt = ShardedOptimizer([list(m.parameters()) for m in model], None, 2, opt_, offload=offload)
    losses = []
    for step in range(1, 6):
        x, y = make_batch(step)
        opt.zero_grad()
        loss = loss_fn(model, x[:GLOBAL_BATCH], y[:GLOBAL_BATCH])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in opt.full_parameters()]


def _both(rank, world):
    fused = Adam._cpu_fused_update
    calls = []

    def counted(self, param, *args):
        calls.append(param.numel())
        fused(self, param, *args)

    Adam._cpu_fused_update = counted
    try:
        runs = _train(rank, world, "none", True), _train(rank, world, "optimizer", True), \
            _train(rank, world, "optimizer", False)
    finally:
        Adam._cpu_fused_update = fused
    return runs, calls


@pytest.mark.slow
def test_offloaded_run_with_fused_host_step_close_to_device_step():
    """ZeRO-2 offloaded on one rank, 5 AdamW steps: the fused host step (what runs by default)
    close to the device's step; with ``cpu_fused=False`` bit-equal to it."""
    ((ref_l, ref_p), (off_l, off_p), (exact_l, exact_p)), calls = run_local(_both, 1, timeout=300)[0]
    assert calls == [80, 99, 30] * 5   # the offloaded run's chunks, each step: the fused kernel ran
    assert exact_l == ref_l and all(torch.equal(a, b) for a, b in zip(exact_p, ref_p))
    assert off_l == pytest.approx(ref_l, rel=1e-5)
    for a, b in zip(off_p, ref_p):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
