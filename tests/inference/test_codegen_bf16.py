"""16-bit plans on the codegen backend (autopar/inference/codegen_engine.py, codegen_iteration.py):
a bf16 (or fp16) InferencePlan runs its steps traced, planned and run in that dtype, the model cast
to it in place (an fp32 model, or one already in it), and each rank holds bf16 cache blocks of as
many bytes as the plan's ``kv_cache_bytes_per_rank``. Greedy tokens equal the modules backend's on
the same plan and model, and Hugging Face's ``generate`` on the model cast to the dtype: on one
process (static, fp16 too), on 2 gloo ranks at tp=2 (static, and the continuous engine's staggered
requests against each prompt generated alone) and at pp=2 (static)."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.inference.engine import compile_inference
from autopar.inference.inference_plan import InferencePlan
from autopar.inference.iteration_engine import IterationEngine
from autopar.inference.planner import plan_inference
from runtime.launch import run_local
from tests.helpers.serving import generate_alone
from tests.inference.test_codegen_engine import MASK, NEW, PROMPTS, _model
from tests.inference.test_codegen_iteration import MAX_NEW, PROMPT_LEN, REQUESTS, SLOTS, _serve
from tests.inference.test_codegen_iteration import _plan as _rows_plan
from tests.inference.test_codegen_iteration import _model as _spread_model

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops
TORCH = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _plan(world, dtype="bf16", **pins):
    cl = autopar.Cluster.preset("cpu", devices=world)
    return plan_inference(_model("hf_llama"), PROMPTS, cl, max_new_tokens=NEW, constraints=pins, dtype=dtype)


def _reference(dtype):
    """Hugging Face's greedy ``generate`` on the model cast to ``dtype``."""
    with torch.no_grad():
        return _model("hf_llama").to(TORCH[dtype]).generate(PROMPTS, attention_mask=MASK, max_new_tokens=NEW,
                                                            do_sample=False, pad_token_id=0).tolist()


def _static(plan, model):
    """The codegen engine's tokens, its cache blocks' dtypes and bytes, and the modules backend's
    tokens on the same plan."""
    engine = compile_inference(model, plan=plan, backend="codegen")
    tokens = engine.generate(PROMPTS, NEW, attention_mask=MASK).tolist()
    cache = engine.runner.cache
    modules = compile_inference(_model("hf_llama"), plan=plan).generate(PROMPTS, NEW, attention_mask=MASK)
    return {"tokens": tokens, "modules": modules.tolist(), "kv": engine.kv_cache_bytes(),
            "held": sum(c.numel() * c.element_size() for c in cache), "dtypes": {c.dtype for c in cache},
            "params": {p.dtype for p in engine.model.parameters()}}


def _check_static(got, plan, dtype):
    assert got["tokens"] == got["modules"] == _reference(dtype)
    assert got["dtypes"] == got["params"] == {TORCH[dtype]}
    assert got["kv"] == got["held"] == plan.kv_cache_bytes_per_rank > 0


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_one_process_16_bit_plan_equals_the_modules_backend_and_hf(dtype):
    plan = _plan(1, dtype)
    assert plan.dtype == dtype
    _check_static(_static(plan, _model("hf_llama")), plan, dtype)


def test_a_model_already_in_bf16_runs_as_one_cast_by_the_engine():
    plan = _plan(1)
    _check_static(_static(plan, _model("hf_llama").to(torch.bfloat16)), plan, "bf16")


def _static_rank(rank, world, plan_json):
    return _static(InferencePlan.from_json(plan_json), _model("hf_llama"))


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_2_ranks_bf16_equals_the_modules_backend_and_hf(tp, pp):
    """tp=2 (the row-parallel matmuls all-reduced in bf16) and pp=2 (bf16 hidden states sent
    between the stages; each stage's cache blocks its layers', as priced)."""
    plan = _plan(2, tp=tp, pp=pp, dp=1)
    assert (plan.tp, plan.pp, plan.dtype) == (tp, pp, "bf16")
    for got in run_local(_static_rank, 2, args=(plan.to_json(),), timeout=600):
        _check_static(got, plan, "bf16")


def _iteration_plan(devices, **pins):
    return _rows_plan(devices, dtype="bf16", **pins)


def _iteration_rank(rank, world, plan_json):
    plan = InferencePlan.from_json(plan_json)
    engine = IterationEngine.from_plan(_spread_model(), plan, backend="codegen")
    seqs, most = _serve(engine)
    modules = _serve(IterationEngine.from_plan(_spread_model(), plan))[0]
    cache = engine.runner.new_cache()
    return ([s.tokens for s in seqs], [s.tokens for s in modules], most, engine.calls, engine.kv_cache_bytes(),
            {c.dtype for c in cache})


@pytest.mark.slow
def test_tp2_continuous_bf16_equals_the_modules_engine_and_generate_alone():
    plan = _iteration_plan(2, tp=2)
    assert (plan.tp, plan.pp, plan.dtype) == (2, 1, "bf16")
    model = _spread_model().to(torch.bfloat16)
    wants = [generate_alone(model, p, n) for p, n, _ in REQUESTS]
    cfg = model.config
    whole = 2 * cfg.num_hidden_layers * SLOTS * cfg.num_key_value_heads * (PROMPT_LEN + MAX_NEW) \
        * (cfg.hidden_size // cfg.num_attention_heads) * 2
    for tokens, modules, most, calls, held, dtypes in run_local(_iteration_rank, 2, args=(plan.to_json(),),
                                                                 timeout=600):
        assert tokens == modules == wants and most >= 2
        assert calls[1] > 0 and calls[PROMPT_LEN] == len(REQUESTS)   # premise: the programs ran
        assert dtypes == {torch.bfloat16} and held == whole // 2      # each rank its kv heads, in bf16


def test_a_meta_model_reads_an_fp32_checkpoint_into_bf16_blocks(tmp_path):
    """A model built on the meta device, its parameter blocks read from an fp32 checkpoint: cast
    to the plan's bf16 as they are read (and its rotary buffers, computed, too)."""
    from autopar.models.hf_config import from_hf_config
    _model("hf_llama").save_pretrained(tmp_path)
    plan = _plan(1)
    meta = from_hf_config(str(tmp_path), seq=16, batch=1)
    engine = compile_inference(meta, plan=plan, weights=str(tmp_path), backend="codegen")
    assert engine.generate(PROMPTS, NEW, attention_mask=MASK).tolist() == _reference("bf16")
    assert {c.dtype for c in engine.runner.cache} == {torch.bfloat16}
    assert {b.dtype for blocks in engine.runner.params.values() for b in blocks if b.is_floating_point()} \
        == {torch.bfloat16}
