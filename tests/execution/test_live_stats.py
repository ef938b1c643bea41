"""``compile(log_every=N, on_step=...)`` and ``CompiledModel.stats()``: measured step figures printed
by rank 0 next to the plan's predictions, which must be the plan's own values."""
from __future__ import annotations

import contextlib
import io

import pytest
import torch

import autopar
from autopar.errors import ExecutionError
from autopar.execution.live_stats import StepStats
from autopar.models import ZOO
from runtime.launch import run_local

torch.set_num_threads(1)   # forked ranks (tests/execution/test_execute.py)


def _train(rank, world, plan_json, log_every, steps, use_callback):
    model, batch = ZOO["gpt2"]()
    plan = autopar.Plan.from_json(plan_json)
    got = []
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch, plan=plan,
                             log_every=log_every, on_step=got.append if use_callback else None)
        for _ in range(steps):
            cm.step(*batch)
    return out.getvalue(), got, cm.stats(), cm.stats(last=1)


@pytest.fixture(scope="module")
def plan():
    model, batch = ZOO["gpt2"]()
    p = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2))
    return autopar.Plan.from_json(p.to_json())   # as the ranks get it (the JSON rounds to 12 digits)


def test_log_every_prints_measured_next_to_the_plan(plan):
    res = run_local(_train, 2, args=(plan.to_json(), 2, 5, False), timeout=240)
    text0, _, stats0, last1 = res[0]
    text1 = res[1][0]
    lines = [ln for ln in text0.splitlines() if ln.startswith("autopar: step ")]
    assert [ln.split(":")[1].strip() for ln in lines] == ["step 2", "step 4"], text0   # every 2 steps
    assert text1 == ""                                                               # rank 0 only
    # the predictions shown are the plan's
    pred = plan.data["predictions"]
    assert f"(plan {pred['step_time'] * 1e3:.1f} ms)" in lines[0]
    assert f"(plan {100 * plan.mfu:.1f}%)" in lines[0]
    assert "tokens/s" in lines[0] and "TFLOP/s per device" in lines[0]
    assert "[mean of 1 step]" in lines[0] and "[mean of 2 steps]" in lines[1]   # step 1 (warm-up) left out
    # stats(): every step but the first
    assert isinstance(stats0, StepStats) and stats0.step == 5 and stats0.steps == 4 and last1.steps == 1
    assert stats0.predicted_step_time == plan.step_time and stats0.predicted_mfu == plan.mfu
    batch, seq = ZOO["gpt2"]()[1][0].shape
    assert stats0.unit == "tokens"
    assert stats0.predicted_throughput == pytest.approx(batch * seq / plan.step_time)
    peak = plan.cluster.device.peak("bf16" if plan.data["settings"]["precision"] == "bf16" else "fp32")
    assert stats0.mfu == pytest.approx(pred["model_flops"] / (stats0.step_time * plan.world_size * peak))
    # the plan's MFU follows the same definition, so predicted and measured are comparable
    assert stats0.predicted_mfu == pytest.approx(pred["model_flops"] / (plan.step_time * plan.world_size * peak))
    assert stats0.step_time > 0 and stats0.tflops > 0


def test_on_step_callback_gets_stats_on_every_rank_and_nothing_is_printed(plan):
    res = run_local(_train, 2, args=(plan.to_json(), 3, 4, True), timeout=240)
    for rank in (0, 1):
        text, got, _, _ = res[rank]
        assert "autopar: step" not in text
        assert [s.step for s in got] == [3] and got[0].steps == 2
        assert got[0].predicted_step_time == plan.step_time


def _bad(rank, world):
    out = []
    for kw in ({"log_every": 0}, {"log_every": 1.5}, {"on_step": "print"}):
        try:
            autopar.compile(ZOO["mlp"]()[0], autopar.Cluster.preset("cpu", devices=1), **kw)
        except ExecutionError as e:
            out.append(str(e))
    return out


def test_bad_log_every_or_on_step_is_refused():
    errors = run_local(_bad, 1, timeout=120)[0]
    assert len(errors) == 3
    assert "log_every must be a positive whole number" in errors[0] and "1.5" in errors[1]
    assert "on_step must be callable" in errors[2]
