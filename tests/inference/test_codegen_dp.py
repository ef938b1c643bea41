"""compile_inference(..., backend="codegen") with data-parallel replicas (autopar/inference/
codegen_engine.py ``CodegenEngine``): dp=2 on 2 gloo ranks, dp=2 x tp=2 on 4 and dp=2 x pp=2 on 4,
greedy tokens equal Hugging Face's ``generate`` and the modules backend's on every rank (one prompt
too: the second replica then has no rows); each replica decoded only its
share of the prompts (its runner's batch the plan's per-replica ``batch_size``), its programs'
process groups hold its own ranks only (with pp, its stage's; its pipeline group its two stages),
each rank holds its stage's layers only, and each rank's cache is its kv heads of its layers for
its replica's batch, the InferencePlan's ``kv_cache_bytes_per_rank``. (The continuous engine's
replicas: test_codegen_iteration_dp.py.)"""
from __future__ import annotations

import pytest
import torch

from autopar.errors import PlanError
from autopar.inference.codegen_engine import check_codegen_plan
from autopar.inference.engine import compile_inference
from autopar.inference.inference_plan import InferencePlan
from runtime.launch import run_local
from tests.inference.test_codegen_engine import MASK, NEW, PROMPTS, _model, _plan, _reference

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
def test_replicas_of_pipeline_stages_equal_hf_generate_and_the_modules_backend():
    plan = _plan("hf_llama", 4, tp=1, pp=2, dp=2)
    assert (plan.dp, plan.pp, plan.tp, plan.world_size, plan.stages) == (2, 2, 1, 4, [[0, 1], [1, 2]])
    share = -(-len(PROMPTS) // 2)
    assert plan.batch_size == share
    kv_heads = _model("hf_llama").config.num_key_value_heads
    want = _reference("hf_llama").tolist()
    results = run_local(_run, 4, args=(plan.to_json(),), timeout=900)
    for rank, got in enumerate(results):
        replica, stage = divmod(rank, 2)                                 # replica-major, stage-major inside
        mine = PROMPTS[replica * share:(replica + 1) * share].tolist()
        assert got["tokens"] == want == got["modules"]
        assert got["one"] == got["modules_one"] and len(got["one"]) == 1
        decoded = got["decoded"][0]
        assert len(got["decoded"]) == (2 if replica == 0 else 1)          # one prompt: replica 1 decoded none
        assert len(decoded) == plan.batch_size and decoded[:len(mine)] == mine
        assert all(row == mine[0] for row in decoded[len(mine):])
        assert got["stage"] == stage and got["layers"] == [str(stage)]     # its stage's layer only
        assert got["pipe"] == [2 * replica, 2 * replica + 1]               # its replica's two stages
        assert all(set(g) <= {rank} for g in got["groups"])                # tp=1: no axis group past the rank
        assert got["kv"] == got["held"] == plan.kv_cache_bytes_per_rank > 0   # one layer's cache
        assert got["block_shapes"] == [(plan.batch_size, kv_heads)]


def test_replicas_are_not_refused_but_need_their_ranks():
    base = dict(prompt_len=6, max_new_tokens=2, batch_size=1, dtype="fp32", cluster={"name": "cpu"})
    plan = InferencePlan(dp=2, pp=2, stages=[[0, 1], [1, 2]], **base)
    check_codegen_plan(plan)   # both engines run it (the continuous one: test_codegen_iteration_dp.py)
    with pytest.raises(PlanError, match="runs on 4 processes.*launch 4"):
        compile_inference(_model("hf_llama"), plan=plan, backend="codegen")
