"""dcp_to_torch_save of a checkpoint saved under every kind of plan (issue 30).

Each case trains the zoo's tiny Llama (weights ramped, helpers/large_batch.py) two steps of SGD with
momentum under one plan kind (dp, ZeRO-1/2/3, tp, Megatron-SP, pp, the 2D, 2.5D and 3D grids (each
rank writing only its blocks), and dp over 4 ranks, another world size), saves it with
``compiled.save``, and converts the committed generation with plain
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``: the resulting state dict's model
entries equal the one-process model's after the same two steps (rel 1e-4), and its step is 2.
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import autopar
from autopar.execution import checkpoint_atomic
from helpers.large_batch import ramped_llama
from runtime.launch import run_local

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP otherwise (see tests/execution/test_execute.py)

STEPS = 2
OPT = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}
KINDS = [   # (id, ranks, constraints)
    ("dp2", 2, {"dp": 2, "zero": 0}),
    ("dp2-zero1", 2, {"dp": 2, "zero": 1}),
    ("dp2-zero2", 2, {"dp": 2, "zero": 2}),
    ("dp2-zero3", 2, {"dp": 2, "zero": 3}),
    ("tp2", 2, {"tp": 2}),
    ("megatron-sp2", 2, {"tp": 2, "sp": 2, "sp_mode": "megatron"}),
    ("pp2", 2, {"pp": 2, "num_micro_batches": 2}),
    ("2d", 4, {"tp_mode": "2d"}),
    ("2.5d", 8, {"tp_mode": "2.5d"}),
    ("3d", 8, {"tp_mode": "3d"}),
    ("dp4-zero1", 4, {"dp": 4, "zero": 1}),
]


def _train_and_save(rank, world, directory, constraints):
    model, batch = ramped_llama()
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), batch,
                         plan_options={"constraints": {"num_micro_batches": 1, **constraints}}, **OPT)
    for _ in range(STEPS):
        cm.step(*batch)
    cm.save(directory)
    return ({**cm.plan.degrees, "zero": cm.zero} if rank == 0 else None)


def _one_process():
    model, batch = ramped_llama()
    opt = torch.optim.SGD(model.parameters(), lr=OPT["lr"], momentum=OPT["momentum"])
    for _ in range(STEPS):
        opt.zero_grad()
        model(*batch).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("cid,world,constraints", KINDS, ids=[k[0] for k in KINDS])
def test_dcp_to_torch_save_gives_the_one_process_state_dict(tmp_path, cid, world, constraints):
    d = str(tmp_path / "ck")
    degrees = run_local(_train_and_save, world, args=(d, constraints), timeout=300)[0]
    for key, want in constraints.items():
        if key != "num_micro_batches":
            assert degrees[key] == want, f"{cid}: plan has {key}={degrees[key]}, not {want}"
    out = str(tmp_path / "one.pt")
    dcp_to_torch_save(checkpoint_atomic.committed_path(d), out)
    sd = torch.load(out)
    ref = _one_process()
    assert int(sd["step"]) == STEPS
    assert sd["model"].keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(sd["model"][k], ref[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{cid} {k}: {m}")
