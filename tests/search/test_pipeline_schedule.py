"""Pipeline schedule model: torch's per-rank orders, the simulator against closed forms,
p2p pricing on the link a boundary crosses, and the timeline / stage table pictures."""
from __future__ import annotations

import io

import pytest
from rich.console import Console

from autopar.cluster import Cluster
from autopar.hardware import Device, Link
from autopar.errors import PlanError
from autopar.pricing.pipeline_cost import boundary_p2p_time, crosses_nodes, p2p_time
from runtime.pipeline_orders import SCHEDULES, pipeline_orders, stage_ranks
from solver.pipeline_schedule import StageDurations, peak_alive_counts, simulate


def _sim(schedule, p, m, v=1, f=1.0, bi=1.0, bw=1.0, p2p=0.0):
    """Equal stages: a rank's share of the model costs f / bi / bw, split over its v chunks."""
    orders = pipeline_orders(schedule, p, m, v)
    return simulate(orders, StageDurations.uniform(p * v, f / v, bi / v, bw / v, p2p))


# ---------------------------------------------------------------- torch's orders

@pytest.mark.parametrize("schedule,p,m,v", [
    ("gpipe", 3, 5, 1), ("1f1b", 4, 6, 1), ("interleaved-1f1b", 2, 4, 2),
    ("interleaved-1f1b", 4, 8, 2), ("zero-bubble", 4, 8, 1), ("zero-bubble", 2, 4, 2), ("zbv", 2, 4, 2)])
def test_orders_cover_every_stage_and_micro_batch_once(schedule, p, m, v):
    orders = pipeline_orders(schedule, p, m, v)
    assert sorted(orders) == list(range(p))
    acts = [a for r in orders for a in orders[r]]
    split = schedule in ("zero-bubble", "zbv")
    want = {(k, s, mb) for s in range(p * v) for mb in range(m) for k in (("F", "I", "W") if split else ("F", "B"))}
    assert len(acts) == len(set(acts)) and set(acts) == want
    placed = stage_ranks(orders)
    if schedule == "zbv":  # V shape: rank r holds stages r and 2p-1-r
        assert all(placed[s] == placed[2 * p - 1 - s] for s in range(p))
    else:                  # loop: stage s on rank s mod p
        assert all(placed[s] == s % p for s in range(p * v))


def test_1f1b_order_is_what_torch_runs_not_its_descriptive_ir():
    """Schedule1F1B runs its own loop; torch 2.13's pipeline_order lists micro-batches 1..m on
    the last rank. The adapter records the loop, so the last rank alternates F0 B0 F1 B1 ..."""
    p, m = 4, 6
    orders = pipeline_orders("1f1b", p, m)
    last = orders[p - 1]
    assert last == [a for mb in range(m) for a in (("F", p - 1, mb), ("B", p - 1, mb))]
    # stage k warms up with min(p - k, m) forwards before its first backward
    for k in range(p):
        first_b = next(i for i, a in enumerate(orders[k]) if a[0] == "B")
        assert first_b == min(p - k, m)


def test_gpipe_runs_all_forwards_then_all_backwards():
    orders = pipeline_orders("gpipe", 2, 3)
    assert orders[1] == [("F", 1, 0), ("F", 1, 1), ("F", 1, 2), ("B", 1, 0), ("B", 1, 1), ("B", 1, 2)]


def test_bad_schedule_arguments_are_clear():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'pipedream'"):
        pipeline_orders("pipedream", 2, 4)
    with pytest.raises(ValueError, match="Schedule1F1B rejects pp=4, num_micro_batches=2"):
        pipeline_orders("1f1b", 4, 2)
    with pytest.raises(ValueError, match="one stage per rank"):
        pipeline_orders("gpipe", 2, 4, 2)
    with pytest.raises(ValueError, match="exactly 2 virtual stages"):
        pipeline_orders("zbv", 2, 4, 3)
    with pytest.raises(ValueError, match="pp must be a positive int"):
        pipeline_orders("1f1b", 0, 4)
    assert set(SCHEDULES) >= {"gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"}  # api.md's names


# ---------------------------------------------------------------- simulator vs closed forms

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 8), (3, 7)])
def test_bubble_matches_closed_form(schedule, p, m):
    sim = _sim(schedule, p, m, f=1.0, bi=1.0, bw=1.0)
    t = 1.0 + 2.0  # forward + full backward of one micro-batch on one stage
    assert sim.step_time == pytest.approx((m + p - 1) * t)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert all(sim.busy[r] == pytest.approx(m * t) for r in range(p))


@pytest.mark.parametrize("p,m", [(4, 8), (4, 4), (3, 7), (2, 5)])
def test_live_micro_batches_gpipe_m_and_1f1b_min_p_minus_k_m(p, m):
    assert _sim("gpipe", p, m).peak_alive == {k: m for k in range(p)}
    assert _sim("1f1b", p, m).peak_alive == {k: min(p - k, m) for k in range(p)}


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 8, 4), (4, 16, 2), (2, 4, 2)])
def test_interleaving_divides_bubble_by_v_and_grows_first_rank_memory(p, m, v):
    """Torch's Interleaved1F1B order gives exactly bubble (p-1)/(v m + p-1), and (m a multiple of
    p) rank 0 holds p (1 + (p-1)/(p v)) stage-units of activations: Megatron's factor, with v
    model chunks in the denominator (the issue's "p·m" uses m for the chunk count)."""
    sim = _sim("interleaved-1f1b", p, m, v)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    plain = _sim("1f1b", p, m)
    assert plain.bubble_fraction / sim.bubble_fraction == pytest.approx((v * m + p - 1) / (m + p - 1))
    mem = sim.peak_rank_memory({s: 1.0 / v for s in range(p * v)})  # a chunk is 1/v of a rank's layers
    assert mem[0] == pytest.approx(p * (1 + (p - 1) / (p * v)))
    assert mem[0] > plain.peak_alive[0]


def test_interleaving_with_m_not_a_multiple_of_p_holds_every_micro_batch_on_rank_0():
    """torch's flexible Interleaved1F1B runs m=6 on p=4 as one round of 6: rank 0 warms up all of
    its chunk-micro-batches, 6 stage-units (x1.5 over 1F1B), above Megatron's x1.375 for v=2.
    The planner must take the count from the simulated order, not from the closed form."""
    p, m, v = 4, 6, 2
    sim = _sim("interleaved-1f1b", p, m, v)
    assert sim.peak_rank_memory({s: 1.0 / v for s in range(p * v)})[0] == pytest.approx(m)
    assert sim.peak_alive[0] == sim.peak_alive[p] == m
    assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("p,m,v", [(4, 8, 1), (2, 4, 1), (4, 8, 2)])
def test_zero_bubble_beats_1f1b_and_keeps_activations_until_w(p, m, v):
    zb = _sim("zero-bubble", p, m, v, f=1.0, bi=1.0, bw=1.0)
    ref = _sim("1f1b" if v == 1 else "interleaved-1f1b", p, m, v, f=1.0, bi=1.0, bw=1.0)
    assert zb.bubble_fraction < ref.bubble_fraction
    assert zb.step_time < ref.step_time
    # activations live until W: the last stage, freed right after its B under 1F1B, now holds more
    assert zb.peak_alive[p * v - 1] > ref.peak_alive[p * v - 1]
    assert max(zb.held_for_weight.values()) >= 1
    for iv in zb.intervals:   # no W before its own I, as the dependency model says
        if iv.kind == "W":
            i = next(j for j in zb.intervals if (j.kind, j.stage, j.micro_batch) == ("I", iv.stage, iv.micro_batch))
            assert iv.start >= i.end


def test_torch_first_stage_does_its_whole_backward_in_w():
    d = StageDurations.uniform(2, 1.0, 1.0, 2.0).first_stage_backward_in_weight_pass()
    assert list(d.backward_input) == [0.0, 1.0] and list(d.backward_weight) == [3.0, 2.0]
    sim = simulate(pipeline_orders("zero-bubble", 2, 4), d)
    assert all(i.end == i.start for i in sim.intervals if (i.kind, i.stage) == ("I", 0))
    assert sim.busy[0] == pytest.approx(4 * (1.0 + 3.0))


def test_transfers_delay_consumers_and_are_recorded():
    p, m, x = 3, 4, 0.25
    sim = _sim("gpipe", p, m, f=1.0, bi=1.0, bw=1.0, p2p=x)
    # fill adds one transfer per boundary forward and backward on top of the no-transfer time
    assert sim.step_time == pytest.approx((m + p - 1) * 3.0 + 2 * (p - 1) * x)
    assert len(sim.transfers) == 2 * (p - 1) * m
    f01 = [t for t in sim.transfers if (t.kind, t.src_stage, t.micro_batch) == ("activation", 0, 0)][0]
    f1 = next(i for i in sim.intervals if (i.kind, i.stage, i.micro_batch) == ("F", 1, 0))
    assert f01.end - f01.start == pytest.approx(x) and f1.start == pytest.approx(f01.end)


def test_without_timeline_the_figures_are_the_same():
    orders = pipeline_orders("zero-bubble", 4, 8, 2)
    d = StageDurations.uniform(8, 0.5, 0.4, 0.3, 0.05)
    full, lean = simulate(orders, d), simulate(orders, d, timeline=False)
    assert lean.intervals == [] and lean.transfers == [] and full.intervals and full.transfers
    for f in ("step_time", "busy", "bubble_time", "peak_alive", "held_for_weight", "alive"):
        assert getattr(lean, f) == getattr(full, f), f


@pytest.mark.parametrize("schedule,p,m,v", [("gpipe", 3, 5, 1), ("1f1b", 4, 7, 1), ("interleaved-1f1b", 4, 6, 2),
                                             ("zero-bubble", 4, 8, 2), ("zbv", 2, 4, 2)])
def test_alive_counts_follow_from_the_orders_alone(schedule, p, m, v):
    """With every action taking time, the micro-batches alive (per stage, and a rank's total
    weighted over its stages) do not depend on the durations: ``peak_alive_counts`` reads them off
    the orders, and simulations with unequal random stage times and transfers count the same, the
    time-ordered span count (stage times with zeros) included."""
    import random
    rng = random.Random(p * 100 + m)
    orders = pipeline_orders(schedule, p, m, v)
    V = p * v
    want = peak_alive_counts(orders, V)
    weights = {k: rng.uniform(1, 3) for k in range(V)}
    ranks = None
    for _ in range(3):
        d = StageDurations([rng.uniform(0.1, 2) for _ in range(V)], [rng.uniform(0.1, 2) for _ in range(V)],
                           [rng.uniform(0.1, 1) for _ in range(V)], [rng.uniform(0, 0.5) for _ in range(V - 1)])
        sim = simulate(orders, d)
        assert sim.peak_alive == want
        per_rank = sim.peak_rank_memory(weights)
        assert ranks is None or per_rank == pytest.approx(ranks)
        ranks = per_rank
    sim.rank_events = None   # the time-ordered count over the spans gives the same peaks
    assert sim.peak_rank_memory(weights) == pytest.approx(ranks)


def test_v_shape_boundary_on_one_rank_is_free():
    sim = _sim("zbv", 2, 4, 2, p2p=0.5)
    assert not [t for t in sim.transfers if t.src_rank == t.dst_rank]
    assert {(t.src_stage, t.dst_stage) for t in sim.transfers if t.kind == "activation"} == {(0, 1), (2, 3)}


def test_uneven_stages_bottleneck_sets_the_pace():
    orders = pipeline_orders("1f1b", 2, 8)
    sim = simulate(orders, StageDurations([1.0, 3.0], [1.0, 3.0], [1.0, 3.0]))
    # stage 0's first forward, then stage 1 never waits (8 x (3 + 6)), then stage 0's last backward
    assert sim.step_time == pytest.approx(1.0 + 8 * 9.0 + 2.0)
    assert sim.idle(1) == pytest.approx(3.0) and sim.idle(0) == pytest.approx(75.0 - 8 * 3.0)


def test_simulator_rejects_bad_orders():
    d = StageDurations.uniform(2, 1.0, 1.0, 1.0)
    with pytest.raises(PlanError, match="deadlocks"):
        simulate({0: [("F", 0, 0), ("B", 0, 0)], 1: [("B", 1, 0), ("F", 1, 0)]}, d)
    with pytest.raises(PlanError, match="need F and B"):
        simulate({0: [("F", 0, 0), ("B", 0, 0)], 1: [("F", 1, 0)]}, d)
    with pytest.raises(PlanError, match="durations are given for 3 stages"):
        simulate(pipeline_orders("1f1b", 2, 2), StageDurations.uniform(3, 1.0, 1.0, 1.0))


# ---------------------------------------------------------------- p2p pricing

def _cluster(nodes=2):
    dev = Device("gpu", {"bf16": 1e14, "fp16": 1e14, "fp32": 2e13}, 8e10, 2e12)
    return Cluster("t", nodes, 4, dev, Link(100e9, 5e-6), Link(10e9, 20e-6))


def test_p2p_priced_on_the_link_the_boundary_crosses():
    c, n = _cluster(), 64e6
    assert p2p_time(c, n, inter_node=False) == pytest.approx(5e-6 + n / 100e9)
    assert p2p_time(c, n, inter_node=True) == pytest.approx(20e-6 + n / 10e9)
    assert not crosses_nodes(c, 0, 3) and crosses_nodes(c, 3, 4)
    assert boundary_p2p_time(c, n, 1, 2) == pytest.approx(p2p_time(c, n, False))
    assert boundary_p2p_time(c, n, 3, 4) == pytest.approx(p2p_time(c, n, True))
    assert boundary_p2p_time(c, n, 2, 2) == 0.0 and p2p_time(c, 0, True) == 0.0


def test_p2p_on_a_calibrated_preset_is_slower_across_nodes():
    c = Cluster.preset("dgx-a100", nodes=2)
    intra, inter = p2p_time(c, 64e6, False), p2p_time(c, 64e6, True)
    assert 0 < intra < inter
    assert 64e6 / inter < c.inter_link.bandwidth  # no faster than the InfiniBand link's rate


def test_p2p_bad_input():
    with pytest.raises(PlanError, match="expected bytes >= 0"):
        p2p_time(_cluster(), -1, False)
    with pytest.raises(PlanError, match="one node"):
        p2p_time(_cluster(nodes=1), 10, True)
    with pytest.raises(PlanError, match="outside cluster"):
        crosses_nodes(_cluster(), 0, 8)


# ---------------------------------------------------------------- pictures

def test_timeline_png_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    from autopar.plans.timeline import draw_timeline

    sim = _sim("zero-bubble", 2, 4, f=1e-3, bi=1e-3, bw=1e-3, p2p=1e-4)
    out = draw_timeline(sim, tmp_path / "t.png", title="zero-bubble pp=2 m=4")
    data = open(out, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_stage_table_renders_rows():
    from autopar.plans.timeline import stage_table

    t = stage_table([
        {"index": 0, "ranks": [0, 1], "blocks": (0, 6), "time": 0.0123, "peak_memory": 3 * 2**30},
        {"index": 1, "ranks": "2-3", "blocks": (6, 12), "time": 0.011, "peak_memory": 512 * 2**20},
    ])
    buf = io.StringIO()
    Console(file=buf, width=120).print(t)
    text = buf.getvalue()
    assert "0-5" in text and "6-11" in text and "12.30 ms" in text and "3.00 GiB" in text and "512.0 MiB" in text
    with pytest.raises(PlanError, match="lacks"):
        stage_table([{"index": 0}])


@pytest.mark.parametrize("schedule,p,m,v", [
    ("interleaved-1f1b", 2, 4, 2), ("interleaved-1f1b", 4, 6, 2), ("zero-bubble", 4, 8, 1),
    ("zero-bubble", 2, 4, 2), ("zbv", 4, 8, 2)])
def test_fast_orders_equal_the_lowered_program_torch_runtime_walks(schedule, p, m, v):
    """pipeline_orders skips torch's slow lowering pass; its compute actions must not change."""
    from runtime.pipeline_orders import _multi_stage_orders, torch_schedule_class

    lowered = _multi_stage_orders(torch_schedule_class(schedule), p, m, v, lowered=True)
    assert pipeline_orders(schedule, p, m, v) == lowered


# ---------------------------------------------------------------- the orders are what torch runs

# (schedule, pp, micro-batches, virtual stages) run for real on 2 gloo processes
_RUN = [("gpipe", 2, 3, 1), ("1f1b", 2, 4, 1), ("interleaved-1f1b", 2, 4, 2),
        ("zero-bubble", 2, 4, 1), ("zero-bubble", 2, 4, 2), ("zbv", 2, 4, 2)]


def _record_torch_run(rank, world):
    """Each rank runs every schedule of _RUN on tiny Linear stages and logs the compute calls
    torch's runtime makes on its PipelineStages, in the order it makes them."""
    import torch
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    from runtime.pipeline_orders import torch_schedule_class

    out = {}
    for schedule, pp, m, v in _RUN:
        torch.manual_seed(0)
        log = []
        n = pp * v
        placed = [s for s in range(n) if (s % pp if schedule != "zbv" else min(s, n - 1 - s)) == rank]
        stages = []
        for s in placed:
            st = PipelineStage(torch.nn.Linear(4, 4), s, n, torch.device("cpu"))
            for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", None),
                               ("backward_weight_one_chunk", "W")):
                orig = getattr(st, name)

                def wrapped(mb, *a, _orig=orig, _kind=kind, _s=s, **k):
                    tag = _kind or ("B" if k.get("full_backward", True) else "I")
                    log.append((tag, _s, mb))
                    return _orig(mb, *a, **k)
                setattr(st, name, wrapped)
            stages.append(st)
        cls = torch_schedule_class(schedule)
        single = issubclass(cls, PipelineScheduleSingle)
        sched = cls(stages[0] if single else stages, m, loss_fn=lambda y, t: ((y - t) ** 2).mean())
        x, t = torch.randn(2 * m, 4), torch.randn(2 * m, 4)
        if rank == 0:
            sched.step(x, target=t)
        else:
            sched.step(target=t)
        out[(schedule, pp, m, v)] = log
    return out


@pytest.mark.slow
def test_orders_equal_the_compute_calls_torch_makes_on_gloo():
    from runtime.launch import run_local

    runs = run_local(_record_torch_run, 2)
    for key in _RUN:
        want = pipeline_orders(*key)
        assert {r: runs[r][key] for r in range(2)} == want, key
