"""Multi-process execution of plans (gloo, forked ranks) against a single-process eager run of the
same model, seed and batch: the loss at every step (rtol 1e-5) and every parameter after 3 steps of
SGD with momentum (rtol 1e-4) must agree, fp32. SGD, not Adam: Adam's g/sqrt(v) turns fp32
reduction-order noise on near-zero gradients into visible parameter differences (shared/facts.md)."""
from __future__ import annotations

import pytest
import torch
from helpers.exactness import assert_matches_eager, train_eagerly

import autopar
from autopar.errors import ExecutionError
from autopar.models import HF_ZOO, ZOO
from runtime.launch import LocalLaunchError, run_local

# Forked ranks deadlock in OpenMP if the parent already ran a multi-threaded op (the eager
# reference runs here): keep the parent single-threaded (the machine has 2 cores anyway).
torch.set_num_threads(1)

STEPS = 3
FACTORIES = {**ZOO, **HF_ZOO}
OPT = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}   # compile's optimizer; eager uses the same
PARAM_RTOL = 1e-4


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=OPT["lr"], momentum=OPT["momentum"])


def reference(name: str, steps: int = STEPS, **kw):
    """Eager single-process training: (losses, final state_dict)."""
    model, batch = FACTORIES[name](**kw)
    return train_eagerly(model, batch, _sgd(model), steps)


def _train(rank, world, name, devices, constraints, plan_json, steps, kw):
    model, batch = FACTORIES[name](**kw)
    cluster = autopar.Cluster.preset("cpu", devices=devices)
    plan = autopar.Plan.from_json(plan_json) if plan_json else None
    cm = autopar.compile(model, cluster, example_inputs=batch, plan=plan, **OPT,
                         plan_options={"constraints": constraints})
    losses = [cm.step(*batch) for _ in range(steps)]
    sd = {k: v.numpy() for k, v in cm.full_state_dict().items()}   # numpy: plain pickling through the queue
    return losses, (sd if rank == 0 else None), cm.plan.degrees, cm.comm_stats()


def run_plan(name, nprocs, constraints=None, plan_json=None, steps=STEPS, plan_in_compile=False, policy=None,
             memory_budget=None, **kw):
    if plan_json is None and not plan_in_compile:
        # Plan here: the ILP solver is much slower inside forked ranks. autopar.compile's own
        # planning path (plan=None) is covered by test_compile_plans_on_rank_0.
        model, batch = FACTORIES[name](**kw)
        plan_json = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=nprocs),
                                 constraints=constraints, policy=policy, memory_budget=memory_budget).to_json()
    res = run_local(_train, nprocs, args=(name, nprocs, constraints, plan_json, steps, kw), timeout=240)
    return res


def check_against_reference(name, nprocs, constraints=None, plan_in_compile=False, moves=(), policy=None,
                            memory_budget=None, **kw):
    """``moves``: mesh axes that must carry bytes at run time (the premise of a test named for a
    parallel mode). Whatever it names, some axis must: a run that moves nothing repeats the whole
    model on every rank, and comparing it with eager would compare eager with eager."""
    ref_losses, ref_sd = reference(name, **kw)
    res = run_plan(name, nprocs, constraints, plan_in_compile=plan_in_compile, policy=policy,
                   memory_budget=memory_budget, **kw)
    stats = res[0][3]
    assert any(v > 0 for v in stats.values()), f"nothing moved on any mesh axis: {stats}"
    for axis in moves:
        assert stats.get(axis, 0) > 0, f"no bytes moved on mesh axis {axis!r}: {stats}"
    assert_matches_eager([out[0] for out in res], res[0][1], ref_losses, ref_sd, param_rtol=PARAM_RTOL)
    return res


NM1 = {"num_micro_batches": 1}


@pytest.mark.slow
@pytest.mark.parametrize("nprocs", [2, 4])
def test_pure_dp_mlp(nprocs):
    res = check_against_reference("mlp", nprocs, {"dp": nprocs, "tp": 1, "zero": 0, **NM1}, moves=("dp",))
    assert res[0][2]["dp"] == nprocs


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_gpt2(zero):
    res = check_against_reference("gpt2", 2, {"dp": 2, "tp": 1, "zero": zero, **NM1})
    assert res[0][2]["zero"] == zero


@pytest.mark.slow
def test_tp_mlp_2():
    # Megatron column/row splits: on the cpu preset the search alone replicates a model this small.
    res = check_against_reference("mlp", 2, {"dp": 1, "tp": 2, **NM1}, moves=("tp",), policy="megatron")
    assert res[0][2]["tp"] == 2


@pytest.mark.slow
def test_tp_gpt2_4():
    res = check_against_reference("gpt2", 4, {"dp": 1, "tp": 4, **NM1}, moves=("tp",))
    assert res[0][2]["tp"] == 4


@pytest.mark.slow
def test_dp_tp_gpt2_2x2():
    res = check_against_reference("gpt2", 4, {"dp": 2, "tp": 2, **NM1}, moves=("dp", "tp"))
    assert (res[0][2]["dp"], res[0][2]["tp"]) == (2, 2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "vit", "mlp"])
def test_automatic_plan_zoo(name):
    """The planner's own choice for 4 CPU devices (e.g. gpt2: dp=2 x tp=2). Should the tiny MLP's
    free choice replicate everything (nothing to compare; it did before the cpu preset was
    calibrated), a budget of 60% of that plan's peak makes the search split it."""
    budget = None
    if name == "mlp":
        model, batch = FACTORIES[name]()
        free = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=4))
        assert free.predictions["split_share"]
        if not any(free.predictions["split_share"].values()):
            budget = 0.6 * free.peak_memory
    check_against_reference(name, 4, None, memory_budget=budget)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_bert", "hf_gpt2", "hf_llama"])   # the rest: tests/models/test_hf_suite.py
def test_automatic_plan_hugging_face(name):
    """Hugging Face models built from configs (torch.export graphs with higher-order ops, fp32
    masks, rotary submodules) train under their automatic 4-device plan like eager."""
    pytest.importorskip("transformers")
    check_against_reference(name, 4, None)


@pytest.mark.slow
def test_compile_plans_on_rank_0():
    """plan=None: rank 0 plans and broadcasts the JSON. In a fresh interpreter: the ILP solver's
    threads do not survive a fork once this (pytest) process has planned."""
    import os
    import subprocess
    import sys

    code = ("import sys; sys.path[:0] = [%r, %r]; import test_execute as t; "
            "t.check_against_reference('gpt2', 2, {'num_micro_batches': 1}, plan_in_compile=True, moves=('dp',)); "
            "print('OK')"
            % (os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def _lazy_and_local_rows(rank, world, constraints):
    """compile(model, cluster) alone: set-up (and planning on rank 0) at the first step; then a
    step fed only this rank's rows (batch_rows()), then a forward-only evaluation."""
    model, batch = ZOO["gpt2"](batch=8)
    cluster = autopar.Cluster.preset("cpu", devices=world)
    cm = autopar.compile(model, cluster, **OPT,
                         **({"plan_options": {"constraints": constraints}} if constraints else {}))
    first = cm.step(*batch)
    rows = cm.batch_rows()
    second = cm.step(*(x[rows] for x in batch))
    evaluation = float(cm(*batch))
    return first, second, evaluation, rows, cm.plan.degrees


def check_lazy_and_local_rows():
    """Run by test_compile_with_only_model_and_cluster in a fresh interpreter."""
    model, batch = ZOO["gpt2"](batch=8)
    opt = _sgd(model)
    want = []
    for _ in range(2):
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        opt.step()
        want.append(loss.item())
    with torch.no_grad():
        want.append(model(*batch).item())
    for constraints in (None, {"dp": 2, "tp": 1, "num_micro_batches": 2}):
        res = run_local(_lazy_and_local_rows, 2, args=(constraints,), timeout=240)
        for first, second, evaluation, rows, degrees in res:
            torch.testing.assert_close(torch.tensor([first, second, evaluation]), torch.tensor(want),
                                       rtol=1e-5, atol=1e-6)
        if constraints:   # the data split really hands each rank half the rows, micro-batch by micro-batch
            assert res[0][3] == [0, 1, 4, 5] and res[1][3] == [2, 3, 6, 7], (res[0][3], res[1][3])


@pytest.mark.slow
def test_compile_with_only_model_and_cluster():
    import os
    import subprocess
    import sys

    code = ("import sys; sys.path[:0] = [%r, %r]; import test_execute as t; t.check_lazy_and_local_rows(); print('OK')"
            % (os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=400)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def _force(plan_json: str, picks: dict) -> str:
    """Replace the strategies of some ops by the named candidate (a hand-edited plan)."""
    import json

    from autopar.rules import spec_for
    from autopar.frontend.trace import trace
    from autopar.rules.strategy import enumerate_strategies

    data = json.loads(plan_json)
    plan = autopar.Plan(data)
    model, batch = ZOO["gpt2"]()
    nodes = {n.name: n for n in trace(model, batch).gm.graph.nodes}
    for op in data["ops"]:
        want = picks.get(op["node"])
        if want is None:
            continue
        cands = enumerate_strategies(spec_for(nodes[op["node"]]), plan.mesh)
        st = next(s for s in cands if want(s))
        op.update(strategy=st.name, inputs=[None if l is None else l.to_json() for l in st.inputs],
                  outputs=[l.to_json() for l in st.outputs], splits=list(st.splits), special=list(st.special))
    return json.dumps(data)


@pytest.mark.slow
def test_vocab_parallel_embedding_and_cross_entropy():
    model, batch = ZOO["gpt2"]()
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2), constraints={"tp": 2, **NM1})
    forced = _force(plan.to_json(), {
        "embedding": lambda s: "vocab_parallel_embedding" in s.special,
        "linear_8": lambda s: s.name == "S(n)@tp",          # lm head split on the vocabulary
        "view_6": lambda s: s.name == "S(c)@tp",
        "cross_entropy_loss": lambda s: "vocab_parallel_ce" in s.special,
    })
    assert "vocab_parallel_ce" in forced and "vocab_parallel_embedding" in forced
    ref_losses, ref_sd = reference("gpt2")
    res = run_plan("gpt2", 2, plan_json=forced)
    torch.testing.assert_close(torch.tensor(res[0][0]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for k in ref_sd:
        torch.testing.assert_close(torch.from_numpy(res[0][1][k]), ref_sd[k], rtol=PARAM_RTOL, atol=1e-6)


@pytest.mark.slow
def test_eight_processes_dp_tp():
    res = check_against_reference("gpt2", 8, {"dp": 2, "tp": 4, **NM1}, moves=("dp", "tp"), policy="megatron")
    assert res[0][2]["dp"] == 2


def _check_plan_against_reference(name, plan):
    ref_losses, ref_sd = reference(name)
    res = run_plan(name, plan.mesh.size, plan_json=plan.to_json())
    for losses, _, _, _ in res:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for k in ref_sd:
        torch.testing.assert_close(torch.from_numpy(res[0][1][k]), ref_sd[k], rtol=PARAM_RTOL, atol=1e-6,
                                   msg=lambda m: f"{k}: {m}")


def _axes_splitting_params(plan) -> set[int]:
    return {a for v in plan.data["params"].values() for d in v["layout"]["dims"] for a in d}


@pytest.mark.slow
def test_2d_tensor_parallel_weights_split_over_two_axes():
    """dp=1 x tp=2 x tp2=2 (tp_mode "2d-reshard"): MLP weights split over both model axes at once."""
    model, batch = ZOO["gpt2"]()
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=4),
                        constraints={"dp": 1, "tp": 4, "tp_shape": [2, 2], **NM1})
    assert plan.degrees["tp_mode"] == "2d-reshard"
    assert any("@tp " in o["strategy"] + " " and "@tp2" in o["strategy"] for o in plan.data["ops"])
    _check_plan_against_reference("gpt2", plan)


@pytest.mark.slow
def test_three_d_mesh_dp_tp_tp2():
    """dp=2 x tp=2 x tp2=2 on 8 processes; a budget below the dp x tp plan's peak makes the planner
    split parameters over the third axis too (a real 3-D mix, not a degenerate axis)."""
    model, batch = ZOO["gpt2"]()
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=8), memory_budget=1.2e6,
                        constraints={"dp": 2, "tp": 4, "tp_shape": [2, 2], "zero": 0, **NM1})
    assert tuple(plan.mesh.shape) == (2, 2, 2)
    assert {1, 2} <= _axes_splitting_params(plan), "no parameter split over both model axes"
    _check_plan_against_reference("gpt2", plan)


@pytest.mark.slow
def test_micro_batches_zero2():
    res = check_against_reference("mlp", 2, {"dp": 2, "tp": 1, "zero": 2, "num_micro_batches": 2})
    assert res[0][2]["num_micro_batches"] == 2


# ------------------------------------------------------------------ checkpoints

def _ckpt_phase(rank, world, directory, phase, plan_json):
    model, batch = ZOO["gpt2"]()
    cluster = autopar.Cluster.preset("cpu", devices=world)
    cm = autopar.compile(model, cluster, example_inputs=batch, **OPT, plan=autopar.Plan.from_json(plan_json))
    if phase == "save":
        losses = [cm.step(*batch) for _ in range(2)]
        cm.save(directory)
    else:
        cm.load(directory)
        losses = [cm.step(*batch)]
    return losses, cm.plan.data["mesh"]["shape"]


@pytest.mark.slow
def test_checkpoint_4_to_2_processes(tmp_path):
    ref_losses, _ = reference("gpt2")
    saved = run_local(_ckpt_phase, 4, args=(str(tmp_path / "ck"), "save", _plan_json("gpt2", 4)))
    loaded = run_local(_ckpt_phase, 2, args=(str(tmp_path / "ck"), "load", _plan_json("gpt2", 2)))
    assert saved[0][1] != loaded[0][1]      # really another plan
    torch.testing.assert_close(torch.tensor(saved[0][0] + loaded[0][0]), torch.tensor(ref_losses),
                               rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ errors

def _wrong_model(rank, world, plan_json):
    model, batch = ZOO["mlp"](hidden=32)
    cm_plan = autopar.Plan.from_json(plan_json)
    try:
        autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch, plan=cm_plan)
    except ExecutionError as e:
        return str(e)
    return None


def _plan_json(name, devices, **kw):
    model, batch = ZOO[name](**kw)
    return autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=devices),
                        constraints=NM1).to_json()


@pytest.mark.slow
def test_plan_for_a_different_model_is_rejected():
    msgs = run_local(_wrong_model, 2, args=(_plan_json("mlp", 2),))
    assert all(m and "different model" in m for m in msgs)


@pytest.mark.slow
def test_world_size_mismatch_is_rejected():
    msgs = run_local(_wrong_model, 2, args=(_plan_json("mlp", 4, hidden=32),))
    assert all(m and "4 devices" in m and "2 ranks" in m for m in msgs)


def _dies(rank, world, plan_json):
    model, batch = ZOO["mlp"]()
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json))
    cm.step(*batch)
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    cm.step(*batch)   # rank 0 waits in a collective for a peer that is gone
    return "finished"


@pytest.mark.slow
def test_rank_raising_mid_step_is_reported_without_hanging():
    import time

    t0 = time.perf_counter()
    with pytest.raises(LocalLaunchError, match="rank 1 fails on purpose"):
        run_local(_dies, 2, args=(_plan_json("mlp", 2),), timeout=60, pg_timeout=10)
    assert time.perf_counter() - t0 < 60


def _killed_in_backward(rank, world, plan_json):
    import os

    model, batch = ZOO["mlp"]()
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json))
    cm.step(*batch)
    if rank == 1:   # dies hard early in the next backward (the last layer's gradient): no exception, no report
        list(cm.params.values())[-1].register_hook(lambda g: os._exit(3))
    cm.step(*batch)
    return "finished"


@pytest.mark.slow
def test_rank_killed_mid_step_gives_every_rank_a_clear_error():
    import time

    t0 = time.perf_counter()
    with pytest.raises(LocalLaunchError) as ei:
        plan = autopar.plan(*ZOO["mlp"](), autopar.Cluster.preset("cpu", devices=2),
                            constraints={"dp": 2, "tp": 1, **NM1})   # rank 0 needs rank 1's gradients
        run_local(_killed_in_backward, 2, args=(plan.to_json(),), timeout=120, pg_timeout=10)
    msg = str(ei.value)
    assert "rank 1 exited with code 3" in msg, msg
    # the survivor reports an ExecutionError of its own (the collective failed), not a hang, naming
    # the rank whose process is gone (autopar/execution/step_guard.py)
    assert ("rank 0: autopar.errors.ExecutionError: rank 0: training step failed because rank 1 failed: "
            "its process is gone and reported no cause") in msg, msg
    assert time.perf_counter() - t0 < 60
