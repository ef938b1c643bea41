"""The recompute floor (autopar/search/pipeline_bounds.py's ``device_recompute_floor``) and the
checkpointed retry's bound it gives (autopar/search/pipeline_candidates.py's ``retry_bound``): below
every plan with every block checkpointed (gpt2 and llama, 1F1B, GPipe and interleaved, pp 2 and
4), and higher than the bound without it by enough to prune a retry against a real incumbent."""
import pytest

import autopar
from autopar.frontend.trace import trace
from autopar.models import ZOO
from autopar.pricing.price import Settings
from autopar.search.pipeline_bounds import block_time_floor, device_floors, device_recompute_floor, proven_step


def _case(name):
    if name == "llama":
        model, batch = ZOO["llama"](n_layer=8, d_model=256, n_head=8, seq=64, batch=32)
    else:
        model, batch = ZOO["gpt2"](n_layer=8, d_model=256, n_head=8, seq=64, batch=32)
    cluster = autopar.Cluster.preset("dgx-a100", nodes=1)
    graph = trace(model, batch)
    return model, batch, cluster, graph, Settings(budget=float(cluster.device.memory_bytes))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("pins", [{"pp": 2}, {"pp": 4, "pp_schedule": "interleaved-1f1b"},
                                  {"pp": 2, "pp_schedule": "gpipe"}, {"pp": 4, "tp": 2},
                                  {"pp": 2, "pp_schedule": "interleaved-1f1b", "num_micro_batches": 8}])
def test_retry_bound_is_below_every_checkpointed_pipelined_plan(name, pins):
    """A plan with every block checkpointed steps at or above the proven bound with the compute
    floor plus the recompute floor as its ranks' mean work, and that bound is above the one
    without recomputation (premise: the floor adds something)."""
    model, batch, cluster, graph, base = _case(name)
    floor, block, rec = device_floors(graph, cluster, base, recompute=True)
    assert rec == device_recompute_floor(graph, cluster, base) and 0.2 * floor < rec < floor
    plan = autopar.plan(model, batch, cluster, traced=graph, constraints=dict(pins, checkpoint="full"))
    deg = plan.degrees
    sched, p, m = deg["pp_schedule"], deg["pp"], deg["num_micro_batches"]
    b = block_time_floor(block, p, m)
    bound = proven_step(sched, p, m, floor + rec, b)
    assert plan.predictions["time_breakdown"]["recompute"] > 0   # premise: it recomputes
    assert proven_step(sched, p, m, floor, b) < bound <= plan.step_time * (1 + 1e-9), (bound, plan.step_time)


def test_recompute_floor_is_below_an_unpipelined_checkpointed_plan():
    """Without pipelining too: compute plus recomputation per device is at least the two floors."""
    model, batch, cluster, graph, base = _case("gpt2")
    floor, _, rec = device_floors(graph, cluster, base, recompute=True)
    plan = autopar.plan(model, batch, cluster, traced=graph, constraints={"dp": 8, "checkpoint": "full"})
    tb = plan.predictions["time_breakdown"]
    assert tb["recompute"] > 0 and floor + rec <= (tb["compute"] + tb["recompute"]) * (1 + 1e-9), (floor, rec, tb)


def test_retry_bound_prunes_a_checkpointed_retry_the_bound_without_recomputation_keeps():
    """Premise of the prune: against the free plan as incumbent, a pipelined candidate's bound
    without recomputation is below it (so the retry would be searched) and the retry's bound is
    at or above it; the retry's real plan is indeed slower."""
    model, batch = ZOO["gpt2"](device="meta", n_layer=8, d_model=2048, n_head=16, seq=1024, batch=64, vocab=51200)
    cluster = autopar.Cluster.preset("dgx-a100", nodes=1)
    graph = trace(model, batch)
    floor, block, rec = device_floors(graph, cluster, Settings(budget=float(cluster.device.memory_bytes)),
                                      recompute=True)
    best = autopar.plan(model, batch, cluster, traced=graph).step_time
    found = []
    for p, sched, m in [(2, "1f1b", 8), (2, "1f1b", 16), (4, "1f1b", 16), (2, "interleaved-1f1b", 16),
                        (4, "interleaved-1f1b", 32)]:
        b = block_time_floor(block, p, m)
        if proven_step(sched, p, m, floor, b) < best <= proven_step(sched, p, m, floor + rec, b):
            found.append((p, sched, m))
    assert found   # premise
    p, sched, m = found[0]
    retry = autopar.plan(model, batch, cluster, traced=graph,
                         constraints={"pp": p, "pp_schedule": sched, "num_micro_batches": m, "checkpoint": "full"})
    assert retry.step_time >= best
