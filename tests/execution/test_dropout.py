"""Dropout under a plan: ranks holding replicas of an activation draw the same mask, ranks holding
different blocks (split over a model axis, other rows over a data axis) draw their own
(runtime/rng.py, codegen/random_ops.py).

With dropout > 0 a run cannot equal one-process eager training: eager draws one mask for the whole
batch from one stream, each rank here draws its block's mask from its own seeded generator. What
is checked instead: the loss is finite and the same on every rank, parameters replicated over the
tensor-parallel axis stay bit-identical on its ranks, and the masks agree or differ as above."""
from __future__ import annotations

import math

import pytest
import torch

import autopar
import runtime.rng as RNG
from autopar.models import ZOO
from runtime.launch import run_local

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP otherwise (see tests/execution/test_execute.py)


def mlp(dropout=0.1):
    return ZOO["mlp"](d_in=128, hidden=512, n_layer=2, dropout=dropout, batch=64)


def _plan(dropout=0.1):
    model, batch = mlp(dropout)
    return autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=4), optimizer="sgd", precision="fp32",
                        constraints={"dp": 2, "tp": 2, "num_micro_batches": 1})


# ------------------------------------------------------------------ single process

def test_seeded_masks_agree_for_equal_blocks_and_differ_otherwise():
    RNG.set_seed(7)
    x = torch.ones(64, 64)
    drop = torch.ops.aten.dropout.default
    state = torch.get_rng_state()
    a = RNG.seeded(drop, 1, 10, ((1, 0),), x, 0.5, True)
    assert torch.equal(a, RNG.seeded(drop, 1, 10, ((1, 0),), x, 0.5, True))       # a replica / a recomputation
    assert not torch.equal(a, RNG.seeded(drop, 1, 10, ((1, 1),), x, 0.5, True))   # another block
    assert not torch.equal(a, RNG.seeded(drop, 2, 10, ((1, 0),), x, 0.5, True))   # the next micro-batch
    assert not torch.equal(a, RNG.seeded(drop, 1, 11, ((1, 0),), x, 0.5, True))   # another op
    assert torch.equal(state, torch.get_rng_state()), "the user's random stream moved"


def test_codegen_keys_dropout_by_the_axes_its_output_is_split_over():
    """dp=2 x tp=2: the first dropout's output is split over both axes (its key names both
    coordinates), the second one's is replicated over tp (its key leaves tp out)."""
    from autopar.frontend.trace import trace
    from codegen import generate

    model, batch = mlp()
    plan, traced = _plan(), trace(model, batch)
    keys = {}
    for r in range(4):
        prog = generate(traced, plan, r)
        calls = [n for n in prog.gm.graph.nodes if n.target is RNG.seeded]
        assert len(calls) == 2
        keys[r] = [n.args[3] for n in calls]
    coords = {r: plan.mesh.coords(r) for r in range(4)}
    for r in range(4):
        dp, tp = coords[r]
        assert keys[r] == [((0, dp), (1, tp)), ((0, dp),)], keys[r]
    inactive = generate(trace(*mlp(0.0)), _plan(0.0), 0)
    assert not any(n.target is RNG.seeded or n.target is RNG.tick for n in inactive.gm.graph.nodes)


# ------------------------------------------------------------------ four processes

MASKS: list = []


def _recording_seeded(fn, position, op, block, /, *args, **kwargs):
    out = _ORIGINAL_SEEDED(fn, position, op, block, *args, **kwargs)
    MASKS.append((position, op, block, (out == 0).clone()))
    return out


_ORIGINAL_SEEDED = RNG.seeded


def _train(rank, world, plan_json):
    torch.manual_seed(1000 + rank)   # separate processes, separately seeded (torchrun gives no common seed)
    RNG.seeded = _recording_seeded   # generated programs call what runtime.rng.seeded is at codegen time
    model, batch = mlp()
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), optimizer="sgd", lr=0.1, momentum=0.9)
    losses = [cm.step(*batch) for _ in range(3)]
    # numpy, not tensors: torch pickles tensors through shared memory that vanishes with this process
    local = {fqn: p.detach().numpy().copy() for fqn, p in cm.params.items()}
    layouts = {fqn: sorted(lay.axes_used()) for fqn, lay in cm.program.param_layouts.items()}
    masks = [(pos, op, block, m.numpy().copy()) for pos, op, block, m in MASKS]
    return losses, local, layouts, masks, cm.comm_stats()


@pytest.mark.slow
def test_dropout_replicas_agree_and_splits_differ_dp2_tp2():
    plan = _plan()
    res = run_local(_train, 4, args=(plan.to_json(),), timeout=300)
    coords = {r: tuple(plan.mesh.coords(r)) for r in range(4)}
    assert res[0][4].get("tp", 0) > 0 and res[0][4].get("dp", 0) > 0
    for losses, *_ in res:
        assert losses == res[0][0] and all(math.isfinite(v) for v in losses)
    # Parameters replicated over tp: bit-identical on the two tp ranks of each dp row.
    replicated = [f for f, axes in res[0][2].items() if 1 not in axes]
    assert replicated, "the plan replicates no parameter over tp: the test checks nothing"
    for r in range(4):
        partner = next(q for q in range(4) if coords[q] == (coords[r][0], 1 - coords[r][1]))
        for f in replicated:
            assert (res[r][1][f] == res[partner][1][f]).all(), f"{f} diverged between tp ranks {r} and {partner}"

    def mask(r, op_rank):   # the masks rank r drew, by (position, op)
        return {(pos, op): m for pos, op, _, m in res[r][3] if op == op_rank}

    ops = sorted({op for _, op, _, _ in res[0][3]})
    split_op, replicated_op = ops   # codegen test: the first is split over tp, the second replicated
    for key, m in mask(0, replicated_op).items():
        assert (m == mask(1, replicated_op)[key]).all()               # tp replicas: one mask
        assert not (m == mask(2, replicated_op)[key]).all()           # other rows (dp): another
    for key, m in mask(0, split_op).items():
        assert not (m == mask(1, split_op)[key]).all()                # split over tp: independent


def _gpt_dropout(rank, world, plan_json):
    torch.manual_seed(1000 + rank)
    model, batch = ZOO["gpt2"](dropout=0.1, batch=4)
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), optimizer="sgd", lr=0.1, momentum=0.9)
    calls = [str(n.args[0]) for n in cm.program.gm.graph.nodes if n.target is RNG.seeded]
    losses = [cm.step(*batch) for _ in range(3)]
    return losses, calls, {k: v.numpy() for k, v in cm.full_state_dict().items()}


@pytest.mark.slow
def test_attention_dropout_and_dropout_train_gpt2_dp2():
    """SDPA's dropout_p runs seeded too; the run trains (the loss moves) and stays finite."""
    model, batch = ZOO["gpt2"](dropout=0.1, batch=4)
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2), optimizer="sgd", precision="fp32",
                        constraints={"dp": 2, "tp": 1, "num_micro_batches": 1})
    res = run_local(_gpt_dropout, 2, args=(plan.to_json(),), timeout=300)
    losses, calls, _ = res[0]
    assert any("scaled_dot_product_attention" in c for c in calls) and any("dropout" in c for c in calls)
    assert res[1][0] == losses and all(math.isfinite(v) for v in losses) and losses[-1] != losses[0]
