"""LAMB and LARS under every plan kind equal the same optimizer in one process (issue 33).

Their update of a tensor is scaled by a ratio of the WHOLE tensor's norms (LAMB ||w||/||u||,
LARS ||w||/(||g|| + wd ||w||)), whatever mesh axes and ZeRO chunks split it. Taken per block
(each rank's shard of a tensor-parallel weight), the update is silently different while the
losses still agree closely.

* one process: autopar's LAMB equals a reference written here from NVIDIA apex's FusedLAMB
  (adam_w_mode, bias correction, global gradient-norm clipping with max_grad_norm, trust ratio
  ||w||/||u||, 1 where either norm is 0) with the BERT recipe's no-decay group (parameters of at
  most one dimension: no weight decay, no trust ratio; apex applies no ratio where decay is 0),
  and LARS the paper's formula with the same exclusions (no decay, no layer adaptation);
* every plan kind (data parallel with ZeRO-1, -2 and -3, 1D tensor parallel, dp x tp with ZeRO-1,
  Megatron-SP, Ulysses sequence axis, pipeline, 2D grid on 2 and 4 gloo ranks; the 2.5D and 3D grids
  and dp x tp x pp with ZeRO-1 on 8) trained 3 steps equals the one-process run: losses rel 1e-5; parameters rel
  1e-3 for LAMB (its m/sqrt(v) amplifies fp32 noise like Adam's) and 1e-5 for LARS.

The tiny Llama's weights are scaled by a ramp along each dimension before training, so every
block of a split tensor has its own norm: per-block trust ratios then differ from the whole
tensor's by percents, far outside the tolerances (``test_per_block_norms_would_fail`` shows it by
turning the cross-rank sums off, and each case checks that the plan really split some tensor).
Parameters are compared per tensor by the largest difference relative to the tensor's largest
magnitude (an elementwise relative error blows up where m/sqrt(v) divides fp32 noise by a tiny v).
"""
from __future__ import annotations

import functools

import pytest
import torch

import autopar
from helpers.large_batch import ramped_llama, rel_errors
from runtime.launch import run_local

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops

STEPS = 3
HPARAMS = {"lamb": dict(lr=2e-2, weight_decay=0.01, grad_clip=1.0),   # the gradient norm is ~7: clipped
           "lars": dict(lr=0.5, momentum=0.9, weight_decay=0.01, trust_coefficient=0.02)}
PARAM_RTOL = {"lamb": 1e-3, "lars": 1e-5}


def _train(rank, world, opt, constraints, per_block=False):
    from runtime.zero import ShardedOptimizer
    if per_block == "model":   # the bug: each rank's model-axis blocks taken for whole tensors
        init = ShardedOptimizer.__init__

        def no_sums(self, *a, **kw):
            kw.update(tensor_norm_groups=(), tensor_norm_skip=())
            init(self, *a, **kw)
        ShardedOptimizer.__init__ = no_sums
    elif per_block == "all":   # no cross-rank sums at all, ZeRO shards included
        ShardedOptimizer._tensor_norm_reducer = lambda self, c: None
    model, batch = ramped_llama()
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), batch, optimizer=opt,
                         plan_options={"constraints": constraints}, **HPARAMS[opt])
    losses = [cm.step(*batch) for _ in range(STEPS)]
    sd = {k: v.numpy() for k, v in cm.full_state_dict().items()}
    split = sorted(fqn for fqn, p in cm.params.items() if p.numel() != model.get_parameter(fqn).numel())
    return losses, (sd if rank == 0 else None), cm.plan.degrees, split, cm.zero


@functools.lru_cache(maxsize=None)
def one_process(opt):
    return run_local(_train, 1, args=(opt, {}), timeout=240)[0]


def _compare(opt, world, constraints, per_block=False):
    ref_losses, ref_sd = one_process(opt)[:2]
    res = run_local(_train, world, args=(opt, constraints, per_block), timeout=400)
    for r, (losses, *_) in enumerate(res if not per_block else ()):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"rank {r} losses: {m}")
    return res, rel_errors(res[0][1], {k: torch.from_numpy(v) for k, v in ref_sd.items()})


# ----------------------------------------------------------------------------- one process
def fused_lamb_reference(params, grads, states, step, lr, b1=0.9, b2=0.999, eps=1e-6, wd=0.0,
                         max_grad_norm=0.0, no_decay=None):
    """NVIDIA apex FusedLAMB's update, per tensor, in plain torch: global gradient clipping first
    (max_grad_norm > 0: every gradient divided by ||g||/max_grad_norm when that is > 1),
    adam_w_mode (decoupled decay added to the Adam direction), bias correction, grad_averaging
    (m takes (1 - b1) g); p -= lr * ratio * u with ratio = ||p||/||u||, or 1 where either norm is
    0. ``no_decay[i]``: tensor i is in the no-decay group (decay 0, and so no ratio: apex's
    multi_tensor_lamb applies the ratio only where decay != 0, unless use_nvlamb)."""
    if max_grad_norm > 0:
        norm = torch.sqrt(sum((g * g).sum() for g in grads))
        if norm > max_grad_norm:
            grads = [g / (norm / max_grad_norm) for g in grads]
    no_decay = no_decay or [False] * len(params)
    for p, g, st, nd in zip(params, grads, states, no_decay):
        m = st.setdefault("m", torch.zeros_like(p))
        v = st.setdefault("v", torch.zeros_like(p))
        m.mul_(b1).add_((1 - b1) * g)
        v.mul_(b2).add_((1 - b2) * g * g)
        m_hat, v_hat = m / (1 - b1 ** step), v / (1 - b2 ** step)
        u = m_hat / (v_hat.sqrt() + eps) + (0.0 if nd else wd) * p
        w_norm, u_norm = p.norm(), u.norm()
        ratio = w_norm / u_norm if w_norm != 0 and u_norm != 0 and not nd else 1.0
        p.sub_(lr * ratio * u)


def lars_reference(params, grads, states, step, lr, momentum=0.9, wd=0.0, trust_coefficient=0.001, eps=1e-8,
                   no_decay=None):
    """LARS (You et al. 2017) with momentum: v = m v + lr * local_lr * (g + wd p), p -= v,
    local_lr = coef ||p|| / (||g|| + wd ||p|| + eps), 1 where either norm is 0; a no-decay tensor
    has wd 0 and local_lr 1 (timm's LARS with always_adapt=False)."""
    no_decay = no_decay or [False] * len(params)
    for p, g, st, nd in zip(params, grads, states, no_decay):
        buf = st.setdefault("buf", torch.zeros_like(p))
        pn, gn = p.norm(), g.norm()
        local = trust_coefficient * pn / (gn + wd * pn + eps) if pn != 0 and gn != 0 and not nd else 1.0
        buf.mul_(momentum).add_(lr * local * (g + (0.0 if nd else wd) * p))
        p.sub_(buf)


def _reference(opt):
    model, batch = ramped_llama()
    params = [p for p in model.parameters() if p.requires_grad]
    hp = dict(HPARAMS[opt])
    lr, wd = hp.pop("lr"), hp.pop("weight_decay")
    if "grad_clip" in hp:
        hp["max_grad_norm"] = hp.pop("grad_clip")
    states = [{} for _ in params]
    no_decay = [p.dim() <= 1 for p in params]   # the BERT recipe, compile's default for LAMB and LARS
    losses = []
    for step in range(1, STEPS + 1):
        model.zero_grad()
        loss = model(*batch)
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            ref = fused_lamb_reference if opt == "lamb" else lars_reference
            ref(params, [p.grad for p in params], states, step, lr, wd=wd, no_decay=no_decay, **hp)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("opt", ["lamb", "lars"])
def test_one_process_equals_reference(opt):
    """autopar's one-process LAMB / LARS (flat chunks, Segments) equal the per-tensor references."""
    want_losses, want_sd = _reference(opt)
    losses, sd = one_process(opt)[:2]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), rtol=1e-6, atol=1e-7)
    rel = rel_errors(sd, want_sd)
    worst = max(rel, key=rel.get)
    assert rel[worst] < 1e-5, f"{worst} differs by {rel[worst]:.2e} of its largest magnitude"


def test_fused_lamb_reference_zero_norms():
    """The reference's conventions: a zero tensor (||w|| = 0) and a zero update take ratio 1."""
    p = [torch.zeros(3), torch.ones(2)]
    g = [torch.ones(3), torch.zeros(2)]
    fused_lamb_reference(p, g, [{}, {}], 1, lr=0.1)
    # step 1: m_hat = g, v_hat = g^2, u = g / (|g| + eps): ratio 1 for the zero weight
    torch.testing.assert_close(p[0], torch.full((3,), -0.1 / (1 + 1e-6)))
    torch.testing.assert_close(p[1], torch.ones(2))


# ----------------------------------------------------------------------------- every plan kind
# (id, ranks, constraints, what the plan must have split: a mesh axis or ZeRO stage)
PLANS = [
    ("dp2-zero1", 2, {"dp": 2, "zero": 1}),
    ("dp2-zero2", 2, {"dp": 2, "zero": 2}),
    ("dp2-zero3", 2, {"dp": 2, "zero": 3}),
    ("tp2", 2, {"tp": 2}),
    ("dp2xtp2-zero1", 4, {"dp": 2, "tp": 2, "zero": 1}),
    ("megatron-sp2", 2, {"tp": 2, "sp": 2, "sp_mode": "megatron"}),
    ("ulysses-sp2", 2, {"sp": 2, "sp_mode": "ulysses"}),
    ("pp2", 2, {"pp": 2}),
    ("2d", 4, {"tp_mode": "2d"}),
]


def _check_plan(cid, degrees, split, zero):
    """The plan is the kind the case names, and splits tensors where it should."""
    if "zero" in cid:
        assert zero == int(cid.split("zero")[1]) and degrees["dp"] == 2
    if "tp2" in cid or "megatron" in cid or cid == "2d":
        assert split, "no parameter split over a model axis: the case tests nothing"
    if "megatron" in cid:
        assert degrees["sp_mode"] == "megatron"
    if "ulysses" in cid:
        assert degrees["sp_mode"] == "ulysses" and degrees["sp"] == 2
    if cid == "2d":
        assert degrees["tp_mode"] == "2d"
    if cid == "pp2":
        assert degrees["pp"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("opt", ["lamb", "lars"])
@pytest.mark.parametrize("cid,world,constraints", PLANS, ids=[p[0] for p in PLANS])
def test_plan_kind_equals_one_process(cid, world, constraints, opt):
    res, rel = _compare(opt, world, constraints)
    _, _, degrees, split, zero = res[0]
    _check_plan(cid, degrees, split, zero)
    worst = max(rel, key=rel.get)
    assert rel[worst] < PARAM_RTOL[opt], f"{cid} {opt}: {worst} differs by {rel[worst]:.2e} (relative)"


EIGHT = [("2.5d", {"tp_mode": "2.5d"}, "lamb"), ("2.5d", {"tp_mode": "2.5d"}, "lars"),
         ("3d", {"tp_mode": "3d"}, "lamb"), ("dp2xtp2xpp2-zero1", {"dp": 2, "tp": 2, "pp": 2, "zero": 1}, "lamb")]


@pytest.mark.slow
@pytest.mark.parametrize("cid,constraints,opt", EIGHT, ids=[f"{c}-{o}" for c, _, o in EIGHT])
def test_eight_ranks(cid, constraints, opt):
    """8 ranks: the 2.5D grid (q 2, depth 2: every weight split over the grid), the 3D grid
    (q 2), and dp 2 x tp 2 x
    pp 2 with ZeRO-1 (data shards, stages, and the tensor axis at once; the planner keeps this
    tiny model's stage weights whole on the tensor axis, so only the replica masking runs there)."""
    res, rel = _compare(opt, 8, constraints)
    _, _, degrees, split, zero = res[0]
    if cid in ("2.5d", "3d"):
        assert degrees["tp_mode"] == cid and split
    else:
        assert (degrees["dp"], degrees["tp"], degrees["pp"], zero) == (2, 2, 2, 1)
    worst = max(rel, key=rel.get)
    assert rel[worst] < PARAM_RTOL[opt], f"{cid} {opt}: {worst} differs by {rel[worst]:.2e} (relative)"


PER_BLOCK = [("model", 2, {"tp": 2}), ("all", 2, {"dp": 2, "zero": 1})]


@pytest.mark.slow
@pytest.mark.parametrize("opt", ["lamb", "lars"])
@pytest.mark.parametrize("mode,world,constraints", PER_BLOCK, ids=["tp2-blocks", "zero1-shards"])
def test_per_block_norms_would_fail(mode, world, constraints, opt):
    """Norms taken per block are far outside the tolerance, so the plan-kind tests above catch
    them: tp 2 without the sums over the tensor axis, ZeRO-1 without the sums over the shards
    (measured: 1.4-4.3e-2 of the largest magnitude for LAMB, 2.2-3.3e-2 for LARS)."""
    res, rel = _compare(opt, world, constraints, per_block=mode)
    assert mode != "model" or res[0][3], "nothing split"
    worst = max(rel.values())
    assert worst > 10 * PARAM_RTOL[opt], f"per-block norms differ by only {worst:.2e}"
