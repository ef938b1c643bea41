"""Plans that offload the optimizer state to NVMe (``offload="optimizer-nvme"``, and with ZeRO-3's
parameter shards on the host ``"optimizer+params-nvme"``, docs/offload.md) trained on 2 gloo
processes: SGD with momentum equals a single-process eager run (losses rel
1e-5, parameters rel 1e-4), AdamW equals the same plan without offload (losses), and the premise
measured on the run: the state's files are in the ``offload_dir`` given, written and read once
per step, exactly the state the plan predicts on NVMe (``nvme_bytes``), their size on disk that
too, the host holding the plan's host bytes (plus the two buffers of one chunk's state the files
stream through, which the plan leaves out), no optimizer state on the device, and
``compiled.close()`` removes the files."""
from __future__ import annotations

import functools
import os

import pytest
import torch
from helpers.exactness import assert_matches_eager, train_eagerly

import autopar
from autopar.models import ZOO
from runtime.launch import run_local

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops

STEPS = 3
SGD = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}
ADAMW = {"optimizer": "adamw", "lr": 1e-3}
CASES = [("dp zero2 sgd", {"dp": 2, "zero": 2, "offload": "optimizer-nvme"}, SGD),
         ("dp zero1 adamw", {"dp": 2, "zero": 1, "offload": "optimizer-nvme"}, ADAMW),
         ("dp zero3 sgd, parameters on the host", {"dp": 2, "zero": 3, "offload": "optimizer+params-nvme"}, SGD)]


def _plans():
    model, batch = ZOO["gpt2"]()
    cluster = autopar.Cluster.preset("cpu", devices=2)
    out = []
    for label, cons, opt in CASES:
        plan = autopar.plan(model, batch, cluster, constraints=cons, optimizer=opt["optimizer"], precision="fp32")
        ref = autopar.plan(model, batch, cluster, constraints={**cons, "offload": "none"}, optimizer=opt["optimizer"],
                           precision="fp32")
        out.append((label, plan.to_json(), ref.to_json(), opt))
    return out


def _train(rank, world, cases, root):
    results = []
    for i, (label, plan_json, ref_json, opt) in enumerate(cases):
        got = {}
        for key, pj in (("off", plan_json), ("ref", ref_json)):
            model, batch = ZOO["gpt2"]()
            given = os.path.join(root, f"case{i}")
            cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                                 plan=autopar.Plan.from_json(pj), offload_dir=given, **opt)
            losses, stats = [], []
            for _ in range(STEPS):
                cm.reset_comm_stats()
                losses.append(cm.step(*batch))
                stats.append(cm.offload_stats())
            sd = {k: v.numpy() for k, v in cm.full_state_dict().items()}
            store = cm.opt.offload.nvme
            files = sorted(store.files.values()) if store is not None else []
            inside = all(os.path.dirname(os.path.dirname(f)) == given for f in files)
            largest = max((sum(t.numel() * 4 for t in c.state.values()) for c in cm.opt.chunks), default=0)
            cm.close()
            got[key] = dict(losses=losses, sd=sd if rank == 0 else None, stats=stats, files=len(files),
                            inside=inside, removed=not any(os.path.exists(f) for f in files), largest=largest,
                            device_optimizer=cm.opt.state_bytes()["optimizer"])
        results.append(got)
    return results


@functools.lru_cache(maxsize=None)
def run(root):
    for i in range(len(CASES)):
        os.makedirs(os.path.join(root, f"case{i}"), exist_ok=True)
    plans = _plans()
    return plans, run_local(_train, 2, args=(plans, root), timeout=600)


@functools.lru_cache(maxsize=None)
def eager():
    model, batch = ZOO["gpt2"]()
    return train_eagerly(model, batch, torch.optim.SGD(model.parameters(), lr=SGD["lr"], momentum=SGD["momentum"]),
                         STEPS)


@pytest.mark.slow
def test_nvme_offloaded_plans_train_like_one_process(tmp_path_factory):
    plans, res = run(str(tmp_path_factory.mktemp("nvme")))
    ref_losses, ref_sd = eager()
    for i, (label, plan_json, _, opt) in enumerate(plans):
        plan = autopar.Plan.from_json(plan_json)
        pred = plan.predictions["offload"]
        assert plan.degrees["offload"].endswith("-nvme") and pred["target"] == "nvme", label
        runs, refs = [r[i]["off"] for r in res], [r[i]["ref"] for r in res]
        if opt is SGD:
            assert_matches_eager([r["losses"] for r in runs], runs[0]["sd"], ref_losses, ref_sd, label=f"{label}: ")
        torch.testing.assert_close(torch.tensor(runs[0]["losses"]), torch.tensor(refs[0]["losses"]), rtol=1e-5,
                                   atol=1e-6, msg=lambda m: f"{label}: {m}")
        for r in runs:
            # the state in files, read and written once per step: what the plan puts on NVMe
            assert r["files"] > 0 and r["inside"] and r["removed"], label
            assert r["device_optimizer"] == 0, label
            for s in r["stats"]:
                assert s["nvme_write"] == s["nvme_read"] == s["nvme_disk"] > 0, (label, s)
                assert s["nvme_write"] == pytest.approx(pred["nvme_bytes"], rel=0.02), (label, s, pred)
                assert s["host"] - s["nvme_buffer"] == pytest.approx(pred["host_bytes"], rel=0.02), (label, s, pred)
                assert s["nvme_buffer"] == 2 * r["largest"] > 0, (label, s)   # two buffers of one chunk's state
        for r in refs:
            assert "nvme_write" not in r["stats"][0] and r["files"] == 0, label
