"""autopar/search/grid_bound.py: the bound a grid geometry is pruned with before its lowering is a
true lower bound of the step ``price_grid`` predicts, on every geometry (2D, 2.5D, 3D; dp
replicas; several micro-batches) that lowers for small models on one and two DGX-A100 nodes and
on a cluster with slow links (where collectives weigh most); and the pruned grid pass returns the
plan the unpruned pass returns."""
from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar.frontend.batching import infer_batch_dims, input_shapes
from autopar.frontend.trace import trace
from autopar.mesh import Mesh
from autopar.models import ZOO
from autopar.pricing.price import Settings
from autopar.rules.candidates import candidates
from autopar.search import grid_geometry, grid_price, grid_search
from autopar.search.context import SearchStats
from autopar.search.grid_bound import grid_step_lower_bound
from benchmarks.bench_tp_grid_where import slow_links
from codegen.grid_ops import GridLoweringError


def _graph(name):
    g = trace(*ZOO[name]())
    g.batch_dims = infer_batch_dims(input_shapes(g), None)
    return g


@pytest.mark.parametrize("model", ["gpt2", "gpt2_small"])
def test_bound_never_exceeds_the_priced_grid_step(model):
    g = _graph(model)
    checked = 0
    for cluster in (autopar.Cluster.preset("dgx-a100", nodes=1), autopar.Cluster.preset("dgx-a100", nodes=2)):
        clusters = [cluster, slow_links(cluster)]
        one = candidates(g, Mesh((1,), ("dp",), cluster.devices_per_node))
        batch = grid_geometry.grid_batch(g)
        geos = grid_geometry.grid_geometries(cluster.num_devices, {}, batch)
        geos += ([dataclasses.replace(x, nm=2) for x in geos]
                 + [dataclasses.replace(x, zero=1) for x in geos if x.dp > 1])
        for c in clusters:
            for precision in ("bf16", "fp32"):
                base = Settings(precision=precision)
                for geo in geos:
                    try:
                        step = grid_price.price_grid(g, c, base, geo, one).prediction["step_time"]
                    except GridLoweringError:
                        continue
                    lb = grid_step_lower_bound(g, c, base, geo, one)
                    assert 0 < lb <= step * (1 + 1e-12), (model, c.name, precision, geo, lb, step)
                    checked += 1
    assert checked >= 8, checked


def test_pruned_grid_pass_returns_the_unpruned_plan(monkeypatch):
    g = _graph("gpt2")
    cluster = autopar.Cluster.preset("dgx-a100", nodes=1)
    base = Settings()
    # incumbents around the grid plans' steps: the pass with the bound returns what it returns without
    plain = grid_search.best_grid(g, cluster, base, {}, None, SearchStats())
    assert plain is not None
    for f in (0.9, 1.0, 1.01, 1.5, 3.0):
        best_step = plain.prediction["step_time"] * f
        stats = SearchStats()
        got = grid_search.best_grid(g, cluster, base, {}, best_step, stats)
        monkeypatch.setattr("autopar.search.grid_search.grid_step_lower_bound", lambda *a, **k: 0.0)
        ref = grid_search.best_grid(g, cluster, base, {}, best_step, SearchStats())
        monkeypatch.undo()
        assert (got is None) == (ref is None), f
        if got is not None:
            assert got.geo == ref.geo and got.prediction["step_time"] == ref.prediction["step_time"]
