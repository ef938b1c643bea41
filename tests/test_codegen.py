"""Single-process checks of generated per-rank programs (no process group needed for a 1-device
plan: it has no collectives) and of the printed code of a multi-device plan."""
from __future__ import annotations

import operator
import warnings

import pytest
import torch

import autopar
from autopar.models import ZOO
from autopar.trace import trace
from codegen import generate, per_rank_code
from codegen.per_rank import block_slices, normalize
from autopar.layout import Layout

warnings.filterwarnings("ignore", message="autopar: no sharding rule")


def _one_device_plan(name):
    model, batch = ZOO[name]()
    cluster = autopar.Cluster.preset("cpu", devices=1)
    return model, batch, autopar.plan(model, batch, cluster, constraints={"num_micro_batches": 1})


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "vit", "mlp"])
def test_one_device_program_reproduces_loss_and_grads(name):
    model, batch, plan = _one_device_plan(name)
    traced = trace(model, batch)
    prog = generate(traced, plan, 0)
    assert "runtime_context" not in prog.code          # one device: no collectives at all
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    local = [params[prog.param_fqn[n]].detach().clone().requires_grad_(n not in prog.buffers)
             for n in prog.param_names]
    loss = prog.gm(*local, *batch)
    ref = model(*batch)
    assert loss.item() == ref.item()
    loss.backward()
    ref.backward()
    for n, t in zip(prog.param_names, local):
        if n not in prog.buffers:
            torch.testing.assert_close(t.grad, params[prog.param_fqn[n]].grad, rtol=1e-6, atol=1e-7)


def test_tensor_parallel_code_prints_collectives():
    model, batch = ZOO["gpt2"]()
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2),
                        constraints={"tp": 2, "num_micro_batches": 1})
    code = per_rank_code(plan, 1, "gpt2")
    assert "def forward(self" in code and "rank 1 of mesh" in code
    assert "all_reduce" in code                      # the row-parallel linear's partial sum
    assert "axis = 1" in code                        # collectives name their mesh axis
    prog = generate(trace(model, batch), plan, 1)
    # column-parallel weights are this rank's half of the rows
    for fqn, lay in prog.param_layouts.items():
        if lay.dims and lay.dims[0] == (1,):
            sl = prog.param_slices[fqn][0]
            assert sl.start == sl.stop - sl.start    # second block of two
    ops = [n.target for n in prog.gm.graph.nodes if n.op == "call_function"]
    assert operator.getitem in ops


def test_data_parallel_params_leave_grads_partial_over_dp():
    model, batch = ZOO["gpt2"]()
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2),
                        constraints={"dp": 2, "tp": 1, "num_micro_batches": 1})
    prog = generate(trace(model, batch), plan, 0)
    # every block parameter is only used on the split batch: summed by the reducer, no copy
    assert prog.grad_partial_axes["blocks.0.fc.weight"] == (0,)
    # the position embedding feeds a replicated (batch-free) lookup: its grad is completed in-graph
    assert prog.grad_partial_axes["wpe.weight"] == ()
    assert prog.loss_layout.partial == (0,)
    assert prog.input_layouts[0].dims[0] == (0,)


def test_layout_helpers():
    lay = Layout(((0, 1), ()), ())
    assert block_slices(lay, (8, 3), (2, 2), (1, 0)) == (slice(4, 6), slice(0, 3))
    assert normalize(Layout(((0, 1),), (0,)), (1, 2)) == Layout(((1,),), ())
