"""The stage sub-mesh's work floor (autopar/search/stage_work_floor.py): at or above the
one-device compute floor, below the mean work per rank of every pipelined plan of its candidate
(gpt2 and llama, 1F1B, GPipe and interleaved, pp 2 and 4) and its proven step below the plan's
step; and it prunes a candidate against a real incumbent that the compute floor keeps."""
import pytest

import autopar
from autopar.frontend.fuse import uses_kernels
from autopar.frontend.trace import trace
from autopar.models import ZOO
from autopar.pricing.price import Settings
from autopar.search.pipeline_bounds import block_time_floor, device_floors, proven_step
from autopar.search.stage_work_floor import stage_work_floor


def _case(name):
    model, batch = ZOO[name](n_layer=8, d_model=256, n_head=8, seq=64, batch=32)
    cluster = autopar.Cluster.preset("dgx-a100", nodes=1)
    graph = trace(model, batch)
    return model, batch, cluster, graph, Settings(budget=float(cluster.device.memory_bytes))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("pins", [{"pp": 2}, {"pp": 4, "pp_schedule": "interleaved-1f1b"},
                                  {"pp": 2, "pp_schedule": "gpipe", "num_micro_batches": 8}, {"pp": 4, "tp": 2},
                                  {"pp": 2, "checkpoint": "full"}])
def test_stage_work_floor_is_below_every_pipelined_plan_of_its_candidate(name, pins):
    model, batch, cluster, graph, base = _case(name)
    floor, block = device_floors(graph, cluster, base)
    plan = autopar.plan(model, batch, cluster, traced=graph, constraints=pins)
    deg = plan.degrees
    sched, p, m = deg["pp_schedule"], deg["pp"], deg["num_micro_batches"]
    work = stage_work_floor(graph, cluster, base, p, m, {})
    mean = m * sum(s["time"] for s in plan.data["stages"]) / p   # the ranks' mean work per step
    assert floor < work <= mean * (1 + 1e-9), (floor, work, mean)   # premise: higher than the compute floor
    assert proven_step(sched, p, m, work, block_time_floor(block, p, m)) <= plan.step_time * (1 + 1e-9)


def test_stage_work_floor_prunes_a_candidate_the_compute_floor_keeps():
    """Against the free plan as incumbent: a candidate whose proven step from the compute floor is
    below it and from the stage work floor at or above it; its real plan is slower indeed."""
    model, batch, cluster, graph, base = _case("gpt2")
    floor, block = device_floors(graph, cluster, base)
    best = autopar.plan(model, batch, cluster, traced=graph).step_time
    found = []
    for p, sched, m in [(2, "1f1b", 4), (2, "1f1b", 8), (2, "interleaved-1f1b", 4), (4, "interleaved-1f1b", 8),
                        (2, "1f1b", 16), (4, "1f1b", 8)]:
        b = block_time_floor(block, p, m)
        if proven_step(sched, p, m, floor, b) < best <= proven_step(
                sched, p, m, stage_work_floor(graph, cluster, base, p, m, {}), b):
            found.append((p, sched, m))
    assert found, best   # premise
    p, sched, m = found[0]
    plan = autopar.plan(model, batch, cluster, traced=graph,
                        constraints={"pp": p, "pp_schedule": sched, "num_micro_batches": m})
    assert plan.step_time >= best


def test_proven_search_with_the_stage_work_floor_finds_the_estimates_plan(monkeypatch):
    """``MESH_WORK_FLOOR`` on (with the proven bounds) changes no plan, on a case whose pipelined
    plan wins (premise: pp > 1)."""
    import autopar.search.pipeline_candidates as pc
    monkeypatch.setenv("AUTOPAR_PLAN_WORKERS", "1")
    model, batch = ZOO["gpt2"](device="meta", n_layer=6, d_model=16384, n_head=128, seq=2048, batch=6,
                               vocab=51200)
    cluster = autopar.Cluster.preset("dgx-a100", nodes=3)
    graph = trace(model, batch, kernels=uses_kernels("auto", cluster.backend))   # traced once, for both plans
    monkeypatch.setattr(pc, "PROVEN_BOUNDS", False)
    estimated = autopar.plan(model, batch, cluster, traced=graph)
    monkeypatch.setattr(pc, "PROVEN_BOUNDS", True)
    monkeypatch.setattr(pc, "MESH_WORK_FLOOR", True)
    proven = autopar.plan(model, batch, cluster, traced=graph)
    assert estimated.degrees["pp"] > 1
    assert (proven.degrees, proven.step_time) == (estimated.degrees, estimated.step_time)
