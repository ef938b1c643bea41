"""The outer search's pruning and caching never change the plan: on small cases the pruned search
returns a configuration whose predicted step time equals the exhaustive search's (every
configuration solved, no bounds, no time limit), and every bound it prunes with is below what
the configuration's own plan predicts. Also: the progress line exists under verbose.
No timing assertions here (timings live in benchmarks/bench_planning.py)."""
import numpy as np
import pytest

import autopar
from autopar.frontend.batching import infer_batch_dims, input_shapes
from autopar.rules.candidates import candidates
from autopar.models import ZOO
from autopar.search.predict import predict, step_time_lower_bound
from autopar.pricing.price import Settings, price, price_edges
from autopar.pricing.edge_floor import edge_pairs, with_edge_floors
from autopar.search.build import bound_problem, build_problem, work_problem
from autopar.search.configurations import configurations
from autopar.search.outer import search
from autopar.search.visit import FLOOR_LP_PAIRS, MIP_GAP
from autopar.frontend.trace import trace
from solver.ilp import relaxation_bound, solve
from solver.tree_bound import tree_lower_bound

CASES = [
    ("gpt2", {}, ("cpu", dict(devices=4)), None),
    ("mlp", {}, ("cpu", dict(devices=4)), None),
    ("gpt2", dict(n_layer=3, batch=8), ("dgx-a100", dict(nodes=1)), None),
    ("llama", {}, ("cpu", dict(devices=4)), {"zero": 1}),
]


@pytest.fixture(scope="module", params=range(len(CASES)), ids=[f"{c[0]}-{c[2][0]}" for c in CASES])
def case(request):
    name, kw, (preset, ckw), cons = CASES[request.param]
    model, inputs = ZOO[name](**kw)
    g = trace(model, inputs)
    g.batch_dims = infer_batch_dims(input_shapes(g), None)
    return g, autopar.Cluster.preset(preset, **ckw), cons


def _base(cluster, budget=None):
    return Settings(budget=float(budget if budget is not None else cluster.device.memory_bytes))


def test_pruned_search_equals_exhaustive(case):
    g, cluster, cons = case
    best, stats = search(g, cluster, _base(cluster), cons)
    ref, ref_stats = search(g, cluster, _base(cluster), cons, exhaustive=True)
    assert ref_stats["pruned"] == 0 and ref_stats["solved"] + ref_stats["infeasible"] >= ref_stats["configs"] - 0
    assert best.prediction["step_time"] == pytest.approx(ref.prediction["step_time"], rel=MIP_GAP)
    assert best.prediction["step_time"] <= ref.prediction["step_time"] * (1 + MIP_GAP)


def test_bounds_are_below_every_configurations_plan(case):
    g, cluster, cons = case
    from autopar.search.configurations import check_constraints
    cache = {}
    for cfg in configurations(g, cluster, _base(cluster), check_constraints(cons)):
        if cfg.mesh not in cache:   # per mesh (setdefault's argument ran for every configuration)
            cache[cfg.mesh] = candidates(g, cfg.mesh)
        c = cache[cfg.mesh]
        P = price(c, cluster, cfg.settings, edges=False)
        node_bound = step_time_lower_bound(P)
        price_edges(c, cluster, cfg.settings, P)
        edge_bound = step_time_lower_bound(P, edges=True)
        problem = build_problem(c, P, cfg.settings)
        sol = solve(problem, mip_gap=MIP_GAP)
        if sol.status == "infeasible":
            continue
        step = predict(c, P, cfg.settings, problem, sol, cluster)["step_time"]
        assert node_bound <= edge_bound * (1 + 1e-12) + 1e-15
        assert edge_bound <= step * (1 + 1e-9), (cfg.mesh.describe(), cfg.settings)
        # the resharding floors (autopar/pricing/edge_floor.py) bound the priced matrices entry by
        # entry, so the bounds built on them are below the priced ones and below the plan
        F = with_edge_floors(P, c, cluster, cfg.settings)
        for k, floor in F.edges.items():
            assert np.all(floor <= P.edges[k] * (1 + 1e-9) + 1e-15), (cfg.mesh.describe(), k)
        assert node_bound <= step_time_lower_bound(F, edges=True) * (1 + 1e-12) + 1e-15
        assert step_time_lower_bound(F, edges=True) <= edge_bound * (1 + 1e-12) + 1e-15
        # the spanning-tree bound over the floors, on the light problem the search builds for it
        # (visit._pruned_by_floors): the costs and edges of bound_problem(build_problem(...))
        light, full = work_problem(c, F), bound_problem(build_problem(c, F, cfg.settings), F)
        assert all(np.array_equal(a, b) for a, b in zip(light.costs, full.costs, strict=True))
        assert [(e.src, e.dst) for e in light.edges] == [(e.src, e.dst) for e in full.edges]
        assert all(np.array_equal(e.cost, f.cost) for e, f in zip(light.edges, full.edges))
        assert tree_lower_bound(light) <= step * (1 + 1e-9) + 1e-15, (cfg.mesh.describe(), cfg.settings)
        if len(cfg.mesh.model_axes()) > 1:   # the LP over the floors, as the search runs it there
            lp = relaxation_bound(bound_problem(build_problem(c, F, cfg.settings), F))
            assert lp <= step * (1 + 1e-6), (cfg.mesh.describe(), cfg.settings)


def test_floors_prune_the_two_axis_mesh_unpriced():
    """The premise of the floors: on llama (cpu x4) the two-model-axis mesh, whose edges cost
    tens of thousands of shortest-path searches, is pruned without pricing them, and the floors
    are far from zero there (above the bound without resharding). The plan equals the exhaustive
    search's (test_pruned_search_equals_exhaustive)."""
    model, inputs = ZOO["llama"]()
    g = trace(model, inputs)
    g.batch_dims = infer_batch_dims(input_shapes(g), None)
    cluster = autopar.Cluster.preset("cpu", devices=4)
    best, stats = search(g, cluster, _base(cluster), None)
    assert stats.get("pruned_unpriced", 0) >= 1
    mesh = next(m for m in cluster.meshes() if len(m.model_axes()) == 2)
    c = candidates(g, mesh)
    assert edge_pairs(c, cluster) >= FLOOR_LP_PAIRS
    s = Settings(budget=float(cluster.device.memory_bytes))
    P = price(c, cluster, s, edges=False)
    assert step_time_lower_bound(with_edge_floors(P, c, cluster, s), edges=True) > 1.05 * step_time_lower_bound(P)


def test_candidates_shared_across_nodes_and_meshes_equal_a_fresh_enumeration(case):
    """candidates() keeps op specs on the graph and enumerates ops with equal specs once per mesh:
    every node still gets exactly the strategies of its own spec (spec_for + enumerate_strategies)."""
    from autopar.rules import spec_for
    from autopar.rules.strategy import enumerate_strategies, propagate_batch
    from autopar.rules.table import input_dim_sets
    g, cluster, _ = case
    for mesh in cluster.meshes():
        c = candidates(g, mesh)
        c = candidates(g, mesh)   # a second time: the graph's caches warm
        batch_of = {n: info.batch_dims for n, info in c.nodes.items()}
        for name in c.order:
            info = c.nodes[name]
            if info.kind != "op" or info.rep != name:
                continue
            spec = spec_for(info.node)
            assert spec == info.spec, name
            letters, _ = propagate_batch(spec, input_dim_sets(info.node, batch_of))
            assert info.strategies == enumerate_strategies(spec, mesh, letters), (mesh.describe(), name)


def test_ops_priced_once_per_mesh_match_a_fresh_pricing():
    """The per-(mesh, micro-batches) op cache gives the same arrays as pricing from scratch."""
    model, inputs = ZOO["gpt2"]()
    g = trace(model, inputs)
    cluster = autopar.Cluster.preset("cpu", devices=4)
    cfgs = [c for c in configurations(g, cluster, _base(cluster), {}) if c.settings.zero == 3]
    cfg = cfgs[0]
    c = candidates(g, cfg.mesh)
    for z in (0, 1, 2):   # fill the caches through other stages first
        price(c, cluster, Settings(zero=z, num_micro_batches=cfg.settings.num_micro_batches), edges=True)
    cached = price(c, cluster, cfg.settings, edges=True)
    fresh = price(candidates(g, cfg.mesh), cluster, cfg.settings, edges=True)
    for field in ("compute", "comm", "grad_comm", "optimizer", "saved", "transient", "valid", "edges"):
        a, b = getattr(cached, field), getattr(fresh, field)
        assert a.keys() == b.keys(), field
        for k in a:
            assert (a[k] == b[k]).all(), (field, k)


def test_verbose_shows_search_progress(capsys):
    model, inputs = ZOO["mlp"]()
    autopar.plan(model, inputs, autopar.Cluster.preset("cpu", devices=4), verbose=True)
    out = capsys.readouterr().out
    assert "configurations visited" in out and "pruned" in out and "best" in out


def _out_of_time(real):
    """``real`` (a solver call) as it behaves when the search's time runs out mid-call: HiGHS
    gets a time limit it cannot do anything in, stops with no solution and raises PlanError."""
    def call(problem, time_limit=None, **kw):
        assert time_limit is not None, "the search passes its remaining time to the solver"
        return real(problem, **dict(kw, time_limit=1e-9))
    return call


def test_a_time_limit_hit_in_the_lp_bound_returns_the_best_plan_so_far(monkeypatch):
    """The LP relaxation bound runs under the time limit too: running out of time there keeps the
    best plan found (it used to abort the whole search with the LP's PlanError)."""
    import autopar.search.visit as S
    from autopar.search.build import bound_problem
    from autopar.errors import PlanError
    from solver.ilp import relaxation_bound

    model, inputs = ZOO["gpt2"]()
    g = trace(model, inputs)
    g.batch_dims = infer_batch_dims(input_shapes(g), None)
    cluster = autopar.Cluster.preset("cpu", devices=4)
    # the premise: a real LP bound of one configuration, out of time, raises
    cfg = next(iter(configurations(g, cluster, _base(cluster), {})))
    c = candidates(g, cfg.mesh)
    P = price(c, cluster, cfg.settings)
    with pytest.raises(PlanError, match="time_limit"):
        _out_of_time(relaxation_bound)(bound_problem(build_problem(c, P, cfg.settings), P), time_limit=5.0)

    monkeypatch.setattr(S, "relaxation_bound", _out_of_time(relaxation_bound))
    # the spanning-tree bound (solver/tree_bound.py) would prune some configurations before their
    # LP: switched off so that LPs run
    monkeypatch.setattr(S, "tree_lower_bound", lambda problem: -float("inf"))
    # tp=2 pinned: on this toy the data-parallel plan, visited first, prunes every other mesh
    # by its bounds before any LP runs
    best, stats = search(g, cluster, _base(cluster), {"tp": 2}, time_limit=60)
    assert stats["timed_out"] >= 1 and "lp_bounds" not in stats
    assert best.prediction["step_time"] > 0 and stats["solved"] >= 1


def test_a_time_limit_with_no_plan_found_is_a_clear_error(monkeypatch):
    """Every LP and ILP out of time before any plan: a PlanError naming the time limit, after
    every configuration had its try (not the first solver's message half-way through)."""
    import autopar.search.visit as S
    from autopar.errors import PlanError
    from solver.ilp import relaxation_bound

    model, inputs = ZOO["gpt2"]()
    g = trace(model, inputs)
    g.batch_dims = infer_batch_dims(input_shapes(g), None)
    cluster = autopar.Cluster.preset("cpu", devices=4)
    # ILP configurations only (no grid plan to fall back on), each a real HiGHS problem (tp=1
    # problems are solved without HiGHS)
    pins = {"tp_mode": "1d", "tp": 2}
    monkeypatch.setattr(S, "relaxation_bound", _out_of_time(relaxation_bound))
    monkeypatch.setattr(S, "solve", _out_of_time(solve))
    with pytest.raises(PlanError, match=r"no plan found within time_limit=60 s.*raise time_limit") as ei:
        search(g, cluster, _base(cluster), pins, time_limit=60)
    n = len(list(configurations(g, cluster, _base(cluster), pins)))
    assert n > 1 and f"on {n} of {n} configurations" in str(ei.value), str(ei.value)


def test_stage_sub_mesh_reuses_the_whole_mesh_reshard_searches(monkeypatch):
    """A pipeline stage's sub-mesh (dp / pp x the same model axes) at m micro-batches asks the
    reshard problems the whole mesh asked at m / pp (the same per-rank blocks once the shared data
    axis is left out: autopar/pricing/reshard.py ``reduce_problem``). They are answered from the
    shared memo without a search (all but tensors the data axis does not split on both sides,
    whose per-rank blocks differ), and the matrices equal a pricing from scratch."""
    import autopar.pricing.edge_price as E
    from autopar.mesh import Mesh
    from autopar.search.pipeline_pins import stage_cluster

    model, inputs = ZOO["gpt2"]()
    g = trace(model, inputs)
    cluster = autopar.Cluster.preset("dgx-a100", nodes=4)
    whole, sub_cluster = Mesh((4, 2, 4), ("dp", "tp", "tp2"), 8), stage_cluster(cluster, 2)
    sub = Mesh((2, 2, 4), ("dp", "tp", "tp2"), 8)
    searched = []
    real = E.search_reduced
    monkeypatch.setattr(E, "search_reduced", lambda *a: searched.append(a) or real(*a))
    families: dict = {}   # one plan's reshard memos (Candidates.reshards)
    price(candidates(g, whole, reshards=families), cluster, Settings(num_micro_batches=1), edges=True)
    n_whole = len(searched)
    searched.clear()
    reused = price(candidates(g, sub, reshards=families), sub_cluster, Settings(num_micro_batches=2), edges=True)
    n_reused = len(searched)
    searched.clear()
    fresh = price(candidates(g, sub), sub_cluster, Settings(num_micro_batches=2), edges=True)
    assert n_whole and n_reused * 10 < len(searched), (n_whole, n_reused, len(searched))
    assert reused.edges.keys() == fresh.edges.keys() and reused.edges
    for k in fresh.edges:
        assert (reused.edges[k] == fresh.edges[k]).all(), k
        for a, b in zip(reused.edge_bytes[k], fresh.edge_bytes[k]):
            assert (a == b).all(), k


def test_zero2_relaxation_is_at_most_zero1s(case):
    """visit._lp_bound does not solve ZeRO-2's LP bound when ZeRO-1's on the same mesh and micro-batch
    count is below the target: the two bound problems have the same costs (gradient communication
    free: all that differs between the stages' prices) and ZeRO-2's memory rows are looser."""
    g, cluster, cons = case
    from autopar.search.configurations import check_constraints
    cache, lps = {}, {}
    for cfg in configurations(g, cluster, _base(cluster), check_constraints(cons)):
        if cfg.settings.zero not in (1, 2):
            continue
        if cfg.mesh not in cache:
            cache[cfg.mesh] = candidates(g, cfg.mesh)
        c = cache[cfg.mesh]
        P = price(c, cluster, cfg.settings, edges=True)
        relaxed = bound_problem(build_problem(c, P, cfg.settings), P)
        lps[cfg.mesh, cfg.settings.num_micro_batches, cfg.settings.zero] = relaxation_bound(relaxed)
    pairs = [(v, lps[k[:2] + (1,)]) for k, v in lps.items() if k[2] == 2 and k[:2] + (1,) in lps]
    assert pairs or (cons or {}).get("zero") == 1
    for lp2, lp1 in pairs:
        assert lp2 <= lp1 * (1 + 1e-9) + 1e-15


def test_search_skips_floors_where_the_matrices_are_priced(monkeypatch):
    """Where another ZeRO stage priced a configuration's resharding matrices, the search skips the
    floors (its exact bounds use the matrices); the plan is the exhaustive search's."""
    import autopar.search.visit as O
    model, inputs = ZOO["gpt2"](n_layer=3, batch=8)
    g = trace(model, inputs)
    cluster = autopar.Cluster.preset("dgx-a100", nodes=1)
    floors_on_priced = []
    real = O._pruned_by_floors
    monkeypatch.setattr(O, "_pruned_by_floors", lambda cfg, P, cands, cl, *a: floors_on_priced.append(
        O.edges_priced(cands, cl, cfg.settings)) or real(cfg, P, cands, cl, *a))
    best, stats = search(g, cluster, _base(cluster), {})
    assert not any(floors_on_priced) and floors_on_priced
    ref, _ = search(g, cluster, _base(cluster), {}, exhaustive=True)
    assert best.prediction["step_time"] <= ref.prediction["step_time"] * (1 + MIP_GAP)


@pytest.mark.slow
def test_zero2_reuses_zero1s_lp_and_plans_the_same(monkeypatch):
    """Under memory pressure (a GPT 18.4B shape cut to two layers, a tenth of the memory, tp=8 on
    32 DGX nodes) ZeRO-2 configurations reuse ZeRO-1's LP bound (visit.REUSE_ZERO1_LP) and the
    plan is the one found solving every LP."""
    import autopar.search.visit as O
    from benchmarks.bench_planning import GPT_18_4B, _factory
    model, inputs = _factory("gpt2")(**dict(GPT_18_4B, n_layer=2))
    g = trace(model, inputs)
    cluster = autopar.Cluster.preset("dgx-a100", nodes=32)
    base = Settings(budget=0.1 * cluster.device.memory_bytes)
    best, stats = search(g, cluster, base, {"tp": 8})
    assert stats.get("lp_reused", 0) >= 1, stats
    monkeypatch.setattr(O, "REUSE_ZERO1_LP", False)
    ref, ref_stats = search(g, cluster, base, {"tp": 8})
    assert "lp_reused" not in ref_stats and ref_stats["lp_bounds"] > stats["lp_bounds"]
    assert best.config == ref.config
    assert best.prediction["step_time"] == ref.prediction["step_time"]


@pytest.mark.parametrize("preset,kw", [("cpu", dict(devices=4)), ("dgx-a100", dict(nodes=2)),
                                       ("dgx-h100", dict(nodes=2))])
def test_least_collective_price_on_at_least_some_bytes(preset, kw):
    """edge_floor._least_from(nbytes, axis) is no more than any collective on that axis costs on
    nbytes or more (checked on a dense grid of sizes: the published and calibrated curves are not
    monotone everywhere), and 0 on an axis spanning nodes."""
    from autopar.pricing.edge_floor import COLLECTIVES, _least_from
    from autopar.pricing.mesh_comm import mesh_comm

    cluster = autopar.Cluster.preset(preset, **kw)
    mesh = next(m for m in cluster.meshes() if len(m.model_axes()) == 2)
    comm = mesh_comm(candidates(trace(*ZOO["mlp"]()), mesh), cluster)
    least = _least_from(comm, cluster, mesh)
    grid = np.geomspace(1.0, 2.0**36, 900)
    for axis in range(mesh.ndim):
        p = mesh.placement(axis)
        prices = np.array([min(comm(k, float(x), axis) for k in COLLECTIVES) for x in grid])
        after = np.minimum.accumulate(prices[::-1])[::-1]   # the least at each size or above
        for x, floor in zip(grid[::7], after[::7]):
            got = least(float(x), axis)
            assert got <= floor * (1 + 1e-12), (axis, x, got, floor)
            if p.inter > 1:
                assert got == 0.0
        if p.inter <= 1 and p.size > 1:
            assert least(2.0**20, axis) > 0.0


def test_planning_pauses_the_cyclic_collector_and_restores_it(monkeypatch):
    """autopar.plan turns the cyclic collector off while it searches (every collection walked the
    memoised prices: api.plan's comment) and puts the caller's state back, enabled or not, with
    nothing left frozen."""
    import gc

    import autopar.search.pipeline_search as PS
    seen = []
    real = PS.plan_search
    monkeypatch.setattr(PS, "plan_search", lambda *a, **k: seen.append(gc.isenabled()) or real(*a, **k))
    model, inputs = ZOO["mlp"]()
    for caller_enabled in (True, False):
        (gc.enable if caller_enabled else gc.disable)()
        try:
            autopar.plan(model, inputs, autopar.Cluster.preset("cpu", devices=4))
            assert seen[-1] is False and gc.isenabled() is caller_enabled and gc.get_freeze_count() == 0
        finally:
            gc.enable()


@pytest.mark.slow   # three llama searches, two at a tight budget: minutes of CPU
def test_infeasible_floor_lp_prunes_as_the_priced_path_would(monkeypatch):
    """An LP over the resharding floors with no solution prunes its configuration as infeasible
    before its edges are priced (visit.FLOOR_LP_INFEASIBLE): the edges only add transportation
    columns, so the LP over the priced edges has no solution either. On gpt2 (cpu x4) pinned to the
    two-model-axis mesh (tp_shape [2, 2]: four configurations, one per micro-batch count) at 0.6 of
    the free plan's peak, the floors' LP is infeasible at one and two micro-batches (visited first,
    before any plan exists: a cutoff far above any plan makes the floors run); the plan and the
    configurations ruled out (infeasible or pruned) equal those with the edges priced."""
    import autopar.search.visit as V
    model, inputs = ZOO["gpt2"]()
    g = trace(model, inputs)
    g.batch_dims = infer_batch_dims(input_shapes(g), None)
    cluster = autopar.Cluster.preset("cpu", devices=4)
    free, _ = search(g, cluster, _base(cluster), None)
    budget = 0.6 * free.prediction["peak_memory"]
    pins = {"dp": 1, "tp": 4, "tp_shape": [2, 2]}
    seen = []
    real = V._pruned_by_floors
    monkeypatch.setattr(V, "_pruned_by_floors", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    far = 100 * free.prediction["step_time"]
    best, stats = search(g, cluster, _base(cluster, budget), pins, cutoff=far)
    assert seen.count(V.INFEASIBLE) >= 1
    monkeypatch.setattr(V, "FLOOR_LP_INFEASIBLE", False)
    seen.clear()
    ref, ref_stats = search(g, cluster, _base(cluster, budget), pins, cutoff=far)
    assert V.INFEASIBLE not in seen
    assert best.config == ref.config
    assert best.prediction["step_time"] == ref.prediction["step_time"]
    # the same configurations ruled out; one the priced path prunes by a bound before its LP may be
    # counted infeasible here (its LP over the priced edges would have had no solution either)
    assert stats["infeasible"] + stats["pruned"] == ref_stats["infeasible"] + ref_stats["pruned"]
    assert stats["infeasible"] >= ref_stats["infeasible"] and stats["solved"] == ref_stats["solved"]


def test_min_peak_off_skips_the_smallest_peak():
    """SearchOptions.min_peak=False (a pipelined candidate's first attempt, whose error only sends it
    to its checkpointed retry): the same MemoryBudgetError, without the smallest peak solved for."""
    model, inputs = ZOO["gpt2"]()
    g = trace(model, inputs)
    g.batch_dims = infer_batch_dims(input_shapes(g), None)
    cluster = autopar.Cluster.preset("cpu", devices=4)
    with pytest.raises(autopar.MemoryBudgetError) as full:
        search(g, cluster, _base(cluster, budget=4096))
    with pytest.raises(autopar.MemoryBudgetError) as lazy:
        search(g, cluster, _base(cluster, budget=4096), min_peak=False)
    assert full.value.min_peak_bytes is not None and full.value.min_peak_bytes > 4096
    assert lazy.value.min_peak_bytes is None and lazy.value.budget_bytes == full.value.budget_bytes
