"""Sequence-parallel axes composed with pipeline stages (issue 7): ``pp`` x ``sp`` plans.

A pipelined plan's mesh is one stage's sub-mesh; with ``sp`` pinned it carries the sequence axis
(dp x sp x tp), every stage runs its attention ops with the pinned algorithm (ring / Ulysses) on
that axis, and what crosses a stage boundary is each rank's local sequence shard (the same
per-rank program is cut into stages, so both sides agree on the split, zig-zag included).

Executed cases train 3 steps of SGD with momentum in fp32 on 4 forked gloo ranks against one eager
process (losses rel 1e-5, parameters rel 1e-4) and assert their premise: the plan's degrees
(pp=2, sp=2, the mode), the attention ops' algorithm, every rank holding only its stage's blocks,
the bytes counted at run time per mesh axis and point-to-point equal to the plan's per-stage
prediction (steps 2-3: the first step includes PyTorch's metadata pass), the sequence axis moving
the attention algorithm's closed-form bytes, and the point-to-point transfers being the local
sequence shard (s / sp tokens per rank, not the whole sequence).
"""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.models import ZOO
from helpers.sp_pipeline import CPU4, STEPS, plan_case, run_pp_sp_case

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops


def _attention_shape(name, kw):
    """(batch, heads at the attention op, seq, head dim) of a zoo model (the zoo Llama repeats
    its kv heads before SDPA, so K/V carry all query heads there)."""
    model, batch = ZOO[name](**kw)
    c = model.config
    return batch[0].shape[0], c.n_head, batch[0].shape[1], c.d_model // c.n_head


def _local_shard_p2p(plan, res, name, kw, split):
    """What crosses a boundary is each rank's local sequence shard: per micro-batch (mb, s / split,
    d_model) fp32 activations (forward, to the next stage) or their gradients (backward, to the
    previous one); a stage sends over each of its boundaries."""
    b, h, s, d = _attention_shape(name, kw)
    m = plan.degrees["num_micro_batches"]
    mb = b // plan.degrees["dp"] // m
    shard = mb * (s // split) * h * d * 4
    last = len(plan.data["stages"]) - 1
    for st in plan.data["stages"]:
        assert st["p2p_bytes"] == ((st["index"] > 0) + (st["index"] < last)) * m * shard, st


def _run_pp_sp(name, mode, m=2, extra=None, **kw):
    """pp=2 x sp=2 (``mode``, and ``extra`` pins) on 4 gloo ranks (``run_pp_sp_case``) and the sequence axis'
    premise. With activation checkpointing every attention call's forward runs twice."""
    from runtime.ring_attention import ring_attention_bytes
    from runtime.ulysses import ulysses_bytes

    plan, res = run_pp_sp_case(name, {"pp": 2, "sp": 2, "sp_mode": mode, "num_micro_batches": m, **(extra or {})}, **kw)
    recomputed = plan.degrees["checkpoint"] == "full"
    deg = plan.degrees
    assert (deg["pp"], deg["sp"], deg["sp_mode"]) == (2, 2, mode), deg
    assert plan.mesh.shape[plan.mesh.axis("sp")] == 2, plan.mesh.describe()
    algo = {"ring": "ring_attention", "ulysses": "ulysses_attention"}[mode]
    attn = [op for op in plan.data["ops"] if "scaled_dot_product_attention" in op["target"]]
    assert attn and all(op["special"] == [algo] for op in attn), [op["strategy"] for op in attn]
    _local_shard_p2p(plan, res, name, kw, deg["sp"])
    b, h, s, d = _attention_shape(name, kw)
    mb = b // deg["dp"] // m
    for r in res:
        assert r["comm"]["sp"] > 0, r["comm"]
        # the sequence axis ran the mode's algorithm: its closed-form bytes per attention call, once
        # per layer of this rank's stage and micro-batch
        mine = [st for st in plan.data["stages"] if st["index"] % deg["pp"] == r["stage"]]
        layers = sum(st["blocks"][1] - st["blocks"][0] for st in mine)
        if mode == "ulysses":
            got, per_call = r["kinds"].get("sp:all_to_all", 0), ulysses_bytes(mb, h, h, s, d, 2, 4)
        else:
            got = r["kinds"].get("sp:ring_kv", 0) + r["kinds"].get("sp:ring_dkv", 0)
            per_call = ring_attention_bytes(mb, h, s, d, 2, 4)
        want = per_call.total_bytes + (per_call.forward_bytes if recomputed else 0)
        assert got == (STEPS - 1) * m * layers * want > 0, (r["kinds"], per_call)
    return plan, res


@pytest.mark.slow
def test_llama_pp2_x_ring_sp2_load_balanced():
    """Zoo Llama (causal, GQA, RoPE): zig-zag (load-balanced) ring attention inside each stage;
    the RoPE tables are sliced zig-zag like the tokens on every stage (recomputed, not sent)."""
    plan, res = _run_pp_sp("llama", "ring")
    assert plan.degrees["pp_schedule"] == "1f1b"


@pytest.mark.slow
def test_gpt2_pp2_x_ulysses_sp2():
    """Zoo GPT-2 (tied embedding: on the first and the last stage, its gradient summed between them)."""
    plan, res = _run_pp_sp("gpt2", "ulysses")
    for r in res:
        assert "wte.weight" in r["params"] and r["comm"]["pp_tied"] > 0, r["comm"]


@pytest.mark.slow
def test_gpt2_interleaved_pp2_x_ring_sp2():
    """Two virtual stages per rank (torch's ScheduleInterleaved1F1B, 4 layers, 4 micro-batches)
    with load-balanced ring attention in every stage."""
    plan, res = _run_pp_sp("gpt2", "ring", m=4, extra={"pp_schedule": "interleaved-1f1b"}, n_layer=4)
    assert [s["virtual"] for s in plan.data["stages"]] == [0, 0, 1, 1]


@pytest.mark.slow
def test_gpt2_pp2_x_ulysses_sp2_with_activation_checkpointing():
    """Checkpointed blocks rerun their forward all-to-alls in backward: the plan's per-stage bytes
    include them (autopar/search/stage_costs.py ``stage_costs``) and equal what runs."""
    plan, res = _run_pp_sp("gpt2", "ulysses", extra={"checkpoint": "full"})
    assert plan.degrees["checkpoint"] == "full" and all(s["recompute_time"] > 0 for s in plan.data["stages"])


@pytest.mark.slow
def test_llama_pp2_x_megatron_sp_tp2():
    """Megatron-SP inside each stage: the norms split the sequence over the tensor axis, the
    row-parallel all-reduce is a reduce-scatter and the column-parallel entry an all-gather."""
    plan, res = run_pp_sp_case("llama", {"pp": 2, "tp": 2, "sp_mode": "megatron", "num_micro_batches": 2})
    assert plan.degrees["sp"] == plan.degrees["tp"] == 2 and plan.degrees["sp_mode"] == "megatron"
    tp = plan.mesh.axis("tp")
    norms = [op for op in plan.data["ops"] if op["target"] == "aten.mean.dim"]   # RMSNorm's statistics
    assert norms and all(op["splits"][tp] is not None for op in norms), [op["strategy"] for op in norms]
    _local_shard_p2p(plan, res, "llama", {}, 2)   # the residual stream crosses sequence-split over tp
    for r in res:
        assert r["kinds"].get("tp:reduce_scatter", 0) > 0 and r["kinds"].get("tp:all_gather", 0) > 0, r["kinds"]


@pytest.mark.parametrize("cons, msg", [
    ({"pp": 2, "sp": 4, "sp_mode": "ring"}, r"pp=2 and sp=4 cannot be met on 4 devices.*sp=4 does not divide 2"),
    ({"pp": 2, "dp": 2, "sp": 2, "sp_mode": "ulysses"}, r"dp=2 x sp=2 cannot be met.*4 does not divide 2"),
    ({"pp": 2, "sp": 3}, r"sp=3 does not divide 2"),
])
def test_impossible_pp_x_sp_pins_are_clear_errors(cons, msg):
    with pytest.raises(autopar.ConstraintError, match=msg):
        plan_case("llama", dict(cons, num_micro_batches=2))


def test_pinned_pp_x_sp_plans_the_sequence_axis_in_each_stage():
    """The premise without processes: the stage sub-mesh has the sequence axis, every attention op
    of both stages runs ring attention there, and each stage predicts sequence-axis traffic."""
    plan = plan_case("llama", {"pp": 2, "sp": 2, "sp_mode": "ring", "num_micro_batches": 2})
    assert plan.mesh.describe() == "dp=1 × sp=2" and plan.degrees["pp"] == 2
    assert [s["ranks"] for s in plan.data["stages"]] == [[0, 1], [2, 3]]
    attn = [op for op in plan.data["ops"] if "scaled_dot_product_attention" in op["target"]]
    assert len(attn) == 2 and all(op["special"] == ["ring_attention"] for op in attn)
    assert all(s["comm_bytes"]["sp"] > 0 for s in plan.data["stages"])


def test_free_search_finds_pp_x_sp_when_memory_needs_both():
    """Issue 7 step 4 with pipelining: a long-sequence Llama (2 layers, d=1024, s=1024, batch 4) on
    4 devices with ZeRO, tensor parallelism and checkpointing pinned off, so parameters split only over pipeline
    stages and a sequence's activations (beyond micro-batching) only over a sequence axis. The
    budget is 1.1x the pinned pp=2 x sp=2 plan's peak. Neither alone fits it (pp=1 with any sequence
    axis: the parameters are whole on every device; sp=1 with any pp: a stage's data ranks can cut
    their 2 rows into at most 2 micro-batches), and the free search finds the pp x sp plan."""
    from autopar.errors import MemoryBudgetError
    from autopar.models.llama import llama

    model, inputs = llama(n_layer=2, n_head=4, n_kv_heads=4, d_model=1024, ffn_hidden=4096, vocab=256, seq=1024,
                          batch=4, device="meta")
    pins = {"zero": 0, "tp": 1, "checkpoint": "none"}   # recomputing every block would fit pp alone

    def plan(budget=None, **cons):
        return autopar.plan(model, inputs, CPU4, precision="fp32", optimizer="sgd", memory_budget=budget,
                            constraints={**pins, **cons})
    both = plan(pp=2, sp=2, num_micro_batches=4)
    budget = int(1.1 * both.peak_memory)
    with pytest.raises(MemoryBudgetError):   # sequence axes without pipelining
        plan(budget, pp=1)
    with pytest.raises(MemoryBudgetError):   # pipelining without a sequence axis
        plan(budget, sp=1)
    free = plan(budget)
    deg = free.degrees
    assert deg["pp"] == 2 and deg["sp"] == 2 and deg["sp_mode"] in ("ring", "ulysses"), deg
    assert free.mesh.shape[free.mesh.axis("sp")] == 2 and free.world_size == 4
    assert len(free.data["stages"]) == 2 and free.peak_memory <= budget
    assert free.stats["pipeline_candidates"] >= 1


@pytest.mark.slow
def test_llama_zero_bubble_x_megatron_sp_tp2():
    """Zero-bubble (PyTorch's InterleavedZeroBubble: input and weight gradients in separate passes)
    with Megatron-SP in each stage: the column-parallel linears keep their all-gathered inputs'
    sequence shards and gather them again in backward (runtime/regather.py, an autograd function
    computing both gradients in one backward); equal to one process, bytes per axis = plan."""
    plan, res = run_pp_sp_case("llama", {"pp": 2, "tp": 2, "sp_mode": "megatron", "num_micro_batches": 4,
                               "pp_schedule": "zero-bubble"}, n_layer=4)
    assert plan.degrees["sp_mode"] == "megatron" and plan.degrees["pp_schedule"] == "zero-bubble"
