"""Micro-batching cuts each input along its batch dim (the one the data-parallel split uses,
recorded in the plan as ``batch_dims``), never blindly dim 0; invalid micro-batch counts are
clear ConstraintErrors at plan time. Exactness runs: fp32, SGD with momentum, 3 steps against eager."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from helpers import exactness as E
from autopar.frontend.batching import infer_batch_dims, plan_batch_dims
from autopar.errors import ConstraintError, PlanError
from autopar.models import ZOO

SEQ, BATCH, DIM, CLASSES = 5, 8, 16, 4


class SeqFirst(nn.Module):
    """x: T x B x D (sequence first), y: B class labels."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=False)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x, y):
        h, _ = self.attn(x, x, x, need_weights=False)
        return F.cross_entropy(self.head(torch.tanh(h).mean(0)), y)


def seq_first():
    torch.manual_seed(0)
    model = SeqFirst()
    g = torch.Generator().manual_seed(2)
    # rows of the batch differ a lot, so cutting the wrong dim changes the loss
    x = torch.randn(SEQ, BATCH, DIM, generator=g) * torch.linspace(0.2, 3.0, BATCH).view(1, BATCH, 1)
    y = torch.randint(0, CLASSES, (BATCH,), generator=g)
    return model, (x, y)


def _plan(devices, **constraints):
    model, batch = seq_first()
    return autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=devices), optimizer="sgd",
                        precision="fp32", constraints=constraints)


# ------------------------------------------------------------------ batch dims

def test_batch_dims_inferred_and_recorded():
    assert infer_batch_dims([(SEQ, BATCH, DIM), (BATCH,)]) == [1, 0]
    assert infer_batch_dims([(8, 16), (8, 16)]) == [0, 0]          # dim 0 agrees: the convention
    assert infer_batch_dims([(4, 3), ()]) == [0, None]
    assert infer_batch_dims([(SEQ, BATCH, DIM), (BATCH,)], override=(None, 0)) == [None, 0]
    with pytest.raises(PlanError, match="batch_dims"):
        infer_batch_dims([(3, 5), (7, 2)])
    with pytest.raises(PlanError, match="same size"):
        infer_batch_dims([(SEQ, BATCH, DIM), (BATCH,)], override=(0, 0))
    plan = _plan(1, num_micro_batches=2)
    assert plan.data["batch_dims"] == [1, 0]
    assert plan.degrees["micro_batch_size"] == BATCH // 2
    # plans made before the field existed cut dim 0
    old = json.loads(plan.to_json())
    del old["batch_dims"]
    assert plan_batch_dims(old, 2) == [0, 0]


def test_data_axis_splits_the_batch_dim_of_a_sequence_first_input():
    plan = _plan(2, dp=2, num_micro_batches=1)
    from autopar.rules.candidates import candidates
    from autopar.frontend.trace import trace

    model, batch = seq_first()
    g = trace(model, batch)
    g.batch_dims = plan.data["batch_dims"]
    c = candidates(g, plan.mesh)
    x = c.nodes[g.input_names[0]].strategies[0].outputs[0]
    assert x.dims == ((), (0,), ()), x       # B (dim 1) over dp, not T


# ------------------------------------------------------------------ invalid counts (no processes)

@pytest.mark.parametrize("constraints, says", [
    ({"num_micro_batches": 100}, "1, 2, 4, 8, 16"),
    ({"num_micro_batches": 3}, "1, 2, 4, 8, 16"),
    ({"num_micro_batches": 3, "dp": 2}, "8 rows per data-parallel rank"),
])
def test_invalid_micro_batch_counts_are_constraint_errors(constraints, says):
    model, batch = ZOO["mlp"]()    # a global batch of 16
    assert batch[0].shape[0] == 16
    with pytest.raises(ConstraintError, match="num_micro_batches") as ei:
        autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2), constraints=constraints)
    assert says in str(ei.value), str(ei.value)


def test_search_only_tries_counts_that_divide():
    from autopar.search.configurations import _micro_choices

    for per_dp in (1, 6, 8, 12, 16):
        for nm in _micro_choices(per_dp, {}):
            assert per_dp % nm == 0
    assert _micro_choices(8, {"num_micro_batches": 3}) == []


# ------------------------------------------------------------------ exactness (processes)

@pytest.mark.slow
def test_sequence_first_two_micro_batches():
    plan = _plan(1, num_micro_batches=2)
    assert plan.degrees["num_micro_batches"] == 2 and plan.data["batch_dims"] == [1, 0]
    E.check(seq_first, plan)


@pytest.mark.slow
def test_sequence_first_data_parallel():
    plan = _plan(2, dp=2, num_micro_batches=1)
    assert plan.degrees["dp"] == 2 and plan.data["batch_dims"] == [1, 0]
    res = E.check(seq_first, plan)
    assert res[0][3] == [0, 1, 2, 3] and res[1][3] == [4, 5, 6, 7]


@pytest.mark.slow
def test_sequence_first_data_parallel_and_micro_batches():
    plan = _plan(2, dp=2, num_micro_batches=2)
    res = E.check(seq_first, plan)
    assert res[0][3] == [0, 1, 4, 5] and res[1][3] == [2, 3, 6, 7]


@pytest.mark.slow
def test_mean_over_the_batch_is_exact_with_micro_batches():
    """An aten.mean loss (mse) over micro-batches: each micro-batch's mean is scaled by 1/nm in
    the program (localize), the step sums."""
    factory = lambda: ZOO["mlp"](loss="mse")  # noqa: E731
    model, batch = factory()
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=1), optimizer="sgd",
                        precision="fp32", constraints={"num_micro_batches": 4})
    E.check(factory, plan)


# ------------------------------------------------------------------ how the loss splits over micro-batches

class Regularized(nn.Module):
    """A mean cross-entropy plus a term that does not depend on the batch (counted once per step)."""

    def __init__(self, how: str = "plain"):
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.how = how

    def forward(self, x, y):
        loss = F.cross_entropy(self.lin(x), y) + 0.1 * self.lin.weight.pow(2).sum()
        if self.how == "sqrt":
            loss = loss.sqrt()       # not linear in the micro-batch shares
        return loss


def regularized(how: str = "plain"):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    return Regularized(how), (torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g))


def _decompose(factory, nm=2):
    from autopar.rules.microbatch import batch_carrying, decompose
    from autopar.frontend.trace import trace

    model, batch = factory()
    dims = infer_batch_dims([x.shape for x in batch])
    full, micro = trace(model, batch), trace(model, tuple(x.narrow(d, 0, x.shape[d] // nm)
                                                          for x, d in zip(batch, dims)))
    return decompose(micro, batch_carrying(full, micro)), micro


def test_decomposition_roles():
    d, g = _decompose(regularized)
    assert d.error is None and d.roles[g.output_name] == "share"
    assert any(d.input_scales.values()), d.input_scales      # the regularizer is scaled by 1/nm
    assert "cross_entropy_loss" in d.reduces_batch
    d, _ = _decompose(lambda: regularized("sqrt"))
    assert d.error and "sqrt" in d.error and "num_micro_batches" in d.error
    d, g = _decompose(seq_first)   # the batch dim is lost from the op letters by MHA's views: shapes still see it
    assert d.error is None and d.reduces_batch == {"cross_entropy_loss"}


def test_value_free_creation_ops_are_the_same_in_every_micro_batch():
    """Hugging Face Mistral builds its sliding-window mask with ``x.new_ones(...)`` of a
    batch-carrying ``x``: the op reads x's dtype and device, not its values, so its output is the
    same in every micro-batch (it was taken for a reduction over the batch, and compile refused
    any plan with micro-batches, pipelines included)."""
    from autopar.models import HF_ZOO
    d, g = _decompose(HF_ZOO["hf_mistral"])
    assert d.error is None and d.roles[g.output_name] == "share", d.error
    assert [n for n in d.roles if n.startswith("new_ones") and d.roles[n] == "same"]


@pytest.mark.slow
def test_hf_mistral_with_micro_batches_equals_eager():
    from autopar.models import HF_ZOO
    model, batch = HF_ZOO["hf_mistral"]()
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2), optimizer="sgd",
                        precision="fp32", constraints={"dp": 2, "num_micro_batches": 2})
    assert plan.degrees["num_micro_batches"] == 2
    E.check(HF_ZOO["hf_mistral"], plan)


@pytest.mark.slow
def test_batch_independent_loss_term_counts_once_with_micro_batches():
    model, batch = regularized()
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=1), optimizer="sgd",
                        precision="fp32", constraints={"num_micro_batches": 2})
    E.check(regularized, plan)


def seq_first_square():
    """Sequence length == batch size: dim 0 and dim 1 of x both have the batch's size."""
    torch.manual_seed(0)
    model = SeqFirst()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(BATCH, BATCH, DIM, generator=g) * torch.linspace(0.2, 3.0, BATCH).view(1, BATCH, 1)
    return model, (x, torch.randint(0, CLASSES, (BATCH,), generator=g))


@pytest.mark.slow
def test_ambiguous_batch_dim_warns_and_the_override_is_used():
    model, batch = seq_first_square()
    cpu1 = autopar.Cluster.preset("cpu", devices=1)
    with pytest.warns(UserWarning, match="batch_dims"):
        plan = autopar.plan(model, batch, cpu1, optimizer="sgd", precision="fp32",
                            constraints={"num_micro_batches": 2})
    assert plan.data["batch_dims"] == [0, 0]
    plan = autopar.plan(model, batch, cpu1, optimizer="sgd", precision="fp32", batch_dims=(1, 0),
                        constraints={"num_micro_batches": 2})
    assert plan.data["batch_dims"] == [1, 0]
    E.check(seq_first_square, plan)
