"""compile_inference(..., backend="codegen") with data-parallel replicas (autopar/inference/
codegen_engine.py ``CodegenEngine``): dp=2 on 2 gloo ranks, dp=2 x tp=2 on 4, dp=2 x pp=2 on 4 and
dp=2 x pp=2 x tp=2 on 8, greedy tokens equal Hugging Face's ``generate`` and the modules backend's
on every rank (one prompt too: the second replica then has no rows); each replica decoded only its
share of the prompts (its runner's batch the plan's per-replica ``batch_size``), its programs'
process groups hold its own ranks only (with pp, its stage's; its pipeline group its two stages),
each rank holds its stage's layers only, and each rank's cache is its kv heads of its layers for
its replica's batch, the InferencePlan's ``kv_cache_bytes_per_rank``. Sampled (temperature, top-k,
top-p, a seed) under dp=2 and dp=2 x tp=2, every rank's tokens equal the modules backend's with the
same seed and plan: each replica draws its own rows (padded to its batch) from a stream seeded with
the seed, so they are also what one process's Hugging Face ``generate`` samples for that replica's
rows with that seed. (The continuous engine's replicas: test_codegen_iteration_dp.py.)"""
from __future__ import annotations

import pytest
import torch

from autopar.errors import PlanError
from autopar.inference.codegen_engine import check_codegen_plan
from autopar.inference.engine import compile_inference
from autopar.inference.inference_plan import InferencePlan
from runtime.launch import run_local
from tests.inference.test_codegen_engine import MASK, NEW, PROMPTS, SAMPLINGS, _model, _plan, _reference

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops


def _run(rank, world, plan_json):
    import torch.distributed as dist

    from runtime import context as RC
    plan = InferencePlan.from_json(plan_json)
    engine = compile_inference(_model("hf_llama"), plan=plan, backend="codegen")
    decoded = []
    run = engine.runner.generate
    engine.runner.generate = lambda ids, *a, **k: decoded.append(ids.clone()) or run(ids, *a, **k)
    tokens = engine.generate(PROMPTS, NEW, attention_mask=MASK).tolist()
    one = engine.generate(PROMPTS[:1], NEW, attention_mask=MASK[:1]).tolist()   # replica 1 without rows
    groups = sorted(sorted(dist.get_process_group_ranks(g)) for g in RC.current().groups.values())
    modules = compile_inference(_model("hf_llama"), plan=plan)
    out = {"tokens": tokens, "modules": modules.generate(PROMPTS, NEW, attention_mask=MASK).tolist(), "one": one,
           "modules_one": modules.generate(PROMPTS[:1], NEW, attention_mask=MASK[:1]).tolist(),
           "decoded": [d.tolist() for d in decoded], "groups": groups, "kv": engine.kv_cache_bytes(),
           "held": sum(c.numel() * c.element_size() for c in engine.runner.cache),
           "block_shapes": sorted({tuple(c.shape[:2]) for c in engine.runner.cache})}
    if plan.pp > 1:   # this rank's stage, its replica's pipeline group, the layers it holds
        runner = engine.runner
        out.update(stage=runner.stage, pipe=sorted(dist.get_process_group_ranks(runner.pipe_group())),
                   layers=sorted({f.split("layers.")[1].split(".")[0] for f in runner.param_fqns() if "layers." in f}))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_replicas_equal_hf_generate_and_the_modules_backend(tp):
    world = 2 * tp
    plan = _plan("hf_llama", world, tp=tp, pp=1, dp=2)
    assert (plan.dp, plan.tp, plan.world_size) == (2, tp, world)
    share = -(-len(PROMPTS) // 2)
    assert plan.batch_size == share          # a replica's batch: half the prompts
    kv_heads = _model("hf_llama").config.num_key_value_heads
    want = _reference("hf_llama").tolist()
    results = run_local(_run, world, args=(plan.to_json(),), timeout=600)
    for rank, got in enumerate(results):
        replica = rank // tp
        mine = PROMPTS[replica * share:(replica + 1) * share].tolist()
        assert got["tokens"] == want == got["modules"]
        assert got["one"] == got["modules_one"] and len(got["one"]) == 1
        decoded = got["decoded"][0]                                      # the first generate: this replica's rows
        assert len(got["decoded"]) == (2 if replica == 0 else 1)          # one prompt: replica 1 decoded none
        assert len(decoded) == plan.batch_size and decoded[:len(mine)] == mine
        assert all(row == mine[0] for row in decoded[len(mine):])        # padded with its first row
        ranks = list(range(replica * tp, (replica + 1) * tp))            # its mesh axes' groups: its own ranks
        assert all(set(g) <= set(ranks) for g in got["groups"]) and ranks in got["groups"]
        assert got["kv"] == got["held"] == plan.kv_cache_bytes_per_rank > 0
        assert got["block_shapes"] == [(plan.batch_size, kv_heads // tp)]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_replicas_of_pipeline_stages_equal_hf_generate_and_the_modules_backend(tp):
    """dp=2 x pp=2 on 4 ranks and dp=2 x pp=2 x tp=2 on 8: every rank of a replica's stage holds its
    layer and its kv heads of it, its replica's pipeline group of its tp position."""
    world = 4 * tp
    plan = _plan("hf_llama", world, tp=tp, pp=2, dp=2)
    assert (plan.dp, plan.pp, plan.tp, plan.world_size, plan.stages) == (2, 2, tp, world, [[0, 1], [1, 2]])
    share = -(-len(PROMPTS) // 2)
    assert plan.batch_size == share
    kv_heads = _model("hf_llama").config.num_key_value_heads
    want = _reference("hf_llama").tolist()
    results = run_local(_run, world, args=(plan.to_json(),), timeout=900)
    for rank, got in enumerate(results):
        replica, within = divmod(rank, 2 * tp)                           # replica-major, stage-major inside
        stage, position = divmod(within, tp)
        mine = PROMPTS[replica * share:(replica + 1) * share].tolist()
        assert got["tokens"] == want == got["modules"]
        assert got["one"] == got["modules_one"] and len(got["one"]) == 1
        decoded = got["decoded"][0]
        assert len(got["decoded"]) == (2 if replica == 0 else 1)          # one prompt: replica 1 decoded none
        assert len(decoded) == plan.batch_size and decoded[:len(mine)] == mine
        assert all(row == mine[0] for row in decoded[len(mine):])
        assert got["stage"] == stage and got["layers"] == [str(stage)]     # its stage's layer only
        first = replica * 2 * tp
        assert got["pipe"] == [first + position, first + tp + position]    # its replica's two stages
        ranks = list(range(first + stage * tp, first + (stage + 1) * tp))  # its stage's tp ranks
        assert all(set(g) <= set(ranks) for g in got["groups"])            # no axis group past them
        assert tp == 1 or ranks in got["groups"]
        assert got["kv"] == got["held"] == plan.kv_cache_bytes_per_rank > 0   # one layer's cache, its kv heads
        assert got["block_shapes"] == [(plan.batch_size, kv_heads // tp)]


def _run_sampled(rank, world, plan_json):
    plan = InferencePlan.from_json(plan_json)
    engine = compile_inference(_model("hf_llama"), plan=plan, backend="codegen")
    decoded = []
    run = engine.runner.generate
    engine.runner.generate = lambda ids, *a, **k: decoded.append((ids.clone(), k.get("sample"))) or run(ids, *a, **k)
    modules = compile_inference(_model("hf_llama"), plan=plan)
    pairs = [(engine.generate(PROMPTS, NEW, attention_mask=MASK, sampling=s).tolist(),
              modules.generate(PROMPTS, NEW, attention_mask=MASK, sampling=s).tolist()) for s in SAMPLINGS]
    return {"pairs": pairs, "decoded": [(ids.tolist(), sample is not None) for ids, sample in decoded],
            "shard": engine.runner.vocab_shard.size}


def _replicas_sampled(sampling, dp, batch):
    """One process's Hugging Face sampled generate of each replica's rows (padded to the replica's
    batch with its first row), seeded with the seed, the new tokens put together in row order."""
    share, prompt, news = -(-len(PROMPTS) // dp), PROMPTS.shape[1], []
    for r in range(dp):
        ids, mask = PROMPTS[r * share:(r + 1) * share], MASK[r * share:(r + 1) * share]
        rows = len(ids)
        if rows == 0:
            continue
        ids = torch.cat([ids, ids[:1].expand(batch - rows, -1)])
        mask = torch.cat([mask, mask[:1].expand(batch - rows, -1)])
        lm = _model("hf_llama")   # built first: it seeds its own weights
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(sampling.get("seed", 0))
            opts = {k: v for k, v in sampling.items() if k != "seed"}
            out = lm.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, pad_token_id=0, **opts)
        news.append(out[:rows, prompt:])
    width = max(t.shape[1] for t in news)
    new = torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=0) for t in news])
    return torch.cat([PROMPTS, new], 1).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_replicas_sample_what_the_modules_backend_samples(tp):
    """Sampled under dp=2 (and dp=2 x tp=2, a vocabulary-parallel head): every rank's tokens are the
    modules backend's for the same seed and plan, and each replica's rows are what one process
    samples for them (padded to its batch) with that seed; sampled, not greedy."""
    world = 2 * tp
    plan = _plan("hf_llama", world, tp=tp, pp=1, dp=2)
    assert (plan.dp, plan.tp, plan.pp) == (2, tp, 1)
    share = -(-len(PROMPTS) // 2)
    want = [_replicas_sampled(s, 2, plan.batch_size) for s in SAMPLINGS]
    greedy = _reference("hf_llama").tolist()
    results = run_local(_run_sampled, world, args=(plan.to_json(),), timeout=900)
    for rank, got in enumerate(results):
        mine = PROMPTS[(rank // tp) * share:(rank // tp + 1) * share].tolist()
        assert [g for g, _ in got["pairs"]] == [m for _, m in got["pairs"]] == want
        assert all(g != greedy for g, _ in got["pairs"])                   # sampled, not greedy
        assert len(got["decoded"]) == len(SAMPLINGS) and got["shard"] == tp   # tp=2: drawn from vocabulary slices
        for ids, sampled in got["decoded"]:                               # this replica's rows, sampled
            assert sampled and len(ids) == plan.batch_size and ids[:len(mine)] == mine


def test_replicas_are_not_refused_but_need_their_ranks():
    base = dict(prompt_len=6, max_new_tokens=2, batch_size=1, dtype="fp32", cluster={"name": "cpu"})
    plan = InferencePlan(dp=2, pp=2, stages=[[0, 1], [1, 2]], **base)
    check_codegen_plan(plan)   # both engines run it (the continuous one: test_codegen_iteration_dp.py)
    with pytest.raises(PlanError, match="runs on 4 processes.*launch 4"):
        compile_inference(_model("hf_llama"), plan=plan, backend="codegen")
