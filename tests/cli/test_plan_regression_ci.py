"""`autopar diff --fail-on` (autopar/plans/report.py ``parse_fail_on``, ``check_limits``) and the CI
recipe in examples/ci/: the workflow's plan-and-diff step (examples/ci/plan_regression.sh) passes
against the committed baseline and fails on an injected regression."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autopar.cli import main
from autopar.errors import PlanError
from autopar.plans.report import parse_fail_on

ROOT = Path(__file__).resolve().parents[2]
CI = ROOT / "examples" / "ci"
BASELINE = CI / "baseline.json"


def test_parse_fail_on():
    assert parse_fail_on("step_time=+2%,peak_memory=5%") == {"step_time": 0.02, "peak_memory": 0.05}
    assert parse_fail_on(" mfu = 0.5% , comm_bytes=0% ") == {"mfu": 0.005, "comm_bytes": 0.0}
    for bad, words in (("walltime=2%", "unknown metric 'walltime'"), ("step_time=2", "percentage"),
                       ("step_time=+2 %x", "percentage"), ("step_time=-1%", "0% or more"),
                       ("step_time", "METRIC=LIMIT"), ("", "empty"), ("step_time=1%,step_time=2%", "twice"),
                       ("step_time=abc%", "percentage")):
        with pytest.raises(PlanError, match=words):
            parse_fail_on(bad)


def _edited(tmp_path, name, **scale):
    data = json.loads(BASELINE.read_text())
    for key, factor in scale.items():
        data["predictions"][key] *= factor
    out = tmp_path / name
    out.write_text(json.dumps(data))
    return out


def test_diff_fail_on_exit_codes_and_output(capsys, tmp_path):
    faster = _edited(tmp_path, "faster.json", step_time=0.9)          # the new plan is 11% slower than this
    code = main(["diff", str(BASELINE), str(BASELINE), "--fail-on", "step_time=+2%,peak_memory=+5%"])
    out = capsys.readouterr().out
    assert code == 0 and "step_time:" in out and "peak_memory:" in out and "0 of 2 metric(s)" in out
    code = main(["diff", str(faster), str(BASELINE), "--fail-on", "step_time=+2%,peak_memory=+5%"])
    out = capsys.readouterr().out
    assert code == 1 and "REGRESSION" in out and "1 of 2 metric(s) regressed" in out
    assert "worse by +11.11%" in out
    code = main(["diff", str(faster), str(BASELINE), "--fail-on", "step_time=+12%"])   # within its limit
    assert code == 0
    code = main(["diff", str(faster), str(BASELINE), "--fail-on", "peak_memory=0%"])   # only named metrics count
    assert code == 0
    capsys.readouterr()
    # mfu: a drop is the regression
    low_mfu = _edited(tmp_path, "low.json", mfu=0.5)
    assert main(["diff", str(BASELINE), str(low_mfu), "--fail-on", "mfu=10%"]) == 1
    assert main(["diff", str(low_mfu), str(BASELINE), "--fail-on", "mfu=10%"]) == 0
    capsys.readouterr()
    # bad syntax and --threshold together: exit 2, one line
    assert main(["diff", str(BASELINE), str(BASELINE), "--fail-on", "speed=1%"]) == 2
    assert "unknown metric 'speed'" in capsys.readouterr().err
    assert main(["diff", str(BASELINE), str(BASELINE), "--fail-on", "step_time=1%", "--threshold", "0.1"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["diff", str(faster), str(BASELINE), "--threshold", "0.2"]) == 0   # --threshold still works
    assert main(["diff", str(faster), str(BASELINE)]) == 1


def _workflow_steps():
    wf = yaml.safe_load((CI / "plan-regression.yml").read_text())
    assert wf["name"] and (wf.get("on") or wf.get(True))   # YAML reads a bare `on:` key as True
    (job,) = wf["jobs"].values()
    return [s for s in job["steps"] if "run" in s]


def _run_recipe(tmp_path, baseline, autopar=None):
    """The workflow's plan-and-diff step, with autopar run from this checkout (or ``autopar``)."""
    (step,) = [s for s in _workflow_steps() if "plan_regression.sh" in s["run"]]
    env = dict(os.environ, **{k: str(v) for k, v in step.get("env", {}).items()})
    env.update(AUTOPAR=autopar or f"{sys.executable} -m autopar.cli", BASELINE=str(baseline),
               OUT=str(tmp_path / "plan.json"),
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), AUTOPAR_PLAN_WORKERS="1")
    return subprocess.run(["bash", "-c", step["run"]], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def test_ci_recipe_passes_on_the_baseline_and_fails_on_a_regression(tmp_path):
    steps = _workflow_steps()
    assert any("pip install" in s["run"] for s in steps)
    assert any("autopar report" in s["run"] for s in steps)
    res = _run_recipe(tmp_path, BASELINE)
    assert res.returncode == 0, (
        f"the plan no longer matches examples/ci/baseline.json within the limits; after an intended planner "
        f"change regenerate it: bash examples/ci/plan_regression.sh --update\n{res.stdout}\n{res.stderr}")
    assert "0 of 2 metric(s) regressed" in res.stdout
    assert (json.loads((tmp_path / "plan.json").read_text())["fingerprint"]
            == json.loads(BASELINE.read_text())["fingerprint"])
    # an injected regression: the baseline promised a 10% faster step. The recipe's plan step is the
    # one just run (plans are deterministic: its fingerprint is the baseline's), so its plan is
    # reused instead of planned again; the recipe's diff is the real CLI's
    planned = tmp_path / "planned.json"
    (tmp_path / "plan.json").rename(planned)
    cli = f"{sys.executable} -m autopar.cli"
    wrapper = tmp_path / "autopar.sh"
    wrapper.write_text(f'if [ "$1" = plan ]; then cp {planned} "${{@: -1}}"; else exec {cli} "$@"; fi\n')
    res = _run_recipe(tmp_path, _edited(tmp_path, "faster.json", step_time=0.9), autopar=f"bash {wrapper}")
    assert json.loads((tmp_path / "plan.json").read_text()) == json.loads(planned.read_text())
    assert res.returncode == 1, res.stdout + res.stderr
    assert "step_time" in res.stdout and "REGRESSION" in res.stdout
