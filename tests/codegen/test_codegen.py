"""Single-process checks of generated per-rank programs (no process group needed for a 1-device
plan: it has no collectives) and of the printed code of a multi-device plan."""
from __future__ import annotations

import operator
import warnings

import pytest
import torch

import autopar
from autopar.models import ZOO
from autopar.frontend.trace import trace
from codegen import generate, per_rank_code
from codegen.rank_program import block_slices, normalize
from autopar.rules.layout import Layout

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


def _graph_constants(gm, kind):
    from torch.utils import _pytree as pytree

    found = []
    for n in gm.graph.nodes:
        if n.op == "call_function":
            pytree.tree_map_only(kind, found.append, (n.args, n.kwargs))
    return found


def _bf16_program_vs_eager(model, batch, prog):
    ref_model = model.to(torch.bfloat16)
    values = dict(ref_model.named_parameters())
    values.update(dict(ref_model.named_buffers()))
    local = [values[prog.param_fqn[n]].detach() for n in prog.param_names]
    with torch.no_grad():
        return prog.gm(*local, *batch).float().item(), ref_model(*batch).float().item()


def test_program_for_a_gpu_rank_targets_its_device():
    """The CUDA path, checked without a GPU: factory ops traced on the CPU (gpt2's position
    ``arange``) are emitted on the rank's device; the same rewrite targeting the CPU, in bf16,
    reproduces the bf16 eager model's loss exactly."""
    model, batch, plan = _one_device_plan("gpt2")
    traced = trace(model, batch)
    assert torch.device("cpu") in _graph_constants(traced.gm, torch.device)   # something to rewrite
    prog = generate(traced, plan, 0, compute_dtype=torch.bfloat16, device=torch.device("cuda", 3))
    assert set(_graph_constants(prog.gm, torch.device)) == {torch.device("cuda", 3)}
    prog = generate(traced, plan, 0, compute_dtype=torch.bfloat16, device=torch.device("cpu"))
    got, want = _bf16_program_vs_eager(model, batch, prog)
    assert got == want


def test_fp32_dtype_arguments_become_the_working_dtype():
    """A Hugging Face Llama upcasts to fp32 inside RMSNorm and builds fp32 masks: under bf16 those
    dtype arguments are rewritten, so the program runs in bf16 throughout (no dtype mismatch
    between a bf16 weight and an fp32 activation) and its loss is the bf16 model's to bf16 accuracy."""
    pytest.importorskip("transformers")
    from autopar.models import HF_ZOO

    model, batch = HF_ZOO["hf_llama"]()
    plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=1), constraints={"num_micro_batches": 1})
    traced = trace(model, batch)
    assert torch.float32 in _graph_constants(traced.gm, torch.dtype)
    prog = generate(traced, plan, 0, compute_dtype=torch.bfloat16)
    assert torch.float32 not in _graph_constants(prog.gm, torch.dtype)
    got, want = _bf16_program_vs_eager(model, batch, prog)
    assert got == pytest.approx(want, rel=2e-2)
