"""Flat optimizers, clipping, bucketed DP all-reduce and ZeRO 0-3, against single-process torch.

Single process: FlatOptimizer AdamW/Adam/SGD vs torch.optim over several steps; LAMB/LARS on a
multi-tensor flat buffer vs a per-tensor reference written here from the papers' formulas;
clip_grad_norm vs torch.nn.utils.clip_grad_norm_.
Multi-process (gloo, 2 and 4 ranks): an MLP trained 3 steps with ZeRO 0/1/2/3 (with and without
clipping, AdamW; LAMB and LARS on ZeRO 2/3), each rank on its slice of the global batch, vs the same
MLP trained in this process on the full batch: losses and parameters (rtol 1e-5), state bytes
per rank and bytes sent per step against formulas.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from runtime.clip import clip_grad_norm
from runtime.ddp import GradAllReducer
from runtime.launch import run_local
from runtime.optim import Segments, make_optimizer
from runtime.zero import ShardedOptimizer
from runtime.zero_comm import ChunkComm

LR = 1e-2
STEPS = 3
GLOBAL_BATCH = 8
CLIP = 0.05  # small enough that every step really clips (checked below)


# ----------------------------------------------------------------------------- model
def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    # numels 80, 99, 30: padding to 2 and 4 ranks is exercised (80, 100, 30 / 80, 100, 32).
    return nn.Sequential(nn.Sequential(nn.Linear(7, 10), nn.Tanh()),
                         nn.Sequential(nn.Linear(10, 9), nn.Tanh()),
                         nn.Linear(9, 3))


def make_batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def loss_fn(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)  # mean over this rank's rows


def chunk_numels(model):
    return [sum(p.numel() for p in m.parameters()) for m in model]


def torch_optimizer(name, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.1)
    raise ValueError(name)


def flat_optimizer(name):
    hp = {"adamw": dict(weight_decay=0.1), "lamb": dict(weight_decay=0.1),
          "lars": dict(momentum=0.9, weight_decay=0.01, trust_coefficient=0.02)}[name]
    return make_optimizer(name, LR, **hp)


# ----------------------------------------------------------------------------- references
def lamb_ref_step(params, grads, states, step, lr=LR, b1=0.9, b2=0.999, eps=1e-6, wd=0.1):
    """Per-tensor LAMB, straight from the paper (bias-corrected Adam direction + decoupled decay)."""
    for p, g, st in zip(params, grads, states):
        m = st.setdefault("m", torch.zeros_like(p))
        v = st.setdefault("v", torch.zeros_like(p))
        m.copy_(b1 * m + (1 - b1) * g)
        v.copy_(b2 * v + (1 - b2) * g * g)
        u = (m / (1 - b1 ** step)) / ((v / (1 - b2 ** step)).sqrt() + eps) + wd * p
        pn, un = p.norm(), u.norm()
        ratio = pn / un if pn > 0 and un > 0 else torch.tensor(1.0)
        p.sub_(lr * ratio * u)


def lars_ref_step(params, grads, states, step, lr=LR, mom=0.9, wd=0.01, coef=0.02, eps=1e-8):
    """Per-tensor LARS with momentum (You et al. 2017)."""
    for p, g, st in zip(params, grads, states):
        buf = st.setdefault("buf", torch.zeros_like(p))
        pn, gn = p.norm(), g.norm()
        local = coef * pn / (gn + wd * pn + eps) if pn > 0 and gn > 0 else torch.tensor(1.0)
        buf.copy_(mom * buf + lr * local * (g + wd * p))
        p.sub_(buf)


@functools.lru_cache(maxsize=None)
def reference_run(opt_name: str, clip):
    """Single process, full global batch: per-step losses and final parameters."""
    model = make_model()
    params = list(model.parameters())
    topt = torch_optimizer(opt_name, params) if opt_name == "adamw" else None
    states = [{} for _ in params]
    losses = []
    for step in range(1, STEPS + 1):
        x, y = make_batch(step)
        model.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        losses.append(loss.item())
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
            assert norm > clip  # the test must really clip
        with torch.no_grad():
            if topt is not None:
                topt.step()
            elif opt_name == "lamb":
                lamb_ref_step(params, [p.grad for p in params], states, step)
            else:
                lars_ref_step(params, [p.grad for p in params], states, step)
    with torch.no_grad():
        evaluated = model(make_batch(0)[0])
    return losses, [p.detach().clone() for p in params], evaluated


# ----------------------------------------------------------------------------- ranks
def _train_one(rank, world, stage, opt_name, clip, rs="native"):
    model = make_model()
    chunks = [list(m.parameters()) for m in model]
    probe = ChunkComm.probe_reduce_scatter
    if rs == "all_reduce":  # exercise the fallback for backends without reduce_scatter
        ChunkComm.probe_reduce_scatter = lambda self: False
    try:
        opt = ShardedOptimizer(chunks, None, stage, flat_optimizer(opt_name), grad_clip=clip)
    finally:
        ChunkComm.probe_reduce_scatter = probe
    if stage == 3:
        opt.zero3_hooks(list(model))
        # Stored sharded: the full parameter storage is gone between uses.
        assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    losses, sent, grads_freed = [], [], True
    for step in range(1, STEPS + 1):
        x, y = make_batch(step)
        opt.zero_grad()
        opt.reset_comm_stats()
        loss = loss_fn(model, x[rows], y[rows])
        loss.backward()
        if stage >= 2:  # full gradients freed per chunk during backward
            grads_freed &= all(p.grad is None for p in model.parameters())
        opt.step()
        sent.append(opt.bytes_sent)
        ops = sorted({op for op, _ in opt.comm_log})
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.append(avg.item() / world)
    state = opt.state_bytes()
    with torch.no_grad():  # evaluation forward (stage 3: gathered and freed again by the hooks)
        evaluated = model(make_batch(0)[0]).tolist()
    if stage == 3:
        assert opt.state_bytes() == state
    # Plain lists: torch tensors would travel through shared memory that dies with the rank.
    params = [p.tolist() for p in opt.full_parameters()]
    return dict(losses=losses, params=params, sent=sent, state=state, grads_freed=grads_freed,
                numels=chunk_numels(model), ops=ops, evaluated=evaluated)


def _train_all(rank, world, configs):
    return {cfg: _train_one(rank, world, *cfg) for cfg in configs}


CONFIGS = [(stage, "adamw", clip) for stage in (0, 1, 2, 3) for clip in (None, CLIP)] + \
          [(2, "lamb", None), (3, "lamb", CLIP), (1, "lars", None), (3, "lars", None)] + \
          [(stage, "adamw", CLIP, "all_reduce") for stage in (1, 2, 3)]


@functools.lru_cache(maxsize=None)
def distributed_run(world):
    return run_local(_train_all, world, args=(CONFIGS,), timeout=120)


def expected_state_bytes(stage, opt_name, numels, world):
    padded = [-(-n // world) * world for n in numels]
    shard = [p // world for p in padded]
    per_el = {"adamw": 8, "lamb": 8, "lars": 4}[opt_name]
    params = sum(padded) if stage < 3 else sum(shard)
    grads = sum(numels) if stage < 2 else sum(shard)
    optim = sum(padded) * per_el if stage == 0 else sum(shard) * per_el
    return dict(params=4 * params, grads=4 * grads, optimizer=optim)


def expected_step_bytes(stage, opt_name, numels, world, clip):
    padded = [-(-n // world) * world for n in numels]
    if stage == 0:
        return 4 * sum(numels)  # one bucket: the gradients, all-reduced (clip norm needs no comm)
    per_chunk = {1: 2, 2: 2, 3: 3}[stage]  # RS + AG (+ the backward re-gather under stage 3)
    total = 4 * per_chunk * sum(padded)
    if clip is not None:
        total += 4  # one fp32 squared norm
    if opt_name in ("lamb", "lars"):
        # per chunk one all_reduce of fp32 [2, params + 1 padding id] squared norms (2 params each)
        total += len(numels) * 4 * 2 * (2 + 1)
    return total


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join([f"zero{c[0]}", c[1], f"clip{c[2]}", *c[3:]]))
def test_zero_matches_single_process(world, cfg):
    stage, opt_name, clip, *rs = cfg
    ref_losses, ref_params, ref_eval = reference_run(opt_name, clip)
    results = [r[cfg] for r in distributed_run(world)]
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for got, want in zip(r["params"], ref_params):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(torch.tensor(r["evaluated"]), ref_eval, rtol=1e-5, atol=1e-6)
        assert r["grads_freed"]
        assert r["state"] == expected_state_bytes(stage, opt_name, r["numels"], world)
        assert r["sent"] == [expected_step_bytes(stage, opt_name, r["numels"], world, clip)] * STEPS
        if stage == 0:
            assert r["ops"] == []  # the bucketed reducer counts its own all_reduce bytes
        elif rs:  # fallback: reduce_scatter replaced by all_reduce of the same payload
            assert r["ops"] == ["all_gather", "all_reduce"]
        else:
            assert "reduce_scatter" in r["ops"] and "all_gather" in r["ops"]


# ----------------------------------------------------------------------------- bucketed DP
def _ddp_rank(rank, world):
    model = make_model()
    params = list(model.parameters())
    # 400-byte buckets: several buckets, so ordering and overlap are exercised.
    red = GradAllReducer(params, None, bucket_bytes=400)
    index = {id(p): i for i, p in enumerate(params)}
    buckets = [[index[id(p)] for p in b.params] for b in red.buckets]
    x, y = make_batch(1)
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    loss_fn(model, x[rows], y[rows]).backward()
    launched_in_backward = red._next_launch
    red.wait()
    grads = [p.grad.tolist() for p in params]
    # Gradient accumulation: a backward under no_sync, then a synced one: both are reduced.
    model.zero_grad()
    with red.no_sync():
        loss_fn(model, x[rows], y[rows]).backward()
    loss_fn(model, x[rows], y[rows]).backward()
    red.wait()
    grads2 = [p.grad.tolist() for p in params]
    return dict(buckets=buckets, launched=launched_in_backward, grads=grads, grads2=grads2,
                sent=red.bytes_sent)


def test_grad_all_reducer_buckets_and_values():
    world = 2
    out = run_local(_ddp_rank, world)
    model = make_model()
    x, y = make_batch(1)
    loss_fn(model, x, y).backward()
    ref = [p.grad for p in model.parameters()]
    sizes = [p.numel() * 4 for p in model.parameters()]  # 280, 40, 360, 36, 108, 12 bytes
    # Reverse order, greedy up to 400 bytes: [5,4,3] 156 B, [2,1] 400 B, [0] 280 B.
    assert out[0]["buckets"] == [[5, 4, 3], [2, 1], [0]]
    for r in out:
        assert r["launched"] == 3  # every bucket launched during backward, not at wait()
        for g, g2, want in zip(r["grads"], r["grads2"], ref):
            torch.testing.assert_close(torch.tensor(g), want, rtol=1e-5, atol=1e-8)
            torch.testing.assert_close(torch.tensor(g2), 2 * want, rtol=1e-5, atol=1e-8)
        assert r["sent"] == 2 * sum(sizes)


# ----------------------------------------------------------------------------- single process
def _params_and_grads(seed, shapes, steps):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]
    return params, grads


SHAPES = [(5, 3), (7,), (4, 4)]


@pytest.mark.parametrize("name,flat_hp,torch_cls,torch_hp", [
    ("adamw", dict(weight_decay=0.1, betas=(0.8, 0.99)), torch.optim.AdamW,
     dict(weight_decay=0.1, betas=(0.8, 0.99))),
    ("adam", dict(weight_decay=0.05), torch.optim.Adam, dict(weight_decay=0.05)),
    ("adam", {}, torch.optim.Adam, {}),
    ("sgd", dict(momentum=0.9, weight_decay=0.01), torch.optim.SGD, dict(momentum=0.9, weight_decay=0.01)),
    ("sgd", dict(momentum=0.9, nesterov=True), torch.optim.SGD, dict(momentum=0.9, nesterov=True)),
    ("sgd", dict(momentum=0.5, dampening=0.3), torch.optim.SGD, dict(momentum=0.5, dampening=0.3)),
    ("sgd", {}, torch.optim.SGD, {}),
])
def test_flat_optimizer_matches_torch_optim(name, flat_hp, torch_cls, torch_hp):
    steps = 5
    params, grads = _params_and_grads(1, SHAPES, steps)
    tparams = [nn.Parameter(p.clone()) for p in params]
    topt = torch_cls(tparams, lr=0.03, **torch_hp)
    opt = make_optimizer(name, 0.03, **flat_hp)
    flat = torch.cat([p.reshape(-1) for p in params])
    state = opt.init_state(flat.numel())
    for step in range(1, steps + 1):
        for tp, g in zip(tparams, grads[step - 1]):
            tp.grad = g.clone()
        topt.step()
        opt.step(flat, torch.cat([g.reshape(-1) for g in grads[step - 1]]), state, step)
        want = torch.cat([tp.detach().reshape(-1) for tp in tparams])
        # Same ops in the same order: equal to the last bit, not just close.
        assert torch.equal(flat, want), (step, (flat - want).abs().max())
    assert opt.state_bytes_per_element == 4 * len(state)


@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_lamb_lars_per_tensor_trust_ratio(name):
    steps = 4
    params, grads = _params_and_grads(2, SHAPES, steps)
    ref = [p.clone() for p in params]
    ref_states = [{} for _ in params]
    opt = flat_optimizer(name)
    flat = torch.cat([p.reshape(-1) for p in params])
    state = opt.init_state(flat.numel())
    segs = Segments.from_sizes([p.numel() for p in params])
    for step in range(1, steps + 1):
        opt.step(flat, torch.cat([g.reshape(-1) for g in grads[step - 1]]), state, step, segments=segs)
        (lamb_ref_step if name == "lamb" else lars_ref_step)(ref, grads[step - 1], ref_states, step)
    torch.testing.assert_close(flat, torch.cat([p.reshape(-1) for p in ref]), rtol=1e-5, atol=1e-7)
    # A whole-buffer trust ratio (no segments) is a different update: segments really matter.
    flat2 = torch.cat([p.reshape(-1) for p in params])
    state2 = opt.init_state(flat2.numel())
    for step in range(1, steps + 1):
        opt.step(flat2, torch.cat([g.reshape(-1) for g in grads[step - 1]]), state2, step)
    assert not torch.allclose(flat2, flat, rtol=1e-4)


def test_clip_grad_norm_matches_torch():
    _, grads = _params_and_grads(3, SHAPES, 1)
    grads = grads[0]
    tparams = [nn.Parameter(torch.zeros_like(g)) for g in grads]
    for tp, g in zip(tparams, grads):
        tp.grad = g.clone()
    want_norm = torch.nn.utils.clip_grad_norm_(tparams, 1.0)
    mine = [g.clone() for g in grads]
    norm = clip_grad_norm(mine, 1.0, [])
    torch.testing.assert_close(norm, want_norm, rtol=1e-6, atol=0)
    for g, tp in zip(mine, tparams):
        torch.testing.assert_close(g, tp.grad, rtol=1e-6, atol=1e-8)
    # Below the threshold nothing changes.
    small = [g.clone() for g in grads]
    clip_grad_norm(small, 1e6, [])
    assert all(torch.equal(a, b) for a, b in zip(small, grads))
