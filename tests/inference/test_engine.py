"""The generation engine (autopar/inference/engine.py): greedy tokens equal Hugging Face's own
``generate`` (same config, same weights) for prompts of different lengths in one batch, under
tp=2 and dp=2 on gloo processes and on one process; the KV cache each rank allocates is the plan's
bytes; what a plan cannot run is a clear error."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.errors import PlanError
from autopar.inference.engine import compile_inference
from autopar.inference.inference_plan import InferencePlan
from autopar.inference.planner import plan_inference
from autopar.inference.tp_shard import shard_for_tp
from autopar.models import hf
from runtime.launch import run_local

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops
PROMPTS = torch.tensor([[0, 0, 0, 5, 6, 7], [9, 10, 11, 12, 13, 14], [0, 40, 41, 42, 43, 44]])
MASK = (PROMPTS != 0).long()
NEW = 5


def _model(name):
    torch.manual_seed(0)
    return getattr(hf, name)(vocab=64)[0].model.eval()


def _reference(name):
    m = _model(name)
    with torch.no_grad():
        return m.generate(PROMPTS, attention_mask=MASK, max_new_tokens=NEW, do_sample=False, pad_token_id=0)


def _plan(name, world, **pins):
    cl = autopar.Cluster.preset("cpu", devices=world)
    return plan_inference(_model(name), PROMPTS, cl, max_new_tokens=NEW, constraints=pins, dtype="fp32")


SAMPLED = {"temperature": 0.9, "top_p": 0.95, "seed": 3}


def _run(rank, world, name, plan_json, sampling=None):
    plan = InferencePlan.from_json(plan_json)
    engine = compile_inference(_model(name), plan=plan)
    out = engine.generate(PROMPTS, NEW, attention_mask=MASK, sampling=sampling)
    return out.tolist(), engine.kv_cache_bytes(), engine.last_timing["new_tokens"]


def test_one_process_equals_hf_generate():
    plan = _plan("hf_llama", 1)
    engine = compile_inference(_model("hf_llama"), plan=plan)
    out = engine.generate(PROMPTS, NEW, attention_mask=MASK)
    assert out.tolist() == _reference("hf_llama").tolist()
    assert engine.kv_cache_bytes() == plan.kv_cache_bytes_per_rank > 0
    assert engine.last_timing["new_tokens"] == NEW and engine.last_timing["prefill_s"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_llama", "hf_gpt2", "hf_mistral", "hf_qwen2", "hf_mixtral"])
def test_tp2_equals_hf_generate(name):
    plan = _plan(name, 2, tp=2)
    assert plan.tp == 2
    results = run_local(_run, 2, args=(name, plan.to_json()), timeout=300)
    want = _reference(name).tolist()
    for out, kv, _ in results:
        assert out == want
        assert kv == plan.kv_cache_bytes_per_rank


@pytest.mark.slow
@pytest.mark.parametrize("name, world, pins", [("hf_gpt2", 2, {"pp": 2}), ("hf_mistral", 2, {"pp": 2}),
                                               ("hf_llama", 4, {"pp": 2, "tp": 2}),
                                               ("hf_qwen2", 4, {"pp": 2, "tp": 1})])
def test_pipelined_generation_equals_hf_generate(name, world, pins):
    """pp=2 alone (GPT-2: tied head; Mistral: sliding-window layers), with tp=2, and with dp=2
    replicas: the tokens of one process, every stage holding the KV cache of its layers only."""
    plan = _plan(name, world, **pins)
    assert plan.pp == 2 and plan.stages == [[0, 1], [1, 2]]
    results = run_local(_run, world, args=(name, plan.to_json()), timeout=300)
    for out, kv, _ in results:
        assert out == _reference(name).tolist()
        assert kv == plan.kv_cache_bytes_per_rank   # the planner's bytes of one stage's layers


@pytest.mark.slow
def test_dp2_replicas_each_decode_their_rows():
    plan = _plan("hf_llama", 2, tp=1)
    assert (plan.dp, plan.batch_size) == (2, 2)
    results = run_local(_run, 2, args=("hf_llama", plan.to_json()), timeout=300)
    for out, kv, _ in results:
        assert out == _reference("hf_llama").tolist()
        assert kv == plan.kv_cache_bytes_per_rank


def test_tp_shards_really_split_the_weights():
    m = _model("hf_llama")
    full = m.model.layers[0].self_attn.q_proj.weight.shape
    vocab = m.lm_head.weight.shape[0]
    done = shard_for_tp(m, 0, 2, lambda t: t, all_gather=lambda t: torch.cat([t, t], dim=-1))
    assert m.model.layers[0].self_attn.q_proj.weight.shape == (full[0] // 2, full[1])
    assert done["model.layers.0.self_attn.o_proj"] == "rowwise"
    assert done["lm_head"] == "colwise_gather_output" and m.lm_head.weight.shape[0] == vocab // 2
    tied = _model("hf_qwen2")                  # a head tied to the embeddings stays whole
    assert "lm_head" not in shard_for_tp(tied, 0, 2, lambda t: t, all_gather=lambda t: t)
    assert m.config.num_attention_heads == 2 and m.config.num_key_value_heads == 1


def test_what_the_plan_cannot_run_is_a_clear_error():
    plan = _plan("hf_llama", 1)
    engine = compile_inference(_model("hf_llama"), plan=plan)
    with pytest.raises(PlanError, match="prompt length"):
        engine.generate(torch.ones(1, plan.prompt_len + 1, dtype=torch.long), 2)
    with pytest.raises(PlanError, match="KV cache holds no more"):
        engine.generate(PROMPTS, NEW + 1)
    with pytest.raises(PlanError, match="processes"):
        compile_inference(_model("hf_llama"), plan=InferencePlan(pp=2, tp=1, dp=1, prompt_len=6, max_new_tokens=2,
                                                                 batch_size=1, stages=[[0, 1], [1, 2]]))
    with pytest.raises(PlanError, match="processes"):
        compile_inference(_model("hf_llama"), plan=InferencePlan(tp=2, prompt_len=6, max_new_tokens=2, batch_size=1))
    with pytest.raises(PlanError, match="heads"):
        shard_for_tp(_model("hf_llama"), 0, 3, lambda t: t)
    assert not dist.is_initialized()


def _save(name, directory):
    _model(name).save_pretrained(directory)   # safetensors
    return str(directory)


def _run_from_dir(rank, world, name, plan_json, directory):
    from autopar.models.hf_config import from_hf_config
    plan = InferencePlan.from_json(plan_json)
    meta = from_hf_config(directory, seq=16, batch=1)          # parameters on the meta device
    engine = compile_inference(meta, plan=plan, weights=directory)
    out = engine.generate(PROMPTS, NEW, attention_mask=MASK)
    return out.tolist(), engine.read.elements


@pytest.mark.slow
@pytest.mark.parametrize("name, pins", [("hf_llama", {"tp": 2}), ("hf_gpt2", {"tp": 2}), ("hf_llama", {"pp": 2})])
def test_meta_model_from_a_checkpoint_directory_reads_only_its_shards(name, pins, tmp_path):
    directory = _save(name, tmp_path / name)
    plan = _plan(name, 2, **pins)
    results = run_local(_run_from_dir, 2, args=(name, plan.to_json(), directory), timeout=300)
    full = sum(p.numel() for p in _model(name).parameters())
    for out, read in results:
        assert out == _reference(name).tolist()
        assert read < full          # each rank read its blocks (tp) or its stage's layers (pp), not every tensor


@pytest.mark.slow
def test_tp2_samples_what_one_process_samples_with_the_same_seed():
    one = _run(0, 1, "hf_llama", _plan("hf_llama", 1).to_json(), SAMPLED)[0]
    greedy = _reference("hf_llama").tolist()
    assert one != greedy                                     # it really sampled
    results = run_local(_run, 2, args=("hf_llama", _plan("hf_llama", 2, tp=2).to_json(), SAMPLED), timeout=300)
    assert [r[0] for r in results] == [one, one]


def test_bad_sampling_options_are_clear_errors():
    engine = compile_inference(_model("hf_llama"), plan=_plan("hf_llama", 1))
    with pytest.raises(PlanError, match="not known"):
        engine.generate(PROMPTS, 2, attention_mask=MASK, sampling={"temp": 1})
    with pytest.raises(PlanError, match="top_p"):
        engine.generate(PROMPTS, 2, attention_mask=MASK, sampling={"temperature": 1, "top_p": 2})
