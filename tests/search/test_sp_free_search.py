"""Sequence parallelism in the free search (issue 7, autopar/search/sequence_search.py ``search_with_sp``):
Ulysses/ring meshes are searched when nothing fits memory without them, and only then."""
import pytest

import autopar
from autopar.errors import MemoryBudgetError
from autopar.models import ZOO
from autopar.models.llama import llama
from autopar.search import sequence_search as sequence

# A tiny LLaMA with a 4k sequence on 2 nodes x 2 devices: tensor parallelism stays inside a node,
# so without a sequence axis each sequence's activations split 2 ways (10.6 MB peak at least);
# with one (sp=2 across the nodes, tp=2) 4 ways. Floors: the smallest peaks the search reports
# with a 1 KiB budget (the min-peak ILP's node terms; a real plan's reshard copies add a little:
# autopar/pricing/saved_copies.py, and under BUDGET the search finds one that fits).
TP_ONLY_FLOOR, RING_FLOOR, BUDGET = 10_638_596, 7_733_762, 8_000_000


def _case():
    model, inputs = llama(n_head=4, n_kv_heads=4, seq=4096, batch=2)
    cluster = autopar.Cluster.preset("dgx-a100", nodes=2, devices=2)
    # The floors below are the unfused model's: the tests plan with kernels="torch". With the fused
    # RMSNorm (the default on this GPU preset) the min-peak ILP reports 6.97 MB with sp=2 while no plan fits
    # 8 MB once the reshards' saved copies are counted: a known gap (issue 31's notes).
    return model, inputs, cluster


def test_free_search_adds_sequence_axis_when_tp_alone_does_not_fit():
    model, inputs, cluster = _case()
    with pytest.raises(MemoryBudgetError):   # tensor parallelism (and pipelining) only
        autopar.plan(model, inputs, cluster, kernels="torch", memory_budget=BUDGET, constraints={"sp": 1})
    plan = autopar.plan(model, inputs, cluster, kernels="torch", memory_budget=BUDGET)
    assert plan.degrees["sp_mode"] in ("ulysses", "ring"), plan.degrees
    assert plan.degrees["sp"] > 1 and plan.peak_memory <= BUDGET


def test_memory_error_reports_smallest_peak_over_both():
    model, inputs, cluster = _case()
    with pytest.raises(MemoryBudgetError) as e:
        autopar.plan(model, inputs, cluster, kernels="torch", memory_budget=1024)
    assert e.value.min_peak_bytes <= RING_FLOOR < TP_ONLY_FLOOR
    assert "sequence-parallel" in str(e.value)


def test_small_models_free_plans_unchanged(monkeypatch):
    """No sp search runs for them (a plan fits, sequences < 2 x hidden): same degrees as with sp=1."""
    def boom(*a, **k):
        raise AssertionError("sp retry ran")
    monkeypatch.setattr("autopar.search.pipeline_search.search_with_sp", boom)
    monkeypatch.setattr(sequence, "sp_sizes", boom)   # (b): sequences far below 2 x hidden
    cluster = autopar.Cluster.preset("cpu", devices=4)
    for name in ("gpt2", "llama"):
        model, inputs = ZOO[name]()
        free = autopar.plan(model, inputs, cluster)
        assert free.degrees == autopar.plan(model, inputs, cluster, constraints={"sp": 1}).degrees
        assert free.degrees["sp_mode"] in (None, "megatron")


def test_retry_only_when_sp_is_free():
    assert sequence.sp_free({}) and sequence.sp_free({"tp": 2, "pp": 1})
    assert not sequence.sp_free({"sp": 1}) and not sequence.sp_free({"sp_mode": "megatron"})


def test_long_sequence_offers_sp_up_front_when_faster():
    """Issue 7 (b): seq >= SP_UPFRONT_RATIO x hidden. A 2-layer Llama-7B shape at 32k on 8 A100s:
    the best plan without a sequence axis fits (tp=8 with Megatron-SP), and the free search
    returns a ring/Ulysses plan predicted faster than it (measured: sp=4 ring, tp=2, -11%)."""
    from autopar.models.llama import llama_7b
    model, inputs = llama_7b(n_layer=2, seq=32768, batch=1)
    cluster = autopar.Cluster.preset("dgx-a100")
    no_sp = autopar.plan(model, inputs, cluster, constraints={"sp": 1})
    free = autopar.plan(model, inputs, cluster)
    assert free.degrees["sp_mode"] in ("ulysses", "ring") and free.degrees["sp"] > 1, free.degrees
    assert free.step_time < no_sp.step_time and free.peak_memory <= cluster.device.memory_bytes


def test_a_batch_smaller_than_the_nodes_is_placed_by_a_sequence_axis():
    """One long sequence on 2 nodes: without a sequence axis no configuration exists (the data
    axis spans the nodes and the batch of 1 does not divide), so the free search places it with a
    sequence axis across them; "tensor parallelism only" still says why it cannot."""
    from autopar.errors import ConstraintError
    model, inputs = llama(n_head=4, n_kv_heads=4, seq=4096, batch=1)
    cluster = autopar.Cluster.preset("dgx-a100", nodes=2, devices=2)
    with pytest.raises(ConstraintError, match="global batch 1"):
        autopar.plan(model, inputs, cluster, kernels="torch", constraints={"sp": 1})
    plan = autopar.plan(model, inputs, cluster)
    assert plan.degrees["sp"] * plan.degrees["tp"] * plan.degrees["pp"] == 4, plan.degrees
    assert plan.degrees["sp"] > 1 and plan.degrees["dp"] == 1, plan.degrees
