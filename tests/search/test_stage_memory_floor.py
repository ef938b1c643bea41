"""The proven memory floor of a pipelined candidate's inner configurations
(autopar/search/stage_memory_floor.py): never above the peak ``plan_stages`` computes for a solved
plan (zoo models, 1F1B / interleaved / GPipe, pp 2 and 4, checkpointed or not), and pruning with it
(visit.py ``STAGE_MEMORY_FLOOR``) changes no plan while pruning some inner configuration."""
from __future__ import annotations

import pytest

import autopar
from autopar.frontend.trace import trace
from autopar.models import ZOO
from autopar.pricing.price import Settings
from autopar.search import outer
from autopar.search import visit as V
from autopar.search.pipeline import search_pipelined
from autopar.search.stage_memory_floor import StageMemory, block_floors, exceeds_budget, least_peak


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_floor_is_below_the_peak_of_solved_stage_plans(name):
    """For the plan the inner search solves and the partition ``plan_stages`` picks, the floor
    (each node at its smallest bytes, any partition) is at most the largest rank peak, and a
    budget equal to that peak is never pruned."""
    model, batch = ZOO[name](n_layer=8)
    g = trace(model, batch)
    cluster = autopar.Cluster.preset("cpu", devices=8)
    base = Settings(budget=1e18)   # every partition passes: its peak is reported
    for pp, m in ((2, 4), (4, 8)):
        for schedule in ("1f1b", "interleaved-1f1b", "gpipe"):
            for pins in ({}, {"zero": 3}, {"checkpoint": "full"}):
                if pp == 4 and pins.get("zero"):
                    continue
                res, _, info = search_pipelined(g, cluster, base, dict(pins, pp=pp, pp_schedule=schedule,
                                                                       num_micro_batches=m), outer.search)
                f = block_floors(g, res.cands, res.priced, res.config.settings.checkpoint)
                assert len(f.static) == 8
                floor = least_peak(f, pp, schedule, m)
                peak = info["peak_memory"]
                assert 0 < floor <= peak, (pp, schedule, pins, floor, peak)
                assert floor >= 0.3 * peak, (pp, schedule, pins, floor, peak)   # not vacuous
                spec = StageMemory(pp, m, float(peak), (schedule,))
                assert not exceeds_budget(spec, g, res.cands, res.priced, res.config.settings.checkpoint)
                assert exceeds_budget(StageMemory(pp, m, 0.99 * floor, (schedule,)), g, res.cands, res.priced,
                                      res.config.settings.checkpoint)


def test_floor_prunes_only_under_every_schedule_sharing_the_inner_search():
    """An inner search shared by 1F1B and interleaving is pruned only when neither fits; a
    schedule outside the floor's (zero-bubble) never prunes."""
    model, batch = ZOO["gpt2"](n_layer=8)
    g = trace(model, batch)
    cluster = autopar.Cluster.preset("cpu", devices=8)
    res, _, _ = search_pipelined(g, cluster, Settings(budget=1e18),
                                 dict(pp=2, pp_schedule="1f1b", num_micro_batches=4), outer.search)
    f = block_floors(g, res.cands, res.priced, "none")
    lo = {s: least_peak(f, 2, s, 4) for s in ("1f1b", "interleaved-1f1b")}
    between = (lo["1f1b"] + lo["interleaved-1f1b"]) / 2
    args = (g, res.cands, res.priced, "none")
    assert exceeds_budget(StageMemory(2, 4, 0.5 * min(lo.values()), ("1f1b", "interleaved-1f1b")), *args)
    assert not exceeds_budget(StageMemory(2, 4, between, ("1f1b", "interleaved-1f1b")), *args)
    assert not exceeds_budget(StageMemory(2, 4, 0.5 * min(lo.values()), ("zero-bubble",)), *args)


def _counting(monkeypatch):
    seen = []
    real = V.stage_floor_exceeds_budget

    def count(*a, **k):
        out = real(*a, **k)
        seen.append(out)
        return out
    monkeypatch.setattr(V, "stage_floor_exceeds_budget", count)
    return seen


def _same(a, b):
    assert a.degrees == b.degrees
    assert a.predictions["step_time"] == b.predictions["step_time"]
    assert a.peak_memory == b.peak_memory
    assert [s["blocks"] for s in a.data["stages"]] == [s["blocks"] for s in b.data["stages"]]


def test_stage_floor_changes_no_plan_and_prunes(monkeypatch):
    """GPT-2 (8 layers) on 8 CPU processes at budgets that the first attempt of some pipelined
    candidates cannot meet: the free plan (a pipelined one, checkpointed) and the plan with pp=2
    pinned are the same with the floor on and off, and the floor prunes some inner configuration
    whose ILP would have found a plan no stage partition fits (the premise; one process, so the
    count sees the candidates' inner searches, which forked workers would run)."""
    monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", "1")
    model, batch = ZOO["gpt2"](n_layer=8)
    cluster = autopar.Cluster.preset("cpu", devices=8)
    g = trace(model, batch)
    p1 = autopar.plan(model, batch, cluster, constraints={"pp": 1}, traced=g)
    cases = [(int(0.6 * p1.peak_memory), {}), (int(0.65 * p1.peak_memory), {"pp": 2})]
    seen = _counting(monkeypatch)
    on = []
    for budget, pins in cases:
        seen.clear()
        on.append(autopar.plan(model, batch, cluster, memory_budget=budget, constraints=pins, traced=g))
        assert any(seen), ("the floor pruned no inner configuration", pins)
    assert on[0].degrees["pp"] > 1 and on[1].degrees["pp"] == 2
    monkeypatch.setattr(V, "STAGE_MEMORY_FLOOR", False)
    for (budget, pins), a in zip(cases, on):
        _same(a, autopar.plan(model, batch, cluster, memory_budget=budget, constraints=pins, traced=g))


def test_floor_is_below_every_split_with_any_stage_durations():
    """The bound over splits, alone: random per-block figures, random splits into chunks of
    whole blocks, random stage durations and transfers; each rank's peak as ``plan_stages``
    computes it (the simulation's activation peak over time for interleaving) is never below
    ``least_peak``, and each stage's peak count is the order's (``rank_alive_vectors``)."""
    import random

    from autopar.search.pipeline_pins import virtual_stages
    from autopar.search.stage_memory_floor import BlockFloors, rank_alive_vectors
    from autopar.search.stage_plan import alive, simulate_stages
    rng = random.Random(7)
    for schedule in ("1f1b", "interleaved-1f1b", "gpipe"):
        for pp in (2, 3, 4):
            for m in (pp, 2 * pp, 4 * pp):
                V = pp * virtual_stages(schedule)
                vecs = rank_alive_vectors(schedule, pp, m)
                assert [max(vec[k // pp] for vec in vecs[k % pp]) for k in range(V)] == \
                    [alive(schedule, k, pp, m) for k in range(V)]
                for _ in range(3):
                    n = V + rng.randrange(2 * V)
                    f = BlockFloors(tuple(rng.uniform(0, 4) for _ in range(n)),
                                    tuple(rng.uniform(0, 2) for _ in range(n)),
                                    (rng.uniform(0, 3), rng.uniform(0, 1)), (rng.uniform(0, 3), rng.uniform(0, 1)))
                    floor = least_peak(f, pp, schedule, m)
                    for _ in range(4):
                        cuts = [0, *sorted(rng.sample(range(1, n), V - 1)), n]
                        static = [sum(f.static[cuts[k]:cuts[k + 1]]) for k in range(V)]
                        saved = [sum(f.saved[cuts[k]:cuts[k + 1]]) for k in range(V)]
                        static[0] += f.pro[0]
                        saved[0] += f.pro[1]
                        static[-1] += f.epi[0]
                        saved[-1] += f.epi[1]
                        fwd = [rng.uniform(0.1, 2) for _ in range(V)]
                        sim = simulate_stages(schedule, pp, m, fwd, [x * rng.uniform(1, 3) for x in fwd],
                                              [rng.uniform(0, 0.5) for _ in range(V - 1)])
                        acts = sim.peak_rank_memory(dict(enumerate(saved)))
                        peak = max(sum(static[k] for k in range(r, V, pp)) + acts[r] for r in range(pp))
                        assert floor <= peak * (1 + 1e-9), (schedule, pp, m, floor, peak)
