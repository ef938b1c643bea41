"""The LM head's linear + cross-entropy fused into ``autopar.linear_cross_entropy`` (issue 31):
found in the zoo's and Hugging Face's models, planned (rows free, the vocabulary split is the
vocabulary-parallel kernel), and training with it equal to the unfused torch ops."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.models import HF_ZOO, ZOO
from runtime.launch import run_local

from tests.helpers.kernels import TINY, TRAIN_STEPS, needs_kernels, warm_up_planning

STEPS = TRAIN_STEPS
BIG_VOCAB = 4096   # the CPU cluster's tp=2 plan splits the head on the vocabulary from about here

torch.set_num_threads(1)


@pytest.mark.parametrize("name", ["gpt2", "llama", "hf_llama"])
def test_lm_head_and_loss_are_fused_once(name):
    from autopar.frontend.trace import trace
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    model, batch = (HF_ZOO if name.startswith("hf_") else ZOO)[name]()
    g = trace(model, batch, kernels=True)
    assert g.fused["linear_cross_entropy"] == 1, g.fused
    targets = [str(n.target) for n in g.gm.graph.nodes]
    assert "aten.cross_entropy_loss.default" not in targets
    (fused,) = [n for n in g.gm.graph.nodes if str(n.target) == "autopar.linear_cross_entropy.default"]
    assert tuple(fused.args[0].meta["val"].shape) == (128, 64) and fused.meta["val"].shape == ()


def test_op_matches_the_reference_on_cpu_without_the_kernel():
    from runtime.kernels import ops as K
    g = torch.Generator().manual_seed(0)
    h = torch.randn(12, 8, generator=g, requires_grad=True)
    w = torch.randn(20, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 20, (12,), generator=g)
    t[3] = -100
    for red, name in ((1, "mean"), (2, "sum")):
        got = K.LINEAR_CROSS_ENTROPY(h, w, t, -100, red)
        ref = torch.nn.functional.cross_entropy(h @ w.t(), t, reduction=name)
        torch.testing.assert_close(got, ref)
        gh, gw = torch.autograd.grad(got, (h, w))
        rh, rw = torch.autograd.grad(ref, (h, w))
        torch.testing.assert_close(gh, rh)
        torch.testing.assert_close(gw, rw)


def _model(name, vocab, sizes=None):
    torch.manual_seed(0)
    sizes = sizes or {}
    return ZOO[name](vocab=vocab, **sizes) if vocab else ZOO[name](**sizes)


def _train(rank, world, constraints, kernels, name, vocab, sizes):
    import runtime.kernels as K
    model, batch = _model(name, vocab, sizes)
    compiled = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), batch, optimizer="sgd", lr=0.5,
                               momentum=0.9, plan_options={"constraints": constraints}, kernels=kernels)
    K.reset_kernel_stats()
    losses = [compiled.step(*batch) for _ in range(STEPS)]
    state = {k: v.detach().float().numpy().copy() for k, v in compiled.full_state_dict().items()}
    strategies = [o["strategy"] for o in compiled.plan.ops if o["target"] == "autopar.linear_cross_entropy.default"]
    return losses, state, compiled.kernel_stats(), strategies


def _check_equal(world, constraints, name, vocab=None, sizes=TINY):
    """``sizes``: batch and sequence; each row is a program of the row kernels (TINY: 16 rows)."""
    warm_up_planning()
    ref = run_local(_train, world, (constraints, "torch", name, vocab, sizes), timeout=600)[0]
    got = run_local(_train, world, (constraints, "triton", name, vocab, sizes), timeout=600)
    assert ref[3] == [] and len(ref[0]) == STEPS
    for losses, state, stats, strategies in got:
        assert len(strategies) == 1 and stats["linear_cross_entropy"] > 0, (strategies, stats)   # on every rank
        for a, b in zip(losses, ref[0]):
            assert abs(a - b) < 1e-4 * max(1.0, abs(b)), (losses, ref[0])
        for k, v in ref[1].items():
            torch.testing.assert_close(torch.from_numpy(state[k]), torch.from_numpy(v), atol=1e-4, rtol=1e-4,
                                       msg=k)
    return got[0][3][0]


def test_tp_plan_splits_the_lm_head_on_the_vocabulary():
    model, batch = ZOO["llama"](vocab=BIG_VOCAB)
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2), constraints={"tp": 2},
                        kernels="triton")
    assert plan.fused.get("linear_cross_entropy") == 1
    (op,) = [o for o in plan.ops if o["target"] == "autopar.linear_cross_entropy.default"]
    assert op["strategy"] == "S(v)@tp [vocab_parallel_lce]", op


@pytest.mark.slow
@pytest.mark.parametrize("world, constraints", [(1, {}), (2, {"dp": 2})], ids=["1-process", "dp"])
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_fused_lm_head_trains_equal_to_torch_ops(world, constraints, name):
    needs_kernels()
    _check_equal(world, constraints, name)


@pytest.mark.slow
def test_vocab_parallel_fused_lm_head_trains_equal_to_torch_ops():
    """tp=2 with the head split on the vocabulary: the kernel over the tp group on every rank."""
    needs_kernels()
    # batch 4 x seq 8: with fewer rows (TINY's 2 x 8) the plan keeps the head whole at BIG_VOCAB
    assert _check_equal(2, {"tp": 2}, "llama", BIG_VOCAB, {"batch": 4, "seq": 8}) == "S(v)@tp [vocab_parallel_lce]"


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_priced_saved_bytes_match_what_the_fused_program_saves(name, monkeypatch):
    """One device: the priced saved bytes of the model traced with the kernels equal (within 2%)
    the bytes autograd keeps running that graph, where the fused head keeps grad_hidden and
    grad_weight, no logits; less than the same trace with the head left unfused."""
    needs_kernels()
    import autopar.frontend.fuse as fuse_mod
    from autopar.cluster import Cluster
    from autopar.frontend.trace import trace
    from autopar.mesh import Mesh
    from autopar.pricing.price import Settings, price
    from autopar.pricing.saved_probe import saved_bytes
    from autopar.rules.candidates import candidates

    def predicted_and_measured(g):
        c = candidates(g, Mesh((1,), ("dp",), devices_per_node=1))
        P = price(c, Cluster.preset("cpu", devices=1), Settings(optimizer="sgd", precision="fp32"), edges=False)
        pred = sum(float(arr[0]) for arr in P.saved.values() if len(arr))
        names = [n.name for n in g.gm.graph.nodes if n.op == "placeholder"]
        params = [g.value_of(model, g.param_fqn[n]) for n in names if n in g.param_fqn]
        args = params + list(batch)
        assert len(args) == len(names)
        return pred, saved_bytes(lambda: g.gm(*args), exclude=params)

    model, batch = _model(name, BIG_VOCAB)
    g = trace(model, batch, kernels=True)
    assert g.fused["linear_cross_entropy"] == 1
    pred, got = predicted_and_measured(g)
    assert pred == pytest.approx(got, rel=0.02)
    monkeypatch.setattr(fuse_mod, "_linear_cross_entropy_match", lambda node: None)
    unfused = trace(model, batch, kernels=True)
    assert "linear_cross_entropy" not in unfused.fused
    pred_u, got_u = predicted_and_measured(unfused)
    assert got < got_u and pred < pred_u, (got, got_u, pred, pred_u)
