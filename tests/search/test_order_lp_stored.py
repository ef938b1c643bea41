"""The stored order-LP optima (autopar/search/order_lp_stored.py): equal to the LP solved now, below
the simulated step of any chunks, and used only with the settings they were solved with."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.search import pipeline_bounds
from autopar.search.order_lp_stored import FACTORS, KEPT, UNITS, stored_unit, table_keys
from autopar.search.order_lp_write import solve_units
from autopar.search.pipeline_bounds import order_lp_unit
from autopar.search.pipeline_pins import virtual_stages
from autopar.search.stage_plan import simulate_stages

pytest.importorskip("highspy")

SAMPLE = [("1f1b", 2, 2), ("1f1b", 4, 16), ("1f1b", 8, 56), ("gpipe", 3, 12), ("interleaved-1f1b", 4, 16),
          ("interleaved-1f1b", 8, 32), ("interleaved-1f1b", 2, 4), ("interleaved-1f1b", 12, 384)]


def test_the_table_holds_its_keys_and_the_settings_it_was_solved_with():
    assert KEPT == (pipeline_bounds.KEEP_PER_STAGE, pipeline_bounds.KEEP_PER_RANK, pipeline_bounds.ORDER_LP_EVENTS)
    assert set(UNITS) <= set(table_keys()) and len(UNITS) > 300
    assert all(k in UNITS for k in SAMPLE)
    assert stored_unit("1f1b", 4, 16, (2, 0, 600)) is None   # other settings: solved, not read
    assert stored_unit("1f1b", 4, 17, KEPT) is None


def test_stored_optima_equal_the_lp_solved_now():
    for k, v in solve_units(SAMPLE).items():
        assert UNITS[k] == pytest.approx(v, rel=1e-6), k
        assert order_lp_unit(*k, 0.0) == UNITS[k]   # the planner reads the stored value


@st.composite
def stored_pipelines(draw):
    """A stored key's order with chunks of random forward / backward times."""
    schedule = draw(st.sampled_from(["1f1b", "gpipe", "interleaved-1f1b"]))
    pp = draw(st.integers(2, 6))
    m = pp * draw(st.sampled_from(FACTORS[:5]))
    V = pp * virtual_stages(schedule)
    fwd = [draw(st.floats(0.01, 2.0)) for _ in range(V)]
    bwd = [f * draw(st.floats(0.5, 3.0)) for f in fwd]
    return schedule, pp, m, fwd, bwd


@settings(max_examples=60, deadline=None)
@given(stored_pipelines())
def test_stored_optima_are_below_the_simulated_step(case):
    schedule, pp, m, fwd, bwd = case
    step = simulate_stages(schedule, pp, m, fwd, bwd).step_time
    work = m * (sum(fwd) + sum(bwd)) / pp
    assert (schedule, pp, m) in UNITS
    assert work * UNITS[(schedule, pp, m)] <= step * (1 + 1e-9)


@pytest.mark.parametrize("pins", [{"pp": 2, "num_micro_batches": 4}, {"pp": 4, "num_micro_batches": 16},
                                  {"pp": 2, "num_micro_batches": 8, "pp_schedule": "interleaved-1f1b"},
                                  {"pp": 4, "num_micro_batches": 16, "pp_schedule": "interleaved-1f1b"}])
def test_proven_step_with_stored_optima_is_below_pinned_plans(pins):
    """The planner's proven bound (``proven_step``: the closed forms and the stored order LP, from
    the compute and block floors) is below the step of plans of the candidate on a small gpt2."""
    import autopar
    from autopar.frontend.trace import trace
    from autopar.models import ZOO
    from autopar.pricing.price import Settings
    from autopar.search.pipeline_bounds import block_time_floor, device_floors, proven_step
    model, batch = ZOO["gpt2"](n_layer=8, d_model=256, n_head=8, seq=64, batch=32)
    cluster = autopar.Cluster.preset("dgx-a100", nodes=1)
    graph = trace(model, batch)
    floor, block = device_floors(graph, cluster, Settings(budget=float(cluster.device.memory_bytes)))
    schedule, pp, m = pins.get("pp_schedule", "1f1b"), pins["pp"], pins["num_micro_batches"]
    assert (schedule, pp, m) in UNITS   # premise: the stored optimum is what bounds it
    bound = proven_step(schedule, pp, m, floor, block_time_floor(block, pp, m))
    assert bound >= floor * UNITS[(schedule, pp, m)]
    plan = autopar.plan(model, batch, cluster, traced=graph, constraints=pins)
    assert 0 < bound <= plan.step_time * (1 + 1e-9), (bound, plan.step_time)


def test_the_module_ends_with_its_table_as_format_table_writes_it():
    """``write_table`` rewrites the module's end with ``format_table``: the stored text is that."""
    from autopar.search import order_lp_stored
    text = open(order_lp_stored.__file__).read()
    assert text.endswith(order_lp_stored.format_table(UNITS))
    assert text.count(order_lp_stored.TABLE_MARKER + "\n_ROWS") == 1
