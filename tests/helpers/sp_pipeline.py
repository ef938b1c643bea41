"""Pipeline x sequence-parallel plans trained on forked gloo ranks against one eager process, with
each rank's stage, bytes per mesh axis and point-to-point checked against the plan; shared by
tests/execution/test_sp_pipeline.py and test_hybrid_sp.py."""
from __future__ import annotations

import torch

import autopar
from autopar.frontend.trace import trace
from autopar.models import ZOO
from codegen.stages import pipeline_units
from helpers.exactness import assert_matches_eager, train_eagerly
from runtime.launch import run_local

STEPS = 3


OPT = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}


CPU4 = autopar.Cluster.preset("cpu", devices=4)


def plan_case(name, constraints, cluster=CPU4, **kw):
    model, batch = ZOO[name](**kw)
    return autopar.plan(model, batch, cluster, precision="fp32", optimizer="sgd", constraints=constraints)


def train_stage_rank(rank, world, name, plan_json, kw):
    from runtime.collectives import COMM_STATS
    model, batch = ZOO[name](**kw)
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), **OPT)
    losses = [cm.step(*batch)]
    cm.reset_comm_stats()   # the first step includes PyTorch's metadata pass: count the others
    COMM_STATS.reset()
    losses += [cm.step(*batch) for _ in range(STEPS - 1)]
    comm = cm.comm_stats()
    kinds = {f"{a}:{k}": v for (a, k), v in COMM_STATS.snapshot_by_kind().items()}
    sd = {k: v.numpy() for k, v in cm.full_state_dict().items()}
    return {"losses": losses, "sd": sd if rank == 0 else None, "params": sorted(cm.params), "stage": cm.stage,
            "calls": cm.runner.calls, "comm": comm, "kinds": kinds}


def run_pp_sp_case(name, constraints, world=4, **kw):
    """``constraints`` (pp=2 and a sequence mode) on ``world`` gloo ranks against one process: numerics,
    every rank holding only its stage's blocks, bytes per mesh axis and point-to-point = the plan's
    per-stage prediction. Returns (plan, per-rank results)."""
    m = constraints["num_micro_batches"]
    cluster = CPU4 if world == 4 else autopar.Cluster.preset("cpu", devices=world)
    plan = plan_case(name, constraints, cluster=cluster, **kw)
    deg = plan.degrees
    for k, v in constraints.items():
        if k in deg:
            assert deg[k] == v, (k, deg)
    assert plan.world_size == world, plan.world_size
    model, batch = ZOO[name](**kw)
    ref_losses, ref_sd = train_eagerly(model, batch, torch.optim.SGD(model.parameters(), lr=OPT["lr"],
                                                                     momentum=OPT["momentum"]), STEPS)
    res = run_local(train_stage_rank, world, args=(name, plan.to_json(), kw), timeout=400)
    assert_matches_eager([r["losses"] for r in res], res[0]["sd"], ref_losses, ref_sd)
    pp = deg["pp"]
    traced = trace(*ZOO[name](**kw))
    unit_module = [traced.blocks[g].module_fqns[i] for g, i in pipeline_units(traced)]
    for r in res:
        mine = [st for st in plan.data["stages"] if st["index"] % pp == r["stage"]]
        held = {u for u, mod in enumerate(unit_module) if any(p.startswith(mod + ".") for p in r["params"])}
        assert held == {u for st in mine for u in range(*st["blocks"])}, (r["stage"], held, mine)
        assert r["calls"] == len(mine) * (STEPS * m + 1)   # + PyTorch's metadata pass at the first step
        # bytes per mesh axis and point-to-point in steps 2..STEPS = the plan's for this rank's stage
        for axis in plan.mesh.names:
            want = (STEPS - 1) * sum(st["comm_bytes"][axis] for st in mine)
            assert r["comm"].get(axis, 0) == want, (r["stage"], axis, r["comm"], want)
        p2p = (STEPS - 1) * sum(st["p2p_bytes"] for st in mine)
        assert r["comm"]["pp"] == p2p > 0, (r["comm"], mine)
    return plan, res
