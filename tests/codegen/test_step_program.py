"""codegen.per_rank.generate_step: an inference step's per-rank program returns every output
with its plan layout (the logits gathered whole on request) and takes its state (a cache) as this
rank's block in the layout the step leaves it, so the state never moves between steps."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.frontend.trace import trace_step
from codegen.per_rank import generate_step
from codegen.rank_program import StepProgram, block_shape, block_slices
from runtime.launch import run_local

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops
B, H, SLOTS, HD = 2, 4, 6, 2


class CacheModel(nn.Module):
    """A head-split projection written into a cache [B, H, SLOTS, HD] at ``pos``, read back over
    all slots and projected out: (y, new_cache)."""

    def __init__(self):
        super().__init__()
        self.k = nn.Linear(8, H * HD, bias=False)
        self.o = nn.Linear(H * HD, 8, bias=False)

    def forward(self, x, pos, cache):
        k = self.k(x).view(x.shape[0], H, 1, HD)
        cache = cache.index_copy(2, pos, k)
        return self.o(cache.sum(2).reshape(x.shape[0], H * HD)), cache


def _step(seed=0):
    torch.manual_seed(seed)
    return CacheModel(), (torch.randn(B, 8), torch.tensor([2]), torch.zeros(B, H, SLOTS, HD))


def _plan(model, inputs, devices):
    traced = trace_step(model, inputs)
    cluster = autopar.Cluster.preset("cpu", devices=devices)
    constraints = {"tp": devices, "dp": 1} if devices > 1 else {}
    plan = autopar.plan(model, inputs, cluster, traced=traced, constraints=constraints, policy="megatron",
                        batch_dims=(0, None, 0))
    return traced, plan


def _params(prog, traced, model):
    return [prog.block_of(prog.param_fqn[n], traced.value_of(model, prog.param_fqn[n])) for n in prog.param_names]


def test_one_device_step_program_returns_every_output():
    model, inputs = _step()
    traced, plan = _plan(model, inputs, 1)
    prog = generate_step(traced, plan, 0, state={"cache": traced.outputs[1]})
    assert isinstance(prog, StepProgram) and prog.output_names == traced.outputs
    assert all(lay.is_replicated() for lay in prog.output_layouts)
    with torch.no_grad():
        got = prog.gm(*_params(prog, traced, model), *inputs)
        want = model(*inputs)
    assert len(got) == 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_unknown_state_or_output_names_are_refused():
    model, inputs = _step()
    traced, plan = _plan(model, inputs, 1)
    with pytest.raises(ValueError, match="not an input/output"):
        generate_step(traced, plan, 0, state={"nope": traced.outputs[1]})
    with pytest.raises(ValueError, match="not an input/output"):
        generate_step(traced, plan, 0, whole=("nope",))


def _rank(rank, world, model, traced, plan, inputs):
    from runtime import context as RC

    RC.setup(plan.mesh)
    prog = generate_step(traced, plan, rank, state={"cache": traced.outputs[1]}, whole=(traced.outputs[0],))
    lay = prog.input_layouts[prog.input_names.index("cache")]
    block = torch.zeros(prog.input_block_shape("cache"))
    x, pos, _ = inputs
    with torch.no_grad():
        y, cache = prog.gm(*_params(prog, traced, model), x, pos, block)
        y2, cache2 = prog.gm(*_params(prog, traced, model), x * 2, pos + 1, cache)   # the block fed back
    return (y, y2, cache2, block_slices(lay, (B, H, SLOTS, HD), prog.mesh_shape, prog.coords),
            prog.output_layouts, lay, prog.code, block_shape(lay, (B, H, SLOTS, HD), prog.mesh_shape))


@pytest.mark.slow
def test_tp2_state_stays_split_per_rank_and_outputs_equal_one_process():
    model, inputs = _step()
    traced, plan = _plan(model, inputs, 2)
    x, pos, cache = inputs
    with torch.no_grad():
        y, cache1 = model(x, pos, cache)
        y2, cache2 = model(x * 2, pos + 1, cache1)
    out = run_local(_rank, 2, args=(model, traced, plan, inputs), timeout=300)
    for rank in range(2):
        got_y, got_y2, got_cache, sl, out_layouts, in_layout, code, shape = out[rank]
        assert out_layouts[0].is_replicated() and out_layouts[1] == in_layout
        assert in_layout.dims[1] and shape == (B, H // 2, SLOTS, HD)   # the plan splits the cache's heads
        assert got_cache.shape == (B, H // 2, SLOTS, HD)                 # this rank's heads only
        torch.testing.assert_close(got_cache, cache2[sl])
        torch.testing.assert_close(got_y, y)
        torch.testing.assert_close(got_y2, y2)
        assert "index_copy.default(cache," in code and "slice_block(cache" not in code
        assert "all_gather(index_copy" not in code
        # the projection out of the split heads: row-parallel (its partial sums reduced) or, as the
        # step's outputs are planned as no partial sums, column-parallel on its input gathered
        assert "all_reduce" in code or "reduce_scatter" in code or "all_gather(reshape" in code
