"""Predictions are proven by measurement (design.md, testing doctrine).

Plans are made in this (parent) process with precision="fp32" (the CPU runtime's default) and run
on forked gloo ranks; the "-bf16" cases plan with precision="bf16" and run the mixed-precision
runtime (bf16 working parameters, gradients and collectives, fp32 master and optimizer state) on
the CPU with ``compile(precision="bf16")``. On every rank, in the second training step (the first one warms up):

- the bytes of parameters, gradients and optimizer state the runtime holds
  (``ShardedOptimizer.state_bytes()``; gradients read at the end of backward, just before the
  optimizer step, since stages 0/1 free ``p.grad`` in ``zero_grad``) must equal the plan's
  ``memory_breakdown`` params / grads / optimizer;
- the bytes moved by collectives in that step (``compiled.comm_stats()`` after
  ``reset_comm_stats()``) must equal ``plan.comm_bytes`` for every mesh axis of size > 1.

The one documented difference, computed exactly here (never a tolerance): ZeRO keeps each chunk
(one per repeated block, plus one for the rest) in a flat fp32 buffer padded to a multiple of the
data-parallel size W (runtime/zero.py). With ``pad = ceil(n/W)*W - n`` elements per chunk and
w = 4 bytes (fp32) or 2 (bf16 working copy), o = 8 (AdamW m, v) or 12 (bf16: + fp32 master):
  params     stage 0-2: + pad*w          stage 3: + pad*w/W   (only the shard is kept)
  grads      stage 0-1: exact (p.grad)   stage 2-3: + pad*w/W (the gradient shard)
  optimizer  stage 0:   + pad*o (over the padded buffer)      stage 1-3: + pad*o/W
  data-axis bytes: stage 0 exact (the DDP-style reducer's buckets are unpadded); stages 1-3 move
  the padded buffer in every reduce-scatter / all-gather of a chunk.
The loss all-reduce that makes the reported loss identical on every rank (CompiledModel.
_global_loss) is a plain ``dist.all_reduce`` that COMM_STATS does not count: nothing to exclude.
"""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch

import autopar
from autopar.models import ZOO
from runtime.launch import run_local

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP otherwise (see tests/execution/test_execute.py)

ADAMW_STATE = 8   # fp32 m and v per element
FP32 = 4
WORKING = {"fp32": 4, "bf16": 2}        # bytes of a working parameter / gradient element
OPTIMIZER = {"fp32": 8, "bf16": 12}     # AdamW state (+ the fp32 master under bf16)

# name -> (model, devices, constraints, policy)
CASES = {
    "mlp-dp4-zero0": ("mlp", 4, {"dp": 4, "tp": 1, "zero": 0}, None),
    "mlp-dp4-zero1": ("mlp", 4, {"dp": 4, "tp": 1, "zero": 1}, None),
    "mlp-dp4-zero2": ("mlp", 4, {"dp": 4, "tp": 1, "zero": 2}, None),
    "mlp-dp4-zero3": ("mlp", 4, {"dp": 4, "tp": 1, "zero": 3}, None),
    "gpt2-dp2-zero0": ("gpt2", 2, {"dp": 2, "tp": 1, "zero": 0}, None),
    "gpt2-dp2-zero1": ("gpt2", 2, {"dp": 2, "tp": 1, "zero": 1}, None),
    "gpt2-dp2-zero2": ("gpt2", 2, {"dp": 2, "tp": 1, "zero": 2}, None),
    "gpt2-dp2-zero3": ("gpt2", 2, {"dp": 2, "tp": 1, "zero": 3}, None),
    "mlp-dp2-zero2-nm2": ("mlp", 2, {"dp": 2, "tp": 1, "zero": 2, "num_micro_batches": 2}, None),
    "mlp-dp2-zero3-nm2": ("mlp", 2, {"dp": 2, "tp": 1, "zero": 3, "num_micro_batches": 2}, None),
    "mlp-tp2-megatron": ("mlp", 2, {"dp": 1, "tp": 2}, "megatron"),
    "gpt2-tp2-megatron": ("gpt2", 2, {"dp": 1, "tp": 2}, "megatron"),
    "gpt2-tp4-1d-megatron": ("gpt2", 4, {"dp": 1, "tp": 4, "tp_mode": "1d"}, "megatron"),
    "gpt2-dp2-tp2": ("gpt2", 4, {"dp": 2, "tp": 2}, None),
    "mlp-dp4-zero0-bf16": ("mlp", 4, {"dp": 4, "tp": 1, "zero": 0}, None),
    "gpt2-dp2-zero1-bf16": ("gpt2", 2, {"dp": 2, "tp": 1, "zero": 1}, None),
    "gpt2-dp2-zero2-bf16": ("gpt2", 2, {"dp": 2, "tp": 1, "zero": 2}, None),
    "mlp-dp4-zero3-bf16": ("mlp", 4, {"dp": 4, "tp": 1, "zero": 3}, None),
    "gpt2-dp2-tp2-bf16": ("gpt2", 4, {"dp": 2, "tp": 2}, None),
}


def precision_of(key: str) -> str:
    return "bf16" if key.endswith("-bf16") else "fp32"

TP_CASES = [k for k, v in CASES.items() if v[2].get("tp", 1) > 1]

_RESULTS: dict = {}


def _measure(rank, world, name, plan_json, precision):
    model, batch = ZOO[name]()
    plan = autopar.Plan.from_json(plan_json)
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch, plan=plan,
                         precision=precision)
    cm.step(*batch)   # warm-up: the first step's set-up traffic is not a step's
    box = {}
    inner = cm.opt.step

    def step_measuring():   # end of backward: every persistent gradient exists
        box["state"] = cm.opt.state_bytes()
        inner()

    cm.opt.step = step_measuring
    cm.reset_comm_stats()
    cm.step(*batch)
    return dict(comm=cm.comm_stats(), state=box["state"], after=cm.opt.state_bytes(),
                chunks=[c.numel for c in cm.opt.chunks], W=cm.opt.world)


def run_case(key):
    if key not in _RESULTS:
        name, n, cons, policy = CASES[key]
        model, batch = ZOO[name]()
        prec = precision_of(key)
        plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=n), precision=prec,
                            constraints={"num_micro_batches": 1, **cons}, policy=policy)
        for k, v in cons.items():
            assert plan.degrees[k] == v, (k, plan.degrees)
        _RESULTS[key] = (plan, run_local(_measure, n, args=(name, plan.to_json(), prec), timeout=240))
    return _RESULTS[key]


def _padding(chunks, W) -> int:
    """Padding elements of all of a rank's ZeRO flat buffers (runtime/zero.py: to a multiple of W)."""
    return sum(-(-n // W) * W - n for n in chunks)


def expected_state(plan, chunks, W) -> dict[str, Fraction]:
    z = plan.degrees["zero"]
    pad = _padding(chunks, W)
    mb = plan.memory_breakdown
    shard = Fraction(1, W)
    prec = plan.data["settings"]["precision"]
    w, o = WORKING[prec], OPTIMIZER[prec]
    return {
        "params": mb["params"] + pad * w * (shard if z == 3 else 1),
        "grads": mb["grads"] + (pad * w * shard if z >= 2 else 0),
        "optimizer": mb["optimizer"] + pad * o * (shard if z >= 1 else 1),
    }


def expected_comm(plan, chunks, W) -> dict[str, int]:
    """plan.comm_bytes for the axes of size > 1, plus the padded flat buffers' extra bytes."""
    mesh, z = plan.mesh, plan.degrees["zero"]
    nm = plan.degrees["num_micro_batches"]
    # chunk collectives per step: rs + ag (stage 1), nm rs + ag (stage 2), nm*(2 ag + rs) (stage 3)
    per_chunk = {0: 0, 1: 2, 2: nm + 1, 3: 3 * nm}[z]
    out = {a: int(plan.comm_bytes[a]) for i, a in enumerate(mesh.names) if mesh.shape[i] > 1}
    data = [mesh.names[a] for a in mesh.data_axes() if mesh.shape[a] > 1]
    if data:
        out["+".join(data)] += _padding(chunks, W) * WORKING[plan.data["settings"]["precision"]] * per_chunk
    return out


@pytest.mark.slow
@pytest.mark.parametrize("key", list(CASES))
def test_state_bytes_match_memory_breakdown(key):
    plan, ranks = run_case(key)
    for r, res in enumerate(ranks):
        want = expected_state(plan, res["chunks"], res["W"])
        assert all(v.denominator == 1 for v in want.values()), want   # bytes are whole
        assert res["state"] == {k: int(v) for k, v in want.items()}, (key, r, plan.memory_breakdown)
        # After the step: params and optimizer state unchanged; gradients persist only in stages 2-3.
        z = plan.degrees["zero"]
        assert res["after"] == dict(res["state"], grads=res["state"]["grads"] if z >= 2 else 0)


@pytest.mark.slow
@pytest.mark.parametrize("key", list(CASES))
def test_collective_bytes_match_plan(key):
    plan, ranks = run_case(key)
    for r, res in enumerate(ranks):
        measured = {a: b for a, b in res["comm"].items() if b}
        want = expected_comm(plan, res["chunks"], res["W"])
        mesh = plan.mesh
        size_one = {mesh.names[i] for i in range(mesh.ndim) if mesh.shape[i] == 1}
        # Axes of size 1: see test_no_bytes_counted_on_axes_of_size_one.
        measured = {a: b for a, b in measured.items() if a not in size_one}
        assert measured == {a: b for a, b in want.items() if b}, (key, r, plan.comm_bytes)
        if key in TP_CASES:   # the tensor-parallel split really communicates (no vacuous 0 == 0)
            assert all(measured.get(mesh.names[a], 0) > 0 for a in mesh.model_axes() if mesh.shape[a] > 1)


def test_padding_formula_is_exact():
    assert _padding([4160, 4160, 2762], 4) == 2
    assert _padding([4160, 2762], 2) == 0
    assert _padding([5, 7], 4) == 3 + 1


@pytest.mark.slow
@pytest.mark.parametrize("key", ["mlp-tp2-megatron"])
def test_no_bytes_counted_on_axes_of_size_one(key):
    plan, ranks = run_case(key)
    mesh = plan.mesh
    for res in ranks:
        for i, a in enumerate(mesh.names):
            if mesh.shape[i] == 1:
                assert res["comm"].get(a, 0) == 0 == plan.comm_bytes[a], (a, res["comm"])

