"""Activation checkpointing executed (codegen/checkpoint.py, runtime/checkpoint.py).

Plans with checkpoint none / full / mixed run on 2 and 4 gloo processes (data parallel,
dp x Megatron tp, ZeRO-3) against eager single-process training: SGD with momentum, fp32, 3
steps, losses rel 1e-5 and parameters rel 1e-4. Each run also proves the premise (region bodies
ran once in forward and once more in backward per step, as many as the plan checkpoints) and
measures saved activations on the per-rank program against the plan's
``memory_breakdown["activations"]`` (within 2%):

- forward of the per-rank program under ``torch.autograd.graph.saved_tensors_hooks``: every
  storage autograd saves, counted once (identified by its StorageImpl, ``untyped_storage()._cdata``:
  freed ZeRO-3 buffers and meta tensors all have data pointer 0), parameters excluded. Inside a
  checkpoint region torch.utils.checkpoint's own hooks take the saves, so this sees only what is
  saved outside regions;
- plus what each region keeps: its tensor inputs (``runtime.checkpoint.record_regions``);
- plus the recompute-time working set: the largest set of new storages one region's body saves
  when run with autograd (what its recomputation saves in backward), measured the same way.

A mixed plan needs two block groups: ``two_stacks`` has two ``nn.ModuleList``s of GPT blocks of
different widths; ``constraints={"checkpoint": {"lower": True, "upper": False}}`` pins one.
"""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.models import ZOO
from runtime import checkpoint as RCK
from runtime.launch import run_local

from helpers.checkpoint_training import (FACTORIES, two_stacks, STEPS, program_grads, reference,
                                        train_measured)

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP otherwise (see tests/execution/test_execute.py)


# ------------------------------------------------------------------ measuring saved activations


# ------------------------------------------------------------------ multi-process runs


def _train(rank, world, name, plan_json, steps, kw, measure):
    torch.manual_seed(1234)   # the same dropout masks on every run of a test
    model, batch = FACTORIES[name](**kw)
    cm, out = train_measured(rank, world, model, batch, plan_json, steps, measure)
    return dict(out, stats=(RCK.STATS.forward, RCK.STATS.recompute), code=cm.program.code if rank == 0 else None)


def make_plan(name, devices, constraints, policy=None, **kw):
    model, batch = FACTORIES[name](**kw)
    return autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=devices), precision="fp32",
                        constraints={"num_micro_batches": 1, **constraints}, policy=policy)


def run(plan, name, steps=STEPS, measure=True, **kw):
    return run_local(_train, plan.mesh.size, args=(name, plan.to_json(), steps, kw, measure), timeout=400)


# name -> (model, devices, constraints, policy, expected plan checkpoint per group)
CASES = {
    "gpt2-dp2-none": ("gpt2", 2, {"dp": 2, "tp": 1, "zero": 0, "checkpoint": "none"}, None, {"blocks": False}),
    "gpt2-dp2-full": ("gpt2", 2, {"dp": 2, "tp": 1, "zero": 0, "checkpoint": "full"}, None, {"blocks": True}),
    "gpt2-dp2xtp2-none": ("gpt2", 4, {"dp": 2, "tp": 2, "zero": 0, "checkpoint": "none"}, "megatron",
                          {"blocks": False}),
    "gpt2-dp2-zero3-full": ("gpt2", 2, {"dp": 2, "tp": 1, "zero": 3, "checkpoint": "full"}, None,
                            {"blocks": True}),
    "gpt2-dp2xtp2-full": ("gpt2", 4, {"dp": 2, "tp": 2, "zero": 0, "checkpoint": "full"}, "megatron",
                          {"blocks": True}),
    "two-dp2-mixed": ("two_stacks", 2, {"dp": 2, "tp": 1, "zero": 0,
                                        "checkpoint": {"lower": True, "upper": False}}, None,
                      {"lower": True, "upper": False}),
    "two-dp2-full": ("two_stacks", 2, {"dp": 2, "tp": 1, "zero": 0, "checkpoint": "full"}, None,
                     {"lower": True, "upper": True}),
    "gpt2-dp2-full-nm2": ("gpt2", 2, {"dp": 2, "tp": 1, "zero": 2, "checkpoint": "full", "num_micro_batches": 2},
                          None, {"blocks": True}),
    "two-dp2xtp2-mixed": ("two_stacks", 4, {"dp": 2, "tp": 2, "zero": 1,
                                            "checkpoint": {"lower": False, "upper": True}}, "megatron",
                          {"lower": False, "upper": True}),
}

_RESULTS: dict = {}


def run_case(key):
    if key not in _RESULTS:
        name, devices, cons, policy, want = CASES[key]
        plan = make_plan(name, devices, cons, policy)
        assert plan.data["stages"][0]["checkpoint"] == want, plan.data["stages"][0]["checkpoint"]
        _RESULTS[key] = (plan, run(plan, name))
    return _RESULTS[key]


@pytest.mark.slow
@pytest.mark.parametrize("key", list(CASES))
def test_checkpointed_training_matches_eager(key):
    plan, res = run_case(key)
    name = CASES[key][0]
    ref_losses, ref_sd = reference(name)
    for r in res:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for k, v in ref_sd.items():
        torch.testing.assert_close(torch.from_numpy(res[0]["sd"][k]), v, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"{k}: {m}")
    if "tp" in key:   # the tensor-parallel axis really splits the blocks' weights
        assert any(a == 1 for v in plan.data["params"].values() for d in v["layout"]["dims"] for a in d)


@pytest.mark.slow
@pytest.mark.parametrize("key", list(CASES))
def test_recomputation_really_happens(key):
    """The premise: every checkpointed block instance runs its body once in forward and once more
    in backward per step; an unchecked instance not at all."""
    plan, res = run_case(key)
    ckpt = plan.data["stages"][0]["checkpoint"]
    name = CASES[key][0]
    from autopar.frontend.trace import trace
    traced = trace(*FACTORIES[name]())
    want = [fqn for g in traced.blocks if ckpt.get(g.name) for fqn in g.module_fqns]
    nm = plan.degrees["num_micro_batches"]
    for r in res:
        assert r["regions"] == want
        assert r["stats"] == (len(want) * STEPS * nm, len(want) * STEPS * nm), r["stats"]
    if want:
        assert "checkpoint_region(" in res[0]["code"] and "# checkpoint region body" in res[0]["code"]


@pytest.mark.slow
@pytest.mark.parametrize("key", list(CASES))
def test_saved_activation_bytes_match_plan(key):
    plan, res = run_case(key)
    predicted = plan.data["predictions"]["memory_breakdown"]["activations"]
    for r, out in enumerate(res):
        m = out["measured"]
        assert m["total"] == pytest.approx(predicted, rel=0.02), (key, r, m, predicted)
        assert (m["kept"] > 0) == any(plan.data["stages"][0]["checkpoint"].values())


@pytest.mark.slow
def test_recomputed_collectives_are_in_the_plans_communication():
    """dp x Megatron tp: recomputing the blocks reruns their forward tensor-parallel collectives.
    The plan counts them (predict.py): the tp bytes a step moves grow by exactly what the plan
    adds for checkpointing (compared as differences: the dp=2 x tp=2 Megatron plan's tp figure is
    16384 B above the measured one with or without checkpointing, a gap that predates this)."""
    none_plan, none = run_case("gpt2-dp2xtp2-none")
    full_plan, full = run_case("gpt2-dp2xtp2-full")
    grew = full[0]["comm"]["tp"] - none[0]["comm"]["tp"]
    assert grew > 0
    assert grew == full_plan.comm_bytes["tp"] - none_plan.comm_bytes["tp"]
    assert full[0]["comm"]["dp"] == none[0]["comm"]["dp"] == full_plan.comm_bytes["dp"]
    tb = full_plan.data["predictions"]["time_breakdown"]
    assert tb["recompute"] > 0


@pytest.mark.slow
def test_dropout_masks_are_recomputed_identically():
    """dropout 0.1, ZeRO-3 on 2 processes: with every block checkpointed, losses and parameters
    after 3 steps equal those without checkpointing (same seed), and dropout really acts (the
    losses differ from the dropout-free run)."""
    runs = {}
    for ck in ("none", "full"):
        plan = make_plan("gpt2", 2, {"dp": 2, "tp": 1, "zero": 3, "checkpoint": ck}, dropout=0.1)
        runs[ck] = run(plan, "gpt2", measure=False, dropout=0.1)
    assert runs["full"][0]["stats"] == (2 * STEPS, 2 * STEPS) and runs["none"][0]["stats"] == (0, 0)
    for r0, r1 in zip(runs["none"], runs["full"]):
        torch.testing.assert_close(torch.tensor(r1["losses"]), torch.tensor(r0["losses"]), rtol=1e-6, atol=0)
    for k, v in runs["none"][0]["sd"].items():
        torch.testing.assert_close(torch.from_numpy(runs["full"][0]["sd"][k]), torch.from_numpy(v), rtol=1e-5,
                                   atol=1e-7, msg=lambda m: f"{k}: {m}")
    no_dropout, _ = reference("gpt2")
    assert all(abs(a - b) > 1e-4 for a, b in zip(runs["none"][0]["losses"], no_dropout))


# ------------------------------------------------------------------ one process, no launcher

def _program(name, checkpoint, **kw):
    """A 1-device plan's program (no collectives: it runs without a process group)."""
    from autopar.frontend.trace import trace
    from codegen import generate

    model, batch = FACTORIES[name](**kw)
    plan = make_plan(name, 1, {"checkpoint": checkpoint}, **kw)
    return generate(trace(model, batch), plan, 0), model, batch


def test_single_process_recompute_gives_identical_gradients_with_dropout():
    """Gradients of a fully checkpointed program equal the plain program's, with dropout 0.3
    (the recomputation redraws the forward's masks), and the bodies really ran twice."""
    full, model, batch = _program("two_stacks", "full", dropout=0.3)
    plain, _, _ = _program("two_stacks", "none", dropout=0.3)
    assert full.checkpoint_regions == ["lower.0", "lower.1", "upper.0", "upper.1"]
    assert plain.checkpoint_regions == []
    RCK.STATS.reset()
    l1, g1 = program_grads(full, model, batch)
    assert (RCK.STATS.forward, RCK.STATS.recompute) == (4, 4)
    l0, g0 = program_grads(plain, model, batch)
    assert torch.equal(l1, l0)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    l2, g2 = program_grads(plain, model, batch, seed=1)   # dropout really draws: another seed, another loss
    assert not torch.equal(l2, l0)


@pytest.mark.parametrize("name", ["llama", "bert", "vit", "mlp",
                                  pytest.param("hf_llama", marks=pytest.mark.slow),
                                  pytest.param("hf_bert", marks=pytest.mark.slow)])
def test_zoo_models_recompute_to_the_same_gradients(name):
    """Every zoo family (rotary buffers, masks, higher-order-op submodules of Hugging Face graphs)
    runs fully checkpointed with the plain program's loss and gradients."""
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
        from autopar.models import HF_ZOO
        FACTORIES.setdefault(name, HF_ZOO[name])
    else:
        FACTORIES.setdefault(name, ZOO[name])
    full, model, batch = _program(name, "full")
    plain, _, _ = _program(name, "none")
    assert len(full.checkpoint_regions) >= 2
    RCK.STATS.reset()
    l1, g1 = program_grads(full, model, batch)
    n = len(full.checkpoint_regions)
    assert (RCK.STATS.forward, RCK.STATS.recompute) == (n, n)
    l0, g0 = program_grads(plain, model, batch)
    assert torch.equal(l1, l0)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_regions_outline_collectives_and_zero3_calls():
    """A dp x Megatron-tp ZeRO-3 program: each block instance is one checkpoint_region call whose
    body holds the block's tensor-parallel collectives and its chunk's gather/exit/free; the
    printed program shows the bodies."""
    from autopar.frontend.trace import trace
    from codegen import generate

    model, batch = FACTORIES["gpt2"]()
    plan = make_plan("gpt2", 4, {"dp": 2, "tp": 2, "zero": 3, "checkpoint": "full"}, policy="megatron")
    traced = trace(model, batch)
    chunks = {fqn: (0 if fqn.startswith("blocks.0.") else 1 if fqn.startswith("blocks.1.") else 2)
              for fqn in traced.param_fqn.values()}
    prog = generate(traced, plan, 0, zero3_chunks=chunks)
    assert prog.checkpoint_regions == ["blocks.0", "blocks.1"]
    top = prog.gm.code
    assert top.count("checkpoint_region(") == 2 and "zero3_gather(0)" not in top
    for i in (0, 1):
        body = getattr(prog.gm, f"ckpt_blocks_{i}").code
        assert f"zero3_gather({i})" in body and f"zero3_free({i})" in body and "zero3_exit(" in body
        assert "all_reduce(" in body or "copy(" in body      # Megatron's f / g inside the region
        assert "layer_norm" in body and "aten.linear" in body
    assert "# checkpoint region body self.ckpt_blocks_1" in prog.code


def test_unknown_block_groups_are_clear_errors():
    from autopar.errors import ConstraintError, ExecutionError
    from autopar.frontend.trace import trace
    from codegen import generate

    with pytest.raises(ConstraintError, match="block groups \\['middle'\\]"):
        make_plan("two_stacks", 1, {"checkpoint": {"middle": True}})
    with pytest.raises(ConstraintError, match="must be 'none', 'selective', 'full' or a dict"):
        make_plan("two_stacks", 1, {"checkpoint": "sometimes"})
    model, batch = FACTORIES["gpt2"]()
    plan = make_plan("gpt2", 1, {"checkpoint": "full"})
    plan.data["stages"][0]["checkpoint"] = {"layers": True}
    with pytest.raises(ExecutionError, match="checkpoints block groups \\['layers'\\]"):
        generate(trace(model, batch), plan, 0)


def test_interleaved_regions_are_a_clear_error():
    """Outlining needs each instance's nodes contiguous; interleaved instances are refused."""
    from autopar.errors import ExecutionError
    from codegen.checkpoint import outline_regions

    g = torch.fx.Graph()
    x = g.placeholder("x")
    a1 = g.call_function(torch.relu, (x,))
    b1 = g.call_function(torch.tanh, (x,))
    a2 = g.call_function(torch.sin, (a1,))
    b2 = g.call_function(torch.cos, (b1,))
    g.output(g.call_function(torch.add, (a2, b2)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    with pytest.raises(ExecutionError, match="interleave"):
        outline_regions(gm, {"blocks.0": [a1, a2], "blocks.1": [b1, b2]})
    # contiguous instances outline into two calls that compute the same thing
    g = torch.fx.Graph()
    x = g.placeholder("x")
    a1 = g.call_function(torch.relu, (x,))
    a2 = g.call_function(torch.sin, (a1,))
    b1 = g.call_function(torch.tanh, (a2,))
    b2 = g.call_function(torch.cos, (b1,))
    g.output(g.call_function(torch.add, (a2, b2)))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    t = torch.randn(5)
    want = gm(t)
    assert outline_regions(gm, {"blocks.0": [a1, a2], "blocks.1": [b1, b2]}) == ["blocks.0", "blocks.1"]
    assert gm.code.count("checkpoint_region(") == 2
    torch.testing.assert_close(gm(t), want)


def test_planner_chooses_a_mixed_plan_under_a_budget():
    """Unpinned, the ILP checkpoints one group of two when that is what the budget needs: the
    budget is the peak of the plan pinned to checkpoint only ``lower``."""
    base = {"dp": 2, "tp": 1, "zero": 0}
    pinned = make_plan("two_stacks", 2, {**base, "checkpoint": {"lower": True, "upper": False}})
    model, batch = two_stacks()
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2), precision="fp32",
                        memory_budget=pinned.peak_memory, constraints={"num_micro_batches": 1, **base})
    assert plan.data["stages"][0]["checkpoint"] == {"lower": True, "upper": False}
    assert plan.degrees["checkpoint"] == "mixed"
    assert plan.memory_breakdown["activations"] == pinned.memory_breakdown["activations"]
