"""Micro-batches under 2D / 2.5D / 3D tensor parallelism (gradient accumulation inside the grid
program, autopar/execution/grid_compiled.py) and the grid modes' remaining limits as plan-time
errors.

Executed: GPT-2 and ViT in 2D (SUMMA, q=2, 4 processes) with 2 micro-batches against one process
(fp32, SGD momentum, 3 steps: losses rel 1e-5, parameters rel 1e-4); every grid group's bytes the
run counted equal the plan's exactly (each micro-batch repeats the program's collectives), and
each rank's saved-for-backward bytes of one micro-batch equal the plan's prediction within 2%,
below the one-micro-batch plan's.

Planned (fast): the plan records the count and prices it (op communication and the weight
broadcasts repeat per micro-batch, activations are one micro-batch's); an unpinned count is
searched only when one micro-batch does not fit the budget; activation checkpointing and
dropout p > 0 pinned with a grid mode (also ZeRO 2/3, and ZeRO-1 without dp replicas of the
grid), and a micro-batch count the grid cannot split, are ConstraintErrors at plan time.
"""
from __future__ import annotations

import pytest
import torch
from helpers.exactness import assert_matches_eager, train_eagerly
from helpers.grid_training import KW, OPT, STEPS
from helpers.grid_training import cpu_cluster as _cluster
from helpers.grid_training import train_rank as _train

import autopar
from autopar.errors import ConstraintError
from autopar.models import ZOO
from runtime.launch import run_local

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops



@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "vit"])
def test_2d_with_two_micro_batches_trains_like_one_process(name):
    kw = KW[name]
    model, batch = ZOO[name](**kw)
    one = autopar.plan(model, batch, _cluster(4), constraints={"tp_mode": "2d", "num_micro_batches": 1})
    plan = autopar.plan(model, batch, _cluster(4), constraints={"tp_mode": "2d", "num_micro_batches": 2})
    d = plan.degrees
    assert (d["tp_mode"], d["tp_shape"], d["num_micro_batches"], d["micro_batch_size"]) == \
        ("2d", [2, 2], 2, batch[0].shape[0] // 2)
    res = run_local(_train, 4, args=(name, plan.to_json(), kw), timeout=300)
    model, batch = ZOO[name](**kw)
    ref_losses, ref_sd = train_eagerly(model, batch, torch.optim.SGD(model.parameters(), lr=OPT["lr"],
                                                                     momentum=OPT["momentum"]), STEPS)
    assert_matches_eager([out[0] for out in res], res[0][1], ref_losses, ref_sd)

    predicted = {k: STEPS * v for k, v in plan.comm_bytes.items()}
    pred_saved = plan.predictions["saved_activations_per_rank"]
    assert pred_saved < 0.75 * one.predictions["saved_activations_per_rank"]
    for r, (_, _, stats, saved) in enumerate(res):
        assert set(stats) == {"dp", "col", "row"} and stats["col"] > 0 and stats["row"] > 0, (r, stats)
        assert stats == predicted, f"rank {r}: measured bytes per grid group {stats} != plan's {predicted}"
        assert abs(saved - pred_saved) <= 0.02 * pred_saved, \
            f"rank {r}: saved {saved} bytes, plan predicts {pred_saved}"


# ------------------------------------------------------------------ planning (fast)

@pytest.fixture(scope="module")
def gpt():
    return ZOO["gpt2"]()


def test_micro_batches_are_priced(gpt):
    """Every micro-batch repeats the program's collectives (the grid's per-call list times nm) and
    its compute on 1/nm of the tokens; saved activations are one micro-batch's."""
    model, batch = gpt
    plans = {nm: autopar.plan(model, batch, _cluster(4), constraints={"tp_mode": "2d", "num_micro_batches": nm})
             for nm in (1, 2)}
    for nm, p in plans.items():
        colls = p.data["grid"]["collectives"]
        per_call = {}
        for kind, group, size, nbytes, count, phase in colls:
            per_call[group] = per_call.get(group, 0) + nbytes * count
        assert {g: b for g, b in p.comm_bytes.items() if g != "dp"} == {g: nm * b for g, b in per_call.items()}
        assert p.data["grid"]["nm"] == p.degrees["num_micro_batches"] == nm
    one, two = plans[1], plans[2]
    # the weight broadcasts (col group) repeat per micro-batch; the activations' (row group) split in two
    assert two.comm_bytes["col"] > one.comm_bytes["col"] and two.comm_bytes["row"] == one.comm_bytes["row"]
    assert two.predictions["time_breakdown"]["op_comm"] > one.predictions["time_breakdown"]["op_comm"]
    assert two.predictions["memory_breakdown"]["activations"] < one.predictions["memory_breakdown"]["activations"]
    assert two.step_time > one.step_time


def test_an_unpinned_micro_batch_count_is_searched_only_when_one_does_not_fit(gpt):
    model, batch = gpt
    one = autopar.plan(model, batch, _cluster(4), constraints={"tp_mode": "2d"})
    assert one.degrees["num_micro_batches"] == 1 and one.data["solver"]["configs"] == 1
    two = autopar.plan(model, batch, _cluster(4), constraints={"tp_mode": "2d", "num_micro_batches": 2})
    assert two.peak_memory < one.peak_memory
    fit = autopar.plan(model, batch, _cluster(4), constraints={"tp_mode": "2d"}, memory_budget=two.peak_memory)
    assert fit.degrees["num_micro_batches"] == 2 and fit.peak_memory == two.peak_memory
    assert fit.data["solver"]["configs"] == 2     # nm=1 priced (over the budget), then nm=2


@pytest.mark.parametrize("pin, words", [
    ({"zero": 3}, ["zero=0, 1 or 2", "drop the other pins"]),
    ({"zero": 1}, ["zero=1 need dp > 1"]),     # 4 devices: only the dp=1 grid
    ({"zero": 2}, ["zero=2 need dp > 1"]),
    ({"checkpoint": "full"}, ["no activation checkpointing", "drop the other pins"]),
    ({"num_micro_batches": 8}, ["16 blocks", "batch of 8", "8 micro-batch"]),
    ({"micro_batch_size": 3}, ["micro_batch_size=3", "batch of 8"]),
])
def test_grid_limits_are_constraint_errors(gpt, pin, words):
    model, batch = gpt
    with pytest.raises(ConstraintError) as ei:
        autopar.plan(model, batch, _cluster(4), constraints={"tp_mode": "2d", **pin})
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))


def test_dropout_with_a_grid_mode_is_a_constraint_error_naming_the_op():
    model, batch = ZOO["gpt2"](dropout=0.1)
    with pytest.raises(ConstraintError) as ei:
        autopar.plan(model, batch, _cluster(4), constraints={"tp_mode": "2d"})
    assert "a random op" in str(ei.value) and "node dropout" in str(ei.value), str(ei.value)
    # unpinned, the grid modes are not offered for it: the search still plans the model
    p = autopar.plan(model, batch, _cluster(4))
    assert p.degrees["tp_mode"] not in ("2d", "2.5d", "3d")
