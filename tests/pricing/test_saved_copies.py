"""The copies reshards save (autopar/pricing/saved_copies.py) are in the plan's memory, and a plan
they push over the budget is solved again instead of returned over budget. (That the counted
bytes equal what ranks save is measured in tests/execution/test_sequence_parallel_exec.py
``test_saved_activations_match_prediction``: Megatron-SP on GPT-2 and Hugging Face Llama.)"""
from __future__ import annotations

import autopar
from autopar.errors import MemoryBudgetError
from autopar.models import ZOO
from autopar.search import visit

CONS = {"tp": 2, "sp_mode": "megatron", "num_micro_batches": 1}


def _plan(budget=None):
    model, batch = ZOO["gpt2"]()
    return autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2), precision="fp32",
                        optimizer="sgd", constraints=CONS, memory_budget=budget)


def _node_terms_only(problem, sol, cands, P, remaining, stats):
    return sol      # what the search did before: the ILP's node terms are the plan's memory


def test_megatron_sp_plan_counts_the_copies_its_reshards_save(monkeypatch):
    exact = _plan()
    monkeypatch.setattr(visit, "_with_saved_copies", _node_terms_only)
    nodes_only = _plan()
    assert [op["strategy"] for op in exact.data["ops"]] == [op["strategy"] for op in nodes_only.data["ops"]]
    extra = (exact.data["predictions"]["memory_breakdown"]["activations"]
             - nodes_only.data["predictions"]["memory_breakdown"]["activations"])
    # GPT-2's row-parallel attention projection saves its column slice of the replicated attention
    # output: (b·s, h/2) fp32 per layer, beside the whole output the attention saves. The QKV and
    # FC1 linears read their norm's sequence half through one all-gather and keep that half, not
    # the gathered (b·s, h) input node pricing charged them (runtime/regather.py): -(b·s, h/2) each
    model, batch = ZOO["gpt2"]()
    b, s = batch[0].shape
    cfg = model.config
    half = b * s * cfg.d_model // 2 * 4
    kept = [op for op in exact.data["ops"] if op["rule"] == "linear" and "S(n)" in op["strategy"]]
    assert len(kept) == 2 * cfg.n_layer, [op["strategy"] for op in exact.data["ops"] if op["rule"] == "linear"]
    assert extra == cfg.n_layer * (half - 2 * half)


def test_a_plan_over_budget_by_its_copies_is_solved_again(monkeypatch):
    exact = _plan()
    budget = exact.data["predictions"]["peak_memory"] - 1
    with monkeypatch.context() as m:
        m.setattr(visit, "_with_saved_copies", _node_terms_only)
        try:
            blind = _plan(budget)
        except MemoryBudgetError:
            blind = None
    if blind is not None:
        # the premise: counting node terms only, a plan fits on paper ...
        assert blind.data["predictions"]["peak_memory"] <= budget
    # ... and with the copies counted the search never returns a plan over the budget
    try:
        got = _plan(budget)
    except MemoryBudgetError as e:
        assert "budget" in str(e).lower()
        return
    assert got.data["predictions"]["peak_memory"] <= budget
    assert got.data["ops"] != exact.data["ops"]
