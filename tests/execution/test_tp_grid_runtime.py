"""2D / 2.5D / 3D plans run through the one compiled-model runtime (codegen/grid_rank_program.py
under autopar/execution/compiled.py): the same CompiledModel, ShardedOptimizer (runtime/zero.py),
step guard, gradient clipping and precision as every other plan.

Slow tests (4 gloo processes, zoo GPT-2 under 2D q=2, 3 steps) against one eager process:
``grad_clip`` clips the global norm over every grid block (blocks held by several ranks weighted
1/r) exactly as ``clip_grad_norm_``; bf16 (fp32 masters) follows the fp32 eager losses within
bf16's precision. The premise: the CompiledModel class is not swapped, the program is the grid's,
the optimizer is the ShardedOptimizer, a step guard is installed, and clipping really clipped
(the unclipped norm is above the threshold).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.exactness import assert_matches_eager
from helpers.grid_training import OPT, STEPS, cpu_cluster

import autopar
from autopar.models import ZOO
from runtime.launch import run_local

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops

CLIP = 0.05


def _train(rank, world, plan_json, options):
    from autopar.execution.compiled import CompiledModel
    from runtime.zero import ShardedOptimizer

    model, batch = ZOO["gpt2"]()
    cm = autopar.compile(model, cpu_cluster(world), example_inputs=batch, plan=autopar.Plan.from_json(plan_json),
                         **OPT, **options)
    premise = (type(cm) is CompiledModel, type(cm.program).__name__, isinstance(cm.opt, ShardedOptimizer),
               cm.guard is not None)
    losses = [cm.step(*batch) for _ in range(STEPS)]
    sd = {k: v.float().numpy() for k, v in cm.full_state_dict().items()}
    return losses, (sd if rank == 0 else None), premise


def _eager(clip=None):
    model, batch = ZOO["gpt2"]()
    opt = torch.optim.SGD(model.parameters(), lr=OPT["lr"], momentum=OPT["momentum"])
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        losses.append(float(loss))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


@pytest.fixture(scope="module")
def plan_2d():
    model, batch = ZOO["gpt2"]()
    plan = autopar.plan(model, batch, cpu_cluster(4), constraints={"tp": 4, "tp_mode": "2d"})
    assert plan.degrees["tp_mode"] == "2d"
    return plan


@pytest.mark.slow
def test_grid_plan_clips_like_one_process(plan_2d):
    res = run_local(_train, 4, args=(plan_2d.to_json(), {"grad_clip": CLIP}), timeout=300)
    for out in res:
        assert out[2] == (True, "GridRankProgram", True, True), out[2]
    ref_losses, ref_sd, norms = _eager(CLIP)
    assert min(norms) > CLIP, f"clipping never clipped (norms {norms}): the test proves nothing"
    assert_matches_eager([out[0] for out in res], res[0][1], ref_losses, ref_sd)


@pytest.mark.slow
def test_grid_plan_trains_in_bf16_like_one_process(plan_2d):
    res = run_local(_train, 4, args=(plan_2d.to_json(), {"precision": "bf16"}), timeout=300)
    ref_losses, ref_sd, _ = _eager()
    for r, out in enumerate(res):
        assert out[0] == res[0][0], f"rank {r} reports different losses"
        np.testing.assert_allclose(out[0], ref_losses, rtol=2e-2)
    fp32 = run_local(_train, 4, args=(plan_2d.to_json(), {}), timeout=300)
    # bf16 really ran: its losses differ from the fp32 grid run's (which equal eager's)
    assert res[0][0] != fp32[0][0]
    assert_matches_eager([out[0] for out in fp32], fp32[0][1], ref_losses, ref_sd)
    for k, v in res[0][1].items():
        np.testing.assert_allclose(v, ref_sd[k].numpy(), rtol=5e-2, atol=5e-3, err_msg=k)
