"""The mixture-of-experts operator (runtime/moe.py ``autopar::moe_experts``, rule
autopar/rules/ops_moe.py) on Hugging Face Mixtral: equal to transformers' eager experts forward and
backward, traced as one op, planned and trained on gloo processes equal to one process (data
parallel and expert parallel), and the expert-parallel rank holds only its experts."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

# Forked ranks deadlock in OpenMP if the parent already ran a multi-threaded op.
torch.set_num_threads(1)


def _experts(seed=0, E=4, H=16, Fd=8, T=12, k=2):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    cfg = MixtralConfig(hidden_size=H, intermediate_size=Fd, num_local_experts=E, num_experts_per_tok=k)
    g = torch.Generator().manual_seed(seed)
    m = MixtralExperts(cfg)
    with torch.no_grad():
        m.gate_up_proj.copy_(torch.randn(m.gate_up_proj.shape, generator=g) * 0.3)
        m.down_proj.copy_(torch.randn(m.down_proj.shape, generator=g) * 0.3)
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g, requires_grad=True)
    return m, cfg, x, logits


def _run(impl, seed=0):
    from runtime.moe import register_transformers
    register_transformers()
    m, cfg, x, logits = _experts(seed)
    cfg._experts_implementation = impl
    x = x.clone().requires_grad_(True)
    probs = logits.softmax(-1)
    w, idx = probs.topk(2, dim=-1)
    out = m(x, idx, w)
    (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
    return out.detach(), x.grad, logits.grad, m.gate_up_proj.grad, m.down_proj.grad


def test_op_equals_transformers_eager_forward_and_backward():
    ref = _run("eager")
    got = _run("autopar")
    for name, a, b in zip(("out", "hidden grad", "router grad", "gate_up grad", "down grad"), got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert ref[3].abs().sum() > 0 and ref[2].abs().sum() > 0


def test_expert_blocks_sum_to_the_whole():
    """Expert parallelism: two ranks' blocks (offset 0 and 2) sum to the whole output and their
    gradients are the whole gradient's blocks."""
    m, _, x, logits = _experts()
    w, idx = logits.detach().softmax(-1).topk(2, dim=-1)
    gu, dn = m.gate_up_proj.detach(), m.down_proj.detach()
    whole = torch.ops.autopar.moe_experts(x, idx, w, gu, dn, "silu", 0)
    parts = [torch.ops.autopar.moe_experts(x, idx, w, gu[2 * r:2 * r + 2], dn[2 * r:2 * r + 2], "silu", 2 * r)
             for r in range(2)]
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-6)


def test_hf_mixtral_traces_one_op_per_layer():
    import autopar
    from autopar.models import HF_ZOO
    model, batch = HF_ZOO["hf_mixtral"]()
    g = autopar.trace(model, batch) if hasattr(autopar, "trace") else None
    if g is None:
        from autopar.frontend.trace import trace
        g = trace(model, batch)
    targets = [str(n.target) for n in g.gm.graph.nodes if n.op == "call_function"]
    assert targets.count("autopar.moe_experts.default") == 2, targets
    assert not any("bmm" in t for t in targets)


STEPS = 3
OPT = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9}
GATE_UP = "model.model.layers.0.mlp.experts.gate_up_proj"


def _train(rank, world, plan_json):
    import autopar
    from autopar.models import HF_ZOO
    model, batch = HF_ZOO["hf_mixtral"]()
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), **OPT)
    local = cm._local_values().get(GATE_UP)   # None on a pipeline stage without layer 0
    local_shape = None if local is None else tuple(local.shape)
    losses = [cm.step(*batch) for _ in range(STEPS)]
    sd = {k: v.numpy() for k, v in cm.full_state_dict().items()}
    return losses, (sd if rank == 0 else None), cm.comm_stats(), local_shape


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dp2", "tp2", "pp2"])
def test_hf_mixtral_trains_like_one_process(kind):
    """dp=2 (tokens split, experts replicated) and tp=2 (the planner splits the experts over tp:
    expert parallelism, output a partial sum) on 2 gloo processes: losses rel 1e-5 and parameters
    rel 1e-4 against eager SGD with momentum on one process; also pp=2 (the op in pipeline
    stages). Under tp=2 each rank holds half the
    experts (premise: the split really happens)."""
    from helpers.exactness import assert_matches_eager, train_eagerly

    import autopar
    from autopar.models import HF_ZOO
    from runtime.launch import run_local
    cons = {"dp2": {"dp": 2, "tp": 1}, "tp2": {"dp": 1, "tp": 2},
            "pp2": {"dp": 1, "tp": 1, "pp": 2, "num_micro_batches": 2}}[kind]
    model, batch = HF_ZOO["hf_mixtral"]()
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2),
                        constraints={"num_micro_batches": 1, **cons})
    moe = [op for op in plan.data["ops"] if op["target"] == "autopar.moe_experts.default"]
    assert len(moe) == 2 and plan.degrees["pp"] == cons.get("pp", 1)
    model, batch = HF_ZOO["hf_mixtral"]()
    opt = torch.optim.SGD(model.parameters(), lr=OPT["lr"], momentum=OPT["momentum"])
    ref_losses, ref_sd = train_eagerly(model, batch, opt, STEPS)
    res = run_local(_train, 2, args=(plan.to_json(),), timeout=240)
    assert_matches_eager([r[0] for r in res], res[0][1], ref_losses, ref_sd, label=f"hf_mixtral {kind}: ")
    full = tuple(ref_sd[GATE_UP].shape)
    if kind == "tp2":
        assert all(op["special"] == ["moe_experts_ep"] for op in moe), moe
        assert all(r[3] == (full[0] // 2,) + full[1:] for r in res), [r[3] for r in res]
        assert res[0][2].get("tp", 0) > 0
    elif kind == "dp2":
        assert all(r[3] == full for r in res)


def test_rule_splits_tokens_or_experts_only():
    """On a 2 x 2 mesh (dp, tp): the data axis splits the tokens; the tp axis splits the tokens, the
    experts (special "moe_experts_ep", output partial on tp) or nothing, never the concatenated
    gate/up dim, the intermediate or the hidden dim."""
    from autopar.frontend.trace import trace
    from autopar.mesh import Mesh
    from autopar.models import HF_ZOO
    from autopar.rules import spec_for
    from autopar.rules.strategy import enumerate_strategies
    model, batch = HF_ZOO["hf_mixtral"]()
    g = trace(model, batch)
    node = next(n for n in g.gm.graph.nodes if str(n.target) == "autopar.moe_experts.default")
    spec = spec_for(node)
    assert spec.rule == "moe_experts" and spec.flops > 0
    T, k, F_, H = 8 * 16, 2, 64, 64
    assert spec.flops == 2.0 * T * k * (H * 2 * F_ + F_ * H) + 4.0 * T * k * F_
    mesh = Mesh((2, 2), ("dp", "tp"), 4)
    splits = {s.splits for s in enumerate_strategies(spec, mesh, frozenset("t"))}
    assert splits == {("t", None), ("t", "t"), ("t", "e")}, splits
    ep = next(s for s in enumerate_strategies(spec, mesh, frozenset("t")) if s.splits == ("t", "e"))
    assert ep.special == ("moe_experts_ep",) and ep.outputs[0].partial == (1,)


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu"])
def test_activation_derivatives(act):
    """The backward op's hand-written activation derivatives (it runs below autograd) against autograd."""
    from runtime.moe import ACTS, _act_grad
    g = torch.randn(64, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    (d,) = torch.autograd.grad(ACTS[act](g).sum(), g)
    torch.testing.assert_close(_act_grad(act, g.detach()), d)


def test_bf16_hidden_with_fp32_router_weights():
    """Mixed precision as Mixtral runs it: bf16 activations and experts, fp32 routing weights (the
    router softmaxes in fp32); the output is bf16, the routing weights' gradient fp32."""
    m, _, x, logits = _experts()
    w, idx = logits.detach().softmax(-1).topk(2, dim=-1)
    gu, dn = m.gate_up_proj.detach(), m.down_proj.detach()
    ref = torch.ops.autopar.moe_experts(x, idx, w, gu, dn, "silu", 0)
    xb, gub, dnb = (t.bfloat16().requires_grad_(True) for t in (x, gu, dn))
    wb = w.clone().requires_grad_(True)
    out = torch.ops.autopar.moe_experts(xb, idx, wb, gub, dnb, "silu", 0)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and wb.grad.dtype == torch.float32 and gub.grad.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=3e-2, atol=3e-2)


def test_unsupported_experts_fall_back_to_batched_mm_with_a_warning():
    """Experts the operator cannot run (here a custom gate) run transformers' batched_mm, warned once."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from runtime.moe import register_transformers
    register_transformers()

    class CustomGate(MixtralExperts):
        def _apply_gate(self, gate_up_out):
            gate, up = gate_up_out.chunk(2, dim=-1)
            return self.act_fn(gate) * up * 2

    m, cfg, x, logits = _experts()
    c = CustomGate(cfg)
    c.load_state_dict(m.state_dict())
    w, idx = logits.detach().softmax(-1).topk(2, dim=-1)
    cfg._experts_implementation = "autopar"
    with pytest.warns(UserWarning, match="custom gate"):
        got = c(x, idx, w)
    cfg._experts_implementation = "batched_mm"
    torch.testing.assert_close(got, c(x, idx, w))
