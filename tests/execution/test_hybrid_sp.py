"""The Ulysses x ring hybrid planned and executed (sp_mode="hybrid", autopar/rules/hybrid_sequence.py):
two sequence axes (ring outer ``sp_r``, Ulysses inner ``sp_u``), SDPA run by
runtime/hybrid_sp.py's ``hybrid_attention``, the rest of the model laid out as its ``positions``
(zig-zag ring pieces under the causal mask).

Slow: the zoo Llama (causal, GQA, RoPE) and GPT-2 on 4 gloo ranks (u=2, r=2), 3 SGD-momentum
steps in fp32, equal one process (tests/execution/test_sequence_parallel_exec.py's ``run_case``: losses rel
1e-5, parameters rel 1e-4, bytes per mesh axis at run time = the plan's), and the hybrid's own
traffic per axis equals ``hybrid_bytes``. Fast: the pins, the default split, the errors naming
the op, and the priced bytes of the attention strategy per axis."""
from __future__ import annotations

import pytest
import torch
from helpers.sequence_parallel import (ZOO, attention_ops, attention_shape, measure_saved, predicted_saved,
                                         reference, run_case)

import autopar
from autopar.rules.hybrid_sequence import HYBRID, HYBRID_CONTIGUOUS, default_shape, splits
from runtime.hybrid_sp import hybrid_bytes

HYBRID_4 = {"sp": 4, "sp_mode": "hybrid", "sp_shape": [2, 2]}


def _plan(name, n, constraints, **kw):
    model, batch = ZOO[name](**kw)
    return autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=n), precision="fp32", optimizer="sgd",
                        constraints={"num_micro_batches": 1, **constraints})


def _check_hybrid_plan(plan, name, algo=HYBRID):
    d = plan.degrees
    assert (d["sp"], d["sp_mode"], d["sp_shape"], d["dp"], d["tp"]) == (4, "hybrid", [2, 2], 1, 1), d
    seq_axes = [n for n in plan.mesh.names if n.startswith("sp")]
    assert seq_axes == ["sp_r", "sp_u"], plan.mesh.names       # two sequence axes, ring outer
    assert [plan.mesh.shape[plan.mesh.axis(a)] for a in seq_axes] == [2, 2]
    attn = attention_ops(plan)
    assert attn and all(op["special"] == [algo] for op in attn), [op["strategy"] for op in attn]
    assert all(op["splits"][plan.mesh.axis("sp_r")] == op["splits"][plan.mesh.axis("sp_u")] == "s" for op in attn)
    b, h, s, hd, layers = attention_shape(name)
    return layers, hybrid_bytes(b, h, h, s, hd, 2, 2, 4)


def _max_rel(got, want, floor: float = 0.0) -> float:
    """Largest |got - want| / |want| over the elements whose |want| exceeds ``floor``."""
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    keep = want.abs() > floor
    return float(((got - want).abs()[keep] / want.abs()[keep]).max()) if keep.any() else 0.0


@pytest.mark.slow
@pytest.mark.parametrize("name, algo", [("llama", HYBRID), ("gpt2", HYBRID), ("bert", HYBRID_CONTIGUOUS)])
def test_hybrid_u2_r2_on_4_processes_equals_one_process(name, algo):
    """Causal Llama and GPT-2: zig-zag ring pieces; BERT (no mask): contiguous ones."""
    plan, res = run_case(name, 4, {"sp": 4, "sp_mode": "hybrid"})   # sp_shape from the heads: [2, 2]
    layers, (uly, ring) = _check_hybrid_plan(plan, name, algo)
    for out in res:
        kinds = out[3]
        # the hybrid's own traffic: Ulysses' all-to-alls on the inner axis, the ring's K/V and
        # dK/dV p2p on the outer axis, per step and rank, as priced (hybrid_bytes)
        assert kinds.get("sp_u:all_to_all", 0) == layers * uly.total_bytes, (kinds, uly)
        assert kinds.get("sp_r:ring_kv", 0) + kinds.get("sp_r:ring_dkv", 0) == layers * ring.total_bytes, kinds
        assert not any(k.startswith("sp_u:ring") or k == "sp_r:all_to_all" for k in kinds), kinds
        assert {a: out[2].get(a, 0) for a in ("sp_r", "sp_u")} == \
            {a: int(plan.comm_bytes[a]) for a in ("sp_r", "sp_u")}, (out[2], plan.comm_bytes)   # also in run_case
    ref_losses, ref_sd = reference(name, {})
    loss_rel = _max_rel([float(x) for x in res[0][0]], [float(x) for x in ref_losses])
    # parameters: elementwise over |value| > 1e-3 (assert_matches_eager's atol covers the ones near 0),
    # and per tensor max|diff| / max|value|
    param_rel = max(_max_rel(torch.from_numpy(res[0][1][k]), v, 1e-3) for k, v in ref_sd.items())
    param_norm = max(float((torch.from_numpy(res[0][1][k]).double() - v.double()).abs().max() / v.abs().max())
                     for k, v in ref_sd.items() if v.abs().max() > 0)
    print(f"\n{name} hybrid u=2 r=2: losses {[float(x) for x in res[0][0]]} vs {[float(x) for x in ref_losses]}, "
          f"loss max rel {loss_rel:.2e}, param max rel {param_rel:.2e} (|p|>1e-3), per tensor {param_norm:.2e}; "
          f"bytes/step/rank "
          f"planned {dict(plan.comm_bytes)} measured {res[0][2]}")


@pytest.mark.slow
def test_hybrid_with_activation_checkpointing_bytes_as_priced():
    """Full checkpointing reruns the attention's forward in backward: both axes send their forward
    bytes again (the ring's backward, with fp32 dK/dV, is larger than its forward), and the plan's
    per-axis bytes equal what runs (run_case)."""
    plan, res = run_case("llama", 4, {"sp": 4, "sp_mode": "hybrid", "checkpoint": "full"})
    assert plan.degrees["checkpoint"] == "full", plan.degrees
    layers, (uly, ring) = _check_hybrid_plan(plan, "llama", HYBRID)
    assert ring.backward_bytes > ring.forward_bytes
    for out in res:
        kinds = out[3]
        assert kinds.get("sp_u:all_to_all", 0) == layers * (uly.total_bytes + uly.forward_bytes), (kinds, uly)
        assert kinds.get("sp_r:ring_kv", 0) + kinds.get("sp_r:ring_dkv", 0) == \
            layers * (ring.total_bytes + ring.forward_bytes), (kinds, ring)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hybrid_saved_activations_match_prediction(name):
    """saved_tensors_hooks on every rank against the plan, within 2%, as for zig-zag ring (same
    bytes as ring sp=4 on these models): GPT-2 +256 B (the int64 permutation indices of the
    zig-zag reshards), Llama +1.6% (also its RoPE cos/sin rows: the zig-zag slice copies them,
    and each multiply saves its copy, 16 x 512 B, which the plan does not count)."""
    from runtime.launch import run_local

    model, batch = ZOO[name]()
    cluster = autopar.Cluster.preset("cpu", devices=4)
    plan = autopar.plan(model, batch, cluster, precision="fp32", optimizer="sgd",
                        constraints={"num_micro_batches": 1, **HYBRID_4})
    pred = predicted_saved(plan)
    for meas in run_local(measure_saved, 4, args=(name, plan.to_json()), timeout=300):
        assert pred <= meas <= 1.02 * pred, (meas, pred)


@pytest.mark.slow
@pytest.mark.parametrize("name, cons, policy", [
    ("llama", {"tp": 2, "sp": 4, "sp_mode": "hybrid"}, "megatron"),   # Megatron column/row on the tensor axis
    ("gpt2", {"dp": 2, "sp": 4, "sp_mode": "hybrid"}, None),
])
def test_hybrid_with_a_tensor_or_data_axis_on_8_processes(name, cons, policy):
    plan, res = run_case(name, 8, cons, policy=policy)
    d = plan.degrees
    assert (d["sp"], d["sp_mode"], d["sp_shape"]) == (4, "hybrid", [2, 2]) and attention_ops(plan), d
    assert all(op["special"] == [HYBRID] for op in attention_ops(plan))
    assert all(out[3].get("sp_u:all_to_all", 0) > 0 and out[3].get("sp_r:ring_kv", 0) > 0 for out in res)


@pytest.mark.slow
def test_hybrid_in_pipeline_stages_on_8_processes():
    """pp=2 x hybrid (u=2, r=2): each stage's sub-mesh carries both sequence axes; numerics, bytes
    per axis and point-to-point per stage = plan (tests/execution/test_sp_pipeline.py ``_run``)."""
    from helpers.sp_pipeline import run_pp_sp_case
    plan, res = run_pp_sp_case("llama", {"pp": 2, "sp": 4, "sp_mode": "hybrid", "num_micro_batches": 2}, world=8)
    assert plan.degrees["sp_shape"] == [2, 2] and plan.mesh.names[1:3] == ("sp_r", "sp_u"), plan.mesh.names
    assert all(r["kinds"].get("sp_u:all_to_all", 0) > 0 and r["kinds"].get("sp_r:ring_kv", 0) > 0 for r in res)


# ------------------------------------------------------------------ plans (fast)

@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_hybrid_plan_degrees_axes_and_priced_bytes(name):
    from autopar.frontend.trace import trace
    from autopar.rules.candidates import candidates
    from autopar.rules.sequence import policy_for
    plan = _plan(name, 4, HYBRID_4)
    layers, (uly, ring) = _check_hybrid_plan(plan, name)
    # the chosen attention strategy's priced bytes per axis (forward and backward entries) are
    # hybrid_bytes': all-to-alls on sp_u, the ring on sp_r
    model, batch = ZOO[name]()
    c = candidates(trace(model, batch), plan.mesh, policy_for(None, HYBRID_4))
    ra, ua = plan.mesh.axis("sp_r"), plan.mesh.axis("sp_u")
    for op in attention_ops(plan):
        st = next(s for s in c.nodes[op["node"]].strategies if s.name == op["strategy"])
        per_axis = {a: sum(b for _, ax, b in st.comms + st.backward_comms if ax == a) for a in (ra, ua)}
        assert per_axis == {ua: uly.total_bytes, ra: ring.total_bytes}, (per_axis, uly, ring)
    # the plan's bytes on each axis include the attention's (plus the reshards around it)
    assert plan.comm_bytes["sp_u"] >= layers * uly.total_bytes and plan.comm_bytes["sp_r"] >= layers * ring.total_bytes


def test_default_split_ulysses_inside_a_node_ring_across():
    assert splits(8) == [(4, 2), (2, 4)] and splits(2) == [] and splits(9) == [(3, 3)]
    assert default_shape(8, room=8, heads=[8]) == (4, 2)
    assert default_shape(8, room=2, heads=[8]) == (2, 4)      # a node holds 2 sequence ranks: u=2
    assert default_shape(8, room=8, heads=[6]) == (2, 4)      # 4 does not divide 6 heads
    assert default_shape(8, room=1, heads=[4]) == (4, 2)      # nothing fits a node: the largest u dividing heads
    assert default_shape(4, room=4, heads=[3]) is None


def test_hybrid_pin_with_only_sp_shape():
    plan = _plan("llama", 4, {"sp_mode": "hybrid", "sp_shape": [2, 2]})
    assert plan.degrees["sp"] == 4 and plan.degrees["sp_mode"] == "hybrid"


# ------------------------------------------------------------------ bad input: errors naming the op or pin

@pytest.mark.parametrize("n, kw, cons, msg", [
    # heads not divisible by u (pinned split; unpinned: no u of sp divides the heads)
    (8, {"n_head": 2, "d_model": 32}, {"sp": 8, "sp_mode": "hybrid", "sp_shape": [4, 2]},
     r"scaled_dot_product_attention.*2 heads over u=4 ranks"),
    (4, {"n_head": 3, "d_model": 48}, {"sp": 4, "sp_mode": "hybrid"},
     r"scaled_dot_product_attention.*splits its 3 heads.*none of these u divides 3"),
    # causal: the sequence cuts into 2·r·u zig-zag chunks
    (4, {"seq": 12}, HYBRID_4, r"scaled_dot_product_attention.*sequence length 12 does not divide into 8 chunks"),
    # sp must be u·r
    (4, {}, {"sp": 4, "sp_mode": "hybrid", "sp_shape": [2, 3]}, r"sp=4 and sp_shape=\[2, 3\] contradict"),
    (2, {}, {"sp": 2, "sp_mode": "hybrid"}, r"sp=2 with sp_mode='hybrid'.*not such a product"),
    (4, {}, {"sp": 4, "sp_mode": "hybrid", "sp_shape": [4, 1]}, r"sp_shape=\[4, 1\]: must be \[u, r\]"),
    (4, {}, {"sp": 4, "sp_mode": "ring", "sp_shape": [2, 2]}, r"sp_shape.*of sp_mode='hybrid'"),
])
def test_hybrid_errors(n, kw, cons, msg):
    with pytest.raises(autopar.ConstraintError, match=msg):
        _plan("gpt2", n, cons, **kw)


def test_hybrid_needs_sdpa():
    with pytest.raises(autopar.PlanError, match=r"no such op"):
        _plan("gpt2", 4, HYBRID_4, attention="explicit")


# ------------------------------------------------------------------ the free search (fast)

def test_free_search_tries_the_hybrid_only_where_it_can_pay():
    from autopar.frontend.trace import trace
    from autopar.rules.hybrid_sequence import free_search_pins
    llama4 = trace(*ZOO["llama"]())                              # 4 heads
    llama6 = trace(*ZOO["llama"](n_head=6, n_kv_heads=6, d_model=48))
    one_node = autopar.Cluster.preset("cpu", devices=4)
    two_nodes = autopar.Cluster.preset("dgx-a100", nodes=2)
    assert free_search_pins(llama4, one_node, 4) is None        # one node, heads divide: Ulysses / ring only
    assert free_search_pins(llama6, one_node, 4) == {"sp_mode": "hybrid", "sp_shape": [2, 2]}   # 6 % 4 heads
    assert free_search_pins(llama4, two_nodes, 2) is None       # 2 = no u, r >= 2
    assert free_search_pins(llama4, two_nodes, 4) == {"sp_mode": "hybrid", "sp_shape": [2, 2]}
    assert free_search_pins(llama4, two_nodes, 16) == {"sp_mode": "hybrid", "sp_shape": [4, 4]}   # u | 4 heads
    assert free_search_pins(trace(*ZOO["gpt2"](attention="explicit")), two_nodes, 4) is None       # no SDPA


def test_fastest_over_sp_takes_the_hybrid_when_faster():
    from types import SimpleNamespace

    from autopar.frontend.trace import trace
    from autopar.search.context import Planner
    from autopar.search.sequence_search import fastest_over_sp
    graph = trace(*ZOO["llama"]())
    tried = []

    def run(pins):
        tried.append(pins)
        t = 1.0 if pins.get("sp_mode") == "hybrid" and pins["sp"] == 8 else 2.0
        return SimpleNamespace(prediction={"step_time": t}, pins=pins), {}

    cluster = autopar.Cluster.preset("dgx-a100", nodes=2)
    best = fastest_over_sp(Planner(graph, cluster, None, lambda g, c, b, pins: run(pins), {}), {})
    assert best[0].pins == {"sp": 8, "sp_mode": "hybrid", "sp_shape": [4, 2]}
    hybrid = [p["sp"] for p in tried if p.get("sp_mode") == "hybrid"]
    assert [p["sp"] for p in tried if "sp_mode" not in p] == [2, 4, 8, 16] and hybrid == [4, 8, 16]


def test_hybrid_priced_faster_than_one_sequence_axis_across_nodes():
    """Llama-7B shape, 2 layers, 32k tokens, batch 1 on 2 DGX-A100 nodes, tp=4 x sp=4: the sequence
    axis spans the nodes. Ulysses 2 inside a node x ring 2 across them beats the best the ILP finds
    on one sequence axis (Ulysses, ring or K/V all-gather per op): 0.103 s against 0.125 s."""
    from autopar.models.llama import llama_7b
    model, inputs = llama_7b(n_layer=2, seq=32768, batch=1)
    cluster = autopar.Cluster.preset("dgx-a100", nodes=2)
    one = autopar.plan(model, inputs, cluster, constraints={"sp": 4, "tp": 4})
    both = autopar.plan(model, inputs, cluster, constraints={"sp": 4, "tp": 4, "sp_mode": "hybrid"})
    assert both.degrees["sp_shape"] == [2, 2] and both.mesh.describe() == "dp=1 × sp_r=2 × sp_u=2 × tp=4"
    assert both.step_time < 0.9 * one.step_time, (both.step_time, one.step_time)


def test_hybrid_sp_shape_alone_fills_sp():
    from autopar.rules.hybrid_sequence import resolve
    graph = None   # a pinned sp_shape needs no graph
    assert resolve(graph, None, {"sp_mode": "hybrid", "sp_shape": [2, 4]}) == \
        {"sp_mode": "hybrid", "sp_shape": [2, 4], "sp": 8}


def test_show_names_the_hybrid_split():
    from autopar.plans.report import show_text
    plan = _plan("llama", 4, HYBRID_4)
    text = show_text(plan, limit=None)
    assert "sp=4 (hybrid) u×r=2×2" in text and "sp_r=2 × sp_u=2" in text and "[hybrid_attention]" in text, text
