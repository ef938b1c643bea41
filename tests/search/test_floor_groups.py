"""The envelope LP over the floors of a group of ZeRO / offload variants (autopar/search/floor_groups.py):
its LP never exceeds any member's ILP optimum and is infeasible only when every member is; on a
search it prunes configurations (premise) and the plan is the one without it."""
import math

import numpy as np
import pytest

import autopar
from autopar.frontend.batching import infer_batch_dims, input_shapes
from autopar.frontend.trace import trace
from autopar.models import ZOO
from autopar.pricing.price import Settings
from autopar.search import floor_groups
from autopar.search.floor_groups import lower_envelope
from autopar.search.context import CutOff
from autopar.search.outer import search
from solver.ilp import relaxation_bound, solve
from solver.problem import CheckpointGroup, Edge, MemoryConstraint, Problem


def _problem(rng, sizes, scale_cost, scale_mem, budget):
    """A chain with one memory row and one checkpoint group, costs and bytes scaled per member."""
    n = len(sizes)
    costs = [scale_cost * rng.uniform(1, 3, s) for s in sizes]
    edges = [Edge(i, i + 1, scale_cost * rng.uniform(0, 2, (sizes[i], sizes[i + 1]))) for i in range(n - 1)]
    terms = [(i, scale_mem * rng.uniform(1, 4, s)) for i, s in enumerate(sizes)]
    group = CheckpointGroup("blocks", saved=[(1, scale_mem * rng.uniform(2, 6, sizes[1]))],
                            kept=[(1, scale_mem * rng.uniform(0, 1, sizes[1]))],
                            recompute_memory=[(1, scale_mem * rng.uniform(0, 1, sizes[1]))],
                            recompute_time=[(1, scale_cost * rng.uniform(0, 1, sizes[1]))])
    memory = [MemoryConstraint("end-of-forward", budget, scale_mem * rng.uniform(0, 1), terms, [0])]
    return Problem(node_names=[f"n{i}" for i in range(n)], costs=costs, edges=edges, memory=memory,
                   checkpoint_groups=[group])


@pytest.mark.parametrize("seed", range(12))
def test_envelope_lp_is_below_every_members_optimum(seed):
    """Random members of one structure (costs and bytes scaled apart, as ZeRO stages and offload
    differ): the envelope's LP is at most each feasible member's ILP optimum, and infeasible only
    when every member is."""
    rng = np.random.default_rng(seed)
    sizes = [3, 4, 2]
    budget = 11.0
    members = [_problem(np.random.default_rng(seed * 7 + k), sizes, rng.uniform(0.7, 1.3), rng.uniform(0.6, 1.4),
                        budget) for k in range(3)]
    env = lower_envelope(members)
    assert env is not None
    lp = relaxation_bound(env)
    optima = []
    for m in members:
        sol = solve(m, mip_gap=1e-9)
        optima.append(math.inf if sol.status == "infeasible" else sol.objective)
    if lp == math.inf:
        assert all(o == math.inf for o in optima)
    assert lp <= min(optima) + 1e-9
    # the cutoff form the search uses: it reaches a target only if every member's optimum does
    target = min(optima) if math.isfinite(min(optima)) else 1.0
    got = relaxation_bound(env, cutoff=target)
    assert got == math.inf or got <= min(optima) + 1e-9


def test_envelope_of_members_of_another_structure_is_none():
    rng = np.random.default_rng(0)
    a = _problem(rng, [3, 4, 2], 1.0, 1.0, 10.0)
    b = _problem(rng, [3, 4, 3], 1.0, 1.0, 10.0)
    assert lower_envelope([a, b]) is None
    c = _problem(rng, [3, 4, 2], 1.0, 1.0, 12.0)   # another budget
    assert lower_envelope([a, c]) is None


def test_grouped_floor_lp_prunes_and_plans_the_same(monkeypatch):
    """gpt2 on 8 cpu devices pinned to dp=2 x tp=4 (tp_shape [2, 2]: each micro-batch count's ZeRO
    stages share floors) at 0.6 of the free plan's peak, with a cutoff at 0.9 of that budget's plan
    (so the floors' LPs run before any plan exists): the envelope of one micro-batch's ZeRO-0 and
    ZeRO-2 reaches the cutoff and prunes both with one LP where each solved its own (premise), and
    the search ends as it does with the envelope off (every configuration cut off)."""
    import autopar.search.visit as V
    model, inputs = ZOO["gpt2"]()
    g = trace(model, inputs)
    g.batch_dims = infer_batch_dims(input_shapes(g), None)
    cluster = autopar.Cluster.preset("cpu", devices=8)
    pins = {"dp": 2, "tp": 4, "tp_shape": [2, 2]}
    free, _ = search(g, cluster, Settings(budget=float(cluster.device.memory_bytes)), pins)
    budget = Settings(budget=0.6 * free.prediction["peak_memory"])
    tight, _ = search(g, cluster, budget, pins)
    cutoff = 0.9 * tight.prediction["step_time"]
    answers, lps = [], []
    real_bound, real_rb = floor_groups.FloorGroups.bound, V.relaxation_bound

    def bound(self, *a):
        got = real_bound(self, *a)
        answers.append(got)
        return got
    monkeypatch.setattr(floor_groups.FloorGroups, "bound", bound)
    monkeypatch.setattr(V, "relaxation_bound", lambda *a, **k: lps.append(1) or real_rb(*a, **k))
    with pytest.raises(CutOff) as on:
        search(g, cluster, budget, pins, cutoff=cutoff)
    assert sum(1 for a in answers if isinstance(a, float) and a >= cutoff) >= 2   # premise: one answer, two members
    lps_on = len(lps)
    monkeypatch.setattr(floor_groups, "GROUPED_FLOOR_LP", False)
    lps.clear()
    with pytest.raises(CutOff) as off:
        search(g, cluster, budget, pins, cutoff=cutoff)
    assert lps_on < len(lps)   # premise: fewer LPs (the envelope's counted)
    assert str(on.value) == str(off.value)
    # the plan at the tight budget without a cutoff (``tight``, envelope on): the same with it off
    again, _ = search(g, cluster, budget, pins)
    assert again.config == tight.config and again.prediction["step_time"] == tight.prediction["step_time"]
