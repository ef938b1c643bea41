"""codegen.stages.split_step_stages: an inference step's program (a tiny Llama's decode and prefill
steps over an explicit KV cache) cut into pipeline stages at decoder-layer boundaries. Run one
after another in one process, feeding each stage the previous one's sent values, the stages
return exactly the whole program's outputs; each stage reads only its layers' parameters and
cache tensors, returns its layers' cache, and only the hidden states cross a boundary (the
attention mask and rotary cos / sin are recomputed from the step inputs)."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.errors import ExecutionError
from autopar.inference.codegen_stages import unit_stages_of
from autopar.inference.codegen_step import CacheStep, plan_cache_step, step_inputs
from autopar.models import hf
from codegen.per_rank import generate_step
from codegen.stages import even_stages, pipeline_units, split_stages, split_step_stages

B, MAX_LEN, LAYERS = 2, 12, 4


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    lm = hf.hf_llama(seq=32, n_layer=LAYERS)[0].model.eval()
    return CacheStep(lm)


def _program(step, seq):
    ps = plan_cache_step(step, B, seq, MAX_LEN, autopar.Cluster.preset("cpu", devices=1))
    prog = generate_step(ps.traced, ps.plan, 0, state=ps.state, whole=(ps.traced.outputs[0],))
    return ps, prog


def _layer_of(fqn):
    parts = fqn.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else None


def test_even_stages():
    assert even_stages(4, 2) == [0, 0, 1, 1]
    assert even_stages(5, 2) == [0, 0, 0, 1, 1]
    assert even_stages(3, 3) == [0, 1, 2]
    with pytest.raises(ExecutionError):
        even_stages(2, 3)


@pytest.mark.parametrize("seq, pp", [(1, 2), (5, 2), (1, 4)])
def test_stages_chained_equal_the_whole_step(llama, seq, pp):
    ps, prog = _program(llama, seq)
    torch.manual_seed(1)
    inputs = list(step_inputs(llama.lm, B, seq, MAX_LEN))
    inputs[0] = torch.randint(1, 200, (B, seq))
    inputs[4:] = [torch.randn_like(c) for c in inputs[4:]]
    params = {n: ps.traced.value_of(llama, prog.param_fqn[n]) for n in prog.param_names}
    with torch.no_grad():
        want = prog.gm(*params.values(), *inputs)
    unit_stage = even_stages(len(pipeline_units(ps.traced)), pp)
    stages = split_step_stages(prog, ps.traced, unit_stage, pp)
    assert [sp.index for sp in stages] == list(range(pp))
    got, received = {}, []
    n_layer = llama.n_layers
    for sp in stages:
        layers = {u for u in range(n_layer) if unit_stage[u] == sp.index}
        # premise: only this stage's layers' parameters (the embedding on the first, norm and head
        # on the last; the rotary buffer everywhere, each stage computes its cos / sin)
        fqns = [prog.param_fqn[n] for n in sp.param_names]
        assert {_layer_of(f) for f in fqns} - {None} == layers
        assert ("lm.model.embed_tokens.weight" in fqns) == (sp.index == 0)
        assert ("lm.lm_head.weight" in fqns) == (sp.index == pp - 1)
        # its layers' cache tensors in, the same ones out, nothing else of the cache
        cache = [f"kv_{2 * u + j}" for u in sorted(layers) for j in (0, 1)]
        assert [n for n in sp.state_inputs] == cache
        assert sorted(prog.output_names[i] for i in sp.outputs if i) == sorted(prog.state[c] for c in cache)
        assert (0 in sp.outputs) == (sp.index == pp - 1)
        assert sp.received == (stages[sp.index - 1].sent if sp.index else [])
        with torch.no_grad():
            out = sp.gm(*[params[n] for n in sp.param_names], *received,
                        *[inputs[p] for p in sp.input_positions])
        k = len(sp.sent)
        received = list(out[:k])
        if sp.index < pp - 1:
            # only the hidden states [B, seq, hidden] cross the boundary
            assert [tuple(x.shape) for x in received] == [(B, seq, llama.lm.config.hidden_size)]
        else:
            assert k == 0
        got.update(zip(sp.outputs, out[k:]))
    assert sorted(got) == list(range(len(want)))
    for i, w in enumerate(want):
        torch.testing.assert_close(got[i], w, atol=0, rtol=0)


def test_a_training_program_still_needs_its_loss(llama):
    # the step program ends in a tuple of outputs, not a loss: the training split refuses it
    ps, prog = _program(llama, 1)
    with pytest.raises(ExecutionError, match="loss"):
        split_stages(prog, ps.traced, even_stages(LAYERS, 2), 2)


def test_the_cut_of_a_pipelined_plan_of_the_step(llama):
    # the planner pipelines a step only with micro-batches (it prices a training step of frozen
    # parameters); its cut by blocks is what the stage runner can take as unit_stage
    ps = plan_cache_step(llama, B, 1, MAX_LEN, autopar.Cluster.preset("cpu", devices=2),
                         constraints={"pp": 2, "pp_schedule": "gpipe", "dp": 1, "tp": 1})
    cut = unit_stages_of(ps.plan)
    assert len(cut) == LAYERS and cut[0] == 0 and cut[-1] == 1 and cut == sorted(cut)
    with pytest.raises(ValueError, match="pipeline stage"):
        unit_stages_of(_program(llama, 1)[0].plan)
