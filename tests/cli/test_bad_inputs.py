"""The first hour: every mistake a user makes gets ONE clear, actionable error.

Table-driven: each case is a mistake found by trying autopar as a new user would, the error class
it must raise (or the CLI exit code), a key phrase of the message, and — for the CLI — that no
traceback is printed. Multi-process cases (step, checkpoints) live in tests/execution/test_step_inputs.py
and tests/models/test_model_quirks.py; this file covers planning, plan files, clusters and the CLI.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import autopar
from autopar import ClusterError, ConstraintError, PlanError, TraceError
from autopar.cli import main
from autopar.models import ZOO

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    p = d / "mlp.json"
    model, batch = ZOO["mlp"]()
    autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2)).save(p)
    return p


def _edited(plan_file: Path, tmp: Path, edit) -> Path:
    data = json.loads(plan_file.read_text())
    edit(data)
    out = tmp / "edited.json"
    out.write_text(json.dumps(data))
    return out


def _del(path):
    def edit(d):
        *parents, last = path.split(".")
        for k in parents:
            d = d[k]
        del d[last]
    return edit


def _set(path, value):
    def edit(d):
        *parents, last = path.split(".")
        for k in parents:
            d = d[k]
        d[last] = value
    return edit


# ------------------------------------------------------------------ CLI: (argv, exit code, key phrase)

CLI_CASES = [
    # arguments
    (["plan", "mlp", "--cluster", "cpu", "--devices", "0"], 2, "--devices must be at least 1"),
    (["plan", "mlp", "--cluster", "cpu", "--nodes", "0"], 2, "--nodes must be at least 1"),
    (["run", "-n", "0", "script.py"], 2, "-n must be at least 1"),
    (["plan", "mlp", "--cluster", "cpu", "--devices", "2", "--time-limit", "-5"], 2, "--time-limit must be positive"),
    (["plan", "mlp", "--cluster", "cpu", "--devices", "2", "--memory-budget", "40 parsecs"], 2, "unknown unit"),
    (["plan", "mlp", "--cluster", "cpu", "--devices", "2", "--constraint", "tp"], 2, "--constraint expects name=value"),
    (["plan", "mlp", "--cluster", "cpu", "--devices", "2", "--constraint", "tp=2", "--constraint", "tp=1"], 2,
     "--constraint tp is given twice"),
    (["plan", "mlp", "--cluster", "cpu", "--devices", "2", "--arg", "nonexistent=1"], 2,
     "takes no argument 'nonexistent'"),
    (["plan", "gpt2", "--cluster", "cpu", "--devices", "2", "--arg", "batch=0"], 2, "empty dimension"),
    (["plan", "mlp", "--cluster", "cpu", "--devices", "2", "--constraint", "zero=3", "--constraint", "dp=1"], 2,
     "contradict each other"),
]


@pytest.mark.parametrize("argv, code, phrase", CLI_CASES, ids=[" ".join(c[0][2:6]) for c in CLI_CASES])
def test_cli_mistakes(capsys, argv, code, phrase):
    got = main(argv)
    out, err = capsys.readouterr()
    assert got == code, (got, err)
    assert phrase in err, err
    assert "Traceback" not in err + out


def test_memory_budget_with_units_is_accepted(capsys, tmp_path):
    out_file = tmp_path / "p.json"
    assert main(["plan", "mlp", "--cluster", "cpu", "--devices", "2", "--memory-budget", "40MB",
                 "-o", str(out_file)]) == 0
    assert autopar.Plan.load(out_file).data["settings"]["memory_budget"] == 40e6


PLAN_FILE_CASES = [
    ("version as a string", _set("version", "1"), "field 'version' must be an integer"),
    ("no predictions", _del("predictions"), "field 'predictions' is missing"),
    ("no mesh names", _del("mesh.names"), "field 'mesh.names' is missing"),
    ("step time a string", _set("predictions.step_time", "fast"), "field 'predictions.step_time' must be a number"),
    ("future version", _set("version", 99), "plan version 99 is not supported"),
]


@pytest.mark.parametrize("what, edit, phrase", PLAN_FILE_CASES, ids=[c[0] for c in PLAN_FILE_CASES])
@pytest.mark.parametrize("command", ["show", "diff"])
def test_damaged_plan_files(capsys, plan_file, tmp_path, what, edit, phrase, command):
    bad = _edited(plan_file, tmp_path, edit)
    argv = [command, str(bad)] + ([str(plan_file)] if command == "diff" else [])
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert phrase in err and "Traceback" not in err + out, err
    with pytest.raises(PlanError, match="re-|not supported"):
        autopar.Plan.load(bad)


def test_plan_path_that_is_a_directory(capsys, tmp_path):
    assert main(["show", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert "is a directory, not a plan file" in err and "Traceback" not in err


def test_diff_of_two_models_is_refused_unless_forced(capsys, plan_file, tmp_path):
    other = tmp_path / "gpt.json"
    model, batch = ZOO["mlp"](hidden=32)
    autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2)).save(other)
    assert main(["diff", str(plan_file), str(other)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["diff", str(plan_file), str(other), "--force"]) in (0, 1)


def test_show_code_needs_the_factory_and_a_valid_rank(capsys, plan_file):
    assert main(["show", str(plan_file), "--code"]) == 2
    assert "--factory" in capsys.readouterr().err
    assert main(["show", str(plan_file), "--code", "--factory", "mlp", "--rank", "99"]) == 2
    assert "--rank 99 is outside the plan's mesh" in capsys.readouterr().err


def test_internal_errors_are_one_line_with_v_for_the_traceback(capsys, monkeypatch):
    import autopar.cli as cli

    def boom(args):
        raise KeyError("bug")
    monkeypatch.setattr(cli, "cmd_ops", boom)
    assert main(["ops", "mlp"]) == 4
    err = capsys.readouterr().err
    assert "internal error" in err and "-v" in err and "Traceback" not in err
    assert main(["-v", "ops", "mlp"]) == 4
    assert "Traceback" in capsys.readouterr().err


# ------------------------------------------------------------------ API: (call, error class, key phrase)

def _mlp():
    return ZOO["mlp"]()


CPU2 = autopar.Cluster.preset("cpu", devices=2)

API_CASES = [
    ("memory_budget with an unknown unit", dict(memory_budget="80 parsecs"), PlanError, "unknown unit"),
    ("negative time limit", dict(time_limit=-5), PlanError, "time_limit must be positive"),
    ("constraints as a list", dict(constraints=["tp=2"]), ConstraintError, "must be a dict of degree pins"),
    ("zero with dp=1", dict(constraints={"zero": 3, "dp": 1}), ConstraintError, "contradict each other"),
    ("unknown constraint", dict(constraints={"tpp": 2}), ConstraintError, "did you mean 'tp'"),
]


@pytest.mark.parametrize("what, kw, cls, phrase", API_CASES, ids=[c[0] for c in API_CASES])
def test_plan_api_mistakes(what, kw, cls, phrase):
    model, batch = _mlp()
    with pytest.raises(cls, match=phrase):
        autopar.plan(model, batch, CPU2, **kw)


def test_memory_budget_accepts_units():
    model, batch = _mlp()
    assert autopar.plan(model, batch, CPU2, memory_budget="80MB").data["settings"]["memory_budget"] == 80e6
    assert autopar.plan(model, batch, CPU2, memory_budget="1GiB").data["settings"]["memory_budget"] == 2**30


def test_dict_batch_is_explained():
    model, (x, y) = _mlp()
    with pytest.raises(PlanError, match="tuple of tensors in the order of forward's arguments"):
        autopar.plan(model, ({"x": x, "y": y},), CPU2)


def test_implausible_bare_number_in_a_cluster_file_warns(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("name: t\nnodes: 1\ndevices_per_node: 2\n"
                 "device: {name: x, memory: 80GB, peak_flops: {bf16: 312T, fp32: 156T}, hbm_bandwidth: 2TB/s}\n"
                 "links:\n  intra: {bandwidth: 200GB/s, latency: 10}\n  inter: {bandwidth: 20GB/s, latency: 5us}\n")
    with pytest.warns(UserWarning, match=r"links.intra.latency = 10 .* implausible"):
        c = autopar.Cluster.from_yaml(f)
    assert c.intra_link.latency == 10.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # with units: no warning
        f.write_text(f.read_text().replace("latency: 10}", "latency: 10us}"))
        assert autopar.Cluster.from_yaml(f).intra_link.latency == pytest.approx(1e-5)


def test_cluster_file_errors_name_the_field(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("name: t\nnodes: 1\ndevices_per_node: 2\n"
                 "device: {name: x, memory: lots, peak_flops: {bf16: 312T, fp32: 156T}, hbm_bandwidth: 2TB/s}\n"
                 "links:\n  intra: {bandwidth: 200GB/s, latency: 5us}\n  inter: {bandwidth: 20GB/s, latency: 5us}\n")
    with pytest.raises(ClusterError, match="device.memory"):
        autopar.Cluster.from_yaml(f)


class _TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, y):
        out = self.lin(x)
        return out, ((out - y) ** 2).mean()


class _Regression(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, y):
        return ((self.lin(x) - y) ** 2).mean()


X, Y = torch.randn(2, 4), torch.randn(2, 4)
TRACE_CASES = [
    ("forward returns (logits, loss)", _TwoOutputs, (X, Y), "returns 2 outputs (e.g. (logits, loss))"),
    ("one input for two arguments", _Regression, (X,), "missing a required argument: 'y' (got 1 input)"),
    ("three inputs for two arguments", _Regression, (X, Y, Y), "too many positional arguments (got 3 inputs)"),
]


@pytest.mark.parametrize("what, cls, inputs, phrase", TRACE_CASES, ids=[c[0] for c in TRACE_CASES])
def test_trace_mistakes_are_one_message(capfd, what, cls, inputs, phrase):
    with pytest.raises(TraceError) as ei:
        autopar.plan(cls(), inputs, CPU2)
    msg = str(ei.value)
    assert phrase in msg and msg.count(phrase) == 1, msg   # said once, not once per front end
    assert "<unknown" not in msg and "inspect.py" not in msg, msg


def test_untraceable_forward_names_module_and_line(capfd):
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            if self.lin(x).sum() > 0:
                return self.lin(x).sum()
            return self.lin(x).mean()

    capfd.readouterr()
    with pytest.raises(TraceError, match="torch.cond") as ei:
        autopar.plan(Branchy(), (torch.randn(2, 4),), CPU2)
    assert "Branchy" in str(ei.value) and "test_bad_inputs.py" in str(ei.value)
    out, err = capfd.readouterr()
    assert "def forward" not in err + out, err   # torch's partial-graph dump is held back


# ------------------------------------------------------------------ running: (mistake, key phrase)

def _run_mistake(rank, world, plan_json, case, tmp):
    from autopar.errors import ExecutionError

    model, batch = ZOO["gpt2"]()
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), optimizer="sgd", lr=0.1)
    x, y = batch
    calls = {
        "another sequence length": lambda: cm.step(x[:, :8], y[:, :8]),
        "one input instead of two": lambda: cm.step(x),
        "an extra input": lambda: cm.step(x, y, y),
        "a token outside the vocabulary": lambda: cm.step(x + 10_000, y),
        "a checkpoint directory that does not exist": lambda: cm.load(f"{tmp}/nowhere"),
        "a file given as checkpoint directory": lambda: cm.load(__file__),
        "another model's checkpoint": lambda: _save_other_then_load(cm, world, f"{tmp}/other"),
    }
    try:
        calls[case]()
    except ExecutionError as e:
        return "ExecutionError", str(e)
    except BaseException as e:   # anything else is a failure of this test: say what it was
        return type(e).__name__, str(e)
    return None, "no error"


def _save_other_then_load(cm, world, directory):
    other, batch = ZOO["gpt2"](n_layer=1)
    autopar.compile(other, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                    plan_options={"constraints": {"dp": world, "tp": 1, "num_micro_batches": 1}}).save(directory)
    cm.load(directory)


RUN_CASES = [
    ("another sequence length", "the plan is fixed to the example batch's shapes"),
    ("one input instead of two", "step() got 1 inputs"),
    ("an extra input", "step() got 3 inputs"),
    ("a token outside the vocabulary", "outside the 256 embedding rows (vocabulary size) of wte"),
    ("a checkpoint directory that does not exist", "does not exist"),
    ("a file given as checkpoint directory", "is a file, not a checkpoint directory"),
    ("another model's checkpoint", "does not match this model"),
]


@pytest.fixture(scope="module")
def gpt_dp2_plan():
    model, batch = ZOO["gpt2"]()
    return autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2),
                        constraints={"dp": 2, "tp": 1, "num_micro_batches": 1}).to_json()


@pytest.mark.slow
@pytest.mark.parametrize("case, phrase", RUN_CASES, ids=[c[0] for c in RUN_CASES])
def test_running_mistakes(gpt_dp2_plan, tmp_path, case, phrase):
    from runtime.launch import run_local

    torch.set_num_threads(1)
    res = run_local(_run_mistake, 2, args=(gpt_dp2_plan, case, str(tmp_path)), timeout=120, pg_timeout=20)
    for kind, msg in res:   # every rank gets the same clear error, none hangs
        assert kind == "ExecutionError" and phrase in msg, (kind, msg)
