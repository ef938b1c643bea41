"""Issue 34's generation matrix: GPT-2, Llama, Mistral, Qwen2 and Mixtral (tiny configs) x tp=2,
tp=4, pp=2 and tp=2 x pp=2 on gloo processes. In every cell both inference backends, the modules
one (``compile_inference(model, plan=plan)``) and the codegen one (``backend="codegen"``), compiled
from the same InferencePlan on each rank, generate the same batch of prompts of different lengths
(left-padded, with an attention mask): on every rank both backends' greedy tokens equal one
process's Hugging Face ``generate`` (same config, same weights), and each engine's KV cache holds
the plan's ``kv_cache_bytes_per_rank`` (the codegen one's cache blocks as many bytes).

Configs that would not split: at tp=4 the grouped-query models get 4 kv heads (their tiny default,
2, does not divide by 4); Mistral's sliding window is 16, longer than the cache (6 prompt + 5 new
positions), which the codegen backend requires (a shorter window it refuses, naming the modules
backend: test_codegen_engine.py; the modules backend's sliding window itself: test_engine.py)."""
from __future__ import annotations

import pytest
import torch

from autopar.inference.engine import compile_inference
from autopar.inference.inference_plan import InferencePlan
from runtime.launch import run_local
from tests.inference.test_codegen_engine import MASK, NEW, PROMPTS, _model, _plan, _premise, _reference

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops

MODELS = ["hf_gpt2", "hf_llama", "hf_mistral", "hf_qwen2", "hf_mixtral"]
LAYOUTS = {"tp2": {"tp": 2, "pp": 1}, "tp4": {"tp": 4, "pp": 1}, "pp2": {"tp": 1, "pp": 2},
           "tp2xpp2": {"tp": 2, "pp": 2}}


def _kwargs(name, tp):
    kw = {"window": 16} if name == "hf_mistral" else {}
    if tp == 4 and name != "hf_gpt2":   # GPT-2's 4 heads split 4 ways as they are
        kw["n_kv_heads"] = 4
    return kw


def _run(rank, world, name, plan_json, kw):
    plan = InferencePlan.from_json(plan_json)
    codegen = _premise(compile_inference(_model(name, **kw), plan=plan, backend="codegen"))
    modules = compile_inference(_model(name, **kw), plan=plan)
    tokens = modules.generate(PROMPTS, NEW, attention_mask=MASK).tolist()
    return codegen, {"tokens": tokens, "kv": modules.kv_cache_bytes()}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", MODELS)
def test_both_backends_equal_hf_generate(name, layout):
    pins = LAYOUTS[layout]
    tp, pp = pins["tp"], pins["pp"]
    world, kw = tp * pp, _kwargs(name, pins["tp"])
    plan = _plan(name, world, kw, dp=1, **pins)
    assert (plan.tp, plan.pp, plan.dp, plan.world_size) == (tp, pp, 1, world)       # the layout really happened
    assert pp == 1 or plan.stages == [[0, 1], [1, 2]]                            # two stages of a layer each
    want = _reference(name, **kw).tolist()
    cfg = _model(name, **kw).config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    results = run_local(_run, world, args=(name, plan.to_json(), kw), timeout=900)
    assert len(results) == world
    for rank, (codegen, modules) in enumerate(results):
        assert codegen["tokens"] == want, f"codegen rank {rank}"
        assert modules["tokens"] == want, f"modules rank {rank}"
        assert modules["kv"] == plan.kv_cache_bytes_per_rank > 0
        assert codegen["kv"] == codegen["held"] == plan.kv_cache_bytes_per_rank
        assert codegen["block_heads"] == [kv_heads // tp]                   # its kv heads of the cache
        assert codegen["runner"] and codegen["forward_calls"] == 0          # its programs ran, not the model
        assert codegen["stage"] == rank // tp                                # stage-major ranks
