"""2D / 2.5D / 3D grid plans save and load through the sharded path (issue 30,
autopar/execution/checkpoint_io.py): each rank writes only the pieces it holds and reads only the
pieces it needs, as DCP chunks of the FULL tensor, so grid, dp and one-process plans load each
other's checkpoints; no full tensor is gathered (``_gather_full`` raises during save and load).

A grid parameter's block is a block of its stored form (codegen/grid_rank_program.py: a linear's
weight transposed, QKV columns head-grouped, a patch-embedding weight reshaped and transposed):
``stored_to_full`` maps a box of the stored form to boxes of the full tensor (views, no copy).

  * unit: for every stored form, random boxes of the stored tensor map to boxes of the full one
    holding the same values, covering the box once, writable in place;
  * premise: a grid rank's DCP file holds only chunks inside the pieces it holds (the metadata's
    storage index names the file of every chunk), a split weight is saved as several chunks (never
    one full chunk), and each rank writes at most its share;
  * the zoo GPT-2 (one block) trains 2 steps (SGD, momentum) under 2D (4 ranks), 2.5D, 3D and 2D x dp 2 with
    ZeRO-1 (8 ranks: optimizer shards of grid blocks) and is
    saved; each checkpoint loads into the other grid plans, a dp=2 plan and one process, and every
    parameter, momentum buffer and the step equal the saved ones exactly; the ViT (conv weight)
    2D checkpoint, saved in the background, round-trips into one process.
"""
from __future__ import annotations

import math
import os
import random

import pytest
import torch
import torch.distributed.checkpoint as dcp

import autopar
from autopar.execution import checkpoint_atomic, checkpoint_io
from autopar.models import ZOO
from codegen.grid_local import ParamUse
from codegen.grid_rank_program import stored_shape, stored_to_full, to_stored
from runtime.launch import run_local

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops

OPT = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9}
STEPS = 2
GRIDS = {   # id -> (ranks, constraints)
    "2d": (4, {"tp_mode": "2d", "tp_shape": [2, 2]}),
    "2.5d": (8, {"tp_mode": "2.5d", "tp_shape": [2, 2, 2]}),
    "3d": (8, {"tp_mode": "3d", "tp_shape": [2, 2, 2]}),
    "2d-dp2-zero1": (8, {"tp_mode": "2d", "tp_shape": [2, 2], "dp": 2, "zero": 1}),   # ZeRO shards of grid blocks
}
# one GPT-2 block holds every kind of grid parameter the two-block zoo model does (embedding table,
# head-grouped QKV, transposed linears, norms, biases): half the compile time of every rank
MODEL_KW = {"gpt2": dict(n_layer=1)}
DP = (2, {"dp": 2, "tp": 1, "num_micro_batches": 1})
ONE = (1, {"dp": 1, "tp": 1, "num_micro_batches": 1})


# ---------------------------------------------------------------- stored boxes -> full boxes

USES = [(ParamUse("weight", "p"), (6, 4)), (ParamUse("weight", "p", perm=(0, 2, 4, 1, 3, 5)), (6, 4)),
        (ParamUse("bias", "p", perm=(0, 2, 4, 1, 3, 5)), (6,)), (ParamUse("conv", "p"), (4, 3, 2, 2)),
        (ParamUse("norm", "p"), (8,)), (ParamUse("table", "p"), (5, 8)), (ParamUse("loose", "p", hdim=1), (2, 8, 3)),
        (ParamUse("whole", None), (3, 5))]


@pytest.mark.parametrize("use,shape", USES, ids=[f"{u.kind}{'-perm' if u.perm else ''}" for u, _ in USES])
def test_a_box_of_the_stored_form_is_boxes_of_the_full_tensor(use, shape):
    rng = random.Random(0)
    full = torch.arange(math.prod(shape)).reshape(shape)
    stored = to_stored(use, full)
    assert tuple(stored.shape) == stored_shape(use, shape)
    for _ in range(100):
        off = [rng.randrange(n) for n in stored.shape]
        size = [rng.randint(1, n - o) for n, o in zip(stored.shape, off)]
        box = stored[tuple(slice(o, o + s) for o, s in zip(off, size))].clone()
        pieces = stored_to_full(use, shape, off, box)
        assert sum(v.numel() for _, v in pieces) == box.numel()
        for o, v in pieces:
            assert torch.equal(full[tuple(slice(a, a + n) for a, n in zip(o, v.shape))], v), (o, v.shape)
        assert sorted(x for _, v in pieces for x in v.flatten().tolist()) == sorted(box.flatten().tolist())
        for _, v in pieces:   # views of the box: a load writes into it
            v.zero_()
        assert not box.any()


# ---------------------------------------------------------------- multi-process

def _plan(world, constraints, name="gpt2"):
    model, batch = ZOO[name](**MODEL_KW.get(name, {}))
    return autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=world), precision="fp32",
                        constraints=constraints).to_json()


def _compile(world, plan_json, name="gpt2"):
    model, batch = ZOO[name](**MODEL_KW.get(name, {}))
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), **OPT)
    return cm, batch


def _no_gather(cm):
    def refuse(*a, **k):
        raise AssertionError("a full tensor was gathered")
    cm._gather_full = refuse


def _full(cm):
    """Every parameter and optimizer state whole (collective), the step: rank 0's to compare."""
    del cm._gather_full
    sd = {k: v.clone() for k, v in cm.full_state_dict().items()}
    opt = {k: v.cpu().clone() for k, v in cm._full_optimizer_state().items()}
    return sd, opt, cm.opt.step_count


def _held(cm):
    """(key, offsets, sizes) of every piece this rank holds, and their bytes."""
    state = checkpoint_io.local_state(cm)
    boxes = [(f"{g}.{k}", tuple(off), tuple(t.shape)) for g in ("model", "optim")
             for k, pc in state[g].items() for off, t in pc.pieces]
    return boxes, checkpoint_io.local_bytes(state)


def _save_rank(rank, world, jobs):
    out = []
    for plan_json, directory, name, *blocking in jobs:
        cm, batch = _compile(world, plan_json, name)
        for _ in range(STEPS):
            cm.step(*batch)
        _no_gather(cm)
        handle = cm.save(directory, blocking=not blocking or blocking[0])
        if handle is not None:
            handle.wait()
        held = _held(cm)
        full = _full(cm)
        out.append((type(cm.program).__name__, held, full if rank == 0 else None))
    return out


def _load_rank(rank, world, plan_json, directories, name="gpt2"):
    """The plan compiled once (a compile is most of a rank's time here), each checkpoint of
    ``directories`` loaded into it in turn. Before every load but the first, one more training step
    moves the step count and every parameter and momentum buffer a step has ever moved away from
    the values just loaded, as a fresh compile's are away from any checkpoint's: a piece a load
    skipped would differ from the saved one (what never moves, e.g. the embedding rows of absent
    tokens, is the init in every checkpoint and in a fresh compile alike)."""
    cm, batch = _compile(world, plan_json, name)
    out = []
    for i, directory in enumerate(directories):
        if i:
            cm.step(*batch)
            assert cm.opt.step_count == STEPS + 1
        _no_gather(cm)
        cm.load(directory)
        full = _full(cm)
        out.append((type(cm.program).__name__, full if rank == 0 else None))
    return out


def _equal(got, want, label):
    sd, opt, step = got
    wsd, wopt, wstep = want
    assert step == wstep == STEPS, label
    assert sd.keys() == wsd.keys() and opt.keys() == wopt.keys(), label
    for k in wsd:
        assert torch.equal(sd[k], wsd[k]), f"{label}: {k} differs"
    for k in wopt:
        assert torch.equal(opt[k], wopt[k]), f"{label}: optimizer state {k} differs"


def _file_of(meta):
    """"model.<key>" -> {chunk offsets: rank whose file holds it} (DCP names files __<rank>_<n>.distcp)."""
    out = {}
    for idx, info in meta.storage_data.items():
        out.setdefault(idx.fqn, {})[tuple(idx.offset)] = int(os.path.basename(info.relative_path).split("_")[2])
    return out


def _check_pieces(directory, held, label):
    """Every chunk lies in the file of a rank that holds it; split weights are saved as blocks;
    every element is written once, each rank's at most what it holds (less than half the model)."""
    path = checkpoint_atomic.committed_path(directory)
    meta = dcp.FileSystemReader(str(path)).read_metadata()
    files = _file_of(meta)
    split, written, total = 0, [0] * len(held), 0
    for key, md in meta.state_dict_metadata.items():
        if not key.startswith(("model.", "optim.")):   # step, lr, optim_groups: small, written whole
            continue
        total += md.size.numel() * 4
        for ch in md.chunks:
            off, size = tuple(ch.offsets), tuple(ch.sizes)
            writer = files[key][off]
            assert (key, off, size) in set(held[writer][0]), f"{label}: rank {writer} wrote {key} {off} {size} " \
                                                             f"it does not hold"
            written[writer] += math.prod(size) * 4
        split += key.startswith("model.") and len(md.size) == 2 and len(md.chunks) > 1
    assert split, f"{label}: no weight saved as blocks"
    assert sum(written) == total, f"{label}: {sum(written)} bytes written for {total}"
    for r, (_, nbytes) in enumerate(held):
        assert written[r] <= nbytes < total / 2, f"{label}: rank {r} wrote {written[r]}, holds {nbytes} of {total}"
    return written, total


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each grid plan's checkpoint after 2 steps, with rank 0's full state and what each rank held."""
    d = tmp_path_factory.mktemp("grid_ck")
    out = {}
    for world in (4, 8):
        ids = [g for g, (n, _) in GRIDS.items() if n == world]
        jobs = [(_plan(world, GRIDS[g][1]), str(d / g), "gpt2") for g in ids]
        for g, (plan, _, _) in zip(ids, jobs):
            degrees = autopar.Plan.from_json(plan).degrees
            assert all(degrees[k] == v for k, v in GRIDS[g][1].items()), (g, degrees)
        res = run_local(_save_rank, world, args=(jobs,), timeout=600)
        for i, g in enumerate(ids):
            assert res[0][i][0] == "GridRankProgram", g
            out[g] = dict(dir=str(d / g), full=res[0][i][2], held=[r[i][1] for r in res], plan=jobs[i][0])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("grid", list(GRIDS))
def test_a_grid_rank_writes_only_its_own_pieces(saved, grid):
    _check_pieces(saved[grid]["dir"], saved[grid]["held"], grid)


@pytest.mark.slow
def test_grid_checkpoints_load_into_every_plan(saved):
    """2D <-> 2.5D <-> 3D <-> 2D x dp 2 (ZeRO-1), and each into dp=2 and one process: equal values,
    read piecewise."""
    targets = {**GRIDS, "dp2": DP, "one": ONE}
    for tid, (world, constraints) in targets.items():
        plan = saved[tid]["plan"] if tid in saved else _plan(world, constraints)   # a grid's: planned once
        sources = [g for g in GRIDS if g != tid]
        res = run_local(_load_rank, world, args=(plan, [saved[g]["dir"] for g in sources]), timeout=600)
        for i, g in enumerate(sources):
            want_prog = "GridRankProgram" if tid in GRIDS else "RankProgram"
            assert res[0][i][0] == want_prog, (g, tid)
            _equal(res[0][i][1], saved[g]["full"], f"{g} -> {tid}")


@pytest.mark.slow
def test_a_2d_vit_checkpoint_with_its_conv_weight_loads_into_one_process(tmp_path):
    """Saved in the background (``blocking=False``: the staged copies of the grid pieces)."""
    d = str(tmp_path / "vit")
    world, constraints = GRIDS["2d"]
    res = run_local(_save_rank, world, args=([(_plan(world, constraints, "vit"), d, "vit", False)],), timeout=600)
    assert res[0][0][0] == "GridRankProgram"
    _check_pieces(d, [r[0][1] for r in res], "vit 2d")
    back = run_local(_load_rank, 1, args=(_plan(*ONE, "vit"), [d], "vit"), timeout=600)
    _equal(back[0][0][1], res[0][0][2], "vit 2d -> one")
