"""Mixed precision and gradient clipping under multi-process plans (gloo, forked ranks).

bf16 (``compile(precision="bf16")``, the path a GPU takes for a bf16 plan, run here on the CPU):
the working parameters, activations, gradients and gradient collectives are bf16, the ZeRO
optimizer keeps fp32 master weights. The reference is the same scheme in plain eager PyTorch on
one process (model in bf16, fp32 master copies stepped by torch.optim, copied back). bf16 rounds
differently when the work is split (a sum of two bf16 partial gradients is not the bf16 rounding
of the whole sum), so agreement is to bf16 accuracy, measured where it is sensitive: plain SGD
(an update is ``-lr * grad``: a wrong gradient shows in full, where Adam would normalise a
scaling error away), relative error of the whole update vector below 5% (measured: 1.3-1.6%,
the same as between the bf16 and fp32 references; a gradient off by a factor 2 gives 100%).

Clipping (``compile(grad_clip=c)``): the global norm over every shard of a dp x tp plan, with
parameters replicated on the tensor-parallel ranks counted once, must equal
``torch.nn.utils.clip_grad_norm_`` on the single-process model: fp32, SGD, rtol 1e-5, with a
threshold far below the gradient norm so that clipping really scales every step.
"""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.models import ZOO
from runtime.launch import run_local

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP otherwise (see tests/execution/test_execute.py)

STEPS = 3
LR = 0.3
NM1 = {"num_micro_batches": 1}


def _plan_json(name, devices, constraints, precision):
    model, batch = ZOO[name]()
    return autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=devices), precision=precision,
                        constraints={**NM1, **constraints}).to_json()


def _train(rank, world, name, plan_json, precision, grad_clip):
    model, batch = ZOO[name]()
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), optimizer="sgd", lr=LR,
                         precision=precision, grad_clip=grad_clip)
    kinds = {(p.dtype, p.device.type) for p in cm.params.values()}
    masters = {c.master.dtype for c in cm.opt.chunks if c.master is not None}
    losses = [cm.step(*batch) for _ in range(STEPS)]
    sd = {k: v.float().numpy() for k, v in cm.full_state_dict().items()}
    norm = None if cm.opt.last_grad_norm is None else float(cm.opt.last_grad_norm)
    return losses, (sd if rank == 0 else None), kinds, masters, norm


def reference(name, bf16: bool, grad_clip=None):
    """Eager single process: (losses, final fp32 parameters by name, initial ones, last grad norm)."""
    model, batch = ZOO[name]()
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    if bf16:
        masters = {k: p.detach().clone().float().requires_grad_(True) for k, p in model.named_parameters()}
        model = model.to(torch.bfloat16)
    else:
        masters = dict(model.named_parameters())
    opt = torch.optim.SGD(masters.values(), lr=LR)
    losses, norm = [], None
    for _ in range(STEPS):
        model.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        loss = model(*batch)
        loss.backward()
        if bf16:
            for k, p in model.named_parameters():
                masters[k].grad = p.grad.float()
        if grad_clip is not None:
            norm = float(torch.nn.utils.clip_grad_norm_(masters.values(), grad_clip))
        opt.step()
        if bf16:
            with torch.no_grad():
                for k, p in model.named_parameters():
                    p.copy_(masters[k])
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().float() for k, v in masters.items()}, init, norm


def _relative_update_error(sd, ref, init) -> float:
    num = sum(float(((torch.from_numpy(sd[k]) - ref[k]) ** 2).sum()) for k in ref)
    den = sum(float(((ref[k] - init[k]) ** 2).sum()) for k in ref)
    return (num / den) ** 0.5


def _per_tensor_update_errors(sd, ref, ref32, init) -> dict[str, tuple[float, float]]:
    """Per parameter: (|run - bf16 ref|, allowed). Allowed is 10% of the tensor's own update, or
    3x the distance between the bf16 and fp32 references where bf16 rounding alone is larger (a
    tensor whose update is at bf16's noise level cannot be checked more tightly than that). An
    update that vanished (a LayerNorm or bias never stepped) is off by 100% of its own size."""
    out = {}
    for k in ref:
        run = torch.from_numpy(sd[k])
        err = float((run - ref[k]).norm())
        update = float((ref[k] - init[k]).norm())
        noise = float((ref[k] - ref32[k]).norm())
        out[k] = (err, max(0.10 * update, 3.0 * noise))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name,devices,constraints", [
    ("gpt2", 2, {"dp": 2, "tp": 1, "zero": 0}),
    ("gpt2", 2, {"dp": 2, "tp": 1, "zero": 1}),
    ("gpt2", 2, {"dp": 1, "tp": 2}),
    ("gpt2", 4, {"dp": 2, "tp": 2, "zero": 3}),
    ("llama", 4, {"dp": 2, "tp": 2, "zero": 2}),
])
def test_bf16_matches_eager_bf16_with_fp32_master(name, devices, constraints):
    res = run_local(_train, devices, args=(name, _plan_json(name, devices, constraints, "bf16"), "bf16", None),
                    timeout=240)
    losses, sd, kinds, masters, _ = res[0]
    assert kinds == {(torch.bfloat16, "cpu")} and masters == {torch.float32}
    assert all(r[0] == losses for r in res), "ranks report different losses"
    ref_losses, ref, init, _ = reference(name, bf16=True)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=0)
    err = _relative_update_error(sd, ref, init)
    assert err < 0.05, f"update differs from the bf16 reference by {err:.1%}"
    # Tensor by tensor: a small tensor's update (LayerNorms, biases) cannot hide in the total.
    _, ref32, _, _ = reference(name, bf16=False)
    bad = {k: v for k, v in _per_tensor_update_errors(sd, ref, ref32, init).items() if v[0] > v[1]}
    assert not bad, f"per-tensor update errors above their bound (error, bound): {bad}"
    # The check's premise: had every bias / norm update vanished, each of them would be caught.
    small = [k for k in ref if k.endswith("bias") or "ln" in k or "norm" in k]
    assert small
    vanished = {k: (init[k].numpy() if k in small else v) for k, v in sd.items()}
    caught = {k for k, v in _per_tensor_update_errors(vanished, ref, ref32, init).items() if v[0] > v[1]}
    assert caught == set(small), set(small) ^ caught


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 2])
def test_clipping_global_norm_over_dp_and_tp_shards(zero):
    clip = 0.05
    constraints = {"dp": 2, "tp": 2, "zero": zero}
    res = run_local(_train, 4, args=("gpt2", _plan_json("gpt2", 4, constraints, "fp32"), "fp32", clip), timeout=240)
    ref_losses, ref, _, ref_norm = reference("gpt2", bf16=False, grad_clip=clip)
    assert ref_norm > 10 * clip   # clipping binds: every update is scaled
    for losses, _, _, _, norm in res:
        assert norm == pytest.approx(ref_norm, rel=1e-5)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    sd = res[0][1]
    for k in ref:
        torch.testing.assert_close(torch.from_numpy(sd[k]), ref[k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
