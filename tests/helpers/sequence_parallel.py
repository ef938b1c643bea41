"""Sequence-parallel cases trained on forked gloo ranks against one eager process, with the bytes
per mesh axis and saved activations they are checked on; shared by tests/execution/test_sequence_parallel_exec.py,
test_ulysses_explicit.py and test_hybrid_sp.py."""
from __future__ import annotations

import torch

import autopar
from autopar.models import HF_ZOO
from autopar.models import ZOO as ZOO_MODELS
from helpers.exactness import assert_matches_eager, train_eagerly
from runtime.launch import run_local

ZOO = {**ZOO_MODELS, **HF_ZOO}


STEPS = 3


OPT = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}


def reference(name, kw):
    model, batch = ZOO[name](**kw)
    opt = torch.optim.SGD(model.parameters(), lr=OPT["lr"], momentum=OPT["momentum"])
    return train_eagerly(model, batch, opt, STEPS)


def train_rank(rank, world, name, plan_json, kw):
    from runtime.collectives import COMM_STATS
    model, batch = ZOO[name](**kw)
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), **OPT)
    losses = [cm.step(*batch)]
    cm.reset_comm_stats()
    COMM_STATS.reset()
    losses += [cm.step(*batch) for _ in range(STEPS - 1)]
    per_step = {k: v // (STEPS - 1) for k, v in cm.comm_stats().items()}
    kinds = {f"{a}:{k}": v // (STEPS - 1) for (a, k), v in COMM_STATS.snapshot_by_kind().items()}
    sd = {k: v.numpy() for k, v in cm.full_state_dict().items()}
    return losses, (sd if rank == 0 else None), per_step, kinds


def run_case(name, nprocs, constraints, policy=None, **kw):
    model, batch = ZOO[name](**kw)
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=nprocs), precision="fp32",
                        optimizer="sgd", constraints={"num_micro_batches": 1, **constraints}, policy=policy)
    ref_losses, ref_sd = reference(name, kw)
    res = run_local(train_rank, nprocs, args=(name, plan.to_json(), kw), timeout=300)
    assert_matches_eager([out[0] for out in res], res[0][1], ref_losses, ref_sd)
    # bytes per mesh axis at run time == the plan's prediction, on every rank
    want = {a: int(plan.comm_bytes[a]) for i, a in enumerate(plan.mesh.names) if plan.mesh.shape[i] > 1}
    for r, out in enumerate(res):
        got = {a: out[2].get(a, 0) for a in want}
        assert got == want, (r, got, want)
    for k, v in constraints.items():   # the pinned axes exist and carry traffic
        if k in ("dp", "tp", "sp") and v > 1:
            assert plan.degrees[k] == v, plan.degrees
            axes = ({"megatron": ("tp",), "hybrid": ("sp_r", "sp_u")}.get(constraints.get("sp_mode"), ("sp",))
                    if k == "sp" else (k,))
            for axis in axes:
                assert all(out[2].get(axis, 0) > 0 for out in res), (axis, [out[2] for out in res])
    return plan, res


def attention_ops(plan):
    return [op for op in plan.data["ops"] if "scaled_dot_product_attention" in op["target"]]


def attention_shape(name, kw=None):
    """(batch, heads at the attention op, seq, head_dim, layers) of a zoo model (the zoo Llama and
    Hugging Face's repeat_kv repeat the kv heads before SDPA, so K/V carry all query heads there)."""
    model, batch = ZOO[name](**(kw or {}))
    if name.startswith("hf_"):
        c = model.model.config
        return (batch[0].shape[0], c.num_attention_heads, batch[0].shape[1],
                c.hidden_size // c.num_attention_heads, c.num_hidden_layers)
    c = model.config
    return batch[0].shape[0], c.n_head, batch[0].shape[1], c.d_model // c.n_head, c.n_layer


def predicted_saved(plan):
    """The plan's saved-activation bytes per rank (no pipeline, no checkpointing: every saved
    activation is alive at the peak): node pricing plus the copies its reshards save
    (autopar/pricing/saved_copies.py)."""
    return plan.data["predictions"]["memory_breakdown"]["activations"]


def measure_saved(rank, world, name, plan_json, kw=None):
    from autopar.pricing.saved_probe import saved_bytes
    model, batch = ZOO[name](**(kw or {}))
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), **OPT)
    cm.step(*batch)
    return saved_bytes(cm.step, *batch, exclude=list(cm.params.values()) + list(cm.buffers.values()))
