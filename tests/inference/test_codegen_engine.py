"""compile_inference(..., backend="codegen") (autopar/inference/codegen_engine.py): the static
engine run as autopar's own per-rank programs. On gloo ranks at tp=2 (Llama, Qwen2, Mixtral, and
Mistral whose sliding window is longer than the cache), tp=4, pp=2 and tp=2 x pp=2, and on one
process, greedy tokens for prompts of different lengths equal Hugging Face's ``generate`` and the
modules backend's; sampled tokens (tp=2, pp=2, one process) equal the modules backend's for the
same seed; the programs really ran (a ``StepRunner``, or a ``StageStepRunner`` under pp, with its
prefill and decode programs, the model's own forward never called) with each rank holding its kv
heads of its layers' cache, as many bytes as the InferencePlan's ``kv_cache_bytes_per_rank``;
``weights=`` reads the parameter blocks from a checkpoint; what the backend cannot run is a clear
error naming what would (a fused qkv projection the steps do not split by heads, whose planned
cache stays whole on every rank, and a sliding window shorter than the cache, among them); GPT-2's
own fused qkv is tests/inference/test_codegen_gpt2.py's."""
from __future__ import annotations


import pytest
import torch

import autopar
from autopar.errors import PlanError
from autopar.inference.codegen_stages import StageStepRunner
from autopar.inference.codegen_step import StepRunner
from autopar.inference.engine import compile_inference
from autopar.inference.inference_plan import InferencePlan
from autopar.inference.planner import plan_inference
from autopar.models import hf
from runtime.launch import run_local

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops
PROMPTS = torch.tensor([[0, 0, 0, 5, 6, 7], [9, 10, 11, 12, 13, 14], [0, 40, 41, 42, 43, 44]])
MASK = (PROMPTS != 0).long()
NEW = 5


def _model(name, **kw):
    torch.manual_seed(0)
    return getattr(hf, name)(vocab=64, **kw)[0].model.eval()


def _reference(name, **kw):
    with torch.no_grad():
        return _model(name, **kw).generate(PROMPTS, attention_mask=MASK, max_new_tokens=NEW, do_sample=False,
                                           pad_token_id=0)


def _plan(name, world, kw=None, **pins):
    cl = autopar.Cluster.preset("cpu", devices=world)
    return plan_inference(_model(name, **(kw or {})), PROMPTS, cl, max_new_tokens=NEW, constraints=pins, dtype="fp32")


def _premise(engine):
    """What ran: the runner's programs and cache blocks, the model's forward calls during generate."""
    calls = []
    engine.model.register_forward_pre_hook(lambda *a: calls.append(1))
    out = engine.generate(PROMPTS, NEW, attention_mask=MASK)
    runner = engine.runner
    codes = [p.code for p in runner.programs.values()]
    runs = StageStepRunner if engine.plan.pp > 1 else StepRunner
    return {"tokens": out.tolist(), "kv": engine.kv_cache_bytes(), "runner": isinstance(runner, runs),
            "cache_tensors": len(runner.cache), "stage": getattr(runner, "stage", 0),
            "lengths": sorted(runner.programs), "forward_calls": len(calls),
            "held": sum(c.numel() * c.element_size() for c in runner.cache),
            "block_heads": sorted({c.shape[1] for c in runner.cache}),
            "collectives": all(any(op in c for op in ("all_reduce", "reduce_scatter", "all_gather")) for c in codes)}


def _run(rank, world, name, plan_json, kw):
    plan = InferencePlan.from_json(plan_json)
    got = _premise(compile_inference(_model(name, **kw), plan=plan, backend="codegen"))
    modules = compile_inference(_model(name, **kw), plan=plan).generate(PROMPTS, NEW, attention_mask=MASK)
    return got, modules.tolist()


def _check(results, plan, want, kv_heads):
    for got, modules in results:
        assert got["tokens"] == want == modules
        assert got["runner"] and got["lengths"] == [1, plan.prompt_len] and got["forward_calls"] == 0
        assert got["kv"] == got["held"] == plan.kv_cache_bytes_per_rank > 0
        assert got["block_heads"] == [kv_heads // plan.tp]            # each rank its kv heads of the cache
        assert got["collectives"] or plan.tp == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_llama", "hf_qwen2", "hf_mixtral"])
def test_tp2_equals_hf_generate_and_the_modules_backend(name):
    plan = _plan(name, 2, tp=2, pp=1, dp=1)
    assert plan.tp == 2 and plan.world_size == 2
    results = run_local(_run, 2, args=(name, plan.to_json(), {}), timeout=600)
    cfg = _model(name).config
    _check(results, plan, _reference(name).tolist(), getattr(cfg, "num_key_value_heads", cfg.num_attention_heads))


def linear_qkv(gpt2):
    """``gpt2`` with each fused ``c_attn`` Conv1D an ``nn.Linear`` computing the same: a fused qkv
    projection autopar/inference/fused_qkv.py does not split (it proves only GPT-2's Conv1D)."""
    for block in gpt2.transformer.h:
        conv = block.attn.c_attn
        linear = torch.nn.Linear(*conv.weight.shape)
        with torch.no_grad():
            linear.weight.copy_(conv.weight.t())
            linear.bias.copy_(conv.bias)
        block.attn.c_attn = linear
    return gpt2


def _compile_error(rank, world, name, plan_json):
    try:
        compile_inference(linear_qkv(_model(name)), plan=InferencePlan.from_json(plan_json), backend="codegen")
    except PlanError as e:
        return str(e)


@pytest.mark.slow
def test_a_cache_the_steps_plan_keeps_whole_is_refused():
    """A fused qkv projection the steps do not split (GPT-2 whose ``c_attn`` is an ``nn.Linear``) at
    tp=2 leaves the planned cache whole on every rank, twice what the InferencePlan priced: refused,
    naming the modules backend (which splits its heads)."""
    plan = _plan("hf_gpt2", 2, tp=2, pp=1, dp=1)
    for msg in run_local(_compile_error, 2, args=("hf_gpt2", plan.to_json()), timeout=600):
        assert f"hold {2 * plan.kv_cache_bytes_per_rank} bytes" in msg and 'backend="modules"' in msg


@pytest.mark.slow
def test_tp4_with_four_kv_heads():
    kw = {"n_kv_heads": 4}
    plan = _plan("hf_llama", 4, kw, tp=4, pp=1, dp=1)
    assert plan.tp == 4
    results = run_local(_run, 4, args=("hf_llama", plan.to_json(), kw), timeout=600)
    _check(results, plan, _reference("hf_llama", **kw).tolist(), 4)


def test_one_process_equals_hf_generate():
    plan = _plan("hf_llama", 1)
    engine = compile_inference(_model("hf_llama"), plan=plan, backend="codegen")
    got = _premise(engine)
    modules = compile_inference(_model("hf_llama"), plan=plan).generate(PROMPTS, NEW, attention_mask=MASK)
    _check([(got, modules.tolist())], plan, _reference("hf_llama").tolist(), 2)
    # again on the same engine: fewer rows than the batch, shorter prompts, fewer new tokens
    ids, mask = PROMPTS[1:, 2:], MASK[1:, 2:]
    with torch.no_grad():
        want = _model("hf_llama").generate(ids, attention_mask=mask, max_new_tokens=NEW - 2, do_sample=False,
                                           pad_token_id=0)
    assert engine.generate(ids, NEW - 2, attention_mask=mask).tolist() == want.tolist()
    assert engine.last_timing["new_tokens"] == NEW - 2


def test_planned_by_compile_inference_for_what_it_runs():
    """Without a plan, compile_inference plans one the backend runs: fp32, dp=1."""
    cl = autopar.Cluster.preset("cpu", devices=1)
    engine = compile_inference(_model("hf_llama"), cl, backend="codegen", example_prompt=PROMPTS, max_new_tokens=NEW)
    assert (engine.plan.dtype, engine.plan.pp, engine.plan.dp) == ("fp32", 1, 1)
    assert engine.generate(PROMPTS, NEW, attention_mask=MASK).tolist() == _reference("hf_llama").tolist()


def _run_from_dir(rank, world, plan_json, directory):
    from autopar.models.hf_config import from_hf_config
    meta = from_hf_config(directory, seq=16, batch=1)          # parameters on the meta device
    engine = compile_inference(meta, plan=InferencePlan.from_json(plan_json), weights=directory, backend="codegen")
    return engine.generate(PROMPTS, NEW, attention_mask=MASK).tolist(), engine.read.elements


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_weights_from_a_checkpoint_directory(tmp_path, tp, pp):
    """tp=2, or pp=2 (each stage reading its layers' blocks only)."""
    check_from_dir("hf_llama", tmp_path, tp=tp, pp=pp)


def check_from_dir(name, directory, **pins):
    """``name`` saved to ``directory`` and run on 2 gloo ranks under ``pins`` from it: tokens equal
    ``generate``, each rank reading its blocks, not the whole checkpoint."""
    _model(name).save_pretrained(directory)
    plan = _plan(name, 2, dp=1, **pins)
    results = run_local(_run_from_dir, 2, args=(plan.to_json(), str(directory)), timeout=600)
    total = sum(p.numel() for p in _model(name).parameters())
    for tokens, elements in results:
        assert tokens == _reference(name).tolist()
        assert 0 < elements < total


def test_what_the_backend_cannot_run_is_a_clear_error():
    lm = _model("hf_llama")
    base = dict(prompt_len=6, max_new_tokens=2, batch_size=1, dtype="fp32", cluster={"name": "cpu"})
    with pytest.raises(PlanError, match="backend='bogus' is not known"):
        compile_inference(lm, plan=InferencePlan(**base), backend="bogus")
    with pytest.raises(PlanError, match="pp=2 but 1 stages"):
        compile_inference(lm, plan=InferencePlan(pp=2, stages=[[0, 2]], **base), backend="codegen")
    with pytest.raises(PlanError, match="runs on 2 processes.*launch 2"):
        compile_inference(lm, plan=InferencePlan(pp=2, stages=[[0, 1], [1, 2]], **base), backend="codegen")
    with pytest.raises(PlanError, match='runs fp32, bf16, fp16 \\(the plan is fp8\\).*backend="modules"'):
        compile_inference(lm, plan=InferencePlan(**{**base, "dtype": "fp8"}), backend="codegen")
    with pytest.raises(PlanError, match=r"cache of 10 positions.*sliding window of 8 positions, shorter than the "
                                        r"cache's 10.*backend=\"modules\""):
        compile_inference(_model("hf_mistral"), plan=InferencePlan(**{**base, "max_new_tokens": 4}), backend="codegen")
    engine = compile_inference(lm, plan=InferencePlan(**base), backend="codegen")
    lm.generation_config.min_p = 0.1
    with pytest.raises(PlanError, match=r"temperature, top_k and top_p only.*\['min_p'\].*backend=\"modules\""):
        engine.generate(PROMPTS[:1], 2, sampling={"temperature": 0.7, "seed": 1})
    lm.generation_config.min_p = None
    lm.generation_config.repetition_penalty = 1.3
    with pytest.raises(PlanError, match="repetition_penalty"):
        engine.generate(PROMPTS[:1], 2)


@pytest.mark.parametrize("eos", [[15, 40], [15, 40, 29]])
def test_rows_stop_at_end_of_sequence_as_hf_generate(eos):
    """Rows that chose an end-of-sequence token continue with 0; once all have, generation ends
    (narrower output): as Hugging Face's ``generate`` and the modules backend."""
    plan = _plan("hf_llama", 1)
    outs = []
    for backend in ("codegen", "modules", None):
        lm = _model("hf_llama")
        lm.generation_config.eos_token_id = eos
        if backend is None:
            with torch.no_grad():
                outs.append(lm.generate(PROMPTS, attention_mask=MASK, max_new_tokens=NEW, do_sample=False,
                                        pad_token_id=0).tolist())
        else:
            outs.append(compile_inference(lm, plan=plan, backend=backend).generate(PROMPTS, NEW, attention_mask=MASK)
                        .tolist())
    assert outs[0] == outs[1] == outs[2]
    assert outs[0][0][PROMPTS.shape[1]:][1:] == [0] * (len(outs[0][0]) - PROMPTS.shape[1] - 1)   # row 0 stopped
    assert len(outs[0][0]) == PROMPTS.shape[1] + (1 if 29 in eos else NEW)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_pipeline_stages_equal_hf_generate_and_the_modules_backend(tp):
    """pp=2 (and tp=2 x pp=2): a StageStepRunner per rank, each stage holding its layer's cache
    (its kv heads' share): the InferencePlan's per-rank bytes; every rank returns the same tokens."""
    plan = _plan("hf_llama", 2 * tp, tp=tp, pp=2, dp=1)
    assert (plan.tp, plan.pp, plan.stages) == (tp, 2, [[0, 1], [1, 2]])
    results = run_local(_run, 2 * tp, args=("hf_llama", plan.to_json(), {}), timeout=900)
    _check(results, plan, _reference("hf_llama").tolist(), 2)
    assert [got["stage"] for got, _ in results] == [r // tp for r in range(2 * tp)]
    assert all(got["cache_tensors"] == 2 for got, _ in results)     # k and v of its one layer


SAMPLINGS = [{"temperature": 1.5, "seed": 3}, {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 7}]


def _sampled(lm, sampling):
    """Hugging Face's sampled generate, seeded as the modules backend seeds it."""
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(sampling.get("seed", 0))
        opts = {k: v for k, v in sampling.items() if k != "seed"}
        return lm.generate(PROMPTS, attention_mask=MASK, max_new_tokens=NEW, do_sample=True, pad_token_id=0,
                           **opts).tolist()


def test_one_process_sampled_tokens_equal_the_modules_backend_and_hf():
    plan = _plan("hf_llama", 1)
    engine = compile_inference(_model("hf_llama"), plan=plan, backend="codegen")
    modules = compile_inference(_model("hf_llama"), plan=plan)
    calls = []
    engine.model.register_forward_pre_hook(lambda *a: calls.append(1))
    for sampling in SAMPLINGS:
        got = engine.generate(PROMPTS, NEW, attention_mask=MASK, sampling=sampling).tolist()
        assert got == modules.generate(PROMPTS, NEW, attention_mask=MASK, sampling=sampling).tolist()
        assert got == _sampled(_model("hf_llama"), sampling)
        assert got != _reference("hf_llama").tolist()                      # sampled, not greedy
    assert calls == []                                                     # the programs ran, not the model
    other = engine.generate(PROMPTS, NEW, attention_mask=MASK, sampling={**SAMPLINGS[0], "seed": 4}).tolist()
    assert other != _sampled(_model("hf_llama"), SAMPLINGS[0])            # the seed is honoured


def _run_sampled(rank, world, name, plan_json):
    plan = InferencePlan.from_json(plan_json)
    engine = compile_inference(_model(name), plan=plan, backend="codegen")
    calls = []
    engine.model.register_forward_pre_hook(lambda *a: calls.append(1))
    modules = compile_inference(_model(name), plan=plan)
    return [(engine.generate(PROMPTS, NEW, attention_mask=MASK, sampling=s).tolist(),
             modules.generate(PROMPTS, NEW, attention_mask=MASK, sampling=s).tolist()) for s in SAMPLINGS], \
        len(calls), type(engine.runner).__name__


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_sampled_tokens_equal_the_modules_backend(tp, pp):
    """Sampled at tp=2 (and pp=2): every rank's tokens are the modules backend's for the same seed,
    and one process's Hugging Face generate."""
    plan = _plan("hf_llama", tp * pp, tp=tp, pp=pp, dp=1)
    want = [_sampled(_model("hf_llama"), s) for s in SAMPLINGS]
    for pairs, calls, runner in run_local(_run_sampled, tp * pp, args=("hf_llama", plan.to_json()), timeout=900):
        assert [got for got, _ in pairs] == [modules for _, modules in pairs] == want
        assert calls == 0 and runner == ("StageStepRunner" if pp > 1 else "StepRunner")


def test_a_sliding_window_as_long_as_the_cache_is_full_attention():
    """Mistral whose window (11) is the whole cache (6 prompt + 5 new positions): it never slides, so
    the step is full attention: tokens equal Hugging Face's generate and the modules backend's."""
    kw = {"window": PROMPTS.shape[1] + NEW}
    plan = _plan("hf_mistral", 1, kw)
    assert plan.prompt_len + plan.max_new_tokens == kw["window"]
    got = _premise(compile_inference(_model("hf_mistral", **kw), plan=plan, backend="codegen"))
    modules = compile_inference(_model("hf_mistral", **kw), plan=plan).generate(PROMPTS, NEW, attention_mask=MASK)
    _check([(got, modules.tolist())], plan, _reference("hf_mistral", **kw).tolist(), 2)


@pytest.mark.slow
def test_mistral_tp2_with_a_window_longer_than_the_cache():
    kw = {"window": 16}
    plan = _plan("hf_mistral", 2, kw, tp=2, pp=1, dp=1)
    results = run_local(_run, 2, args=("hf_mistral", plan.to_json(), kw), timeout=600)
    _check(results, plan, _reference("hf_mistral", **kw).tolist(), 2)


@pytest.mark.slow
def test_uneven_stages_hold_their_layers_share_of_the_priced_cache():
    """3 layers on pp=2: the InferencePlan prices the largest stage's cache; the other stage holds
    its fewer layers' share (as many bytes per layer), and the tokens are still HF's."""
    kw = {"n_layer": 3}
    plan = _plan("hf_llama", 2, kw, tp=1, pp=2, dp=1)
    sizes = [b - a for a, b in plan.stages]
    assert sorted(sizes) == [1, 2]
    results = run_local(_run, 2, args=("hf_llama", plan.to_json(), kw), timeout=900)
    want = _reference("hf_llama", **kw).tolist()
    for (got, modules), layers in zip(results, sizes):
        assert got["tokens"] == want == modules and got["runner"] and got["forward_calls"] == 0
        assert got["cache_tensors"] == 2 * layers
        assert got["kv"] == got["held"] == plan.kv_cache_bytes_per_rank * layers // 2
