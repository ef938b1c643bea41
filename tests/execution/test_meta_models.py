"""Issue 11, models bigger than one machine: a model built on the meta device compiles with
``weights="init"`` (each rank replays the initialization for its own shards only) or
``weights=PATH`` (a Hugging Face safetensors checkpoint, plain or sharded, or a compiled.save()
directory, read slice by slice). Each multi-process run is compared with eager one-process
training of the same values (SGD with momentum, fp32, 3 steps); shards right after set-up must
equal the one-process init exactly."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.exactness import train_eagerly

import autopar
from autopar.errors import ExecutionError
from autopar.models import HF_ZOO, ZOO
from runtime.launch import run_local

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP otherwise (see tests/execution/test_execute.py)

STEPS = 3
SGD = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9}
SEED = 5
FACTORIES = {**ZOO, **HF_ZOO}


def eager(model, batch, steps=STEPS):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=SGD["lr"], momentum=SGD["momentum"])
    return train_eagerly(model, batch, opt, steps)


def _meta_train(rank, world, name, plan_json, weights, steps):
    model, _ = FACTORIES[name](device="meta", seed=SEED)
    _, batch = FACTORIES[name](device="cpu", seed=SEED)
    torch.manual_seed(SEED)   # weights="init" replays the init from this stream (rank 0's)
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), weights=weights, **SGD)
    init = {k: v.numpy() for k, v in cm.full_state_dict().items()}
    # this rank's block of every parameter (under ZeRO-3 gathered over the data group: collective)
    # ... and the same block cut from the whole initial tensor (a slice; a grid plan's stored form)
    blocks = {k: (v.numpy(), cm.program.block_of(k, torch.from_numpy(init[k])).numpy())
              for k, v in cm._local_values().items() if k in cm.params}
    cm.reset_comm_stats()
    losses = [cm.step(*batch) for _ in range(steps)]
    sd = {k: v.numpy() for k, v in cm.full_state_dict().items()}
    return init, blocks, losses, sd, cm.comm_stats()


def plan_for(name, world, constraints):
    """Tensor-parallel plans pin policy="megatron" so the tp axis really splits weights."""
    model, batch = FACTORIES[name](device="meta", seed=SEED)
    policy = "megatron" if constraints.get("tp", 1) > 1 else None
    return autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=world), optimizer="sgd",
                        precision="fp32", constraints={"num_micro_batches": 1, **constraints}, policy=policy)


def check_against_eager(res, ref_model, batch, plan):
    want_init = {k: v.detach().clone() for k, v in ref_model.state_dict().items()}
    want_losses, want_sd = eager(ref_model, batch)
    for rank, (init, blocks, losses, sd, stats) in enumerate(res):
        for k, v in want_init.items():   # exactly the one-process init
            assert torch.equal(torch.from_numpy(init[k]), v), (rank, k)
        for k, (b, cut) in blocks.items():   # and each rank's shard is exactly its block
            assert np.array_equal(b, cut), (rank, k)
        np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-6)
        for k, v in want_sd.items():
            torch.testing.assert_close(torch.from_numpy(sd[k]), v, rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")
    tp = plan.degrees["tp"]
    if tp > 1:   # a tp plan must really split: bytes on the tensor axis (the grid's row group)
        stats = res[0][4]
        assert stats.get("row" if plan.degrees["tp_mode"] == "2d" else "tp", 0) > 0, stats
    return want_init


CASES = [
    ("gpt2", 2, {"tp": 2}),
    ("gpt2", 4, {"dp": 2, "tp": 2}),
    ("llama", 4, {"tp": 4}),
    ("llama", 2, {"dp": 2, "zero": 3}),
    ("hf_llama", 4, {"dp": 2, "tp": 2}),
    ("hf_llama", 2, {"dp": 2, "zero": 3}),
    ("llama", 4, {"tp": 4, "tp_mode": "2d"}),     # a grid plan's blocks of stored forms
]


@pytest.mark.slow
@pytest.mark.parametrize("name,world,constraints", CASES, ids=[f"{n}-{w}-{'-'.join(f'{k}{v}' for k, v in c.items())}"
                                                              for n, w, c in CASES])
def test_meta_model_init_matches_one_process(name, world, constraints):
    plan = plan_for(name, world, constraints)
    res = run_local(_meta_train, world, args=(name, plan.to_json(), "init", STEPS), timeout=400)
    ref, batch = FACTORIES[name](device="cpu", seed=SEED)
    check_against_eager(res, ref, batch, plan)


# ------------------------------------------------------------------ Hugging Face checkpoints

def save_hf(name, directory, max_shard_size=None):
    """A small pretrained-looking HF model (seed 11, so not what any meta init would give) saved
    with save_pretrained (safetensors); returns the CPU model."""
    model, _ = FACTORIES[name](device="cpu", seed=11)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.model.save_pretrained(str(directory), **kw)
    return model


HF_CASES = [
    ("hf_llama", {"dp": 2, "tp": 2}, None),
    ("hf_llama", {"tp": 4}, "40KB"),
    ("hf_gpt2", {"dp": 2, "tp": 2}, "40KB"),
    ("hf_gpt2", {"tp": 4}, None),
    ("hf_llama", {"tp": 4, "tp_mode": "2d"}, "40KB"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,constraints,shard", HF_CASES,
                         ids=[f"{n}-{'-'.join(f'{k}{v}' for k, v in c.items())}-{'sharded' if s else 'single'}"
                              for n, c, s in HF_CASES])
def test_hf_checkpoint_loads_into_shards(tmp_path, name, constraints, shard):
    ref = save_hf(name, tmp_path, shard)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert ("model.safetensors.index.json" in files) == bool(shard), files
    plan = plan_for(name, 4, constraints)
    res = run_local(_meta_train, 4, args=(name, plan.to_json(), str(tmp_path), STEPS), timeout=400)
    _, batch = FACTORIES[name](device="cpu", seed=SEED)
    check_against_eager(res, ref, batch, plan)


# ------------------------------------------------------------------ bad input, compiled.save directories

def _errors(rank, world, plan_json, dirs):
    cluster = autopar.Cluster.preset("cpu", devices=world)
    plan = autopar.Plan.from_json(plan_json)
    _, batch = FACTORIES["hf_llama"](device="cpu", seed=SEED)
    out = {}
    for case, weights in [("none", None), *dirs.items(), ("bogus", 3)]:
        model, _ = FACTORIES["hf_llama"](device="meta", seed=SEED)
        try:
            autopar.compile(model, cluster, example_inputs=batch, plan=plan, weights=weights, **SGD)
            out[case] = "ok"
        except ExecutionError as e:
            out[case] = str(e)
    return out


@pytest.mark.slow
def test_bad_weights_are_clear_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    good = tmp_path / "good"
    save_hf("hf_llama", good)
    sd = load_file(str(good / "model.safetensors"))
    dirs = {"absent": str(tmp_path / "nope"), "empty": str(tmp_path)}
    for case, change in [("missing", lambda d: d.pop("model.norm.weight")),
                         ("extra", lambda d: d.__setitem__("model.extra.weight", torch.zeros(2))),
                         ("shape", lambda d: d.__setitem__("lm_head.weight", torch.zeros(3, 64)))]:
        d = dict(sd)
        change(d)
        (tmp_path / case).mkdir()
        save_file(d, str(tmp_path / case / "model.safetensors"))
        dirs[case] = str(tmp_path / case)
    plan = plan_for("hf_llama", 2, {"tp": 2})
    out = run_local(_errors, 2, args=(plan.to_json(), dirs), timeout=300)[0]
    assert "meta device" in out["none"] and 'weights="init"' in out["none"] and "PATH" in out["none"], out["none"]
    assert "no such directory" in out["absent"] and "weights=" in out["absent"], out["absent"]
    assert "neither a Hugging Face checkpoint" in out["empty"], out["empty"]
    assert "missing from the checkpoint: model.norm.weight" in out["missing"], out["missing"]
    assert "not in this model: model.extra.weight" in out["extra"], out["extra"]
    assert "shape differs: lm_head.weight (3, 64)" in out["shape"], out["shape"]
    assert "options are" in out["bogus"], out["bogus"]


def _save_then_load(rank, world, plan_a, plan_b, directory):
    """Train a real model 1 step under plan A, save; a meta model loads it under plan B."""
    cluster = autopar.Cluster.preset("cpu", devices=world)
    model, batch = FACTORIES["llama"](device="cpu", seed=SEED)
    a = autopar.compile(model, cluster, example_inputs=batch, plan=autopar.Plan.from_json(plan_a), **SGD)
    a.step(*batch)
    a.save(directory)
    want = {k: v.numpy() for k, v in a.full_state_dict().items()}
    meta, _ = FACTORIES["llama"](device="meta", seed=SEED)
    b = autopar.compile(meta, cluster, example_inputs=batch, plan=autopar.Plan.from_json(plan_b),
                        weights=directory, **SGD)
    got = {k: v.numpy() for k, v in b.full_state_dict().items()}
    return want, got


@pytest.mark.slow
def test_compiled_save_directory_loads_into_a_meta_model_under_another_plan(tmp_path):
    plan_a = plan_for("llama", 2, {"dp": 2})
    plan_b = plan_for("llama", 2, {"tp": 2})
    want, got = run_local(_save_then_load, 2, args=(plan_a.to_json(), plan_b.to_json(), str(tmp_path / "ck")),
                          timeout=300)[0]
    assert set(want) == set(got)
    for k in want:
        assert np.array_equal(want[k], got[k]), k


# ------------------------------------------------------------------ set-up memory

@pytest.mark.slow
@pytest.mark.parametrize("mode", ["init", "hf"])
def test_setup_memory_is_bounded_by_shards_plus_largest_parameter(mode):
    """A 134 MB GPT-2-style model (128 MiB) on 4 tp ranks: set-up's peak per rank stays within
    what the rank holds afterwards (its parameter blocks, the optimizer's buffers over them, the
    program) + the largest parameter + 16 MiB, a cap below the whole model on top of that (no rank
    ever holds it). Figures: benchmarks/RESULTS.md §7 (benchmarks/bench_setup_memory.py)."""
    from benchmarks.bench_setup_memory import run

    for rank, m in enumerate(run(4, mode)):
        cap = m["held"] + m["largest"] + 16 * 2 ** 20
        assert cap < m["held"] + m["full"], m   # the premise: the whole model does not fit under the cap
        assert m["peak"] <= cap, (rank, {k: round(v / 2 ** 20, 1) for k, v in m.items()})


# ------------------------------------------------------------------ buffers, real models

def _buffers_and_copies(rank, world, plan_json):
    import warnings

    from autopar.models.llama import rotary_tables

    cluster = autopar.Cluster.preset("cpu", devices=world)
    plan = autopar.Plan.from_json(plan_json)
    _, batch = FACTORIES["llama"](device="cpu", seed=SEED)
    out = {}
    # 1. accelerate.init_empty_weights() style: parameters on meta, buffers real (no reset_buffers needed)
    model, _ = FACTORIES["llama"](device="meta", seed=SEED)
    c = model.config
    cos, sin = rotary_tables(c.seq, c.d_model // c.n_head, c.rope_theta)
    model.rope_cos, model.rope_sin = cos, sin   # assigning to a registered buffer keeps it a buffer
    type(model).reset_buffers, saved = None, type(model).reset_buffers   # the model offers no way now
    try:
        torch.manual_seed(SEED)
        cm = autopar.compile(model, cluster, example_inputs=batch, plan=plan, weights="init", **SGD)
        out["real_buffers"] = cm.step(*batch)
        # ... and planned from that model itself (rank 0 traces it: the trace runs on meta copies
        # of the real buffers and batch, autopar/frontend/one_device.py)
        model, _ = FACTORIES["llama"](device="meta", seed=SEED)
        model.rope_cos, model.rope_sin = cos, sin
        torch.manual_seed(SEED)
        cm = autopar.compile(model, cluster, example_inputs=batch, weights="init", **SGD,
                             plan_options={"constraints": {"tp": 2, "num_micro_batches": 1}, "policy": "megatron"})
        out["planned_here"] = (cm.step(*batch), cm.plan.degrees["tp"])
        # 2. a buffer on meta with no way to compute it
        model, _ = FACTORIES["llama"](device="meta", seed=SEED)
        del type(model).reset_buffers
        try:
            autopar.compile(model, cluster, example_inputs=batch, plan=plan, weights="init", **SGD)
            out["meta_buffer"] = "ok"
        except ExecutionError as e:
            out["meta_buffer"] = str(e)
    finally:
        type(model).reset_buffers = saved
    # 3. a materialized model whose copies differ between ranks: rank 0's values, with a warning
    model, _ = FACTORIES["llama"](device="cpu", seed=SEED + rank)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cm = autopar.compile(model, cluster, example_inputs=batch, plan=plan, **SGD)
    out["warned"] = [str(x.message) for x in w if "models differ" in str(x.message)]
    out["differing"] = {k: v.numpy() for k, v in cm.full_state_dict().items()}
    return out


@pytest.mark.slow
def test_real_buffers_meta_buffers_and_differing_copies():
    plan = plan_for("llama", 2, {"tp": 2})
    res = run_local(_buffers_and_copies, 2, args=(plan.to_json(),), timeout=300)
    ref, batch = FACTORIES["llama"](device="cpu", seed=SEED)
    want_loss = ref(*batch).item()
    for out in res:
        assert abs(out["real_buffers"] - want_loss) <= 1e-5 * abs(want_loss), (out["real_buffers"], want_loss)
        loss, tp = out["planned_here"]
        assert tp == 2 and abs(loss - want_loss) <= 1e-5 * abs(want_loss), (out["planned_here"], want_loss)
        assert "rope_cos" in out["meta_buffer"] and "reset_buffers()" in out["meta_buffer"], out["meta_buffer"]
        assert out["warned"] and "using rank 0's values" in out["warned"][0], out["warned"]
    rank0, _ = FACTORIES["llama"](device="cpu", seed=SEED)
    for k, v in rank0.state_dict().items():
        for out in res:
            assert torch.equal(torch.from_numpy(out["differing"][k]), v), k


def _real_buffers_from_directory(rank, world, plan_a, plan_b, directory):
    """Issue 30 point 4 from a checkpoint directory: a real llama trains 1 step under plan A and is
    saved; a model with parameters on meta and its rotary tables real (accelerate's
    init_empty_weights convention, no reset_buffers) compiles from that directory under plan B and
    trains 2 steps."""
    from autopar.models.llama import rotary_tables

    cluster = autopar.Cluster.preset("cpu", devices=world)
    model, batch = FACTORIES["llama"](device="cpu", seed=SEED)
    a = autopar.compile(model, cluster, example_inputs=batch, plan=autopar.Plan.from_json(plan_a), **SGD)
    a.step(*batch)
    a.save(directory)
    saved = {k: v.numpy() for k, v in a.full_state_dict().items()}
    meta, _ = FACTORIES["llama"](device="meta", seed=SEED)
    c = meta.config
    meta.rope_cos, meta.rope_sin = rotary_tables(c.seq, c.d_model // c.n_head, c.rope_theta)
    type(meta).reset_buffers, kept = None, type(meta).reset_buffers
    try:
        b = autopar.compile(meta, cluster, example_inputs=batch, plan=autopar.Plan.from_json(plan_b),
                            weights=directory, **SGD)
    finally:
        type(meta).reset_buffers = kept
    losses = [b.step(*batch) for _ in range(2)]
    return saved, losses, {k: v.numpy() for k, v in b.full_state_dict().items()}


@pytest.mark.slow
def test_meta_parameters_with_real_buffers_compile_from_a_checkpoint_directory(tmp_path):
    plan_a = plan_for("llama", 2, {"dp": 2})
    plan_b = plan_for("llama", 2, {"tp": 2})
    res = run_local(_real_buffers_from_directory, 2, args=(plan_a.to_json(), plan_b.to_json(), str(tmp_path / "ck")),
                    timeout=300)
    saved, losses, got = res[0]
    ref, batch = FACTORIES["llama"](device="cpu", seed=SEED)
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in saved.items()}, strict=False)
    want_losses, want = eager(ref, batch, steps=2)[:2]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-5, atol=1e-7)
    for k, v in want.items():
        torch.testing.assert_close(torch.from_numpy(got[k]), v, rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")
