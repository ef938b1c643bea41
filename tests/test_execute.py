"""Multi-process execution of plans (gloo, forked ranks) against a single-process eager run of the
same model, seed and batch: the loss at every step and every parameter after 3 AdamW steps must
agree (fp32, rtol 1e-5, atol 1e-6)."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.errors import ExecutionError
from autopar.models import ZOO
from runtime.launch import LocalLaunchError, run_local

# Forked ranks deadlock in OpenMP if the parent already ran a multi-threaded op (the eager
# reference runs here): keep the parent single-threaded (the machine has 2 cores anyway).
torch.set_num_threads(1)

STEPS = 3
# Some gradients are exactly zero in exact arithmetic (the key bias of attention: softmax ignores a
# constant shift), so they are float noise that differs with the summation order. AdamW turns noise
# into updates of size lr * noise / (|noise| + eps): a larger eps keeps them below the tolerance,
# identically on both sides.
EPS = 1e-5
LR = 1e-3   # AdamW normalises updates: with a larger lr, float noise in near-zero grads shows above atol


def reference(name: str, steps: int = STEPS, **kw):
    """Eager single-process training: (losses, final state_dict)."""
    model, batch = ZOO[name](**kw)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank, world, name, devices, constraints, plan_json, steps, kw):
    model, batch = ZOO[name](**kw)
    cluster = autopar.Cluster.preset("cpu", devices=devices)
    plan = autopar.Plan.from_json(plan_json) if plan_json else None
    cm = autopar.compile(model, cluster, example_inputs=batch, plan=plan, lr=LR, eps=EPS,
                         plan_options={"constraints": constraints})
    losses = [cm.step(*batch) for _ in range(steps)]
    sd = {k: v.numpy() for k, v in cm.full_state_dict().items()}   # numpy: plain pickling through the queue
    return losses, (sd if rank == 0 else None), cm.plan.degrees, cm.comm_stats()


def run_plan(name, nprocs, constraints=None, plan_json=None, steps=STEPS, **kw):
    res = run_local(_train, nprocs, args=(name, nprocs, constraints, plan_json, steps, kw), timeout=240)
    return res


def check_against_reference(name, nprocs, constraints=None, **kw):
    ref_losses, ref_sd = reference(name, **kw)
    res = run_plan(name, nprocs, constraints, **kw)
    losses0 = res[0][0]
    for r, (losses, _, _, _) in enumerate(res):
        assert losses == losses0, f"rank {r} reports different losses"
    torch.testing.assert_close(torch.tensor(losses0), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    sd = res[0][1]
    assert set(sd) == set(ref_sd)
    for k in ref_sd:
        torch.testing.assert_close(torch.from_numpy(sd[k]), ref_sd[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    return res


NM1 = {"num_micro_batches": 1}


@pytest.mark.slow
@pytest.mark.parametrize("nprocs", [2, 4])
def test_pure_dp_mlp(nprocs):
    res = check_against_reference("mlp", nprocs, {"dp": nprocs, "tp": 1, "zero": 0, **NM1})
    assert res[0][2]["dp"] == nprocs


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_gpt2(zero):
    res = check_against_reference("gpt2", 2, {"dp": 2, "tp": 1, "zero": zero, **NM1})
    assert res[0][2]["zero"] == zero


@pytest.mark.slow
def test_tp_mlp_2():
    res = check_against_reference("mlp", 2, {"dp": 1, "tp": 2, **NM1})
    assert res[0][2]["tp"] == 2


@pytest.mark.slow
def test_tp_gpt2_4():
    res = check_against_reference("gpt2", 4, {"dp": 1, "tp": 4, **NM1})
    assert res[0][2]["tp"] == 4


@pytest.mark.slow
def test_dp_tp_gpt2_2x2():
    res = check_against_reference("gpt2", 4, {"dp": 2, "tp": 2, **NM1})
    assert (res[0][2]["dp"], res[0][2]["tp"]) == (2, 2)
