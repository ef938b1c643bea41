"""2D (SUMMA), 2.5D (Tesseract) and 3D tensor parallelism against one process, on forked gloo ranks.

A pre-LN transformer layer (causal self-attention on head-split activations, then the MLP
x + W2 gelu(W1 LN(x) + b1) + b2, residuals around both), then a classifier y Wh + bh and the mean
cross-entropy on the split logits, runs with every activation and parameter split over the grid
(runtime/summa.py, tesseract.py, matmul3d.py). The parent computes the
one-process reference; the ranks return their blocks, which the parent assembles (checking that
the blocks tile each tensor and that replicas agree) and compares: forward output, input and
parameter gradients (rel 1e-5), then 3 steps of SGD with momentum (loss rel 1e-5, params rel
1e-4). Each rank also checks the premise (it holds 1/q^2, 1/(d q^2) or 1/q^3 of each tensor) and
records the bytes its collectives moved per grid group, which must equal
solver/tp_grid_cost.py's prediction exactly - for the block and for a lone square linear, whose
counts also reproduce the papers' per-layer table.
"""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from runtime import matmul3d, summa, tesseract
from runtime.collectives import COMM_STATS
from runtime.grid import GridError, check_2d, check_2p5d, check_3d, check_divisible, take
from runtime.launch import run_local
from runtime.split_attention import qkv_column_order, local_attention
from solver import tp_grid_cost as cost

# Imported before forking (backward lazily imports it: 1-2 s per child otherwise).
import torch.fx.experimental.symbolic_shapes  # noqa: E402,F401

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops

B, S, NH = 4, 2, 2             # sequences, sequence length, heads
M, H, FF, V = B * S, 8, 16, 16  # tokens, hidden, MLP hidden, classes: divisible by q^3 = 8 and d*q = 4
HD = H // NH
EPS = 1e-5
STEPS, LR, MOMENTUM = 3, 0.5, 0.9
AXES = ("x", "y", "z")
PARAMS = ("emb", "ln1_w", "ln1_b", "wqkv", "bqkv", "wo", "bo", "ln2_w", "ln2_b", "w1", "b1", "w2", "b2", "wh", "bh")


def _globals():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    params = {"emb": r(V, H), "ln1_w": 1 + 0.1 * r(H), "ln1_b": 0.1 * r(H),
              "wqkv": r(H, 3 * H) / H ** 0.5, "bqkv": 0.1 * r(3 * H),
              "wo": r(H, H) / H ** 0.5, "bo": 0.1 * r(H),
              "ln2_w": 1 + 0.1 * r(H), "ln2_b": 0.1 * r(H), "w1": r(H, FF) / H ** 0.5, "b1": 0.1 * r(FF),
              "w2": r(FF, H) / FF ** 0.5, "b2": 0.1 * r(H), "wh": r(H, V) / H ** 0.5, "bh": 0.1 * r(V)}
    target = torch.randint(0, V, (M,), generator=g)
    ids = torch.randint(0, V, (M,), generator=g)
    # params, x, classes, lone X, lone W, token ids (the layer's input is emb[ids] + x)
    return params, r(M, H), target, r(M, M), r(M, M), ids


def _grid_order(p, q):
    """The QKV weight and bias as the grid stores them: columns in qkv_column_order, so each of
    the q column blocks holds whole heads (runtime/split_attention.py). Works on any dict of
    tensors keyed like the parameters (values, gradients, trained values)."""
    order = qkv_column_order(H, NH, q)
    return {k: (v[..., order] if k in ("wqkv", "bqkv") else v) for k, v in p.items()}


def _reference_layer(x, p, ids):
    """emb[ids] + x, then a pre-LN transformer layer: causal self-attention, then the MLP;
    residuals around both."""
    x = F.embedding(ids, p["emb"]) + x
    h = F.layer_norm(x, (H,), p["ln1_w"], p["ln1_b"], EPS)
    q_, k_, v_ = ((h @ p["wqkv"] + p["bqkv"]).split(H, -1))
    q_, k_, v_ = (t.reshape(B, S, NH, HD).transpose(1, 2) for t in (q_, k_, v_))
    a = F.scaled_dot_product_attention(q_, k_, v_, is_causal=True).transpose(1, 2).reshape(M, H)
    x = x + a @ p["wo"] + p["bo"]
    h = F.layer_norm(x, (H,), p["ln2_w"], p["ln2_b"], EPS)
    return x + F.gelu(h @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


def _specs(mode, grid):
    """Block spec of every tensor on this rank (runtime/grid.take)."""
    if mode == "3d":
        a1, a2 = AXES, matmul3d.swap(AXES)
        M3 = matmul3d
        ln = M3.vector_spec(grid, a2)      # LayerNorm vectors of a1's input (matmul3d.layer_norm)
        out = {"x": M3.act_spec(grid, a1), "ln1_w": ln, "ln1_b": ln, "ln2_w": ln, "ln2_b": ln,
               "wqkv": M3.weight_spec(grid, a1), "bqkv": M3.vector_spec(grid, a1),
               "wo": M3.weight_spec(grid, a2), "bo": M3.vector_spec(grid, a2),
               "w1": M3.weight_spec(grid, a1), "b1": M3.vector_spec(grid, a1),
               "w2": M3.weight_spec(grid, a2), "b2": M3.vector_spec(grid, a2),
               "wh": M3.weight_spec(grid, a1), "bh": M3.vector_spec(grid, a1),
               # the logits' tokens: the head's output is laid out as a2's input
               "target": M3.act_spec(grid, a2)[:1], "emb": M3.table_spec(grid, a1)}
    else:
        mod = summa if mode == "2d" else tesseract
        vec, w = mod.vector_spec(grid), mod.weight_spec(grid)
        out = {k: (w if k.startswith("w") else vec) for k in PARAMS}
        out["x"] = mod.act_spec(grid)
        out["target"] = out["x"][:1]
        out["emb"] = mod.table_spec(grid)
    out["ids"] = out["x"][:1]
    return out


def _block(mode, grid, x, p, ids):
    """emb[ids] + x, then the transformer layer on the grid; attention is local (whole
    sequences, whole heads)."""
    if mode == "3d":
        M3, a1, a2 = matmul3d, AXES, matmul3d.swap(AXES)
        x = M3.embedding(ids, p["emb"], grid, a1) + x
        h = M3.layer_norm(x, p["ln1_w"], p["ln1_b"], grid, a1, EPS)
        a = local_attention(M3.linear(h, p["wqkv"], p["bqkv"], grid, a1), S, HD)
        x = x + M3.linear(a, p["wo"], p["bo"], grid, a2)
        h = M3.layer_norm(x, p["ln2_w"], p["ln2_b"], grid, a1, EPS)
        h = F.gelu(M3.linear(h, p["w1"], p["b1"], grid, a1))
        return x + M3.linear(h, p["w2"], p["b2"], grid, a2)
    mod = summa if mode == "2d" else tesseract
    x = mod.embedding(ids, p["emb"], grid) + x
    h = mod.layer_norm(x, p["ln1_w"], p["ln1_b"], grid, EPS)
    a = local_attention(mod.linear(h, p["wqkv"], p["bqkv"], grid), S, HD)
    x = x + mod.linear(a, p["wo"], p["bo"], grid)
    h = mod.layer_norm(x, p["ln2_w"], p["ln2_b"], grid, EPS)
    return x + mod.linear(F.gelu(mod.linear(h, p["w1"], p["b1"], grid)), p["w2"], p["b2"], grid)


def _loss(mode, grid, x, p, target, ids):
    """This rank's share of the mean cross-entropy: its tokens' losses / M. The per-token loss is
    replicated over the q ranks that split the classes, so the global loss is the sum over
    ranks / q; each rank's backward gives exactly its own blocks' gradients."""
    y = _block(mode, grid, x, p, ids)
    if mode == "3d":
        tok = matmul3d.cross_entropy(matmul3d.linear(y, p["wh"], p["bh"], grid, AXES), target, grid, AXES)
    else:
        mod = summa if mode == "2d" else tesseract
        tok = mod.cross_entropy(mod.linear(y, p["wh"], p["bh"], grid), target, grid)
    return y, tok.sum() / M


def _grid(mode, q, d):
    from runtime.grid import Grid2D, Grid25D, Grid3D
    return Grid2D(q) if mode == "2d" else Grid25D(q, d) if mode == "2.5d" else Grid3D(q)


def _rank(rank, world, mode, q, d):
    torch.set_num_threads(1)
    grid = _grid(mode, q, d)
    gp, gx, gt, lx, lw, gids = _globals()
    specs = _specs(mode, grid)
    p = {k: take(v, specs[k]).requires_grad_() for k, v in _grid_order(gp, q).items()}
    x = take(gx, specs["x"]).requires_grad_()
    r = take(gt, specs["target"])
    ids = take(gids, specs["ids"])
    out = {"specs": specs, "numel": {k: t.numel() for k, t in p.items()} | {"x": x.numel()}}

    # One forward + backward of the block, its collectives counted.
    COMM_STATS.reset()
    y, loss = _loss(mode, grid, x, p, r, ids)
    loss.backward()
    out["block_comm"] = (COMM_STATS.snapshot_by_kind(), COMM_STATS.calls())
    out["y"] = y.detach()
    out["y_numel"] = y.numel()
    out["grads"] = {k: t.grad.clone() for k, t in p.items()} | {"x": x.grad.clone()}

    # A lone square linear without bias (the papers' table case).
    if mode == "3d":
        xs, ws = take(lx, matmul3d.act_spec(grid, AXES)), take(lw, matmul3d.weight_spec(grid, AXES))
        fn = lambda a, b: matmul3d.matmul(a, b, grid, AXES)  # noqa: E731
    else:
        mod = summa if mode == "2d" else tesseract
        xs, ws = take(lx, mod.act_spec(grid)), take(lw, mod.weight_spec(grid))
        fn = lambda a, b: mod.matmul(a, b, grid)  # noqa: E731
    xs.requires_grad_(), ws.requires_grad_()
    COMM_STATS.reset()
    fn(xs, ws).sum().backward()
    out["lone_comm"] = (COMM_STATS.snapshot_by_kind(), COMM_STATS.calls())

    # What a lone [M, M] x [M, 2M] matmul saves for backward (3D: with and without regather),
    # its gradients, and its collectives.
    out["saved"] = {}
    sx, sw = torch.randn(M, M, generator=torch.Generator().manual_seed(5)), lw.repeat(1, 2)
    for regather in ((False, True) if mode == "3d" else (False,)):
        if mode == "3d":
            a_, b_ = take(sx, matmul3d.act_spec(grid, AXES)), take(sw, matmul3d.weight_spec(grid, AXES))
            fn = lambda a, b: matmul3d.matmul(a, b, grid, AXES, regather)  # noqa: E731
        else:
            a_, b_ = take(sx, mod.act_spec(grid)), take(sw, mod.weight_spec(grid))
        a_.requires_grad_(), b_.requires_grad_()
        shapes = []
        COMM_STATS.reset()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            yv = fn(a_, b_)
        yv.sum().backward()
        out["saved"][regather] = (sorted(shapes), _measured((COMM_STATS.snapshot_by_kind(), COMM_STATS.calls())),
                                  a_.grad.clone(), b_.grad.clone(), yv.detach())

    # SGD with momentum on the local blocks.
    for t in p.values():
        t.grad = None
    opt = torch.optim.SGD(list(p.values()), lr=LR, momentum=MOMENTUM)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        _, loss = _loss(mode, grid, x.detach(), p, r, ids)
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / q)         # q replicas of each token's loss (_loss)
    out["losses"] = losses
    out["trained"] = {k: t.detach().clone() for k, t in p.items()}
    return _plain(out)


def _plain(obj):
    """Tensors as numpy arrays: a torch tensor crosses the result queue as a shared-memory handle
    that dies with the rank that sent it."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy().copy()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_plain(v) for v in obj)
    return obj


def _assemble(results, key, full_shape, field):
    """Place every rank's block; check the blocks cover the tensor and replicas agree."""
    full = torch.full(full_shape, float("nan"))
    for res in results:
        spec = res["specs"][key]
        t = torch.from_numpy(res[field][key] if isinstance(res[field], dict) else res[field])
        idx = []
        for dim, s in enumerate(spec):
            if s is None:
                idx.append(slice(None))
                continue
            i, n = s
            size = full_shape[dim] // n
            idx.append(slice(i * size, (i + 1) * size))
        prev = full[tuple(idx)]
        if not torch.isnan(prev).all():
            torch.testing.assert_close(prev, t, rtol=0, atol=0, msg=f"replicas of {key} differ")
        full[tuple(idx)] = t
    assert not torch.isnan(full).any(), f"the blocks of {key} do not cover it"
    return full


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _reference():
    gp, gx, gt, _, _, gids = _globals()
    p = {k: v.clone().requires_grad_() for k, v in gp.items()}
    x = gx.clone().requires_grad_()
    y = _reference_layer(x, p, gids)
    F.cross_entropy(y @ p["wh"] + p["bh"], gt).backward()
    ref = {"y": y.detach(), "grads": {k: t.grad.clone() for k, t in p.items()} | {"x": x.grad.clone()}}
    for t in p.values():
        t.grad = None
    opt = torch.optim.SGD(list(p.values()), lr=LR, momentum=MOMENTUM)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(_reference_layer(gx, p, gids) @ p["wh"] + p["bh"], gt)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    ref["losses"], ref["trained"] = losses, {k: t.detach() for k, t in p.items()}
    return ref, gp


CASES = [("2d", 2, 1, 4), ("2.5d", 2, 2, 8), ("3d", 2, 1, 8)]


@pytest.mark.slow
@pytest.mark.parametrize("mode,q,d,nprocs", CASES, ids=[c[0] for c in CASES])
def test_transformer_layer_matches_one_process(mode, q, d, nprocs):
    results = run_local(_rank, nprocs, (mode, q, d), timeout=240)
    ref, gp = _reference()
    # Compare in the grid's storage order (QKV columns grouped per head block).
    ref["grads"], ref["trained"], gp = (_grid_order(ref["grads"], q), _grid_order(ref["trained"], q),
                                        _grid_order(gp, q))

    # The premise: each rank holds 1/q^2 (2D, 2.5D weights: replicated over depth),
    # 1/(d q^2) (2.5D activations) or 1/q^3 (3D) of every tensor.
    act_div = {"2d": q * q, "2.5d": d * q * q, "3d": q ** 3}[mode]
    par_div = {"2d": q * q, "2.5d": q * q, "3d": q ** 3}[mode]
    for res in results:
        assert res["numel"]["x"] * act_div == M * H and res["y_numel"] * act_div == M * H
        for k in PARAMS:
            assert res["numel"][k] * par_div == gp[k].numel(), (k, res["numel"][k])

    # Forward, input and parameter gradients after assembling the blocks.
    y = _assemble(results, "x", (M, H), "y")
    assert _rel(y, ref["y"]) < 1e-5
    for k in ("x",) + PARAMS:
        g = _assemble(results, k, tuple(ref["grads"][k].shape), "grads")
        assert _rel(g, ref["grads"][k]) < 1e-5, (k, _rel(g, ref["grads"][k]))

    # Three SGD-with-momentum steps.
    for res in results:
        for a, b in zip(res["losses"], ref["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b), (res["losses"], ref["losses"])
    for k in PARAMS:
        t = _assemble(results, k, tuple(gp[k].shape), "trained")
        torch.testing.assert_close(t, ref["trained"][k], rtol=1e-4, atol=1e-6)
        assert not torch.equal(t, gp[k])      # the step really moved it

    # Collectives: exactly the predicted calls and bytes per (group, kind), on every rank.
    head = (cost.linear_3d(M, H, V, q, 4, True, AXES) if mode == "3d" else
            cost.linear_2d(M, H, V, q, 4) if mode == "2d" else cost.linear_2p5d(M, H, V, q, d, 4))
    block = _bytes_calls(cost.embedding(mode, V, H, q, d, 4, AXES)
                         + cost.transformer_layer(mode, M, H, FF, q, d, 4, AXES) + head
                         + cost.cross_entropy(mode, M, q, d, 4, AXES))
    lone_pred = (cost.linear_3d(M, M, M, q, 4, bias=False, axes=AXES) if mode == "3d" else
                 cost.linear_2d(M, M, M, q, 4, bias=False) if mode == "2d" else
                 cost.linear_2p5d(M, M, M, q, d, 4, bias=False))
    lone = _bytes_calls(lone_pred)
    for res in results:
        assert _measured(res["block_comm"]) == block
        assert _measured(res["lone_comm"]) == lone
    groups = {"2d": ("row", "col"), "2.5d": ("row", "col", "depth"), "3d": AXES}[mode]
    moved = {g for (g, _k), (_c, b) in block.items() if b > 0}
    assert moved == set(groups), moved

    # Saved for backward: exactly the predicted blocks (3D: regather trades 2 all_gathers for
    # saved activations of 1/q^3), with the same result and gradients either way.
    for res in results:
        for regather, (shapes, comm, ga, gb, yv) in res["saved"].items():
            pred = cost.saved_linear(mode, M, M, 2 * M, q, d, regather)
            assert shapes == sorted([pred["activation"], pred["weight"]]), (regather, shapes, pred)
            assert comm == _bytes_calls(cost.linear_3d(M, M, 2 * M, q, 4, False, AXES, regather) if mode == "3d"
                                        else cost.linear_2d(M, M, 2 * M, q, 4, False) if mode == "2d"
                                        else cost.linear_2p5d(M, M, 2 * M, q, d, 4, False))
            act = pred["activation"][0] * pred["activation"][1]
            assert act * {"2d": q * q, "2.5d": d * q * q, "3d": q * q if not regather else q ** 3}[mode] == M * M
        if mode == "3d":
            for i in (2, 3, 4):
                torch.testing.assert_close(torch.from_numpy(res["saved"][True][i]),
                                           torch.from_numpy(res["saved"][False][i]), rtol=0, atol=0)

    # The papers' table, from the measured counts (rank 0's; all are equal, above).
    tot = _measured(results[0]["lone_comm"])
    sizes = cost.group_sizes(lone_pred)
    plane = ("row", "col") if mode != "3d" else AXES
    bw = cost.bandwidth_of_totals(tot, sizes, M * M * 4, plane)
    lat = cost.latency_of_totals(tot, sizes, plane)
    table = cost.table_3d(q) if mode == "3d" else cost.table_2d(q) if mode == "2d" else cost.table_2p5d(q, d)
    assert (bw, lat) == table, ((bw, lat), table)


def _bytes_calls(colls):
    return cost.totals(colls)


def _measured(comm):
    by_kind, calls = comm
    return {key: (calls[key], by_kind[key]) for key in by_kind}


# ------------------------------------------------------------------ pure checks (no processes)

def test_grid_validation_errors_are_clear():
    check_2d(4, 2), check_2p5d(8, 2, 2), check_3d(27, 3)
    with pytest.raises(GridError, match=r"q\*q processes; got 8 for q=2.*not a perfect square"):
        check_2d(8, 2)
    with pytest.raises(GridError, match="use q=3"):
        check_2d(9, 2)
    with pytest.raises(GridError, match=r"q\*q\*d processes; got 12.*use d=3"):
        check_2p5d(12, 2, 2)
    with pytest.raises(GridError, match=r"q\*\*3 processes; got 16"):
        check_3d(16, 2)
    with pytest.raises(GridError, match="integer >= 1"):
        check_2d(4, 0)
    with pytest.raises(GridError, match="hidden = 10 does not split evenly into 4"):
        check_divisible("hidden", 10, 4, "2D")
    with pytest.raises(GridError, match="tokens = 6 does not split evenly into 4"):
        tesseract.check_shapes(6, {"hidden": 8}, 2, 2)
    with pytest.raises(GridError, match="ffn = 12 does not split evenly into 8"):
        matmul3d.check_shapes(8, {"ffn": 12}, 2)
    with pytest.raises(GridError, match="hidden = 6 does not split evenly into 4"):
        summa.check_shapes(8, {"hidden": 6}, 2)
    with pytest.raises(GridError, match="attention heads = 3 does not split evenly into 2"):
        qkv_column_order(12, 3, 2)
    with pytest.raises(ValueError, match="whole sequences per rank: 3 local tokens"):
        local_attention(torch.zeros(3, 12), 2, 4)


def test_qkv_column_order_groups_whole_heads():
    order = qkv_column_order(8, 4, 2)            # 4 heads of 2, two column blocks
    assert sorted(order) == list(range(24))
    # block 0: Q, K, V of heads 0-1; block 1: those of heads 2-3
    assert order[:12] == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]
    assert order[12:] == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]


@pytest.mark.parametrize("q", [2, 3, 4, 8])
@pytest.mark.parametrize("d", [1, 2, 4])
def test_cost_functions_reproduce_the_papers_table(q, d):
    m = q ** 3 * d
    s = m * m * 4
    c2, c25, c3 = (cost.linear_2d(m, m, m, q, bias=False), cost.linear_2p5d(m, m, m, q, d, bias=False),
                   cost.linear_3d(m, m, m, q, bias=False))
    assert (cost.paper_bandwidth(c2, s), cost.paper_latency(c2)) == cost.table_2d(q)
    assert ((cost.paper_bandwidth(c25, s, ("row", "col")), cost.paper_latency(c25, ("row", "col")))
            == cost.table_2p5d(q, d))
    assert (cost.paper_bandwidth(c3, s), cost.paper_latency(c3)) == cost.table_3d(q)
    # 2.5D with d = 1 is 2D plus a no-op depth group.
    if d == 1:
        assert cost.table_2p5d(q, 1) == cost.table_2d(q)
    # The ordering the papers claim: 3D moves least, 2.5D less than 2D once d > 1.
    assert cost.table_3d(q)[0] < cost.table_2p5d(q, d)[0] <= cost.table_2d(q)[0]
    assert isinstance(cost.paper_bandwidth(c2, s), Fraction)


# ------------------------------------------------------------------ SUMMA with q = 3 (9 ranks)

def _rank_summa_q3(rank, world, q, m, k, n):
    torch.set_num_threads(1)
    from runtime.grid import Grid2D
    grid = Grid2D(q)
    g = torch.Generator().manual_seed(3)
    X, W, b, R = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g), torch.randn(n, generator=g), \
        torch.randn(m, n, generator=g)
    x = take(X, summa.act_spec(grid)).requires_grad_()
    w = take(W, summa.weight_spec(grid)).requires_grad_()
    bb = take(b, summa.vector_spec(grid)).requires_grad_()
    COMM_STATS.reset()
    y = summa.linear(x, w, bb, grid)
    (y * take(R, summa.act_spec(grid))).sum().backward()
    spec = {"x": summa.act_spec(grid), "w": summa.weight_spec(grid), "b": summa.vector_spec(grid)}
    return _plain({"specs": spec, "y": {"x": y.detach()}, "g": {"x": x.grad, "w": w.grad, "b": bb.grad},
                   "comm": (COMM_STATS.snapshot_by_kind(), COMM_STATS.calls())})


@pytest.mark.slow
def test_summa_q3_rectangular():
    """q = 3 (a SUMMA loop of 3 steps, every rank a source once) on non-square blocks, so a
    mixed-up row/column source or a transposed block cannot cancel out."""
    q, m, k, n = 3, 6, 9, 18
    results = run_local(_rank_summa_q3, q * q, (q, m, k, n), timeout=240)
    g = torch.Generator().manual_seed(3)
    X, W, b, R = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g), torch.randn(n, generator=g), \
        torch.randn(m, n, generator=g)
    X.requires_grad_(), W.requires_grad_(), b.requires_grad_()
    Y = X @ W + b
    (Y * R).sum().backward()
    assert _rel(_assemble(results, "x", (m, n), "y"), Y.detach()) < 1e-6
    for key, ref in (("x", X.grad), ("w", W.grad), ("b", b.grad)):
        assert _rel(_assemble(results, key, tuple(ref.shape), "g"), ref) < 1e-6, key
    pred = cost.totals(cost.linear_2d(m, k, n, q, 4))
    for res in results:
        assert _measured(res["comm"]) == pred
