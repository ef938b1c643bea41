"""ZeRO-1/2 over the data-parallel axis of dp x grid plans, by the common ShardedOptimizer
(runtime/zero.py; the grid program through codegen/grid_rank_program.py): the trainable blocks
in chunks padded to dp shards, gradients reduce-scattered over dp, each replica's optimizer
stepping its shard, the updated shards all-gathered.

Executed (8 gloo processes): GPT-2 (one block) on dp=2 x 2D q=2 with zero=1 and zero=2 against one process
(fp32, SGD momentum, 3 steps: losses rel 1e-5, parameters rel 1e-4); bytes per axis (dp
included) equal the plan's exactly; each rank's momentum buffer holds half the padded chunks. A
checkpoint saved after step 2 resumes exactly, both on the same plan (fresh ranks' state) and on
one process. Planned (fast): zero=1 halves the optimizer state of the plan and moves the dp
traffic from one all-reduce to a reduce-scatter plus an all-gather.
"""
from __future__ import annotations

import pytest
import torch
from helpers.exactness import assert_matches_eager, train_eagerly

import autopar
from autopar.models import ZOO
from runtime.launch import run_local

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops

STEPS = 3
OPT = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}
PIN = {"tp_mode": "2d", "tp_shape": [2, 2], "dp": 2}
# executed on one GPT-2 block: every grid parameter kind (embedding, QKV, linears, norms) is in it,
# in ZeRO chunks padded to the dp shards as with two; half of each of the 8 ranks' two compiles
EXEC = dict(n_layer=1)


def _cluster(n):
    return autopar.Cluster.preset("cpu", devices=n)


def _compile(world, plan_json):
    model, batch = ZOO["gpt2"](**EXEC)
    return autopar.compile(model, _cluster(world), example_inputs=batch, plan=autopar.Plan.from_json(plan_json),
                           **OPT), batch


def _train(rank, world, plan_json, directory):
    cm, batch = _compile(world, plan_json)
    cm.reset_comm_stats()
    losses = []
    for s in range(STEPS):
        losses.append(cm.step(*batch))
        if s == STEPS - 2:
            cm.save(directory)
    stats = cm.comm_stats()
    # the ShardedOptimizer's chunks (runtime/zero.py), each padded to dp shards
    momentum = sum(t.numel() for c in cm.opt.chunks for name, t in c.state.items() if name == "momentum_buffer")
    blocks = sum(c.padded for c in cm.opt.chunks)
    sd = {k: v.numpy() for k, v in cm.full_state_dict().items()}
    again, _ = _compile(world, plan_json)     # fresh ranks resume from the checkpoint
    again.load(directory)
    resumed = again.step(*batch)
    return losses, (sd if rank == 0 else None), stats, momentum, blocks, resumed


def _resume(rank, world, plan_json, directory):
    cm, batch = _compile(world, plan_json)
    cm.load(directory)
    return cm.step(*batch)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2])
def test_dp2_x_2d_with_zero_trains_like_one_process_and_resumes(tmp_path, zero):
    """ZeRO-1 and ZeRO-2 (gradients reduce-scattered into shards too) over the grid's dp replicas,
    by the common ShardedOptimizer."""
    model, batch = ZOO["gpt2"](**EXEC)
    plan = autopar.plan(model, batch, _cluster(8), precision="fp32", constraints={**PIN, "zero": zero})
    assert (plan.degrees["zero"], plan.degrees["dp"], plan.degrees["tp_mode"]) == (zero, 2, "2d")
    ck = str(tmp_path / "ck")
    res = run_local(_train, 8, args=(plan.to_json(), ck), timeout=600)
    ref_losses, ref_sd = train_eagerly(model, batch, torch.optim.SGD(model.parameters(), lr=OPT["lr"],
                                                                     momentum=OPT["momentum"]), STEPS)
    assert_matches_eager([out[0] for out in res], res[0][1], ref_losses, ref_sd)
    predicted = {k: STEPS * v for k, v in plan.comm_bytes.items()}
    for r, (losses, _, stats, momentum, blocks, resumed) in enumerate(res):
        assert stats == predicted, f"rank {r}: measured bytes per axis {stats} != plan's {predicted}"
        assert momentum == blocks // 2, (r, momentum, blocks)     # this replica's half of the padded chunks
        torch.testing.assert_close(resumed, ref_losses[-1], rtol=1e-5, atol=1e-6)
    one = autopar.plan(*ZOO["gpt2"](**EXEC), _cluster(1), precision="fp32", constraints={"dp": 1, "tp": 1})
    (single,) = run_local(_resume, 1, args=(one.to_json(), ck), timeout=300)
    torch.testing.assert_close(single, ref_losses[-1], rtol=1e-5, atol=1e-6)


def test_zero1_is_priced():
    model, batch = ZOO["gpt2"]()
    plans = {z: autopar.plan(model, batch, _cluster(8), constraints={**PIN, "zero": z}) for z in (0, 1, 2)}
    z0, z1, z2 = plans[0], plans[1], plans[2]
    # ZeRO-2: the same traffic as ZeRO-1, the gradients sharded too
    assert z2.comm_bytes == z1.comm_bytes
    assert z2.memory_breakdown["grads"] == pytest.approx(z1.memory_breakdown["grads"] / 2, rel=1e-9)
    mb0, mb1 = z0.memory_breakdown, z1.memory_breakdown
    assert mb1["optimizer"] == pytest.approx(mb0["optimizer"] / 2, rel=1e-9)
    assert (mb1["params"], mb1["grads"], mb1["activations"]) == (mb0["params"], mb0["grads"], mb0["activations"])
    # the dp traffic: all_reduce(S) counted S; reduce_scatter(S) + all_gather(S) counted 2 S (S padded to 2 shards)
    assert z1.comm_bytes["dp"] == 2 * z0.comm_bytes["dp"]
    assert ({k: v for k, v in z1.comm_bytes.items() if k != "dp"}
            == {k: v for k, v in z0.comm_bytes.items() if k != "dp"})
    assert z1.peak_memory < z0.peak_memory


def test_an_unpinned_zero_is_tried_when_the_grid_does_not_fit():
    model, batch = ZOO["gpt2"]()
    z1 = autopar.plan(model, batch, _cluster(8), constraints={**PIN, "zero": 1})
    fit = autopar.plan(model, batch, _cluster(8), constraints=PIN, memory_budget=z1.peak_memory)
    assert fit.degrees["zero"] == 1 and fit.degrees["num_micro_batches"] == 1
    assert fit.peak_memory == z1.peak_memory
