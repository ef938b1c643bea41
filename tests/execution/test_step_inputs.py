"""What ``step`` is fed: inputs checked against the example batch, the same global batch on every
rank (the DDP habit of one batch per rank is an error, ``batch_rows()``'s rows stay valid), and
``compile(loss_fn=...)`` for a model whose forward does not return the loss."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.errors import ExecutionError
from autopar.models import ZOO, build
from runtime.launch import run_local

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP otherwise (see tests/execution/test_execute.py)

DP2 = {"dp": 2, "tp": 1, "num_micro_batches": 1}


def _plan(world=2):
    model, batch = ZOO["mlp"]()
    return autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=world), constraints=DP2).to_json()


def _compile(world, plan_json):
    model, batch = ZOO["mlp"]()
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), optimizer="sgd", lr=0.1)
    return cm, batch


def _error(fn):
    try:
        fn()
    except ExecutionError as e:
        return str(e)
    return None


def _wrong_inputs(rank, world, plan_json):
    cm, (x, y) = _compile(world, plan_json)
    return {
        "extra": _error(lambda: cm.step(x, y, y)),
        "missing": _error(lambda: cm.step(x)),
        "shape": _error(lambda: cm.step(x[:, :16], y)),
        "dtype": _error(lambda: cm.step(x.double(), y)),
        "rows": _error(lambda: cm.step(x[:5], y[:5])),
    }


@pytest.mark.slow
def test_step_checks_inputs_against_the_example_batch():
    for msgs in run_local(_wrong_inputs, 2, args=(_plan(),), timeout=240):
        for case, msg in msgs.items():
            assert msg is not None, f"step() accepted {case!r} inputs"
            assert "re-plan" in msg and "example" in msg, (case, msg)
        assert "got 3 inputs" in msgs["extra"] and "for 2" in msgs["extra"]
        assert "torch.float64" in msgs["dtype"]


def _per_rank_batches(rank, world, plan_json):
    cm, (x, y) = _compile(world, plan_json)
    g = torch.Generator().manual_seed(100 + rank)   # DDP habit: every rank draws its own batch
    return _error(lambda: cm.step(torch.randn(x.shape, generator=g), y))


@pytest.mark.slow
def test_ranks_fed_different_batches_are_told_to_pass_the_global_batch():
    for msg in run_local(_per_rank_batches, 2, args=(_plan(),), timeout=240):
        assert msg is not None and "different batches" in msg and "GLOBAL batch" in msg, msg


def _rows_then_global(rank, world, plan_json):
    cm, batch = _compile(world, plan_json)
    rows = cm.batch_rows()
    first = cm.step(*(t[rows] for t in batch))   # only this rank's rows: each rank's differ, that is fine
    second = cm.step(*batch)
    return first, second, len(rows)


@pytest.mark.slow
def test_batch_rows_path_is_not_checksummed():
    res = run_local(_rows_then_global, 2, args=(_plan(),), timeout=240)
    assert res[0][2] == 8 and res[0][:2] == res[1][:2]


# ------------------------------------------------------------------ compile(loss_fn=...)

class Logits(nn.Module):
    """forward(x) returns logits: the loss comes from loss_fn."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 10)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def _logits_model():
    model = build(Logits, "cpu", 0)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(16, 32, generator=g), torch.randint(10, (16,), generator=g))


def _with_loss_fn(rank, world):
    model, batch = _logits_model()
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         loss_fn=F.cross_entropy, plan_options={"constraints": DP2},
                         optimizer="sgd", lr=0.1, momentum=0.9)
    losses = [cm.step(*batch) for _ in range(3)]
    return losses, {k: v.numpy() for k, v in cm.full_state_dict().items()}, cm.plan.degrees, cm.comm_stats()


def check_compile_with_loss_fn():
    """Run by test_compile_takes_loss_fn in a fresh interpreter (compile plans on rank 0: the ILP
    solver's threads do not survive a fork once the parent process has planned)."""
    model, batch = _logits_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    want = []
    for _ in range(3):
        opt.zero_grad()
        loss = F.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        want.append(loss.item())
    res = run_local(_with_loss_fn, 2, timeout=240)
    losses, sd, degrees, stats = res[0]
    assert degrees["dp"] == 2 and stats["dp"] > 0
    assert res[1][0] == losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=1e-6)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(torch.from_numpy(sd[k]), v, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_compile_takes_loss_fn():
    import os
    import subprocess
    import sys

    code = ("import sys; sys.path[:0] = [%r, %r]; import test_step_inputs as t; t.check_compile_with_loss_fn(); "
            "print('OK')" % (os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=400)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
