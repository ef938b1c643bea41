"""autopar.Constraints (autopar/constraints.py): every key round-trips through the dict form, bad
keys and values are ConstraintErrors that say what to change, every key is documented (field
docstring and docs/constraints.md), and a dict and a Constraints give identical plans."""
import ast
import dataclasses
import json
import pickle
from pathlib import Path

import pytest

import autopar
from autopar import ConstraintError, Constraints, PlanError
from autopar.constraints import KEYS
from autopar.frontend.trace import trace
from autopar.models import ZOO

REPO = Path(__file__).resolve().parents[2]

# One valid value per key (with the keys it needs), as the dict form holds it.
VALUES = {
    "dp": {"dp": 2},
    "tp": {"tp": 4},
    "tp_mode": {"tp_mode": "2.5d"},
    "tp_shape": {"tp_shape": [2, 2, 2], "tp_mode": "3d"},
    "sp": {"sp": 2},
    "sp_mode": {"sp_mode": "ring-contiguous"},
    "sp_shape": {"sp_shape": [2, 4], "sp_mode": "hybrid", "sp": 8},
    "pp": {"pp": 1},
    "pp_schedule": {"pp_schedule": "interleaved-1f1b", "pp": 4},
    "micro_batch_size": {"micro_batch_size": 3},
    "num_micro_batches": {"num_micro_batches": 16},
    "zero": {"zero": 0},
    "checkpoint": {"checkpoint": {"blocks": "selective", "head": False}},
    "offload": {"offload": "none"},
}


def test_the_keys_are_plan_degrees():
    assert set(VALUES) == set(KEYS)
    assert KEYS[:3] == ("dp", "tp", "tp_mode")   # the order of the valid-keys list in messages


@pytest.mark.parametrize("key", KEYS)
def test_every_key_round_trips(key):
    d = VALUES[key]
    c = Constraints.from_dict(d)
    assert c.to_dict() == {k: d[k] for k in KEYS if k in d}   # pinned keys only, in field order
    assert c == Constraints(**d) == Constraints.coerce(c.to_dict()) == pickle.loads(pickle.dumps(c))
    assert hash(c) == hash(Constraints(**d))
    assert eval(repr(c), {"Constraints": Constraints}) == c
    assert {k for k in KEYS if getattr(c, k) is not None} == set(d)
    assert Constraints.coerce(c) is c


def test_nothing_pinned():
    assert Constraints().to_dict() == {} == Constraints.coerce(None).to_dict()
    assert Constraints.from_dict({"sp_mode": None, "pp_schedule": None}) == Constraints()   # None: not pinned
    assert repr(Constraints()) == "Constraints()"


def test_canonical_forms():
    c = Constraints.from_dict({"pp": 2, "pp_schedule": "ZB", "tp_shape": [2, 2], "offload": False,
                               "checkpoint": {"blocks": True}})
    assert c.pp_schedule == "zero-bubble" and c.tp_shape == (2, 2) and c.offload == "none"
    assert c.to_dict()["tp_shape"] == [2, 2] and c.to_dict()["checkpoint"] == {"blocks": True}
    for alias, name in (("interleaved", "interleaved-1f1b"), ("interleaved_1f1b", "interleaved-1f1b"),
                        ("zero_bubble", "zero-bubble"), ("1F1B", "1f1b")):
        assert Constraints(pp=2, pp_schedule=alias).pp_schedule == name


def test_frozen():
    c = Constraints(tp=2, checkpoint={"blocks": True})
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.tp = 4
    with pytest.raises(TypeError):
        c.checkpoint["blocks"] = False
    ck = {"blocks": True}
    c = Constraints(checkpoint=ck)
    ck["blocks"] = False   # a copy is held
    assert c.checkpoint["blocks"] is True
    assert dataclasses.replace(c, zero=1).to_dict() == {"zero": 1, "checkpoint": {"blocks": True}}
    with pytest.raises(ConstraintError, match="contradict"):
        dataclasses.replace(Constraints(zero=1), dp=1)   # a replaced field is validated too


@pytest.mark.parametrize("pins, words", [
    ({"tpp": 2}, ["unknown constraint 'tpp'", "did you mean 'tp'", "valid keys: dp, tp, tp_mode"]),
    ({"micro_batch": 2}, ["did you mean 'micro_batch_size'"]),
    ({"bananas": 2}, ["unknown constraint 'bananas'; valid keys"]),
    ({"dp": 0}, ["dp=0", "positive integer"]),
    ({"tp": 2.0}, ["tp=2.0", "positive integer"]),
    ({"sp": True}, ["sp=True", "positive integer"]),
    ({"pp": -1}, ["pp=-1", "positive integer (pipeline stages)"]),
    ({"micro_batch_size": "1"}, ["micro_batch_size='1'", "positive integer"]),
    ({"num_micro_batches": 0}, ["num_micro_batches=0", "positive integer"]),
    ({"zero": 5}, ["zero=5", "0, 1, 2 or 3"]),
    ({"zero": True}, ["zero=True", "0, 1, 2 or 3"]),
    ({"tp_mode": "4d"}, ["tp_mode='4d'", "'2.5d'"]),
    ({"tp_mode": "2D"}, ["'2d' now means SUMMA", "'2d-reshard'"]),
    ({"tp_shape": [2, 1]}, ["tp_shape=[2, 1]", "sizes > 1"]),
    ({"tp_shape": [2, 2, 2, 2], "tp_mode": "3d"}, ["one to three"]),
    ({"tp_shape": 4}, ["tp_shape=4"]),
    ({"tp_shape": [2, 2, 2]}, ["has three axes", "'2.5d'"]),
    ({"tp_shape": [2, 2], "tp_mode": "1d"}, ["tp_mode='1d' and tp_shape=[2, 2] contradict"]),
    ({"tp_shape": [4], "tp_mode": "2d-reshard"}, ["contradict", "'2d-reshard' two"]),
    ({"tp_shape": [2, 2], "tp": 2}, ["tp=2 and tp_shape=[2, 2] contradict", "product"]),
    ({"sp_mode": "diagonal"}, ["sp_mode='diagonal'", "must be one of", "'ulysses'"]),
    ({"sp_mode": "hybrid"}, ["needs the size of the sequence axes"]),
    ({"sp": 1, "sp_mode": "ring"}, ["sp=1 and sp_mode='ring' contradict"]),
    ({"sp": 2, "tp": 4, "sp_mode": "megatron"}, ["sp must equal tp"]),
    ({"tp": 1, "sp_mode": "megatron"}, ["needs tensor parallelism"]),
    ({"sp_shape": [4, 1], "sp_mode": "hybrid"}, ["sp_shape=[4, 1]: must be [u, r]"]),
    ({"sp_shape": [2, 2], "sp_mode": "ring"}, ["sp_shape=[2, 2] is the (Ulysses, ring) split", "sp_mode='ring'"]),
    ({"sp": 4, "sp_shape": [2, 3], "sp_mode": "hybrid"}, ["sp=4 and sp_shape=[2, 3] contradict"]),
    ({"sp": 5, "sp_mode": "hybrid"}, ["sp=5 with sp_mode='hybrid'", "not such a product"]),
    ({"pp": 2, "pp_schedule": "pipedream"}, ["pp_schedule='pipedream'", "known schedules are gpipe, 1f1b"]),
    ({"pp_schedule": "1f1b"}, ["needs pp > 1", "pin pp as well"]),
    ({"pp": 1, "pp_schedule": "gpipe"}, ["needs pp > 1", "got pp=1"]),
    ({"checkpoint": "sometimes"}, ["checkpoint='sometimes'", "must be 'none', 'selective', 'full' or a dict"]),
    ({"checkpoint": {}}, ["checkpoint={}"]),
    ({"checkpoint": {"blocks": "partial"}}, ["block group name -> bool or one of those"]),
    ({"checkpoint": True}, ["checkpoint=True"]),
    ({"offload": "optimizer+params", "zero": 2}, ["offload='optimizer+params' and zero=2 contradict", "pin zero=3"]),
    ({"offload": "optimizer", "tp_mode": "2d", "tp": 4}, ["offload='optimizer' cannot be met with tp_mode='2d'"]),
    ({"offload": "gpu"}, ["offload='gpu'", "'optimizer+params'"]),
    ({"zero": 3, "dp": 1}, ["zero=3 and dp=1 contradict each other", "Drop the zero pin"]),
])
def test_bad_pins_say_what_to_change(pins, words):
    with pytest.raises(ConstraintError) as ei:
        Constraints.from_dict(pins)
    assert isinstance(ei.value, PlanError)
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))


@pytest.mark.parametrize("value", [["tp=2"], "tp=2", 2, ("tp", 2)])
def test_constraints_must_be_a_dict_or_constraints(value):
    with pytest.raises(ConstraintError, match="must be a dict of degree pins"):
        Constraints.coerce(value)


def test_value_sets_agree_with_the_modules_using_them():
    from autopar.constraints import CHECKPOINT_MODES, PP_SCHEDULES, TP_MODES
    from autopar.plans.plan_schema import CHECKPOINT_MODES as PLAN_CHECKPOINT
    from autopar.search.grid_geometry import TP_MODES as GRID_TP_MODES
    from runtime.pipeline import SCHEDULES as RUN_SCHEDULES

    assert TP_MODES == GRID_TP_MODES
    assert CHECKPOINT_MODES == PLAN_CHECKPOINT
    assert set(PP_SCHEDULES) == set(RUN_SCHEDULES)


def _field_docs() -> dict[str, str]:
    """Each dataclass field's docstring (the string literal after it) in autopar/constraints.py."""
    tree = ast.parse((REPO / "autopar" / "constraints.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Constraints")
    docs = {}
    for a, b in zip(cls.body, cls.body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant):
            docs[a.target.id] = b.value.value
    return docs


def test_every_key_is_documented():
    docs = _field_docs()
    assert set(docs) == set(KEYS)
    assert all(len(d.split()) >= 10 for d in docs.values()), docs
    table = (REPO / "docs" / "constraints.md").read_text()
    rows = [line.split("|")[1].strip().strip("`") for line in table.splitlines() if line.startswith("| `")]
    assert rows == list(KEYS)
    assert "docs/constraints.md" in (REPO / "README.md").read_text()
    assert "docs/constraints.md" in (REPO / "autopar" / "api.py").read_text()


# ------------------------------------------------------------------ at the API boundary

@pytest.fixture(scope="module")
def gpt2():
    model, batch = ZOO["gpt2"]()
    return model, batch, trace(model, batch)


def _plan_json(gpt2, constraints) -> dict:
    model, batch, g = gpt2
    p = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=4), traced=g, constraints=constraints)
    return json.loads(p.to_json())


def _diff(a, b, path="$"):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            yield from _diff(a.get(k), b.get(k), f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _diff(x, y, f"{path}[{i}]")
    elif a != b:
        yield path


@pytest.mark.parametrize("pins", [
    {"tp": 2},
    {"dp": 4, "zero": 1},
    {"pp": 2, "pp_schedule": "gpipe", "num_micro_batches": 4},
    {"checkpoint": {"blocks": "full"}, "micro_batch_size": 2},
    {"tp_mode": "2d"},
    {"sp": 2, "sp_mode": "ulysses"},
])
def test_dict_and_constraints_give_identical_plans(gpt2, pins, monkeypatch):
    monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", "1")   # one process: the same search path each time
    as_dict = _plan_json(gpt2, pins)
    for other in (Constraints.from_dict(pins), Constraints(**pins)):
        diffs = list(_diff(as_dict, _plan_json(gpt2, other)))
        assert not diffs, diffs[:10]
    for k, v in pins.items():
        if k != "checkpoint":
            assert as_dict["degrees"][k] == v, (k, as_dict["degrees"])


def test_a_bad_pin_is_refused_before_tracing():
    import torch

    class Branchy(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:   # data-dependent control flow: a TraceError if it were traced
                return x.sum()
            return -x.sum()

    with pytest.raises(ConstraintError, match="did you mean 'zero'"):
        autopar.plan(Branchy(), (torch.randn(4, 4),), autopar.Cluster.preset("cpu", devices=2),
                     constraints={"zeroo": 1})


def test_search_entry_takes_either_form():
    from autopar.search.configurations import check_constraints

    pins = {"tp": 2, "pp_schedule": "zb", "pp": 2}
    assert check_constraints(pins) == check_constraints(Constraints.from_dict(pins)) == \
        {"tp": 2, "pp": 2, "pp_schedule": "zero-bubble"}
    with pytest.raises(ConstraintError, match=r"q\*q"):   # the grid check that stays with the grid modes
        check_constraints({"tp_mode": "2d", "tp": 8})


def test_cli_checks_the_pins_before_loading_the_model(capsys):
    from autopar.cli import main

    code = main(["plan", "no_such_module:factory", "--cluster", "cpu", "--devices", "2", "--constraint", "tpp=2"])
    err = capsys.readouterr().err
    assert code == 2 and "did you mean 'tp'" in err, err


def _compile_with(rank, world, pins):
    import torch
    model, batch = ZOO["mlp"]()
    torch.manual_seed(0)
    try:
        cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                             plan_options={"constraints": pins})
    except (autopar.ExecutionError, autopar.ConstraintError) as e:
        return f"{type(e).__name__}: {e}"
    return cm.plan.degrees


@pytest.mark.slow
def test_compile_takes_constraints_in_plan_options():
    from runtime.launch import run_local

    pins = Constraints(dp=2, num_micro_batches=2)
    for degrees in run_local(_compile_with, 2, args=(pins,), timeout=120):
        assert degrees["dp"] == 2 and degrees["num_micro_batches"] == 2, degrees
    # a bad pin fails in compile itself, on every rank alike (not when rank 0 plans)
    for msg in run_local(_compile_with, 2, args=({"dpp": 2},), timeout=120):
        assert msg.startswith("ConstraintError: unknown constraint 'dpp'"), msg
