"""Continuous batching on autopar's own programs with data-parallel replicas
(autopar/inference/codegen_iteration.py ``CodegenIterationEngine``, Replicas): dp=2 on 2 gloo ranks,
dp=2 x pp=2 and dp=2 x tp=2 on 4, rank 0 leading through ``LeaderIterations`` and the other ranks
following (the server's path). Staggered requests of different prompt and output lengths each get
Hugging Face's ``generate`` of its prompt alone; premises: each replica's ranks added only the
requests rank 0 assigned it (both replicas some, none twice), the programs' process groups hold
only the replica's ranks (with pp, one stage's; its pipeline group its own stages), and no decoder
layer module of the model ever runs."""
from __future__ import annotations

import pytest
import torch

from autopar.inference.inference_plan import InferencePlan
from autopar.inference.iteration_engine import IterationEngine
from autopar.inference.iteration_ranks import LeaderIterations, follow_iterations
from runtime.launch import run_local
from tests.helpers.serving import generate_alone, spread_model
from tests.inference.test_codegen_iteration import PROMPT_LEN, REQUESTS, _no_module_runs, _plan, _serve

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops


def _replica_rank(rank, world, plan_json):
    import torch.distributed as dist

    from runtime import context as RC
    plan = InferencePlan.from_json(plan_json)
    model = spread_model("hf_llama")
    engine = IterationEngine.from_plan(model, plan, backend="codegen")
    fired = _no_module_runs(model)
    added = []
    add = engine.add
    engine.add = lambda prompt, *a, **k: added.append(list(prompt)) or add(prompt, *a, **k)
    out = {"replica": engine.replica, "replicas": engine.replicas, "stage": engine.stage, "tp_rank": engine.tp_rank,
           "replica_ranks": engine.replica_ranks,
           "groups": sorted(sorted(dist.get_process_group_ranks(g)) for g in RC.current().groups.values())}
    if plan.pp > 1:
        out["pipe"] = sorted(dist.get_process_group_ranks(engine.runner.pipe_group()))
    if rank == 0:
        leader = LeaderIterations(engine)
        seqs, _ = _serve(leader)
        leader.stop()
        out.update(tokens=[s.tokens for s in seqs], served=leader.served)
    else:
        follow_iterations(engine)
    out.update(added=added, calls=engine.calls, fired=len(fired),
               turns=[ve.turns for ve in engine.flights] if plan.pp > 1 else None)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(1, 1), (1, 2), (2, 1)])
def test_codegen_replicas_equal_generate_alone(tp, pp):
    world = 2 * tp * pp
    plan = _plan(world, tp=tp, pp=pp, dp=2)
    assert (plan.dp, plan.tp, plan.pp, plan.world_size) == (2, tp, pp, world)
    results = run_local(_replica_rank, world, args=(plan.to_json(),), timeout=900)
    model = spread_model("hf_llama")
    assert results[0]["tokens"] == [generate_alone(model, p, n) for p, n, _ in REQUESTS]
    size = tp * pp
    shares = {}
    for rank, got in enumerate(results):
        replica, local = divmod(rank, size)
        stage, tp_rank = divmod(local, tp)
        assert (got["replica"], got["replicas"], got["stage"], got["tp_rank"], got["replica_ranks"]) \
            == (replica, 2, stage, tp_rank, size)
        shares.setdefault(replica, got["added"])
        assert got["added"] == shares[replica]                    # every rank of a replica: the same requests
        assert got["fired"] == 0 and got["calls"][1] > 0          # premise: the programs ran, never the modules
        assert got["calls"][PROMPT_LEN] == len(got["added"])      # one prefill per request of its replica
        stage_ranks = [replica * size + stage * tp + t for t in range(tp)]
        assert all(set(g) <= set(stage_ranks) for g in got["groups"]) and stage_ranks in got["groups"]
        if pp > 1:
            assert got["pipe"] == [replica * size + s * tp + tp_rank for s in range(pp)]
            assert min(got["turns"]) > 0                          # both virtual engines of its replica had turns
    assert all(shares[r] for r in (0, 1))                         # both replicas served some
    assert sorted(shares[0] + shares[1]) == sorted(p for p, _, _ in REQUESTS)   # each request once
    assert results[0]["served"] == [len(shares[0]), len(shares[1])]
