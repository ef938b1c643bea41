"""Checkpoints of 2D / 2.5D / 3D tensor-parallel plans (codegen/grid_rank_program.py through
the one compiled-model runtime):
``compiled.save(dir)`` / ``compiled.load(dir)`` as for every other plan (whole tensors through
torch.distributed.checkpoint, the format of autopar/execution/compiled_state.py).

The zoo GPT-2 trains 2 steps under a 2D (SUMMA, q=2) plan on 4 gloo processes and is saved; the
checkpoint is loaded (a) into the same 2D plan, (b) into a Megatron tp=2 plan on 2 processes,
(c) into one process, and 2 more steps run there. Losses of all 4 steps and the final parameters
equal 4 uninterrupted eager steps (fp32, SGD lr 0.05 momentum 0.9: losses rel 1e-5, parameters
rel 1e-4), so the momentum buffers moved with the weights (a fresh optimizer after the load
would take a different third step). The other way round too: a dp=2 (non-grid) checkpoint loads
into the 2D plan; and another model's checkpoint is refused with the same clear error as for
other plans, nothing loaded.
"""
from __future__ import annotations

import pytest
import torch
from helpers.exactness import assert_matches_eager, train_eagerly

import autopar
from autopar.errors import ExecutionError
from autopar.models import ZOO
from runtime.launch import run_local

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops

BEFORE, AFTER = 2, 2
OPT = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}


def _cluster(n):
    return autopar.Cluster.preset("cpu", devices=n)


def _plan(n, constraints):
    model, batch = ZOO["gpt2"]()
    return autopar.plan(model, batch, _cluster(n), precision="fp32", constraints=constraints)


GRID = {"tp_mode": "2d", "tp_shape": [2, 2]}
TARGETS = {   # name -> (processes, constraints)
    "same 2d plan": (4, GRID),
    "megatron tp=2": (2, {"dp": 1, "tp": 2, "num_micro_batches": 1}),
    "one process": (1, {"dp": 1, "tp": 1, "num_micro_batches": 1}),
}


def _compile(world, plan_json, **kw):
    model, batch = ZOO["gpt2"](**kw)
    cm = autopar.compile(model, _cluster(world), example_inputs=batch, plan=autopar.Plan.from_json(plan_json), **OPT)
    return cm, batch


def _save_after(rank, world, plan_json, directory):
    cm, batch = _compile(world, plan_json)
    losses = [cm.step(*batch) for _ in range(BEFORE)]
    cm.save(directory)
    return losses, type(cm.program).__name__


def _load_and_continue(rank, world, plan_json, directory, other_dir):
    cm, batch = _compile(world, plan_json)
    refused = None
    if other_dir is not None:
        # another model's checkpoint (one layer fewer), saved by a dp plan on these ranks
        other, obatch = ZOO["gpt2"](n_layer=1)
        autopar.compile(other, _cluster(world), example_inputs=obatch, plan_options={
            "constraints": {"dp": world, "tp": 1, "num_micro_batches": 1}}, **OPT).save(other_dir)
        before = cm.full_state_dict()
        try:
            cm.load(other_dir)
        except ExecutionError as e:
            refused = str(e)
        after = cm.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), "a refused load changed parameters"
    cm.load(directory)
    losses = [cm.step(*batch) for _ in range(AFTER)]
    sd = {k: v.numpy() for k, v in cm.full_state_dict().items()}
    return losses, (sd if rank == 0 else None), type(cm.program).__name__, refused


def _reference():
    model, batch = ZOO["gpt2"]()
    return train_eagerly(model, batch, torch.optim.SGD(model.parameters(), lr=OPT["lr"], momentum=OPT["momentum"]),
                         BEFORE + AFTER)


def _check(first, rest, label):
    ref_losses, ref_sd = _reference()
    assert len({tuple(r[0]) for r in first}) == 1, "ranks report different losses before the save"
    assert_matches_eager([first[0][0] + r[0] for r in rest], rest[0][1], ref_losses, ref_sd, label=label)


@pytest.mark.slow
@pytest.mark.parametrize("target", list(TARGETS))
def test_a_2d_checkpoint_resumes_on_any_plan(tmp_path, target):
    src = _plan(4, GRID)
    assert src.degrees["tp_mode"] == "2d"
    world, constraints = TARGETS[target]
    dst = _plan(world, constraints)
    assert (dst.degrees["tp_mode"] == "2d") == (target == "same 2d plan")
    if target == "megatron tp=2":
        assert dst.degrees["tp"] == 2 and dst.degrees["dp"] == 1
    ck = str(tmp_path / "ck")
    first = run_local(_save_after, 4, args=(src.to_json(), ck), timeout=300)
    assert first[0][1] == "GridRankProgram"
    rest = run_local(_load_and_continue, world, args=(dst.to_json(), ck, None), timeout=300)
    assert rest[0][2] == ("GridRankProgram" if target == "same 2d plan" else "RankProgram")
    _check(first, rest, f"{target}: ")


@pytest.mark.slow
def test_a_non_grid_checkpoint_loads_into_a_2d_plan_and_another_models_is_refused(tmp_path):
    src = _plan(2, {"dp": 2, "tp": 1, "num_micro_batches": 1})
    assert src.degrees["tp_mode"] != "2d" and src.degrees["dp"] == 2
    dst = _plan(4, GRID)
    ck = str(tmp_path / "ck")
    first = run_local(_save_after, 2, args=(src.to_json(), ck), timeout=300)
    assert first[0][1] == "RankProgram"
    rest = run_local(_load_and_continue, 4, args=(dst.to_json(), ck, str(tmp_path / "other")), timeout=300)
    assert rest[0][2] == "GridRankProgram"
    for r, out in enumerate(rest):
        msg = out[3]
        assert msg is not None, f"rank {r}: another model's checkpoint was loaded into the 2d plan"
        assert "does not match this model" in msg and "nothing was loaded" in msg, msg
        assert "model.blocks.1." in msg, msg     # names what is missing: the second block's tensors
    _check(first, rest, "dp=2 -> 2d: ")


def _save_before_any_step(rank, world, plan_json, directory):
    cm, batch = _compile(world, plan_json)
    cm.save(directory)
    cm2, _ = _compile(world, plan_json)
    cm2.load(directory)
    return [cm2.step(*batch) for _ in range(2)]


@pytest.mark.slow
def test_a_checkpoint_saved_before_any_step_starts_training_fresh(tmp_path):
    """step 0 saved: the loaded optimizer has no momentum yet (SGD's first step copies the
    gradient), exactly as a fresh run."""
    plan = _plan(4, GRID)
    res = run_local(_save_before_any_step, 4, args=(plan.to_json(), str(tmp_path / "ck")), timeout=300)
    model, batch = ZOO["gpt2"]()
    ref, _ = train_eagerly(model, batch, torch.optim.SGD(model.parameters(), lr=OPT["lr"], momentum=OPT["momentum"]), 2)
    for losses in res:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-6)
