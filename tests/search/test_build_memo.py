"""``build_problem`` and ``selective_groups`` (autopar/search/build.py, autopar/pricing/selective_pricing.py)
take the graph's name -> node map and each block group's input roots from the candidates' memo
(``PricingMemo``) instead of rebuilding them per problem (issue 35, planning speed: a 42-layer
graph has thousands of nodes and the outer search builds hundreds of problems): the same
problems, with the work counted."""
from __future__ import annotations

import dataclasses

import numpy as np

import autopar
import autopar.search.build as build
from autopar.frontend.batching import infer_batch_dims, input_shapes
from autopar.frontend.trace import trace
from autopar.models import ZOO
from autopar.pricing.price import Settings, price
from autopar.rules.candidates import candidates
from autopar.search.configurations import check_constraints, configurations


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_memoised_block_inputs_build_the_same_problems(monkeypatch):
    model, inputs = ZOO["gpt2"]()
    g = trace(model, inputs)
    g.batch_dims = infer_batch_dims(input_shapes(g), None)
    cluster = autopar.Cluster.preset("cpu", devices=4)
    base = Settings(budget=float(cluster.device.memory_bytes))
    assert g.blocks, "the premise: a graph with repeated blocks (checkpoint groups)"
    calls = {"roots": 0}
    roots = build._block_input_roots

    def counting(c, gi):
        calls["roots"] += 1
        return roots(c, gi)

    monkeypatch.setattr(build, "_block_input_roots", counting)
    shared, built = {}, 0
    for cfg in configurations(g, cluster, base, check_constraints(None)):
        c = shared.setdefault(cfg.mesh, candidates(g, cfg.mesh))
        problem = build.build_problem(c, price(c, cluster, cfg.settings, edges=False), cfg.settings)
        fresh = candidates(g, cfg.mesh)   # an empty memo: everything computed for this problem
        assert _same(problem, build.build_problem(fresh, price(fresh, cluster, cfg.settings, edges=False),
                                                  cfg.settings)), (cfg.mesh.describe(), cfg.settings)
        built += 1
    # each mesh's candidates compute a block group's roots once; each fresh candidates once more
    assert built > len(shared)
    assert calls["roots"] == len(g.blocks) * (len(shared) + built)
