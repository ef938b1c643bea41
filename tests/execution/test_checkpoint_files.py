"""compiled.save / load files (autopar/execution/checkpoint_atomic.py, checkpoint_io.py).

- atomic saves: a rank killed (``os._exit``, the ``AUTOPAR_CHECKPOINT_FAULT`` hook) before, during
  or after writing a save over a good checkpoint, or after the commit, leaves a directory that a
  fresh set of processes loads into exactly the old (or, after the commit, the new) state; a
  directory no save into finished is a clear ExecutionError naming what is missing;
- sharded saves: saved under one plan (dp=2 ZeRO-3, tp=2, dp=2 x tp=2 ZeRO-1), loaded under
  another (other mesh, ZeRO stage, world size, one process), training continues equal to
  uninterrupted one-process training (SGD with momentum, parameters rel 1e-4); the committed
  generation converted by ``dcp_to_torch_save`` is the one-process state dict; each rank wrote
  only its pieces (the files' bytes are about the model's, not world size times it);
- asynchronous saves write the state at the call while training goes on; a second save waits; a
  rank killed before, during or after the background writes, or after the commit, while the other
  ranks train on, leaves the old (or, after the commit, the new) state, exactly;
- mixed precision: the fp32 masters are what is saved and loaded, exactly;
- a plain DCP directory (older autopar) stays loadable until a save commits over it; extra state
  entries (a schedule's numbers and tensors) go through unchanged.

The model is the zoo's MLP with odd widths, so ZeRO shard boundaries fall inside rows.
"""
from __future__ import annotations

import os

import pytest
import torch

import autopar
from autopar.errors import ExecutionError
from autopar.execution import checkpoint_atomic
from codegen.boxes import flat_boxes
from autopar.models import ZOO
from runtime.launch import LocalLaunchError, run_local

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP otherwise (see tests/execution/test_execute.py)

KW = dict(d_in=20, hidden=36, n_layer=2, d_out=6, batch=8)
OPT = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}
NM1 = {"num_micro_batches": 1}


def _plan_json(devices, constraints):
    model, batch = ZOO["mlp"](**KW)
    return autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=devices), precision="fp32",
                        constraints={**NM1, **constraints}).to_json()


def _compile(world, plan_json):
    model, batch = ZOO["mlp"](**KW)
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), **OPT)
    return cm, batch


def _state(cm):
    """Everything a checkpoint holds, as full tensors (collective)."""
    sd = {k: v.clone() for k, v in cm.full_state_dict().items()}
    opt = {k: v.clone() for k, v in cm._full_optimizer_state().items()}
    return {"model": sd, "optim": opt, "step": cm.opt.step_count}


def _assert_state_equal(a, b):
    assert a["step"] == b["step"]
    for g in ("model", "optim"):
        assert a[g].keys() == b[g].keys()
        for k in a[g]:
            assert torch.equal(a[g][k], b[g][k]), f"{g}.{k} differs"


def test_flat_boxes_cover_ranges_exactly():
    for shape in [(7,), (4, 5), (3, 4, 5), ()]:
        n = max(1, int(torch.tensor(shape).prod())) if shape else 1
        full = torch.arange(n).reshape(shape)
        for a in range(n + 1):
            for b in range(a, n + 1):
                boxes = flat_boxes(shape, a, b)
                assert len(boxes) <= max(1, 2 * len(shape) - 1)
                got = []
                for off, size, start in boxes:
                    sl = tuple(slice(o, o + s) for o, s in zip(off, size))
                    vals = full[sl].reshape(-1) if shape else full.reshape(-1)
                    assert vals.tolist() == list(range(start, start + vals.numel()))
                    got += vals.tolist()
                assert got == list(range(a, b))


# ------------------------------------------------------------------ atomic saves

def _save_then_die(rank, world, directory, record, plan_json, point, blocking=True):
    cm, batch = _compile(world, plan_json)
    for _ in range(2):
        cm.step(*batch)
    cm.save(directory)
    old = _state(cm)
    cm.step(*batch)
    new = _state(cm)
    if rank == 0:
        torch.save({"old": old, "new": new}, record)
    os.environ["AUTOPAR_CHECKPOINT_FAULT"] = point
    os.environ["AUTOPAR_CHECKPOINT_FAULT_RANK"] = str(1 if point in ("during",) else 0)
    if blocking:
        cm.save(directory)
        return "not killed"
    h = cm.save(directory, blocking=False)   # "before" dies here; the others on the writing thread
    cm.step(*batch)                          # training goes on while the rank dies in the background
    h.wait()
    return "not killed"


def _numpy(state):   # plain pickling through run_local's queue (tensors would go by shared memory)
    return {g: ({k: v.numpy() for k, v in d.items()} if isinstance(d, dict) else d) for g, d in state.items()}


def _torch(state):
    return {g: ({k: torch.from_numpy(v) for k, v in d.items()} if isinstance(d, dict) else d) for g, d in state.items()}


def _load_state(rank, world, directory, plan_json):
    cm, _ = _compile(world, plan_json)
    cm.load(directory)
    state = _state(cm)   # collective
    return _numpy(state) if rank == 0 else None


@pytest.mark.slow
@pytest.mark.parametrize("blocking,zero", [(True, 1), (False, 2)], ids=["blocking", "asynchronous"])
@pytest.mark.parametrize("point,expect", [("before", "old"), ("during", "old"), ("after", "old"),
                                          ("committed", "new")])
def test_killed_save_leaves_old_or_new_checkpoint(tmp_path, point, expect, blocking, zero):
    """A rank killed at ``point`` of a save (blocking, or ``blocking=False`` with training going on):
    the directory loads exactly the old or the new state."""
    d, record = str(tmp_path / "ck"), str(tmp_path / "states.pt")
    plan = _plan_json(2, {"dp": 2, "tp": 1, "zero": zero})
    with pytest.raises(LocalLaunchError):
        run_local(_save_then_die, 2, args=(d, record, plan, point, blocking), timeout=120, pg_timeout=10)
    states = torch.load(record)
    loaded = _torch(run_local(_load_state, 2, args=(d, plan), timeout=120)[0])
    _assert_state_equal(loaded, states[expect])
    other = states["new" if expect == "old" else "old"]
    assert not all(torch.equal(loaded["model"][k], other["model"][k]) for k in loaded["model"])
    if blocking:   # the uncommitted generation is gone after the next successful save (next test)
        assert len(checkpoint_atomic.generations(d)) == 1


def _save_twice(rank, world, directory, plan_json):
    cm, batch = _compile(world, plan_json)
    cm.step(*batch)
    cm.save(directory)
    cm.step(*batch)
    cm.save(directory, keep_last=2)
    return sorted(os.listdir(directory))


@pytest.mark.slow
def test_generations_pointer_and_incomplete_directory_errors(tmp_path):
    d = str(tmp_path / "ck")
    plan = _plan_json(2, {"dp": 2, "tp": 1, "zero": 0})
    names = run_local(_save_twice, 2, args=(d, plan), timeout=120)[0]
    gens = checkpoint_atomic.generations(d)
    assert len(gens) == 2 and gens[0].startswith("step-00000002-") and gens[1].startswith("step-00000001-")
    assert names == sorted([checkpoint_atomic.POINTER, *gens])
    # dcp_to_torch_save on the committed generation
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint_atomic.committed_path(d), str(tmp_path / "one.pt"))
    sd = torch.load(str(tmp_path / "one.pt"))
    assert int(sd["step"]) == 2 and set(sd) >= {"model", "optim"}

    # incomplete: a generation without .metadata, a missing data file, no pointer at all
    cur = checkpoint_atomic.committed_path(d)
    data = sorted(f for f in os.listdir(cur) if f.endswith(".distcp"))
    os.remove(os.path.join(cur, data[-1]))
    with pytest.raises(ExecutionError, match=rf"incomplete \(missing files: {data[-1]}"):
        checkpoint_atomic.check_complete(cur)
    os.remove(os.path.join(cur, ".metadata"))
    with pytest.raises(ExecutionError, match=r"incomplete: \.metadata is missing"):
        checkpoint_atomic.check_complete(cur)
    os.remove(os.path.join(d, checkpoint_atomic.POINTER))
    with pytest.raises(ExecutionError, match="is incomplete: no autopar_checkpoint.json and only uncommitted"):
        checkpoint_atomic.committed_path(d)


def _load_error(rank, world, directory, plan_json):
    cm, _ = _compile(world, plan_json)
    try:
        cm.load(directory)
    except ExecutionError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_load_of_an_incomplete_directory_is_a_clear_error(tmp_path):
    d = tmp_path / "ck"
    gen = d / "step-00000003-abcd0123"
    gen.mkdir(parents=True)
    (gen / "__0_0.distcp").write_bytes(b"partial")
    plan = _plan_json(1, {})
    msg = run_local(_load_error, 1, args=(str(d), plan), timeout=120)[0]
    assert msg and "incomplete" in msg and "step-00000003-abcd0123" in msg and "nothing was loaded" in msg


# ------------------------------------------------------------------ sharded saves, any plan to any plan

def _eager(steps):
    model, batch = ZOO["mlp"](**KW)
    opt = torch.optim.SGD(model.parameters(), lr=OPT["lr"], momentum=OPT["momentum"])
    for _ in range(steps):
        opt.zero_grad()
        model(*batch).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _phase(rank, world, directory, plan_json, phase):
    cm, batch = _compile(world, plan_json)
    if phase == "save":
        for _ in range(2):
            cm.step(*batch)
        cm.save(directory)
        files = checkpoint_atomic.committed_path(directory)
        return sum(os.path.getsize(os.path.join(files, f)) for f in os.listdir(files))
    cm.load(directory)
    assert cm.opt.step_count == 2
    cm.step(*batch)
    sd = {k: v.numpy() for k, v in cm.full_state_dict().items()}
    return sd if rank == 0 else None


CASES = {   # name -> (world A, constraints A, world B, constraints B)
    "dp2-zero3-to-tp2": (2, {"dp": 2, "tp": 1, "zero": 3}, 2, {"dp": 1, "tp": 2, "zero": 0}),
    "tp2-to-one": (2, {"dp": 1, "tp": 2, "zero": 0}, 1, {}),
    "dp2xtp2-zero1-to-dp2-zero2": (4, {"dp": 2, "tp": 2, "zero": 1}, 2, {"dp": 2, "tp": 1, "zero": 2}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_save_under_one_plan_load_under_another(tmp_path, case):
    wa, ca, wb, cb = CASES[case]
    d = str(tmp_path / "ck")
    nbytes = run_local(_phase, wa, args=(d, _plan_json(wa, ca), "save"), timeout=240)[0]
    got = {k: torch.from_numpy(v) for k, v in run_local(_phase, wb, args=(d, _plan_json(wb, cb), "load"),
                                                         timeout=240)[0].items()}
    ref = _eager(3)
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")
    # Each piece written once: model + momentum, fp32, plus metadata and pickling overhead.
    params = sum(v.numel() for v in ref.values())
    assert nbytes < 2 * params * 4 * 1.5 + 64 * 1024, nbytes

    # dcp_to_torch_save of the committed generation: the one-process state dict after 2 steps
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint_atomic.committed_path(d), str(tmp_path / "one.pt"))
    sd = torch.load(str(tmp_path / "one.pt"))
    ref2 = _eager(2)
    assert sd["model"].keys() == ref2.keys() and int(sd["step"]) == 2
    for k in ref2:
        torch.testing.assert_close(sd["model"][k], ref2[k], rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------ asynchronous saves

def _async_save(rank, world, directory, plan_json):
    cm, batch = _compile(world, plan_json)
    for _ in range(2):
        cm.step(*batch)
    at_save = _state(cm)
    h = cm.save(directory, blocking=False)
    cm.step(*batch)                       # training goes on while the staged copy is written
    h2 = cm.save(directory + "-2", blocking=False)   # waits for the first one, then starts
    assert h.done()
    cm.step(*batch)
    h2.wait()
    h2.wait()                             # a second wait is a no-op
    assert h2.done()
    return _numpy(at_save) if rank == 0 else None


@pytest.mark.slow
def test_asynchronous_save_writes_the_state_at_the_call(tmp_path):
    d = str(tmp_path / "ck")
    plan = _plan_json(2, {"dp": 2, "tp": 1, "zero": 2})
    at_save = _torch(run_local(_async_save, 2, args=(d, plan), timeout=120)[0])
    loaded = _torch(run_local(_load_state, 2, args=(d, plan), timeout=120)[0])
    _assert_state_equal(loaded, at_save)
    loaded2 = _torch(run_local(_load_state, 2, args=(d + "-2", plan), timeout=120)[0])
    assert loaded2["step"] == 3


# ------------------------------------------------------------------ mixed precision: the fp32 masters

def _bf16_phase(rank, world, directory, plan_json, phase):
    model, batch = ZOO["mlp"](**KW)
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), precision="bf16", **OPT)
    if phase == "save":
        for _ in range(2):
            cm.step(*batch)
        cm.save(directory)
    else:
        cm.load(directory)
    state = _state(cm)
    return _numpy(state) if rank == 0 else None


@pytest.mark.slow
def test_mixed_precision_saves_and_loads_the_fp32_masters(tmp_path):
    """bf16 working copies, fp32 masters (sharded under ZeRO-1, whole at stage 0): what is saved
    and loaded is the masters' exact values, across ZeRO stages and world sizes."""
    d = str(tmp_path / "ck")
    saved = _torch(run_local(_bf16_phase, 2, args=(d, _plan_json(2, {"dp": 2, "tp": 1, "zero": 1}), "save"),
                             timeout=120)[0])
    loaded = _torch(run_local(_bf16_phase, 2, args=(d, _plan_json(2, {"dp": 1, "tp": 2, "zero": 0}), "load"),
                              timeout=120)[0])
    _assert_state_equal(loaded, saved)
    assert any(not torch.equal(v, v.bfloat16().float()) for v in saved["model"].values())   # really fp32 values


def test_a_pre_pointer_checkpoint_loads_until_a_save_commits_over_it(tmp_path):
    """A plain DCP directory (what compiled.save wrote before generations) is itself the committed
    checkpoint; a save into it that dies before its commit leaves it so; a committed save
    replaces it and removes its top-level files. In one process (no process group)."""
    import torch.distributed.checkpoint as dcp

    from autopar.execution import checkpoint_io

    d = str(tmp_path / "ck")
    dcp.save({"model": {"w": torch.ones(3, 4)}, "step": torch.tensor(1)}, checkpoint_id=d, no_dist=True)
    assert checkpoint_atomic.committed_path(d) == d
    gen = checkpoint_atomic.begin(d, 2)
    new = {"model": {"w": torch.full((3, 4), 2.0)}, "step": torch.tensor(2)}
    checkpoint_io.write(new, gen)
    assert checkpoint_atomic.committed_path(d) == d          # written, not committed: still the old one
    checkpoint_atomic.commit(d, gen)
    assert checkpoint_atomic.committed_path(d) == gen
    assert sorted(os.listdir(d)) == sorted([checkpoint_atomic.POINTER, os.path.basename(gen)])
    got = {"model": {"w": torch.zeros(3, 4)}, "step": torch.tensor(0)}
    checkpoint_io.read(got, checkpoint_atomic.committed_path(d), no_dist=True)
    assert torch.equal(got["model"]["w"], new["model"]["w"]) and int(got["step"]) == 2


def test_extra_state_entries_are_written_and_read_as_they_are(tmp_path):
    """Entries a caller adds next to model/optim/step (a schedule's state: numbers, tensors) go
    through checkpoint_io.write / read unchanged, nested dicts included."""
    from autopar.execution import checkpoint_io

    d = str(tmp_path / "g")
    checkpoint_io.write({"step": torch.tensor(5), "sched": {"lr": 0.25, "name": "cosine", "t": torch.arange(3.0)}}, d)
    got = {"step": torch.tensor(0), "sched": {"lr": 0.0, "name": "", "t": torch.zeros(3)}}
    checkpoint_io.read(got, d, no_dist=True)
    assert int(got["step"]) == 5 and got["sched"]["lr"] == 0.25 and got["sched"]["name"] == "cosine"
    assert torch.equal(got["sched"]["t"], torch.arange(3.0))


@pytest.mark.slow
def test_save_and_load_add_about_one_piece_per_rank():
    """The memory bound (benchmarks/bench_checkpoint_memory.py, small): dp=2 ZeRO-3, a 16 MB MLP
    (4 MB largest tensor, 16 MB shard of parameters + momentum per rank); save and load each add
    at most the largest tensor and a little, never a copy of the shard or of the model."""
    from benchmarks.bench_checkpoint_memory import run as measure

    MB = 2 ** 20
    for r, m in enumerate(measure(0, "new", world=2, shape=(1024, 3))):
        assert abs(m["shard"] - 16 * MB) < MB and m["largest"] == 4 * MB
        for what in ("save", "load"):
            assert m[what] < m["largest"] + 4 * MB, f"rank {r} {what} added {m[what] / MB:.1f} MB"
