"""Mean losses over targets (cross-entropy with ignore_index, class weights) equal the one-process
loss under every split: data-parallel halves, micro-batches and a tensor-parallel axis (vocab-parallel
cross-entropy; targets split over a model axis) hold different numbers of valid targets, and each
rank's loss must still be its exact share of the global mean (runtime/loss.py). fp32, SGD with
momentum, 3 steps against eager: losses rel 1e-5, parameters rel 1e-4."""
from __future__ import annotations

import functools

import pytest
import torch

import autopar
from helpers import exactness as E

CPU2 = autopar.Cluster.preset("cpu", devices=2)


def _plan(factory, **constraints):
    model, batch = factory()
    return autopar.plan(model, batch, CPU2, optimizer="sgd", precision="fp32", constraints=constraints)


@pytest.mark.parametrize("kind", ["mlm", "padded"])
def test_premise_ranks_hold_different_valid_counts(kind):
    _, (_, labels) = E.tiny_lm(kind)
    halves, quarters = E.valid_counts(labels, 2), E.valid_counts(labels, 4)
    assert halves[0] != halves[1] and len(set(quarters)) == 4, (halves, quarters)
    assert 0 < int((labels != -100).sum()) < labels.numel()    # some targets ignored, not all


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mlm", "padded"])
def test_data_parallel_mean_over_valid_targets(kind):
    factory = functools.partial(E.tiny_lm, kind)
    plan = _plan(factory, dp=2, num_micro_batches=1)
    assert plan.degrees["dp"] == 2
    res = E.check(factory, plan)
    assert sorted(res[0][3] + res[1][3]) == list(range(E.B)) and res[0][3] == [0, 1, 2, 3]


@pytest.mark.slow
def test_data_parallel_with_micro_batches_mlm():
    factory = functools.partial(E.tiny_lm, "mlm")
    plan = _plan(factory, dp=2, num_micro_batches=2)
    assert (plan.degrees["dp"], plan.degrees["num_micro_batches"]) == (2, 2)
    res = E.check(factory, plan)
    assert res[0][3] == [0, 1, 4, 5] and res[1][3] == [2, 3, 6, 7]   # quarters: 1, 2, 11, 4 valid targets


@pytest.mark.slow
def test_class_weights_data_parallel_with_micro_batches():
    factory = functools.partial(E.tiny_lm, "padded", class_weights=True)
    plan = _plan(factory, dp=2, num_micro_batches=2)
    assert plan.degrees["dp"] == 2
    E.check(factory, plan)


def _tp_plan(factory, picks):
    model, batch = factory()
    plan = _plan(factory, dp=1, tp=2, num_micro_batches=1)
    return E.force(plan, model, batch, picks)


def _is(target):
    return lambda n: n.op == "call_function" and n.target is target


aten = torch.ops.aten


def _splits_last_dim_on_tp(plan):
    tp = plan.mesh.names.index("tp")
    return lambda s: s.outputs[0].dims[-1] == (tp,)


@pytest.mark.slow
@pytest.mark.parametrize("nm", [1, 2])
def test_vocab_parallel_cross_entropy_masked_labels(nm):
    """tp=2: the head's logits split on the vocabulary, cross-entropy by the vocab-parallel
    algorithm (which leaves the loss complete over tp); with 2 micro-batches holding 3 and 15
    valid targets it runs as a local sum over the global count."""
    factory = functools.partial(E.tiny_lm, "mlm")
    model, batch = factory()
    base = _plan(factory, dp=1, tp=2, num_micro_batches=nm)
    assert base.degrees["num_micro_batches"] == nm
    traced = __import__("autopar.frontend.trace", fromlist=["trace"]).trace(model, batch)
    last_linear = [n.name for n in traced.gm.graph.nodes
                   if n.target is aten.linear.default][-1]
    plan = E.force(base, model, batch, [
        (lambda n: n.name == last_linear, _splits_last_dim_on_tp(base)),
        (lambda n: n.target is aten.view.default and n.args[0].name == last_linear, _splits_last_dim_on_tp(base)),
        (_is(aten.cross_entropy_loss.default), lambda s: "vocab_parallel_ce" in s.special),
    ])
    ce = next(o for o in plan.data["ops"] if o["target"].startswith("aten.cross_entropy_loss"))
    assert ce["special"] == ["vocab_parallel_ce"]
    res = E.check(factory, plan)
    assert res[0][2].get("tp", 0) > 0, res[0][2]     # bytes really moved on the tp axis


@pytest.mark.slow
def test_targets_split_over_a_model_axis_padded():
    """tp=2 with the cross-entropy's rows (and so its targets) split over the model axis: the two
    tp ranks hold 13 and 15 valid targets."""
    factory = functools.partial(E.tiny_lm, "padded")
    model, batch = factory()
    base = _plan(factory, dp=1, tp=2, num_micro_batches=1)
    tp = base.mesh.names.index("tp")
    plan = E.force(base, model, batch, [
        (_is(aten.cross_entropy_loss.default),
         lambda s: s.inputs[1].dims[0] == (tp,) and not s.special),
    ])
    ce = next(o for o in plan.data["ops"] if o["target"].startswith("aten.cross_entropy_loss"))
    assert ce["inputs"][1]["dims"][0] == [tp], ce
    res = E.check(factory, plan)
    assert res[0][2].get("tp", 0) > 0, res[0][2]


@pytest.mark.slow
def test_bert_masked_lm_data_parallel():
    """The zoo's BERT (masked-LM labels): its dp=2 halves hold 9 and 14 valid targets."""
    from autopar.models import ZOO

    factory = ZOO["bert"]
    _, (_, labels) = factory()
    assert E.valid_counts(labels, 2) == [9, 14]
    plan = _plan(factory, dp=2, tp=1, num_micro_batches=1)
    assert plan.degrees["dp"] == 2
    E.check(factory, plan)


class SelfLabelled(torch.nn.Module):
    """Targets computed from a trainable parameter (pseudo-labels): the global count of valid
    targets cannot be known before the step runs."""

    def __init__(self):
        super().__init__()
        self.teacher = torch.nn.Linear(8, 3)
        self.student = torch.nn.Linear(8, 3)

    def forward(self, x):
        labels = self.teacher(x).argmax(-1).masked_fill(x[:, 0] > 0, -100)
        return torch.nn.functional.cross_entropy(self.student(x), labels)


def test_targets_computed_from_parameters_are_a_clear_error():
    from autopar.errors import ExecutionError
    from autopar.frontend.trace import trace
    from codegen import generate

    torch.manual_seed(0)
    model, batch = SelfLabelled(), (torch.randn(8, 8),)
    plan = autopar.plan(model, batch, CPU2, precision="fp32", constraints={"dp": 2, "num_micro_batches": 1})
    with pytest.raises(ExecutionError, match=r"teacher\.weight.*reduction='sum'"):
        generate(trace(model, batch), plan, 0)
