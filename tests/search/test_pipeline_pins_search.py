"""A pinned pipeline degree chooses the rest as the free search does (autopar/search/pipeline_search.py
``_pinned_degree``): micro-batch count and schedule among the free search's candidates for that pp,
the fastest plan, never slower than the same pins with any of those counts pinned; the plans
train on gloo processes equal to one process (fp32, SGD with momentum, 3 steps, losses rel 1e-5,
parameters rel 1e-4). And the search's solver time-out is its own exception: with ``time_limit``
set it skips a configuration, every other PlanError propagates; ``CutOff`` is no PlanError."""
from __future__ import annotations

import pytest
import torch
from helpers.exactness import train_eagerly

import autopar
import autopar.search.outer as outer
import autopar.search.visit as visit
from autopar.errors import ConstraintError, PlanError
from autopar.frontend.trace import trace
from autopar.models import ZOO
from autopar.pricing.price import Settings
from autopar.search.outer import CutOff
from autopar.search.pipeline_candidates import SCHEDULES, micro_batch_counts
from runtime.launch import run_local
from solver.errors import SolverTimeout

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops

STEPS = 3
OPT = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}

# (pins, devices, policy): megatron where dp x tp pinned, so that the tensor axis splits work
# (the default policy finds a plan as fast that leaves it idle)
PINS = [({"pp": 2, "tp": 2}, 4, None),
        ({"pp": 2, "dp": 2, "zero": 1}, 4, None),
        ({"pp": 2, "dp": 2, "zero": 3}, 4, None),
        ({"pp": 2, "dp": 2, "tp": 2}, 8, "megatron")]
IDS = ["pp2-tp2", "pp2-dp2-zero1", "pp2-dp2-zero3", "pp2-dp2-tp2"]


def _plan(pins, devices, policy=None, name="gpt2"):
    model, batch = ZOO[name]()
    return autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=devices), precision="fp32",
                        constraints=pins, policy=policy)


@pytest.mark.parametrize("pins, devices, policy", PINS, ids=IDS)
def test_a_pipeline_pin_alone_chooses_its_micro_batches(pins, devices, policy):
    plan = _plan(pins, devices, policy)
    d = plan.degrees
    assert d["pp"] == 2 and plan.world_size == devices
    assert all(d[k] == v for k, v in pins.items() if k != "tp"), d
    assert d["tp"] == pins.get("tp", d["tp"]) and d["pp_schedule"] in SCHEDULES
    model, batch = ZOO["gpt2"]()
    counts = micro_batch_counts(2, batch[0].shape[0], autopar.Cluster.preset("cpu", devices=devices))
    assert d["num_micro_batches"] in counts and d["num_micro_batches"] >= 2
    tried = 0
    for m in counts:   # never slower than the same pins with a count the search tries pinned
        try:
            pinned = _plan(dict(pins, num_micro_batches=m), devices, policy)
        except ConstraintError:   # e.g. 8 micro-batches of 4 rows per data-parallel rank
            continue
        tried += 1
        assert plan.step_time <= pinned.step_time * (1 + 1e-9), (m, plan.step_time, pinned.step_time)
    assert tried >= 2


def test_pinned_schedule_and_micro_batch_size_are_kept():
    p = _plan({"pp": 2, "pp_schedule": "gpipe"}, 2)
    assert p.degrees["pp_schedule"] == "gpipe" and p.degrees["num_micro_batches"] >= 2
    p = _plan({"pp": 2, "micro_batch_size": 2}, 2)
    assert p.degrees["pp"] == 2 and p.degrees["micro_batch_size"] == 2 and p.degrees["num_micro_batches"] == 4


@pytest.mark.parametrize("pins, devices, words", [
    ({"pp": 4}, 4, ["pp=4", "2 blocks", "at most 2"]),
    ({"pp": 2, "dp": 4}, 4, ["pp=2", "dp=4", "sub-mesh of 2 devices"]),
])
def test_a_pipeline_pin_that_cannot_be_met_says_why(pins, devices, words):
    with pytest.raises(ConstraintError) as ei:
        _plan(pins, devices)
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))


def _train(rank, world, plan_json):
    model, batch = ZOO["gpt2"]()
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), **OPT)
    losses = [cm.step(*batch) for _ in range(STEPS)]
    comm = cm.comm_stats()
    sd = {k: v.numpy() for k, v in cm.full_state_dict().items()}
    return {"losses": losses, "sd": sd if rank == 0 else None, "comm": comm}


@pytest.mark.slow
@pytest.mark.parametrize("pins, devices, policy", PINS, ids=IDS)
def test_a_pipeline_pin_alone_trains_equal_to_one_process(pins, devices, policy):
    plan = _plan(pins, devices, policy)
    assert plan.degrees["pp"] == 2 and plan.degrees["num_micro_batches"] >= 2 and plan.world_size == devices
    model, batch = ZOO["gpt2"]()
    ref_losses, ref_sd = train_eagerly(model, batch, torch.optim.SGD(model.parameters(), lr=OPT["lr"],
                                                                     momentum=OPT["momentum"]), STEPS)
    res = run_local(_train, devices, args=(plan.to_json(),), timeout=600)
    for r in res:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
        assert r["comm"]["pp"] > 0   # activations crossed between the stages
        for axis in ("dp", "tp"):
            if pins.get(axis, 1) > 1:   # the pinned axes moved data
                assert r["comm"].get(axis, 0) > 0, (axis, r["comm"])
    sd = res[0]["sd"]
    assert set(sd) == set(ref_sd)
    for k in ref_sd:
        torch.testing.assert_close(torch.from_numpy(sd[k]), ref_sd[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")


# ------------------------------------------------------------------ solver time-outs and errors


def _mlp_search(**kw):
    model, batch = ZOO["mlp"]()
    graph = trace(model, batch)
    return outer.search(graph, autopar.Cluster.preset("cpu", devices=4), Settings(), {}, **kw)


def _fail_first_solve(monkeypatch, error):
    """visit.solve raising ``error`` on its first call, then solving as before."""
    real, calls = visit.solve, []

    def solve(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise error
        return real(*a, **k)
    monkeypatch.setattr(visit, "solve", solve)
    monkeypatch.setattr(visit, "LP_BOUND", False)   # straight to the solve of every configuration
    return calls


def test_a_solver_time_out_skips_that_configuration(monkeypatch):
    calls = _fail_first_solve(monkeypatch, SolverTimeout("out of time"))
    best, stats = _mlp_search(time_limit=600)
    assert best is not None and stats["timed_out"] == 1 and len(calls) > 1


def test_any_other_plan_error_propagates_with_a_time_limit(monkeypatch):
    _fail_first_solve(monkeypatch, PlanError("a bug in one configuration"))
    with pytest.raises(PlanError, match="a bug in one configuration"):
        _mlp_search(time_limit=600)


def test_cut_off_is_internal_and_a_time_out_a_plan_error():
    assert not issubclass(CutOff, PlanError)
    assert issubclass(SolverTimeout, PlanError)   # a caller of solver.ilp.solve still reads its message
