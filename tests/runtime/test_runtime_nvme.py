"""NVMe offload in the ZeRO optimizer (runtime/nvme.py through runtime/offload.py,
``offload="optimizer-nvme"``): the optimizer state in files, the fp32 masters in host memory.

Two gloo processes: the MLP of test_runtime_optim.py trained 3 steps with ZeRO 0-3 x {SGD with
momentum, AdamW} (fp32 and a bf16 working dtype), once with the state in host memory
(``"optimizer"``; ZeRO-3 also ``"optimizer+params"``) and once in files (the same mode with
``-nvme``): losses and parameters BIT-equal (the same host step on the
same values; only where the state lives differs), the state's values equal, and the premise:
per step the files are read and written exactly once (``nvme_bytes`` read = write = the state's
bytes, through two buffers of the largest chunk's state), the files on disk hold exactly the
state (their size, and their contents read back with numpy equal to the state), the host holds
the masters but not the state, the files are in the ``offload_dir`` given (or a temporary
directory) and ``close()`` removes them.
"""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch

from runtime.launch import run_local
from runtime.optim import make_optimizer
from runtime.zero import ShardedOptimizer
from tests.runtime.test_runtime_optim import GLOBAL_BATCH, LR, STEPS, loss_fn, make_batch, make_model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
STATES = {"sgd": 1, "adamw": 2}


def _optimizer(name):
    if name == "sgd":
        return make_optimizer("sgd", LR, momentum=0.9, weight_decay=0.01)
    return make_optimizer("adamw", LR, weight_decay=0.1)


def _train(rank, world, stage, opt_name, dtype_name, offload, offload_dir=None):
    dtype = DTYPES[dtype_name]
    model = make_model()
    opt = ShardedOptimizer([list(m.parameters()) for m in model], None, stage, _optimizer(opt_name),
                           working_dtype=dtype if dtype != torch.float32 else None, offload=offload,
                           offload_dir=offload_dir)
    if stage == 3:
        opt.zero3_hooks(list(model))
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    losses, io = [], []
    for step in range(1, STEPS + 1):
        x, y = make_batch(step)
        opt.zero_grad()
        opt.reset_comm_stats()
        loss = loss_fn(model, x[rows].to(dtype), y[rows].to(dtype))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        io.append(opt.nvme_bytes())
    return opt, losses, io


def _case(rank, world, cfg, root):
    stage, opt_name, dtype_name, mode = cfg
    given = os.path.join(root, f"rank{rank}-{stage}-{opt_name}-{dtype_name}-{mode}") if stage == 1 else None
    if given:
        os.makedirs(given)
    ref, ref_losses, _ = _train(rank, world, stage, opt_name, dtype_name, mode)
    opt, losses, io = _train(rank, world, stage, opt_name, dtype_name, mode + "-nvme", given)
    store = opt.offload.nvme
    files = dict(store.files)
    on_disk = {k: np.fromfile(p, dtype=np.float32).tolist() for k, p in files.items()}
    out = dict(losses=losses, ref_losses=ref_losses, io=io,
               params=[p.float().tolist() for p in opt.full_parameters()],
               ref_params=[p.float().tolist() for p in ref.full_parameters()],
               state=[{k: v.tolist() for k, v in c.state.items()} for c in opt.chunks],
               ref_state=[{k: v.tolist() for k, v in c.state.items()} for c in ref.chunks],
               pieces=[c.master.numel() for c in opt.chunks], on_disk=on_disk,
               host=opt.host_bytes(), ref_host=ref.host_bytes(), dir=store.path, given=given,
               device_optimizer=opt.state_bytes()["optimizer"])
    opt.close()
    ref.close()
    out["removed"] = not os.path.exists(store.path) and not any(os.path.exists(p) for p in files.values())
    return out


CONFIGS = [(stage, opt, dt, "optimizer") for stage in (0, 1, 2, 3) for opt in ("sgd", "adamw")
           for dt in ("fp32", "bf16")] + [(3, opt, dt, "optimizer+params") for opt, dt in (("sgd", "fp32"),
                                                                                         ("adamw", "bf16"))]


def _all(rank, world, root):
    return {cfg: _case(rank, world, cfg, root) for cfg in CONFIGS}


@functools.lru_cache(maxsize=None)
def _runs(root):
    return run_local(_all, 2, args=(root,), timeout=600)


@pytest.mark.slow
def test_nvme_offload_equals_host_offload(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("nvme"))
    for rank, results in enumerate(_runs(root)):
        for cfg, r in results.items():
            stage, opt_name, dtype_name, _ = cfg
            where = (rank, cfg)
            assert r["losses"] == r["ref_losses"] and r["params"] == r["ref_params"], where
            assert r["state"] == r["ref_state"], where
            # the premise: the state in files, read and written once per step, exactly its bytes
            state_bytes = sum(r["pieces"]) * 4 * STATES[opt_name]
            assert state_bytes > 0
            buffer = 2 * max(r["pieces"]) * 4 * STATES[opt_name]   # two buffers of the largest chunk's state
            assert r["io"] == [dict(read=state_bytes, write=state_bytes, disk=state_bytes, buffer=buffer)] * STEPS, \
                where
            assert len(r["on_disk"]) == len(r["pieces"]) * STATES[opt_name], where
            flat = [v for c in r["state"] for k in sorted(c) for v in c[k]]
            disk = [v for i, c in enumerate(r["state"]) for k in sorted(c) for v in r["on_disk"][f"{i}.{k}"]]
            assert disk == flat, where   # the files hold the state itself
            # the host: masters (not the state); the device: no optimizer
            assert r["host"]["optimizer"] == sum(r["pieces"]) * 4, where
            assert r["ref_host"]["optimizer"] == sum(r["pieces"]) * 4 * (1 + STATES[opt_name]), where
            assert r["device_optimizer"] == 0, where
            if r["given"]:
                assert os.path.dirname(r["dir"]) == r["given"], where
            assert r["removed"], where


def test_offload_dir_errors(tmp_path):
    model = make_model()
    chunks = [list(m.parameters()) for m in model]
    with pytest.raises(ValueError, match="offload_dir is for offload='optimizer-nvme'"):
        ShardedOptimizer(chunks, None, 1, _optimizer("sgd"), offload="optimizer", offload_dir=str(tmp_path))
    with pytest.raises(ValueError, match="optimizer\\+params-nvme offloads ZeRO-3's parameter shards"):
        ShardedOptimizer(chunks, None, 2, _optimizer("sgd"), offload="optimizer+params-nvme")
