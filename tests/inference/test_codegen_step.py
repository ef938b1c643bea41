"""autopar.inference.codegen_step: a Hugging Face causal LM's prefill and decode steps traced by
autopar's front end over a preallocated KV cache, planned with Megatron tp=2 strategies and run as
codegen's per-rank programs on two gloo ranks, for left-padded prompts of different lengths: the
greedy tokens equal Hugging Face's ``generate``, and each rank holds only its kv heads of the
cache (grouped-query attention: 2 kv heads, one per rank), as many bytes as the plan's cache
layout says."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.inference.codegen_step import CacheStep, StepRunner, empty_cache, plan_cache_step
from autopar.models import hf
from codegen.rank_program import block_slices
from runtime.launch import run_local
from tests.helpers.cache_steps import reference_checked_against_hf

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops
PROMPTS = torch.tensor([[0, 0, 0, 5, 6, 7], [9, 10, 11, 12, 13, 14]])   # left-padded
MASK = (PROMPTS != 0).long()
MAX_LEN, NEW, PREFILL = 16, 4, 8   # prompts of 6 tokens run the length-8 prefill (padded further)


def _lm(name):
    torch.manual_seed(0)
    return getattr(hf, name)(seq=32)[0].model.eval()


def _rank(rank, world, step, steps):
    from runtime import context as RC

    RC.setup(steps[1].plan.mesh)
    runner = StepRunner(step, steps, rank)
    tokens = runner.generate(PROMPTS, MASK, NEW)
    prog = runner.programs[1]
    slices = [block_slices(lay, shape, prog.mesh_shape, prog.coords)
              for lay, shape in zip(runner.cache_layouts, runner.cache_shapes)]
    return (tokens, runner.cache, slices, runner.cache_bytes(), runner.cache_layouts,
            runner.programs[PREFILL].code, prog.code, runner.cache_names)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_llama", "hf_qwen2"])
def test_tp2_greedy_generation_equals_hf_with_the_cache_split_per_rank(name):
    lm = _lm(name)
    assert lm.config.num_key_value_heads == 2 < lm.config.num_attention_heads   # grouped-query attention
    step = CacheStep(lm)
    B, P = PROMPTS.shape
    ref_tokens, ref_cache = reference_checked_against_hf(lm, step, PROMPTS, MASK, PREFILL, MAX_LEN, NEW)

    cluster = autopar.Cluster.preset("cpu", devices=2)
    steps = {s: plan_cache_step(step, B, s, MAX_LEN, cluster, constraints={"tp": 2, "dp": 1}, policy="megatron")
             for s in (1, PREFILL)}
    out = run_local(_rank, 2, args=(step, steps), timeout=600)
    whole_bytes = sum(c.numel() * c.element_size() for c in ref_cache)
    for rank in range(2):
        tokens, cache, slices, plan_bytes, layouts, pre_code, dec_code, names = out[rank]
        assert tokens.tolist() == ref_tokens.tolist()   # = HF generate's
        assert plan_bytes == whole_bytes // 2                              # the plan splits the cache in two
        assert sum(c.numel() * c.element_size() for c in cache) == plan_bytes   # and this rank holds that
        for got, want, sl, lay in zip(cache, ref_cache, slices, layouts):
            assert lay.dims[1] and got.shape[1] == want.shape[1] // 2    # split on the kv heads
            torch.testing.assert_close(got, want[sl], atol=1e-5, rtol=1e-5)
        for code in (pre_code, dec_code):
            # Megatron row linears reduce, the vocabulary-split head's logits are gathered; the
            # cache is neither gathered nor sliced: it enters and leaves as this rank's block
            assert ("reduce_scatter" in code or "all_reduce" in code) and "all_gather" in code
            for name in names:
                assert f"index_copy.default({name}," in code and f"slice_block({name}" not in code
            assert "all_gather(index_copy" not in code


def test_a_sliding_window_cache_is_refused():
    lm = _lm("hf_mistral")
    inputs = (PROMPTS, PROMPTS, torch.arange(PROMPTS.shape[1]), torch.ones(2, MAX_LEN, dtype=torch.long),
              *empty_cache(lm, 2, MAX_LEN))
    with pytest.raises(NotImplementedError, match="sliding window"):
        CacheStep(lm)(*inputs)
