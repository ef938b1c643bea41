"""The `autopar` command line: plan, show, diff, ops and its error handling (exit 2, no traceback)."""
import json
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.plans.plan import Plan

REPO = Path(__file__).resolve().parents[2]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Plans written by the CLI (module scope: planning is the slow part)."""
    d = tmp_path_factory.mktemp("plans")
    auto, pinned = d / "auto.json", d / "checkpointed.json"
    assert main(["plan", "gpt2", "--cluster", "cpu", "--devices", "4", "-o", str(auto)]) == 0
    # ZeRO-3 over all four ranks: slower (per-block gathers) and smaller than the automatic plan
    assert main(["plan", "gpt2", "--cluster", "cpu", "--devices", "4",
                 "--constraint", "checkpoint=full", "--constraint", "dp=4",
                 "-o", str(pinned)]) == 0
    return auto, pinned


def test_plan_writes_a_loadable_plan(plans):
    auto, _ = plans
    p = Plan.load(auto)
    assert p.degrees["dp"] * p.degrees["tp"] == 4
    assert p.data["cluster"]["name"] == "cpu"
    assert auto.read_text() == p.to_json()


def test_plan_prints_summary(capsys, tmp_path):
    out_file = tmp_path / "p.json"
    code, out, err = run(capsys, "plan", "gpt2", "--cluster", "cpu", "--devices", "4", "--constraint", "tp=2",
                         "-o", str(out_file))
    assert code == 0, err
    assert "autopar plan" in out and "mesh" in out and "dp=2 × tp=2" in out
    assert f"saved to {out_file}" in out
    p = Plan.load(out_file)
    assert p.degrees["tp"] == 2 and p.degrees["dp"] == 2


def test_show(capsys, plans):
    auto, _ = plans
    p = Plan.load(auto)
    code, out, err = run(capsys, "show", str(auto))
    assert code == 0, err
    assert p.mesh.describe() in out
    assert "per-op strategies" in out and "memory on the most loaded device" in out
    assert f"{p.peak_memory:,}" in out
    assert p.ops[0]["node"] in out


def test_diff_identical(capsys, plans):
    auto, _ = plans
    code, out, _ = run(capsys, "diff", str(auto), str(auto))
    assert code == 0
    assert "identical" in out
    assert "REGRESSION" not in out


def test_diff_regression_and_improvement(capsys, plans):
    auto, pinned = plans
    slow, fast = Plan.load(pinned), Plan.load(auto)
    assert slow.step_time > fast.step_time * 1.02    # the premise: recomputing every block is slower
    code, out, _ = run(capsys, "diff", str(auto), str(pinned))
    assert code == 1
    assert "REGRESSION" in out and "step_time" in out
    assert "degree checkpoint: " in out
    # the other way round: step time improves, but the automatic plan holds more memory per device
    assert fast.peak_memory > slow.peak_memory * 1.02          # the premise of exit code 1 below
    code, out, _ = run(capsys, "diff", str(pinned), str(auto))
    assert code == 1
    regressions = [line for line in out.splitlines() if "REGRESSION" in line]
    assert len(regressions) == 1 and regressions[0].startswith("peak_memory"), out


def test_diff_threshold(capsys, plans):
    auto, pinned = plans
    a, b = Plan.load(auto), Plan.load(pinned)
    worst = max(b.step_time / a.step_time, b.peak_memory / a.peak_memory,
                a.step_time / b.step_time, a.peak_memory / b.peak_memory) - 1
    for old, new in ((auto, pinned), (pinned, auto)):   # above every change: no regression, exit 0
        code, out, _ = run(capsys, "diff", str(old), str(new), "--threshold", str(worst * 1.1))
        assert code == 0 and "REGRESSION" not in out, out
    slower = b.step_time / a.step_time - 1
    assert slower > 0.1 and b.peak_memory < a.peak_memory   # premise of the next check
    code, out, _ = run(capsys, "diff", str(auto), str(pinned), "--threshold", str(slower / 2))
    assert code == 1 and "REGRESSION" in out


def test_ops_lists_rules(capsys):
    code, out, err = run(capsys, "ops", "gpt2")
    assert code == 0, err
    assert "op rules hit by gpt2" in out
    assert "linear" in out
    last = [line for line in out.splitlines() if "replicate fallback" in line]
    assert len(last) == 1
    n_ops, n_fallback = int(last[0].split()[0]), int(last[0].split(",")[1].split()[0])
    assert n_ops > 10 and 0 <= n_fallback < n_ops


def test_factory_args_change_the_model(capsys, tmp_path, plans):
    _, pinned = plans
    three = tmp_path / "three.json"
    code, _, err = run(capsys, "plan", "gpt2", "--cluster", "cpu", "--devices", "4", "--arg", "n_layer=3",
                       "--constraint", "dp=4", "--constraint", "zero=1", "-o", str(three))
    assert code == 0, err
    p3, p2 = Plan.load(three), Plan.load(pinned)
    assert p3.fingerprint != p2.fingerprint
    assert len(p3.ops) > len(p2.ops)
    def blocks(p):
        return {o["module"].split(".")[1] for o in p.ops if o["module"].count(".") >= 2}
    assert len(blocks(p3)) == len(blocks(p2)) + 1, (blocks(p3), blocks(p2))
    assert p3.degrees["zero"] == 1
    code, out, err = run(capsys, "diff", str(pinned), str(three))   # different models: refused
    assert code == 2 and "plans of different models" in err and "--force" in err and out == ""
    code, out, _ = run(capsys, "diff", str(pinned), str(three), "--force")
    assert "fingerprint differs" in out and code in (0, 1)
    assert code == (1 if "REGRESSION" in out else 0)


def test_yaml_cluster_file(capsys, tmp_path):
    out_file = tmp_path / "y.json"
    code, out, err = run(capsys, "plan", "gpt2", "--cluster", str(REPO / "examples" / "cluster.yaml"),
                         "--arg", "batch=16", "--constraint", "tp=8", "-o", str(out_file))
    assert code == 0, err
    p = Plan.load(out_file)
    assert p.data["cluster"]["name"] == "dgx-a100-2node"
    assert p.degrees["dp"] * p.degrees["tp"] == 16 and p.degrees["tp"] == 8


@pytest.mark.parametrize("argv, words", [
    (["plan", "no_such_model", "--cluster", "cpu", "--devices", "4"], ["unknown model 'no_such_model'", "gpt2"]),
    (["plan", "gpt2", "--cluster", "dgx-z9000"], ["unknown cluster preset 'dgx-z9000'", "dgx-a100"]),
    (["plan", "gpt2", "--cluster", "missing_cluster.yaml"], ["missing_cluster.yaml", "does not exist"]),
    (["plan", "gpt2", "--cluster", "cpu", "--devices", "4", "--constraint", "tpp=2"], ["did you mean 'tp'"]),
    (["plan", "gpt2", "--cluster", "cpu", "--devices", "4", "--optimizer", "adagrad"], ["adagrad", "adamw"]),
    (["plan", "gpt2", "--cluster", "cpu", "--devices", "4", "--arg", "n_layer"], ["name=value"]),
    (["show", "nowhere.json"], ["does not exist"]),
    (["plan", "nosuchpkg.mod:make", "--cluster", "cpu"], ["cannot import module 'nosuchpkg.mod'"]),
])
def test_errors_exit_2_with_a_message(capsys, argv, words):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith("autopar: error: ")
    assert "Traceback" not in err and "Traceback" not in out
    for w in words:
        assert w in err, (w, err)


def test_bad_plan_file_exit_2(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 999}))
    code, _, err = run(capsys, "diff", str(bad), str(bad))
    assert code == 2 and "version 999" in err


def test_show_pipelined_plan_prints_stages_bubble_and_draws_the_timeline(capsys, tmp_path):
    """A pp=2 1F1B plan: `show` prints the stage table (ranks, blocks, alive micro-batches) and the
    bubble in the step-time breakdown; `--timeline` draws the simulated schedule to a PNG."""
    plan_file, png = tmp_path / "pp.json", tmp_path / "t.png"
    code, out, err = run(capsys, "plan", "gpt2", "--cluster", "cpu", "--devices", "2", "--precision", "fp32",
                         "--constraint", "pp=2", "--constraint", "pp_schedule=1f1b",
                         "--constraint", "num_micro_batches=4", "-o", str(plan_file))
    assert code == 0, err
    p = Plan.load(plan_file)
    code, out, err = run(capsys, "show", str(plan_file), "--timeline", str(png))
    assert code == 0, err
    assert "pipeline stages: pp=2 1f1b, 4 micro-batches" in out
    assert "(2 alive)" in out and "(1 alive)" in out      # 1F1B: stage 0 holds 2, stage 1 holds 1
    assert "pipeline bubble" in out
    from autopar.plans.report import _secs
    assert _secs(p.predictions["time_breakdown"]["bubble"]) in out
    assert f"timeline saved to {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_show_timeline_on_unpipelined_plan_is_a_clear_error(capsys, plans):
    auto, _ = plans
    code, out, err = run(capsys, "show", str(auto), "--timeline", "x.png")
    assert code == 2 and "pp=1" in err and "Traceback" not in err


def test_offload_pinned_from_the_command_line_and_shown(capsys, tmp_path):
    """`--constraint offload=optimizer` plans it; `autopar show` says what lives on the host."""
    path = tmp_path / "offload.json"
    code, _, err = run(capsys, "plan", "gpt2", "--cluster", "cpu", "--devices", "2",
                       "--constraint", "offload=optimizer", "-o", str(path))
    assert code == 0, err
    plan = Plan.load(path)
    assert plan.degrees["offload"] == "optimizer" and plan.predictions["offload"]["fraction"] == 1.0
    code, out, err = run(capsys, "show", str(path))
    assert code == 0, err
    assert "optimizer to host (100.0% of the parameters' elements)" in " ".join(out.split())
