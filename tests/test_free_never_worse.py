"""The free search is never slower than the same search pinned to a pipeline degree (issue 29,
item 3): it visits every degree a user could pin (``pipeline_search._pp_choices``: not only powers
of two) and, where a candidate does not fit, the same candidate with every block checkpointed.

The model: a 6-layer GPT with hidden 16384 on 3 DGX-A100 nodes (batch 6). 3 stages is not a power
of two, so the free search used to plan pp=1 only (0.487 s); pinned pp=3 is 0.417 s.
"""
from __future__ import annotations

from unittest import mock

import pytest

import autopar
import autopar.search.pipeline_search as ps
from autopar.frontend.trace import trace
from autopar.models import ZOO


@pytest.fixture(scope="module")
def gpt_3_nodes():
    model, batch = ZOO["gpt2"](device="meta", n_layer=6, d_model=16384, n_head=128, seq=2048, batch=6, vocab=51200)
    return model, batch, autopar.Cluster.preset("dgx-a100", nodes=3), trace(model, batch)


def _plan(case, constraints=None):
    model, batch, cluster, graph = case
    return autopar.plan(model, batch, cluster, traced=graph, constraints=constraints)


def test_three_stages_are_a_free_choice(gpt_3_nodes):
    _, _, cluster, graph = gpt_3_nodes
    assert 3 in ps._pp_choices(graph, cluster, {})


def test_free_no_slower_than_pinned_non_power_of_two_degree(gpt_3_nodes, monkeypatch):
    monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", "1")
    pinned = _plan(gpt_3_nodes, {"pp": 3})
    seen = []   # (bound, step time) of every pipelined candidate the free search evaluated
    evaluate, candidates = ps._Pipelined._evaluate, ps._Pipelined.candidates
    bounds = {}

    def record_candidates(self, base_compute, sp_for=None):
        out = candidates(self, base_compute, sp_for)
        bounds.update({(c[1], c[3], c[4], c[6]): c[0] for c in out})
        return out

    def record(self, p, m, sched, sp, best_time, ck=0):
        out = evaluate(self, p, m, sched, sp, best_time, ck)
        if out[0] == "ok":
            seen.append((bounds[(p, m, sched, ck)], out[3]["step_time"]))
        return out
    with mock.patch.object(ps._Pipelined, "_evaluate", record), \
            mock.patch.object(ps._Pipelined, "candidates", record_candidates):
        free = _plan(gpt_3_nodes)
    assert free.step_time <= pinned.step_time * (1 + 1e-9)
    assert free.degrees["pp"] == 3   # the degree the powers of two skipped wins here
    assert seen and all(b <= t for b, t in seen)   # the candidate bound is below what it bounds
    # and the old degrees alone (powers of two: none on 3 nodes) plan slower
    with mock.patch.object(ps, "_pp_choices", lambda *a: []):
        assert _plan(gpt_3_nodes).step_time > pinned.step_time
