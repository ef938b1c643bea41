"""Pipeline planning with pinned pp / pp_schedule / num_micro_batches (autopar/search/pipeline.py, stage_plan.py): the
plan's stages, the micro-batches each schedule keeps alive in every stage's memory, the bubble in
the step time, and clear ConstraintErrors for impossible pins. Execution: test_pipeline_exec.py."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.errors import ConstraintError, MemoryBudgetError
from autopar.models import ZOO
from autopar.search.stage_plan import alive_micro_batches, simulate_plan, simulate_stages


def _plan(name="gpt2", devices=2, precision="fp32", memory_budget=None, **constraints):
    model, batch = ZOO[name]() if name != "gpt4" else ZOO["gpt2"](n_layer=4)
    return autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=devices), precision=precision,
                        memory_budget=memory_budget, constraints=constraints)


@pytest.fixture(scope="module")
def plans():
    return {s: _plan(pp=2, pp_schedule=s, num_micro_batches=4) for s in ("gpipe", "1f1b")}


def test_pinned_pp_plan_has_stages_on_sub_meshes(plans):
    p = plans["1f1b"]
    assert p.degrees["pp"] == 2 and p.degrees["pp_schedule"] == "1f1b" and p.degrees["num_micro_batches"] == 4
    assert p.mesh.size == 1 and p.world_size == 2
    st = p.data["stages"]
    assert [s["ranks"] for s in st] == [[0, 0], [1, 1]]
    assert st[0]["blocks"][0] == 0 and st[0]["blocks"][1] == st[1]["blocks"][0] and st[1]["blocks"][1] == 2
    for s in st:
        assert s["time"] > 0 and s["peak_memory"] > 0 and s["p2p_bytes"] > 0


def test_step_time_includes_the_bubble(plans):
    """The pipeline time is the simulation of torch's 1F1B order with the stages' forward/backward
    times and the boundary's transfer; without transfers it is the fill-and-drain closed form."""
    p = plans["1f1b"]
    st = p.data["stages"]
    times = [s["time"] for s in st]
    tb = p.predictions["time_breakdown"]
    sim = simulate_plan(p.data)
    assert tb["pipeline"] == pytest.approx(sim.step_time)
    assert tb["bubble"] == pytest.approx(sim.step_time - max(sim.busy.values())) and tb["bubble"] > 0
    assert st[0]["p2p_time"] > 0 and tb["pipeline"] > sum(times) + 3 * max(times)
    free = simulate_stages("1f1b", 2, 4, [s["forward_time"] for s in st], [s["backward_time"] for s in st])
    assert free.step_time == pytest.approx(sum(times) + 3 * max(times))
    assert p.step_time >= tb["pipeline"]


def test_stage_memory_counts_the_micro_batches_the_schedule_keeps_alive(plans):
    for sched, p in plans.items():
        for s in p.data["stages"]:
            alive = alive_micro_batches(sched, s["index"], 2, 4)
            assert s["alive_micro_batches"] == alive
            assert s["peak_memory"] == pytest.approx(s["static_memory"] + alive * s["activations_per_micro_batch"],
                                                     abs=2)
    assert [s["alive_micro_batches"] for s in plans["1f1b"].data["stages"]] == [2, 1]
    assert [s["alive_micro_batches"] for s in plans["gpipe"].data["stages"]] == [4, 4]
    assert plans["gpipe"].peak_memory > plans["1f1b"].peak_memory


def test_a_budget_gpipe_exceeds_but_1f1b_fits():
    g = _plan(pp=2, pp_schedule="gpipe", num_micro_batches=4)
    o = _plan(pp=2, pp_schedule="1f1b", num_micro_batches=4)
    budget = (g.peak_memory + o.peak_memory) // 2
    assert _plan(pp=2, pp_schedule="1f1b", num_micro_batches=4, memory_budget=budget).peak_memory <= budget
    with pytest.raises(MemoryBudgetError, match=r"pipeline stage \d .*\(4 micro-batches alive under gpipe\)"):
        _plan(pp=2, pp_schedule="gpipe", num_micro_batches=4, memory_budget=budget)


def test_uneven_model_gets_the_partition_the_dynamic_program_prefers():
    p = _plan("gpt4", devices=2, pp=2, num_micro_batches=4)
    st = p.data["stages"]
    assert st[0]["blocks"][0] == 0 and st[-1]["blocks"][1] == 4
    # the objective the DP minimised is no worse than the even split's
    times = [s["time"] for s in st]
    assert p.predictions["time_breakdown"]["pipeline"] >= sum(times) + 3 * max(times)
    assert p.predictions["time_breakdown"]["pipeline"] == pytest.approx(simulate_plan(p.data).step_time)


@pytest.mark.parametrize("pins, words", [
    ({"pp": 4, "num_micro_batches": 4}, ["pp=4", "2 blocks", "at most 2"]),
    ({"pp": 2, "num_micro_batches": 1}, ["num_micro_batches=1", "at least 2 micro-batches"]),
    ({"pp": 2, "num_micro_batches": 3}, ["num_micro_batches=3", "8 rows", "3 equal micro-batches"]),
    ({"pp": 4}, ["pp=4", "2 blocks", "at most 2"]),   # pp alone: the error every count it tries meets
    ({"pp": 2, "pp_schedule": "interleaved-1f1b", "num_micro_batches": 4}, ["2 blocks", "at most 1", "2 virtual"]),
    ({"pp": 2, "pp_schedule": "pipedream", "num_micro_batches": 4}, ["pipedream", "known schedules"]),
    ({"pp_schedule": "1f1b"}, ["needs pp > 1"]),
    ({"pp": 0}, ["pp=0", "positive integer"]),
    ({"pp": 2, "num_micro_batches": 4, "checkpoint": "selective"}, ["selective", "pp=2", "not implemented"]),
    ({"pp": 2, "num_micro_batches": 4, "checkpoint": {"blocks": "selective"}}, ["selective", "pp=2"]),
    ({"pp": 2, "num_micro_batches": 4, "checkpoint": "full", "pp_schedule": "zero-bubble"}, ["zero-bubble"]),
    ({"pp": 2, "num_micro_batches": 4, "checkpoint": "full", "zero": 3, "dp": 2}, ["zero=3", "ZeRO <= 2"]),
])
def test_impossible_pipeline_pins_are_constraint_errors(pins, words):
    devices = 4 if pins.get("pp") == 4 or pins.get("dp") == 2 else 2
    with pytest.raises(ConstraintError) as ei:
        _plan("gpt4" if pins.get("pp_schedule") == "zero-bubble" else "gpt2", devices=devices, **pins)
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))


class _Flat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.b(torch.tanh(self.a(x))), y)


def test_a_model_without_repeated_blocks_says_why_it_cannot_pipeline():
    torch.manual_seed(0)
    batch = (torch.randn(8, 8), torch.randint(4, (8,)))
    with pytest.raises(ConstraintError, match="no repeated blocks"):
        autopar.plan(_Flat(), batch, autopar.Cluster.preset("cpu", devices=2),
                     constraints={"pp": 2, "num_micro_batches": 2})


def test_interleaved_plan_has_two_virtual_stages_per_rank_and_sums_their_memory():
    p = _plan("gpt4", pp=2, pp_schedule="interleaved-1f1b", num_micro_batches=4)
    st = p.data["stages"]
    assert [s["ranks"] for s in st] == [[0, 0], [1, 1], [0, 0], [1, 1]] and [s["virtual"] for s in st] == [0, 0, 1, 1]
    assert [s["blocks"] for s in st] == [[0, 1], [1, 2], [2, 3], [3, 4]]
    # torch's interleaved order (m=4, pp=2, v=2): stage k keeps 4, 3, 2, 1 micro-batches alive at its peak
    assert [s["alive_micro_batches"] for s in st] == [4, 3, 2, 1]
    # a rank's peak is over time (its two stages' peaks need not coincide), at most their sum
    for r, (a, b) in enumerate(((0, 2), (1, 3))):
        assert st[a]["rank_peak_memory"] <= st[a]["peak_memory"] + st[b]["peak_memory"]
    assert p.peak_memory == max(s["rank_peak_memory"] for s in st)
    # per rank, what its stages send point-to-point
    assert p.comm_bytes["pp"] == max(st[0]["p2p_bytes"] + st[2]["p2p_bytes"], st[1]["p2p_bytes"] + st[3]["p2p_bytes"])
    zb = _plan("gpt4", pp=2, pp_schedule="zero-bubble", num_micro_batches=4)
    assert zb.predictions["time_breakdown"]["bubble"] < p.predictions["time_breakdown"]["bubble"]


def test_free_search_keeps_pp1_for_a_small_model():
    p = _plan()
    assert p.degrees["pp"] == 1 and p.world_size == 2


def test_free_search_pipelines_when_pp1_cannot_fit_memory():
    """With ZeRO and TP pinned off, pp=1 replicates every parameter on both devices; pp=2 keeps
    half on each. A budget between the two peaks: the free search must choose pp > 1 (schedule and
    micro-batch count its own), and its plan must fit."""
    p1 = _plan(zero=0, tp=1, pp=1)
    p2 = _plan(zero=0, tp=1, pp=2, num_micro_batches=4)
    budget = (p1.peak_memory + p2.peak_memory) // 2
    with pytest.raises(MemoryBudgetError):   # sp=1: a sequence axis would fit it (issue 7's retry)
        _plan(zero=0, tp=1, pp=1, sp=1, memory_budget=budget)
    p = _plan(zero=0, tp=1, memory_budget=budget)
    assert p.degrees["pp"] == 2 and p.degrees["pp_schedule"] in ("1f1b", "interleaved-1f1b")
    assert p.degrees["num_micro_batches"] >= 2 and p.peak_memory <= budget
    assert len(p.data["stages"]) == 2 and p.stats["pipeline_candidates"] >= 1
    assert p.predictions["time_breakdown"]["bubble"] > 0


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_zero3_pinned_with_pp_plans_and_prices_the_gathers_per_micro_batch(name):
    """constraints pp=2 x dp=2 x zero=3 plan (GPT-2 ties its embedding across the first and last
    stage). Against the same pins at ZeRO-2: each rank keeps half the parameters, its state is
    lower (plus the largest chunk gathered whole), and its step is longer by the stages'
    all-gathers (one for forward, one for backward per micro-batch, inside each stage's time),
    while the dp bytes grow by exactly those gathers:
    2 x m x parameters, in place of ZeRO-2's one all-gather after the step."""
    pins = dict(name=name, devices=4, pp=2, dp=2, num_micro_batches=2)
    z2, z3 = _plan(zero=2, **pins), _plan(zero=3, **pins)
    assert z3.degrees["zero"] == 3 and z3.degrees["pp"] == 2 and z3.mesh.describe() == "dp=2"
    assert z3.world_size == 4 and [s["blocks"] for s in z3.data["stages"]] == [s["blocks"] for s in z2.data["stages"]]
    mb2, mb3 = z2.predictions["memory_breakdown"], z3.predictions["memory_breakdown"]
    assert mb3["params"] == pytest.approx(mb2["params"] / 2, rel=0.01)
    state = {z: sum(v for k, v in mb.items() if k in ("params", "grads", "optimizer"))
             for z, mb in ((2, mb2), (3, mb3))}
    assert state[3] < state[2] and mb3["gathered"] > 0   # less kept; the block in use gathered whole
    assert z3.step_time > z2.step_time
    m = 2
    for s2, s3 in zip(z2.data["stages"], z3.data["stages"]):
        assert s3["time"] > s2["time"] and s3["forward_time"] > s2["forward_time"]
        # per stage: ZeRO-2 moves m reduce-scatters + 1 all-gather of its parameters, ZeRO-3 m + 2m
        # (plus the same few KiB of activation collectives on dp in both: GPT-2's position embedding)
        assert s3["comm_bytes"]["dp"] * (m + 1) == pytest.approx(s2["comm_bytes"]["dp"] * 3 * m, rel=0.01)


def test_zero3_under_zero_bubble_is_refused():
    """Its weight pass runs after later forwards freed the chunks: not run, so not planned."""
    with pytest.raises(ConstraintError, match="ZeRO <= 2"):
        _plan("gpt4", devices=4, pp=2, dp=2, zero=3, num_micro_batches=2, pp_schedule="zero-bubble")


def test_checkpointed_pipeline_plan_prices_recomputation_and_keeps_block_inputs():
    """constraints={"pp": 2, "checkpoint": "full"} plans: every stage's blocks are recomputed, their
    recomputation (the blocks' forward) is in the stages' backward time and in the step time, and a
    stage keeps per micro-batch only its blocks' inputs besides what its prologue / epilogue save,
    plus one block's recompute working set at its peak (the memory check counts it)."""
    none = _plan("gpt4", pp=2, num_micro_batches=4)
    full = _plan("gpt4", pp=2, num_micro_batches=4, checkpoint="full")
    assert all(st["checkpoint"] == {"blocks": True} for st in full.data["stages"])
    assert all(st["checkpoint"] == {"blocks": False} for st in none.data["stages"])
    assert full.predictions["step_time"] > none.predictions["step_time"]
    assert full.predictions["time_breakdown"]["recompute"] > 0 == none.predictions["time_breakdown"]["recompute"]
    for a, b in zip(full.data["stages"], none.data["stages"]):
        assert a["blocks"] == b["blocks"]
        nb = a["blocks"][1] - a["blocks"][0]
        assert a["recompute_time"] > 0 and b["recompute_time"] == 0 and b["recompute_memory"] == 0
        assert a["backward_time"] == pytest.approx(b["backward_time"] + a["recompute_time"])
        assert a["activations_per_micro_batch"] < b["activations_per_micro_batch"]
        # what the blocks saved is gone but their inputs (saved by their first norm either way):
        # exactly what recomputing them saves again; the prologue / epilogue are unchanged
        assert b["activations_per_micro_batch"] - a["activations_per_micro_batch"] == \
            pytest.approx(nb * a["recompute_memory"], abs=nb * 2)
        assert a["peak_memory"] == pytest.approx(a["static_memory"] + a["alive_micro_batches"]
                                                 * a["activations_per_micro_batch"] + a["recompute_memory"], abs=2)
    assert full.predictions["peak_memory"] < none.predictions["peak_memory"]


def test_free_search_micro_batch_counts_reach_16_per_stage():
    """The free search's micro-batch counts go to 16 x pp (dividing the batch): with only
    {pp, 2pp, 4pp} a 39B GPT on 64 A100s missed the Megatron-style grid's pp=4, m=64 plan
    (benchmarks/RESULTS-history.md section 10(c))."""
    from autopar.search.pipeline_candidates import micro_batch_counts
    assert micro_batch_counts(4, 512) == [4, 8, 16, 32, 64]
    assert micro_batch_counts(2, 24) == [2, 4, 8]   # only counts dividing the batch
    assert micro_batch_counts(8, 1536) == [8, 16, 32, 64, 128]
    # with the cluster, Megatron's counts (micro-batch 1 or 2, tp over a node): GPT-3 batch 1536 on
    # 128 DGX nodes, pp=8 leaves 16 nodes per stage, dp=16: m = 96 and 48
    cluster = autopar.Cluster.preset("dgx-a100", nodes=128)
    assert micro_batch_counts(8, 1536, cluster) == [8, 16, 32, 48, 64, 96, 128]


def test_inner_cutoff_changes_no_plan(monkeypatch):
    """pipeline_search.py cuts off a pipelined candidate's inner configurations whose work over p
    stages cannot beat the incumbent: the premise (some inner search is cut off) and the same plan
    as without it."""
    import autopar.search.pipeline_candidates as PC
    from autopar.models import HF_ZOO
    model, batch = HF_ZOO["hf_gpt2"]()   # its pp=1 plan leaves room: pipelined candidates get searched
    cluster = autopar.Cluster.preset("cpu", devices=4)
    with_cut = autopar.plan(model, batch, cluster)
    assert with_cut.stats["inner_searches"] >= 2 and with_cut.stats["inner_cut_off"] >= 1, with_cut.stats
    monkeypatch.setattr(PC, "INNER_CUTOFF", False)
    without = autopar.plan(model, batch, cluster)
    assert without.stats["inner_cut_off"] == 0
    assert with_cut.degrees == without.degrees
    assert with_cut.predictions["step_time"] == without.predictions["step_time"]


def test_inner_cutoff_fill_and_drain_changes_no_plan(monkeypatch):
    """The inner cutoff with the least fill and drain (pipeline_candidates.py module doc, pruning)
    gives the plan found with the work bound alone and with no cutoff."""
    import autopar.search.outer as O
    import autopar.search.pipeline_candidates as PC
    from autopar.models import HF_ZOO
    model, batch = HF_ZOO["hf_gpt2"]()
    cluster = autopar.Cluster.preset("cpu", devices=4)
    seen = []
    real = O.optimizer_ceiling
    monkeypatch.setattr(O, "optimizer_ceiling", lambda P: seen.append(real(P)) or seen[-1])
    with_fd = autopar.plan(model, batch, cluster)
    assert with_fd.stats["inner_cut_off"] >= 1 and seen and all(u >= 0 for u in seen)
    monkeypatch.setattr(PC, "INNER_FILL_DRAIN", False)
    work_only = autopar.plan(model, batch, cluster)
    monkeypatch.setattr(PC, "INNER_CUTOFF", False)
    without = autopar.plan(model, batch, cluster)
    for other in (work_only, without):
        assert with_fd.degrees == other.degrees
        assert with_fd.predictions["step_time"] == other.predictions["step_time"]


def test_cutoff_fill_drain_enters_the_cut():
    """outer.search's ``cutoff_fill_drain`` F: a configuration is cut off when its work bound W
    gives (W - U) F >= cutoff (U: its optimizer ceiling). One pinned configuration whose plan does
    work W*: a cutoff of 1.5 W* cuts nothing with F = 1 (no bound exceeds W*), and with F = 2 it
    cuts the configuration (its bounds reach 0.75 W* + U < W*)."""
    from autopar.pricing.price import Settings
    from autopar.frontend.trace import trace
    from autopar.search.outer import CutOff, search

    model, batch = ZOO["gpt2"]()
    g = trace(model, batch)
    cluster = autopar.Cluster.preset("dgx-a100", nodes=1)
    pins = {"dp": 8, "tp": 1, "zero": 1, "num_micro_batches": 1}
    base = Settings(budget=float(cluster.device.memory_bytes))
    best, _ = search(g, cluster, base, pins)
    tb = best.prediction["time_breakdown"]
    work = tb["compute"] + tb["op_comm"] + tb["reshard_comm"] + tb["optimizer"]
    assert work > 4 * tb["optimizer"]   # U (at most every parameter unsharded) cannot undo the bubble
    again, _ = search(g, cluster, base, pins, cutoff=1.5 * work)
    assert again.prediction["step_time"] == best.prediction["step_time"]
    with pytest.raises(CutOff):
        search(g, cluster, base, pins, cutoff=1.5 * work, cutoff_fill_drain=2.0)


def _best_bound_first_changes_no_plan(monkeypatch, model, batch, cluster):
    """Forced through (every 2-axis ILP "large", any bound gap enough), the pipelined candidates
    visited before the pp=1 search's 2-axis ILPs and the proofs against their plan
    (autopar/search/pipeline_search.py before_large, visit.py Incumbent and mip_reaches) give the
    plan the search gives without them."""
    import autopar.search.pipeline_search as PS
    import autopar.search.visit as V
    monkeypatch.setattr(V, "LARGE_ILP_SECONDS", 0.0)
    monkeypatch.setattr(PS, "PIPELINED_FIRST_GAP", 1e9)
    first = autopar.plan(model, batch, cluster)
    assert first.stats["pipelined_first"], first.stats
    monkeypatch.setattr(PS, "BEST_BOUND_FIRST", False)
    plain = autopar.plan(model, batch, cluster)
    assert not plain.stats["pipelined_first"]
    assert first.degrees == plain.degrees
    assert first.predictions["step_time"] == pytest.approx(plain.predictions["step_time"], rel=1e-9)
    return first


@pytest.mark.slow
def test_best_bound_first_changes_no_plan_pp1_wins(monkeypatch):
    model, batch = ZOO["gpt2"]()   # on 16 A100s its pp=1 plan (2-axis ILPs solved) beats every pipelined one
    first = _best_bound_first_changes_no_plan(monkeypatch, model, batch, autopar.Cluster.preset("dgx-a100", nodes=2))
    assert first.degrees["pp"] == 1


@pytest.mark.slow
def test_best_bound_first_changes_no_plan_pipelined_wins(monkeypatch):
    from autopar.models import ZOO
    model, batch = ZOO["gpt2_xl"]()
    first = _best_bound_first_changes_no_plan(monkeypatch, model, batch, autopar.Cluster.preset("dgx-a100", nodes=2))
    assert first.degrees["pp"] > 1


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_closed_form_alive_counts_equal_the_simulation(schedule):
    from autopar.search.stage_plan import _uniform_alive, simulated_alive
    for pp in (2, 3, 4, 5, 8, 12):
        for m in sorted({pp, pp + 1, 2 * pp, 3 * pp + 1, 4 * pp, 33}):
            assert _uniform_alive(schedule, pp, m) == simulated_alive(schedule, pp, m), (pp, m)


def test_closed_form_alive_counts_hold_with_unequal_stages():
    """plan_stages checks 1F1B / GPipe memory before simulating, with the equal-stage counts: the
    order alone sets them, whatever the stage durations and transfers."""
    from autopar.search.stage_plan import _uniform_alive, simulate_stages
    for schedule in ("1f1b", "gpipe"):
        for pp, m in ((3, 7), (4, 4), (5, 12)):
            fwd = [0.3 + 0.7 * (k % 2) for k in range(pp)]
            bwd = [2.5 - 0.4 * k for k in range(pp)]
            sim = simulate_stages(schedule, pp, m, fwd, bwd, [0.05] * (pp - 1))
            assert tuple(sim.peak_alive[k] for k in range(pp)) == _uniform_alive(schedule, pp, m)
