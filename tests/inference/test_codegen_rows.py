"""autopar.inference.codegen_rows: a step whose rows each write their own cache slots, and a
minimal continuous loop over it (requests admitted into free rows at different iterations, every
occupied row decoding at its own length, rows retired and reused): each request's greedy tokens
equal Hugging Face's ``generate`` for that prompt alone, in one process and as codegen's per-rank
programs planned tp=2 on two gloo ranks, where each rank holds only its kv heads of the cache (half
the bytes) and no program gathers or slices the cache."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.inference.codegen_rows import RowCacheStep, RowRequest, RowRunner, plan_row_step, row_chunk, serve_rows
from autopar.inference.codegen_step import empty_cache
from autopar.models import hf
from codegen.rank_program import block_slices
from runtime.launch import run_local

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops
B, MAX_LEN, PREFILL = 2, 16, 8
# two rows, three requests: "b" joins while "a" is mid-decode, "c" waits for "a"'s row to free
REQUESTS = [RowRequest("a", torch.tensor([5, 6, 7]), 5, 0), RowRequest("b", torch.tensor([9, 10, 11, 12, 13]), 4, 2),
            RowRequest("c", torch.tensor([3, 4]), 3, 3)]


def _lm(name):
    torch.manual_seed(0)
    return getattr(hf, name)(seq=32)[0].model.eval()


def _hf_alone(lm, req):
    with torch.no_grad():
        out = lm.generate(req.prompt[None], attention_mask=torch.ones(1, len(req.prompt), dtype=torch.long),
                          max_new_tokens=req.max_new, do_sample=False, pad_token_id=0)
    return out[0, len(req.prompt):].tolist()


def _one_process(lm, log=None, prefill_rows=None):
    step = RowCacheStep(lm)
    return serve_rows(lambda seq, *inputs: step(*inputs), empty_cache(lm, B, MAX_LEN), [PREFILL], B, MAX_LEN,
                      REQUESTS, log=log, prefill_rows=prefill_rows)


def test_each_row_writes_only_its_own_slots_and_unwritten_rows_keep_their_cache():
    lm = _lm("hf_llama")
    step = RowCacheStep(lm)
    torch.manual_seed(1)
    cache = [torch.randn_like(c) for c in empty_cache(lm, B, MAX_LEN)]
    mask = torch.ones(B, MAX_LEN, dtype=torch.long)
    with torch.no_grad():
        # decode, rows at different lengths: row 0 writes slot 3, row 1 slot 9
        slots = torch.tensor([[3], [9]])
        _, *new = step(torch.tensor([[1], [2]]), slots, slots, mask, torch.tensor([0, 1]), *cache)
        for old, got in zip(cache, new):
            changed = (old != got).any(-1).any(1)   # [B, max_len]: slots whose k/v changed
            assert changed[0].nonzero().flatten().tolist() == [3] and changed[1].nonzero().flatten().tolist() == [9]
        # a prefill of row 1 alone (slots 0..3) while row 0 is mid-decode: row 0 unchanged
        slots = torch.arange(4).expand(B, 4).contiguous()
        _, *new = step(torch.ones(B, 4, dtype=torch.long), slots, slots, mask, torch.tensor([-1, 1]), *cache)
        for old, got in zip(cache, new):
            assert torch.equal(got[0], old[0])
            assert torch.equal(got[1, :, 4:], old[1, :, 4:]) and (got[1, :, :4] != old[1, :, :4]).all()
        # the same prefill as a step over that one row of the cache: the same cache
        _, *one = step(torch.ones(1, 4, dtype=torch.long), slots[:1], slots[:1], mask[:1], torch.tensor([1]), *cache)
        for got, want in zip(one, new):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
            assert torch.equal(got[0], want[0])


def test_a_prompt_prefilled_in_chunks_at_its_own_slots_is_the_whole_prompt_prefilled():
    """A row's prompt in two chunks (4 tokens, then 2 padded to 4, the padding writing slots after
    them) while the other row is not written: the last chunk's logits are the model's on the whole
    prompt alone, and the row's cache holds the prompt at slots 0..5."""
    lm = _lm("hf_llama")
    step = RowCacheStep(lm)
    prompt = torch.tensor([7, 3, 9, 4, 11, 5])
    cache = empty_cache(lm, B, MAX_LEN)
    mask = torch.zeros(B, MAX_LEN, dtype=torch.long)
    write = torch.tensor([-1, 1])
    with torch.no_grad():
        want = lm(prompt[None]).logits[0, -1]
        for start, chunk in ((0, prompt[:4]), (4, prompt[4:])):
            ids, pos, slots = (torch.stack([t, t]) for t in row_chunk(chunk, start, 4))
            mask[1, :start + len(chunk)] = 1
            logits, *cache = step(ids, pos, slots, mask, write, *cache)
        torch.testing.assert_close(logits[1], want, atol=1e-5, rtol=1e-5)
        assert all(not c[0].any() for c in cache)   # row 0 never written
        _, *whole = step(prompt[None], torch.arange(6)[None], torch.arange(6)[None], mask[1:], torch.tensor([0]),
                         *empty_cache(lm, 1, MAX_LEN))
        for got, ref in zip(cache, whole):
            torch.testing.assert_close(got[1, :, :6], ref[0, :, :6], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prefill_rows", [None, 1])
def test_rows_admitted_at_different_steps_generate_as_hf_alone(prefill_rows):
    """Prefills over all rows (those not admitted not written) or over the admitted row alone."""
    lm = _lm("hf_llama")
    log = []
    tokens, _ = _one_process(lm, log, prefill_rows)
    assert (2, "prefill", {1: "b"}) in log and (2, "decode", {0: "a", 1: "b"}) in log   # b joins mid-decode
    assert (4, "prefill", {0: "c"}) in log   # c takes a's row once a retired
    for req in REQUESTS:
        assert tokens[req.rid] == _hf_alone(lm, req)


def _rank(rank, world, step, steps):
    from runtime import context as RC

    RC.setup(steps[1].plan.mesh)
    runner = RowRunner(step, steps, rank)
    log = []
    tokens = runner.serve(REQUESTS, log=log)
    assert (2, "prefill", {1: "b"}) in log and (4, "prefill", {0: "c"}) in log
    prog = runner.programs[1]
    slices = [block_slices(lay, shape, prog.mesh_shape, prog.coords)
              for lay, shape in zip(runner.cache_layouts, runner.cache_shapes)]
    return (tokens, runner.cache, slices, runner.cache_bytes(), runner.cache_layouts,
            [p.code for p in runner.programs.values()], runner.cache_names)


@pytest.mark.slow
@pytest.mark.parametrize("name,prefill_rows", [("hf_llama", B), ("hf_qwen2", B), ("hf_llama", 1)])
def test_tp2_rows_generate_as_hf_alone_with_the_cache_split_by_kv_heads(name, prefill_rows):
    """Prefill steps over all rows, or (``prefill_rows`` 1) over the admitted row alone."""
    lm = _lm(name)
    assert lm.config.num_key_value_heads == 2 < lm.config.num_attention_heads   # grouped-query attention
    ref_tokens, ref_cache = _one_process(lm)
    for req in REQUESTS:
        assert ref_tokens[req.rid] == _hf_alone(lm, req)

    step = RowCacheStep(lm)
    cluster = autopar.Cluster.preset("cpu", devices=2)
    steps = {s: plan_row_step(step, B if s == 1 else prefill_rows, s, MAX_LEN, cluster, cache_rows=B,
                              constraints={"tp": 2, "dp": 1}, policy="megatron")
             for s in (1, PREFILL)}
    out = run_local(_rank, 2, args=(step, steps), timeout=600)
    whole_bytes = sum(c.numel() * c.element_size() for c in ref_cache)
    for rank in range(2):
        tokens, cache, slices, plan_bytes, layouts, codes, names = out[rank]
        assert tokens == ref_tokens
        assert plan_bytes == whole_bytes // 2
        assert sum(c.numel() * c.element_size() for c in cache) == plan_bytes
        for got, want, sl, lay in zip(cache, ref_cache, slices, layouts):
            assert lay.dims[1] and got.shape[1] == want.shape[1] // 2    # split on the kv heads
            torch.testing.assert_close(got, want[sl], atol=1e-5, rtol=1e-5)
        for code in codes:
            # the cache enters as this rank's block, is scattered into (or its rows selected to be),
            # never gathered
            for cname in names:
                assert f"scatter.src({cname}," in code or f"index_select.default({cname}," in code
                assert f"slice_block({cname}" not in code
            for op in ("scatter", "where", "index_select", "index_copy"):
                assert f"all_gather({op}" not in code


def test_a_row_retires_at_an_end_of_sequence_token_and_frees_its_row_for_the_next_request():
    lm = _lm("hf_llama")
    step = RowCacheStep(lm)
    eos = _hf_alone(lm, REQUESTS[1])[0]   # "b"'s first token
    log = []
    tokens, _ = serve_rows(lambda seq, *inputs: step(*inputs), empty_cache(lm, B, MAX_LEN), [PREFILL], B, MAX_LEN,
                           REQUESTS, eos=(eos,), log=log)
    assert tokens["b"] == [eos]
    assert (3, "prefill", {1: "c"}) in log   # "c" takes "b"'s row at once
    for req in REQUESTS:
        with torch.no_grad():
            want = lm.generate(req.prompt[None], attention_mask=torch.ones(1, len(req.prompt), dtype=torch.long),
                               max_new_tokens=req.max_new, do_sample=False, pad_token_id=0,
                               eos_token_id=eos)[0, len(req.prompt):].tolist()
        assert tokens[req.rid] == want
