"""Large-batch recipes in ``autopar.compile`` (issue 33 part 2): parameter groups, learning-rate
schedules and scaling, and their checkpoints.

* schedules and lr scaling: values of the named schedules at their corners, bad arguments;
* groups: the BERT recipe decides on the FULL shape; a list's first match wins;
* AdamW and SGD (nesterov) with groups (no decay on norms, a half lr on the head), a warm-up +
  cosine schedule and sqrt lr scaling, in one process, equal torch.optim.AdamW / SGD with the
  same param_groups and a LambdaLR (rel 1e-6); trust_clip and always_adapt on a two-tensor
  buffer; under ZeRO-2 on 2 ranks (per-segment steps of a flat shard) it equals the
  one-process run (slow);
* LAMB with custom groups, trust_clip and a schedule under tp 2 and ZeRO-2 equals one process (slow);
* save/load: LAMB with warm-up + poly decay and sqrt scaling trained 4 steps in one process equals
  2 steps under dp 2 / ZeRO-1, saved, loaded into tp 2, 2 more steps (slow).
"""
from __future__ import annotations

import functools
import math

import pytest
import torch

import autopar
from runtime.launch import run_local
from runtime.lr_schedule import make_schedule, scaled_lr
from runtime.optim_groups import resolve_groups
from helpers.large_batch import ramped_llama, rel_errors

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- schedules
def test_named_schedules():
    s = make_schedule("warmup-poly", warmup_steps=4, total_steps=14, power=0.5)
    assert [s(t) for t in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(9) == pytest.approx(0.5 ** 0.5) and s(14) == 0.0 and s(100) == 0.0
    lin = make_schedule("warmup-linear", warmup_steps=0, total_steps=10)
    assert lin(0) == 1.0 and lin(5) == pytest.approx(0.5)
    cos = make_schedule("warmup-cosine", warmup_steps=2, total_steps=12)
    assert cos(1) == 1.0 and cos(2) == 1.0 and cos(7) == pytest.approx(0.5) and cos(12) == pytest.approx(0.0)
    const = make_schedule("constant", warmup_steps=2)
    assert [const(t) for t in range(4)] == [0.5, 1.0, 1.0, 1.0]
    f = lambda t: 0.9 ** t  # noqa: E731
    assert make_schedule(f) is f and make_schedule(None) is None
    for bad in [dict(spec="warmup-poly"), dict(spec="warmup-cosine", warmup_steps=5, total_steps=5),
                dict(spec="nope"), dict(spec=None, warmup_steps=3)]:
        with pytest.raises(ValueError):
            make_schedule(bad.pop("spec"), **bad)


def test_lr_scaling():
    assert scaled_lr(1e-3, 256, 32, "linear") == pytest.approx(8e-3)
    assert scaled_lr(1e-3, 256, 64, "sqrt") == pytest.approx(2e-3)
    assert scaled_lr(1e-3, 256, None, None) == 1e-3
    with pytest.raises(ValueError):
        scaled_lr(1e-3, 256, None, "sqrt")
    with pytest.raises(ValueError):
        scaled_lr(1e-3, 256, 32, "cubic")


# ----------------------------------------------------------------------------- groups
def test_groups_decide_on_the_full_shape():
    shapes = {"w": (64, 64), "b": (64,), "norm.weight": (64,), "head.weight": (256, 64), "scalar": ()}
    bert = resolve_groups(shapes, "bert", 0.01)
    assert bert["w"] == (0.01, 1.0, True) and bert["b"] == bert["scalar"] == (0.0, 1.0, False)
    assert set(resolve_groups(shapes, "all", 0.01).values()) == {(0.01, 1.0, True)}
    spec = [{"params": r"^head\.", "lr_scale": 0.5}, {"params": lambda n, s: len(s) <= 1, "weight_decay": 0.0},
            {"params": "weight", "weight_decay": 0.5}]
    g = resolve_groups(shapes, spec, 0.01)
    assert g["head.weight"] == (0.01, 0.5, True)          # the first match wins
    assert g["norm.weight"] == (0.0, 1.0, True) and g["w"] == (0.01, 1.0, True)
    for bad in ["nope", [{"weight_decay": 0}], [{"params": 3}], [{"params": "x", "lr": 1}]]:
        with pytest.raises(ValueError):
            resolve_groups(shapes, bad, 0.0)


def test_compile_refuses_bad_options():
    msgs = run_local(_refuse, 1, args=([dict(lr_schedule="warmup-poly"), dict(lr_scaling="sqrt"),
                                        dict(param_groups="none"), dict(trust_clipp=True)],), timeout=60)[0]
    for msg, word in zip(msgs, ["total_steps", "base_batch", "param_groups", "trust_clipp"]):
        assert msg and word in msg, msg


def _refuse(rank, world, kws):
    model, batch = ramped_llama()
    out = []
    for kw in kws:
        try:
            autopar.compile(model, autopar.Cluster.preset("cpu", devices=1), optimizer="lamb", **kw)
            out.append(None)
        except autopar.ExecutionError as e:
            out.append(str(e))
    return out


# ----------------------------------------------------------------------------- AdamW vs torch
ADAMW = dict(optimizer="adamw", lr=3e-3, weight_decay=0.1, lr_schedule="warmup-cosine", warmup_steps=2,
             total_steps=6, lr_scaling="sqrt", base_batch=2,
             param_groups=[{"params": r"norm", "weight_decay": 0.0}, {"params": r"^head\.", "lr_scale": 0.5}])
STEPS = 4


def _train(rank, world, kw, constraints, steps=STEPS):
    model, batch = ramped_llama()
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), batch,
                         plan_options={"constraints": constraints}, **kw)
    lrs, losses = [], []
    for _ in range(steps):
        lrs.append(cm.lr)
        losses.append(cm.step(*batch))
    sd = {k: v.numpy() for k, v in cm.full_state_dict().items()}
    split = sorted(fqn for fqn, p in cm.params.items() if p.numel() != model.get_parameter(fqn).numel())
    return losses, (sd if rank == 0 else None), lrs, split, cm.zero


@functools.lru_cache(maxsize=None)
def one_process(name):
    return run_local(_train, 1, args=(CONFIGS[name], {}), timeout=240)[0]


SGD = dict(ADAMW, optimizer="sgd", lr=0.05, momentum=0.9, nesterov=True)   # torch.optim.SGD's (coupled) decay


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_groups_and_schedule_equal_torch(name):
    """One process: autopar's AdamW / SGD with groups, schedule and sqrt scaling equal torch.optim
    with the same param_groups and a LambdaLR."""
    model, batch = ramped_llama()
    kw = CONFIGS[name]
    lr = kw["lr"] * math.sqrt(8 / 2)   # global batch 8, base 2: sqrt scaling doubles it
    named = dict(model.named_parameters())
    norms = [p for n, p in named.items() if "norm" in n]
    head = [p for n, p in named.items() if n.startswith("head.")]
    rest = [p for n, p in named.items() if "norm" not in n and not n.startswith("head.")]
    groups = [{"params": norms, "weight_decay": 0.0}, {"params": head, "lr": lr * 0.5}, {"params": rest}]
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=0.1) if name == "adamw" else \
        torch.optim.SGD(groups, lr=lr, weight_decay=0.1, momentum=0.9, nesterov=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, make_schedule("warmup-cosine", 2, 6))
    want = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = model(*batch)
        loss.backward()
        opt.step()
        sched.step()
        want.append(loss.item())
    losses, sd, lrs = one_process(name)[:3]
    assert lrs == pytest.approx([lr * make_schedule("warmup-cosine", 2, 6)(t) for t in range(STEPS)])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-6, atol=1e-7)
    rel = rel_errors(sd, {k: v.detach() for k, v in model.state_dict().items()})
    assert max(rel.values()) < 1e-6, max(rel, key=rel.get)


def test_trust_clip_and_always_adapt():
    """LAMB: trust_clip caps the ratio at 1; always_adapt applies it to an excluded tensor too.
    LARS: trust_clip is LARC's min(local_lr / lr, 1)."""
    from runtime.optim import LAMB, LARS, Segments
    from runtime.optim_groups import TensorHParams

    torch.manual_seed(0)
    w = torch.cat([torch.randn(6) * 10, torch.randn(4) * 10])   # big weights: ||w|| / ||u|| > 1
    g = torch.randn(10)
    segs = Segments.from_sizes([6, 4])
    hp = TensorHParams.of([(0.0, 1.0, True), (0.0, 1.0, False)])    # the second tensor excluded

    def lamb_step(**kw):
        p = w.clone()
        opt = LAMB(lr=0.1, **kw)
        opt.step(p, g.clone(), opt.init_state(10), 1, segments=segs, hparams=hp)
        return w - p   # lr * ratio * u, u = m_hat / (sqrt(v_hat) + eps) at step 1
    u = g / (g.abs() + 1e-6)
    ratio0 = w[:6].norm() / u[:6].norm()
    assert ratio0 > 1
    torch.testing.assert_close(lamb_step()[:6], 0.1 * ratio0 * u[:6])
    torch.testing.assert_close(lamb_step()[6:], 0.1 * u[6:])                    # excluded: ratio 1
    torch.testing.assert_close(lamb_step(trust_clip=True)[:6], 0.1 * u[:6])     # clipped to 1
    ratio1 = w[6:].norm() / u[6:].norm()
    torch.testing.assert_close(lamb_step(always_adapt=True)[6:], 0.1 * ratio1 * u[6:])

    p = w.clone()
    lars = LARS(lr=0.5, momentum=0.0, trust_coefficient=1.0, trust_clip=True)
    lars.step(p, g.clone(), lars.init_state(10), 1, segments=segs, hparams=hp)
    local = (w[:6].norm() / (g[:6].norm() + 1e-8) / 0.5).clamp(max=1.0)
    torch.testing.assert_close(w - p, torch.cat([0.5 * local * g[:6], 0.5 * g[6:]]))


# ----------------------------------------------------------------------------- sharded plans
LAMB = dict(optimizer="lamb", lr=2e-2, weight_decay=0.01, trust_clip=True, grad_clip=1.0,
            lr_schedule="warmup-poly", warmup_steps=2, total_steps=8, power=0.5,
            param_groups=[{"params": r"\.w1\.", "lr_scale": 0.5, "weight_decay": 0.1},
                          {"params": lambda name, shape: len(shape) <= 1, "weight_decay": 0.0, "adapt": False},
                          {"params": r"^tok\.", "weight_decay": 0.0}])   # a matrix without decay: still adapts
CONFIGS = {"adamw": ADAMW, "sgd": SGD, "lamb": LAMB}
SHARDED = [("adamw", 2, {"dp": 2, "zero": 2}), ("lamb", 2, {"tp": 2}), ("lamb", 2, {"dp": 2, "zero": 2})]


@pytest.mark.slow
@pytest.mark.parametrize("name,world,constraints", SHARDED, ids=["adamw-zero2", "lamb-tp2", "lamb-zero2"])
def test_groups_under_sharded_plans_equal_one_process(name, world, constraints):
    ref_losses, ref_sd, ref_lrs = one_process(name)[:3]
    res = run_local(_train, world, args=(CONFIGS[name], constraints), timeout=400)
    for losses, _, lrs, _, _ in res:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
        assert lrs == ref_lrs
    losses, sd, _, split, zero = res[0]
    assert split if "tp" in constraints else zero == 2
    rel = rel_errors(sd, {k: torch.from_numpy(v) for k, v in ref_sd.items()})
    worst = max(rel, key=rel.get)
    assert rel[worst] < 1e-3, f"{worst} differs by {rel[worst]:.2e} (relative)"


# ----------------------------------------------------------------------------- checkpoints
RESUME = dict(optimizer="lamb", lr=1e-2, weight_decay=0.01, lr_schedule="warmup-poly", warmup_steps=2,
              total_steps=6, power=0.5, lr_scaling="sqrt", base_batch=4)


def _phase(rank, world, directory, phase, constraints, steps):
    model, batch = ramped_llama()
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), batch,
                         plan_options={"constraints": constraints}, **RESUME)
    if phase == "load":
        cm.load(directory)
    lrs, losses = [], []
    for _ in range(steps):
        lrs.append(cm.lr)
        losses.append(cm.step(*batch))
    if phase == "save":
        cm.save(directory)
    sd = {k: v.numpy() for k, v in cm.full_state_dict().items()}
    return losses, lrs, (sd if rank == 0 else None), cm.plan.degrees, cm.step_count, cm.group_settings


@pytest.mark.slow
def test_resume_into_another_plan_equals_uninterrupted(tmp_path):
    """4 steps in one process == 2 steps under dp 2 (ZeRO-1), save, load under tp 2, 2 steps:
    the step count (the schedule's state), the groups and the scaled lr come back with the weights."""
    ck = str(tmp_path / "ck")
    straight = run_local(_phase, 1, args=(ck + "0", "none", {}, 4), timeout=240)[0]
    first = run_local(_phase, 2, args=(ck, "save", {"dp": 2, "zero": 1}, 2), timeout=400)[0]
    second = run_local(_phase, 2, args=(ck, "load", {"tp": 2}, 2), timeout=400)[0]
    assert first[3]["dp"] == 2 and second[3]["tp"] == 2 and second[4] == 4
    assert first[1] + second[1] == pytest.approx(straight[1], rel=1e-12)
    assert second[5] == straight[5]
    torch.testing.assert_close(torch.tensor(first[0] + second[0]), torch.tensor(straight[0]), rtol=1e-5, atol=1e-7)
    rel = rel_errors(second[2], {k: torch.from_numpy(v) for k, v in straight[2].items()})
    worst = max(rel, key=rel.get)
    assert rel[worst] < 1e-3, f"{worst} differs by {rel[worst]:.2e} (relative)"


# ----------------------------------------------------------------------------- pricing
def test_trust_ratio_norm_all_reduces_are_priced(monkeypatch):
    """A LAMB plan under tp 2 is predicted slower than the same plan priced without the norm
    all-reduces by exactly one all-reduce of each chunk's [2, tensors + 1] fp32 norms over the
    tensor axis (and slower than AdamW's); on one device the term is 0."""
    import autopar.pricing.price as price
    from autopar.frontend.blocks import param_chunks
    from autopar.frontend.trace import trace
    from autopar.pricing.cost import TRUST_NORM_BYTES_PER_TENSOR, Collectives

    model, batch = ramped_llama()
    g = trace(model, batch)
    trainable = [n for n in g.param_fqn if n not in g.buffers]
    chunks: dict[int, int] = {}
    for k in param_chunks(g.blocks, g.param_fqn, trainable).values():
        chunks[k] = chunks.get(k, 0) + 1
    cluster = autopar.Cluster.preset("dgx-a100", devices=2)
    pin = {"tp": 2, "zero": 0, "num_micro_batches": 1}
    lamb = autopar.plan(model, batch, cluster, optimizer="lamb", constraints=pin)
    adamw = autopar.plan(model, batch, cluster, optimizer="adamw", constraints=pin)
    monkeypatch.setattr(price, "TRUST_RATIO_OPTIMIZERS", ())
    unpriced = autopar.plan(model, batch, cluster, optimizer="lamb", constraints=pin)
    assert lamb.data["ops"] == unpriced.data["ops"] == adamw.data["ops"]
    comm = Collectives(cluster, lamb.mesh)
    tp = lamb.mesh.names.index("tp")
    want = sum(comm("all_reduce", TRUST_NORM_BYTES_PER_TENSOR * (n + 1), tp) for n in chunks.values())
    assert want > 0
    assert lamb.step_time - unpriced.step_time == pytest.approx(want, rel=1e-6)
    assert lamb.step_time > adamw.step_time + want
    monkeypatch.undo()
    one = autopar.Cluster.preset("dgx-a100", devices=1)
    solo = autopar.plan(model, batch, one, optimizer="lamb").step_time
    monkeypatch.setattr(price, "TRUST_RATIO_OPTIMIZERS", ())
    assert autopar.plan(model, batch, one, optimizer="lamb").step_time == pytest.approx(solo, rel=1e-12)


# ----------------------------------------------------------------------------- the plan knows the batch
def test_plan_reports_global_batch_and_tokens():
    model, batch = ramped_llama()   # token ids [8, 16]
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2))
    assert plan.global_batch == 8 and plan.tokens_per_step == 128
    again = autopar.Plan.from_json(plan.to_json())
    assert again.global_batch == 8 and again.tokens_per_step == 128
    from autopar.plans.report import batch_text
    assert batch_text(plan) == "; global batch 8 (128 tokens) per step"
    assert "global batch 8" in plan.summary()
    old = autopar.Plan({k: v for k, v in plan.data.items() if k != "batch"})   # a plan from before the field
    assert old.global_batch == 8 and old.tokens_per_step is None


def test_trust_ratio_norms_priced_on_a_2d_grid(monkeypatch):
    """The 2D grid's step (autopar/search/grid_price.py) carries the same term: per chunk one
    all-reduce of its norms over each grid axis."""
    import autopar.pricing.cost as cost
    import autopar.search.grid_price as grid_price
    from autopar.frontend.blocks import param_chunks
    from autopar.frontend.trace import trace
    from autopar.pricing.price import trust_norm_axes

    model, batch = ramped_llama()
    g = trace(model, batch)
    trainable = [n for n in g.param_fqn if n not in g.buffers]
    chunks: dict[int, int] = {}
    for k in param_chunks(g.blocks, g.param_fqn, trainable).values():
        chunks[k] = chunks.get(k, 0) + 1
    cluster = autopar.Cluster.preset("dgx-a100", devices=4)
    pin = {"tp_mode": "2d", "num_micro_batches": 1}
    lars = autopar.plan(model, batch, cluster, optimizer="lars", constraints=pin)
    monkeypatch.setattr(grid_price, "TRUST_RATIO_OPTIMIZERS", ())
    unpriced = autopar.plan(model, batch, cluster, optimizer="lars", constraints=pin)
    assert lars.degrees["tp_mode"] == "2d"
    comm = cost.Collectives(cluster, lars.mesh)
    axes = trust_norm_axes(lars.mesh, lars.degrees["zero"])
    want = sum(comm("all_reduce", cost.TRUST_NORM_BYTES_PER_TENSOR * (n + 1), a) for n in chunks.values() for a in axes)
    assert len(axes) == 2 and want > 0
    assert lars.step_time - unpriced.step_time == pytest.approx(want, rel=1e-6)


def _restore(rank, world, directory):
    import autopar.execution.compiled_state as cs

    def make(**kw):
        model, batch = ramped_llama()
        return autopar.compile(model, autopar.Cluster.preset("cpu", devices=1), batch, optimizer="lamb",
                               weight_decay=0.01, **kw), batch
    cm, batch = make(lr=1e-2)                       # the BERT recipe
    cm.step(*batch)
    cm.save(directory + "/new")
    saved_settings = cm.group_settings
    other, _ = make(lr=5e-3, param_groups="all")
    other.load(directory + "/new")                  # like torch's optimizer.load_state_dict: lr and groups
    restored = (other.lr, other.step_count, other.group_settings == saved_settings,
                other.opt.chunks[0].hparams is not None)
    keep = cs._optimizer_settings
    cs._optimizer_settings = lambda cm: {}          # a checkpoint from before these entries
    cm.save(directory + "/old")
    cs._optimizer_settings = keep
    third, _ = make(lr=5e-3, param_groups="all")
    third.load(directory + "/old")                  # loads; keeps its own lr and groups
    return restored, (third.lr, third.step_count, set(third.group_settings.values()))


def test_load_restores_lr_and_groups_and_reads_older_checkpoints(tmp_path):
    restored, old = run_local(_restore, 1, args=(str(tmp_path),), timeout=120)[0]
    assert restored == (pytest.approx(1e-2), 1, True, True)
    assert old == (pytest.approx(5e-3), 1, {(0.01, 1.0, True)})
