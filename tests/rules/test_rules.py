"""Op rules proven by simulated execution: every strategy of every rule, on 1-, 2- and 3-axis
meshes, runs its local call on per-rank blocks (partial inputs split into random addends), and
the recombined result must equal the unsplit op. Saved-tensor specs are checked against
torch.autograd.graph.saved_tensors_hooks byte for byte.
"""
from __future__ import annotations

import itertools
import math
import operator
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from autopar.mesh import Mesh
from autopar.rules import coverage, spec_for, tensor_inputs
from autopar.rules.localize import local_call
from autopar.rules.strategy import enumerate_strategies, propagate_batch

aten = torch.ops.aten
torch.manual_seed(0)
G = torch.Generator().manual_seed(1)


def rnd(*s):
    return torch.randn(*s, generator=G, dtype=torch.float64)


def idx(hi, *s):
    return torch.randint(0, hi, s, generator=G)


def make_node(target, args, kwargs=None, getitem=None):
    """An fx graph: one placeholder per tensor leaf, then the op (and optionally getitem of it)."""
    g = fx.Graph()
    env = {}

    def to_node(x):
        if isinstance(x, torch.Tensor):
            p = g.placeholder(f"x{len(env)}")
            p.meta["val"] = x
            env[p] = x
            return p
        return x
    nargs, nkwargs = pytree.tree_map(to_node, (tuple(args), dict(kwargs or {})))
    node = g.call_function(target, nargs, nkwargs)
    node.meta["val"] = target(*args, **(kwargs or {}))
    env[node] = node.meta["val"]
    if getitem is not None:
        gi = g.call_function(operator.getitem, (node, getitem))
        gi.meta["val"] = node.meta["val"][getitem]
        env[gi] = gi.meta["val"]
        return gi, env
    return node, env


MESHES = [Mesh((2,), ("tp",), 8), Mesh((2,), ("dp",), 8), Mesh((2, 2), ("dp", "tp"), 8),
          Mesh((2, 2, 2), ("dp", "tp", "tp2"), 8)]


def _block(t, layout, coords, shape):
    for d, axes in enumerate(layout.dims):
        if not axes:
            continue
        k, n = 0, 1
        for a in axes:
            k, n = k * shape[a] + coords[a], n * shape[a]
        size = t.shape[d] // n
        t = t.narrow(d, k * size, size)
    return t


def _addends(x, layout, shape):
    """Random addends (one per coordinate tuple of the partial axes) summing to x."""
    keys = list(itertools.product(*[range(shape[a]) for a in layout.partial]))
    parts = {k: rnd(*x.shape) for k in keys[:-1]}
    parts[keys[-1]] = x - sum(parts.values()) if len(keys) > 1 else x
    return parts


def _vp_embedding(weight, ids, w_layout, coords, shape):
    k, n = 0, 1
    for a in w_layout.dims[0]:
        k, n = k * shape[a] + coords[a], n * shape[a]
    lo, rows = k * weight.shape[0], weight.shape[0]
    local = ids - lo
    mask = (local < 0) | (local >= rows)
    out = F.embedding(local.clamp(0, rows - 1), weight)
    return out.masked_fill(mask.unsqueeze(-1), 0.0)


def simulate(node, env, strat, spec, shape):
    """Run every rank's local call and recombine the outputs into global tensors."""
    ins = tensor_inputs(node)
    ranks = list(itertools.product(*[range(s) for s in shape]))
    addends = {}
    for i, (p, lay) in enumerate(zip(ins, strat.inputs)):
        v = env[p]
        if isinstance(v, (tuple, list)):
            v = v[node.args[1]]
        if lay is not None and lay.partial:
            addends[i] = _addends(v, lay, shape)
    lc0 = local_call(node, spec, strat, shape)
    denom = None
    if lc0.global_mean:   # a mean loss run as a local sum over the global denominator (runtime/loss.py)
        from runtime.loss import local_count
        w = env[ins[2]] if len(ins) > 2 else None
        denom = local_count(env[ins[1]], w, node.args[4] if len(node.args) > 4 else -100).to(env[node].dtype)
    results = {}
    ce_rows = {}
    for c in ranks:
        local = {}
        for i, (p, lay) in enumerate(zip(ins, strat.inputs)):
            v = env[p]
            if isinstance(v, (tuple, list)):     # getitem of a multi-output op
                item = node.args[1]
                src = addends[i][tuple(c[a] for a in lay.partial)] if i in addends else v[item]
                blk = _block(src, lay, c, shape)
                local[p] = tuple(blk if j == item else None for j in range(len(v)))
                continue
            if lay is None:
                local[p] = v
                continue
            if i in addends:
                v = addends[i][tuple(c[a] for a in lay.partial)]
            local[p] = _block(v, lay, c, shape)
        lc = local_call(node, spec, strat, shape)
        args, kwargs = pytree.tree_map(lambda x: local[x] if isinstance(x, fx.Node) else x, (lc.args, lc.kwargs))
        if lc.needs_algorithm == "vocab_parallel_embedding":
            out = _vp_embedding(args[0], args[1], strat.inputs[0], c, shape)
        elif lc.needs_algorithm == "vocab_parallel_ce":
            ce_rows[c] = (args[0], args[1], strat.inputs[0])
            continue
        else:
            out = lc.target(*args, **kwargs)
        if lc.scale is not None:
            out = out * lc.scale
        if denom is not None:
            out = out / denom
        results[c] = out
    if ce_rows:
        results = _vocab_parallel_ce(node, ce_rows, strat, shape, lc0, denom)
    outs = []
    n_out = len(strat.outputs)
    for o, lay in enumerate(strat.outputs):
        v = env[node]
        gv = v[o] if isinstance(v, (tuple, list)) else v
        total = torch.zeros_like(gv)
        used = lay.axes_used()
        for c in ranks:
            r = results[c][o] if n_out > 1 or isinstance(results[c], (tuple, list)) else results[c]
            canon = tuple(x if a in used else 0 for a, x in enumerate(c))
            if canon != c:      # a replica: must agree with its canonical copy
                rc = results[canon][o] if n_out > 1 or isinstance(results[canon], (tuple, list)) else results[canon]
                assert torch.allclose(r, rc), f"replicas disagree for {strat.name}"
                continue
            sl = [slice(None)] * gv.dim()
            for d, axes in enumerate(lay.dims):
                if axes:
                    k, n = 0, 1
                    for a in axes:
                        k, n = k * shape[a] + c[a], n * shape[a]
                    size = gv.shape[d] // n
                    sl[d] = slice(k * size, (k + 1) * size)
            total[tuple(sl)] += r
        outs.append(total)
    return outs


def _vocab_parallel_ce(node, rows, strat, shape, lc, denom):
    """The distributed vocab-parallel cross-entropy, all-reduces done across the vocab axes."""
    v_axes = [a for a, s in enumerate(strat.splits) if s == "v"]
    scale = lc.scale
    reduction = lc.args[3] if len(lc.args) > 3 else lc.kwargs.get("reduction", 1)
    out = {}
    for c, (logits, tgt, lay) in rows.items():
        group = [g for g in rows if all(g[a] == c[a] for a in range(len(shape)) if a not in v_axes)]
        stats = []
        for g in group:
            lg, t, ly = rows[g]
            k, n = 0, 1
            for a in ly.dims[1]:
                k, n = k * shape[a] + g[a], n * shape[a]
            lo, width = k * lg.shape[1], lg.shape[1]
            loc = (t - lo).clamp(0, width - 1)
            own = (t >= lo) & (t < lo + width)
            pick = lg.gather(1, loc.unsqueeze(1)).squeeze(1) * own
            stats.append((lg.amax(1), lg, pick))
        m = torch.stack([s[0] for s in stats]).amax(0)
        sumexp = sum((s[1] - m.unsqueeze(1)).exp().sum(1) for s in stats)
        tl = sum(s[2] for s in stats)
        valid = tgt != -100       # ignore_index: no loss, not counted
        loss = (sumexp.log() + m - tl) * valid
        r = loss.sum() / valid.sum() if reduction == 1 else loss.sum() if reduction == 2 else loss
        r = r * scale if scale is not None else r
        out[c] = r / denom if denom is not None else r
    return out


def check_op(target, args, kwargs=None, meshes=MESHES, getitem=None, min_strats=1):
    node, env = make_node(target, args, kwargs, getitem)
    spec = spec_for(node)
    assert spec.rule != "fallback", f"{target} has no rule"
    expect = env[node]
    expect = list(expect) if isinstance(expect, (tuple, list)) else [expect]
    n_checked = 0
    for mesh in meshes:
        ins = tensor_inputs(node)
        batch_in = [frozenset({0}) if i == 0 and isinstance(env[p], torch.Tensor) and env[p].dim() > 0
                    else frozenset()
                    for i, p in enumerate(ins)]
        letters, _ = propagate_batch(spec, batch_in)
        strats = enumerate_strategies(spec, mesh, letters)
        for st in strats:
            got = simulate(node, env, st, spec, mesh.shape)
            for g, e in zip(got, expect):
                assert torch.allclose(g, e, atol=1e-9, rtol=1e-7), f"{target} {st.name} on {mesh.describe()}"
            n_checked += 1
    assert n_checked >= min_strats
    return spec


# ---------------------------------------------------------------- execution of every strategy

CASES = {
    "linear_bias": lambda: (aten.linear.default, (rnd(4, 4, 8), rnd(8, 8), rnd(8))),
    "linear": lambda: (aten.linear.default, (rnd(4, 8), rnd(4, 8))),
    "mm": lambda: (aten.mm.default, (rnd(4, 8), rnd(8, 4))),
    "bmm": lambda: (aten.bmm.default, (rnd(4, 4, 8), rnd(4, 8, 4))),
    "addmm": lambda: (aten.addmm.default, (rnd(4), rnd(4, 8), rnd(8, 4))),
    "baddbmm": lambda: (aten.baddbmm.default, (rnd(4, 1, 4), rnd(4, 4, 8), rnd(4, 8, 4))),
    "matmul_bcast": lambda: (aten.matmul.default, (rnd(4, 4, 8), rnd(8, 4))),
    "matmul_4d": lambda: (aten.matmul.default, (rnd(4, 1, 4, 8), rnd(2, 8, 4))),
    "einsum": lambda: (aten.einsum.default, ("bij,bjk->bik", [rnd(4, 4, 8), rnd(4, 8, 4)])),
    "conv2d": lambda: (aten.conv2d.default, (rnd(2, 4, 5, 5), rnd(4, 4, 3, 3), rnd(4))),
    "embedding": lambda: (aten.embedding.default, (rnd(16, 8), idx(16, 4, 4))),
    "layer_norm": lambda: (aten.layer_norm.default, (rnd(4, 4, 8), [8], rnd(8), rnd(8), 1e-5, False)),
    "rms_norm": lambda: (aten.rms_norm.default, (rnd(4, 4, 8), [8], rnd(8), 1e-6)),
    "softmax": lambda: (aten._softmax.default, (rnd(4, 4, 8), -1, False)),
    "log_softmax": lambda: (aten._log_softmax.default, (rnd(4, 8, 4), 1, False)),
    "sdpa_causal": lambda: (aten.scaled_dot_product_attention.default,
                            (rnd(4, 4, 4, 8), rnd(4, 4, 4, 8), rnd(4, 4, 4, 8)), {"is_causal": True}),
    "sdpa_mask": lambda: (aten.scaled_dot_product_attention.default,
                          (rnd(4, 4, 4, 8), rnd(4, 4, 6, 8), rnd(4, 4, 6, 4), rnd(4, 1, 4, 6))),
    "gelu": lambda: (aten.gelu.default, (rnd(4, 4, 8),), {"approximate": "tanh"}),
    "silu": lambda: (aten.silu.default, (rnd(4, 8),)),
    "relu": lambda: (aten.relu.default, (rnd(4, 8),)),
    "tanh": lambda: (aten.tanh.default, (rnd(4, 8),)),
    "sigmoid": lambda: (aten.sigmoid.default, (rnd(4, 8),)),
    "neg": lambda: (aten.neg.default, (rnd(4, 8),)),
    "rsqrt": lambda: (aten.rsqrt.default, (rnd(4, 8).abs() + 1,)),
    "exp": lambda: (aten.exp.default, (rnd(4, 8),)),
    "dropout0": lambda: (aten.dropout.default, (rnd(4, 4, 8), 0.0, True)),
    "native_dropout0": lambda: (aten.native_dropout.default, (rnd(4, 8), 0.0, True)),
    "add_bcast": lambda: (aten.add.Tensor, (rnd(4, 4, 8), rnd(8))),
    "add_size1": lambda: (aten.add.Tensor, (rnd(4, 4, 8), rnd(4, 1, 8))),
    "add_scalar": lambda: (aten.add.Tensor, (rnd(4, 8), 1.5)),
    "sub": lambda: (aten.sub.Tensor, (rnd(4, 8), rnd(4, 8))),
    "mul": lambda: (aten.mul.Tensor, (rnd(4, 4, 8), rnd(4, 1, 8))),
    "mul_scalar": lambda: (aten.mul.Tensor, (rnd(4, 8), 3.0)),
    "div": lambda: (aten.div.Tensor, (rnd(4, 8), rnd(8).abs() + 1)),
    "pow": lambda: (aten.pow.Tensor_Scalar, (rnd(4, 8), 2)),
    "where": lambda: (aten.where.self, (rnd(4, 8) > 0, rnd(4, 8), rnd(4, 8))),
    "masked_fill0": lambda: (aten.masked_fill.Scalar, (rnd(4, 8), rnd(4, 8) > 0, 0.0)),
    "masked_fill_inf": lambda: (aten.masked_fill.Scalar, (rnd(4, 8), rnd(1, 8) > 0, float("-inf"))),
    "sum_dim": lambda: (aten.sum.dim_IntList, (rnd(4, 4, 8), [1])),
    "sum_keep": lambda: (aten.sum.dim_IntList, (rnd(4, 4, 8), [-1], True)),
    "sum_all": lambda: (aten.sum.default, (rnd(4, 8),)),
    "mean_dim": lambda: (aten.mean.dim, (rnd(4, 4, 8), [0, 2])),
    "mean_all": lambda: (aten.mean.default, (rnd(4, 8),)),
    "amax": lambda: (aten.amax.default, (rnd(4, 4, 8), [1])),
    "ce_mean": lambda: (aten.cross_entropy_loss.default, (rnd(8, 16), idx(16, 8))),
    "ce_sum": lambda: (aten.cross_entropy_loss.default, (rnd(8, 16), idx(16, 8), None, 2)),
    "ce_none_3d": lambda: (aten.cross_entropy_loss.default, (rnd(4, 8, 4), idx(8, 4, 4), None, 0)),
    "nll": lambda: (aten.nll_loss.default, (rnd(8, 16), idx(16, 8))),
    # masked targets, unevenly spread: split rows hold different numbers of valid targets
    "ce_mean_masked": lambda: (aten.cross_entropy_loss.default,
                               (rnd(8, 16), idx(16, 8).masked_fill(torch.tensor([1, 1, 1, 0, 1, 0, 0, 0]) > 0, -100))),
    "nll_weighted_masked": lambda: (aten.nll_loss.default,
                                    (rnd(8, 16),
                                     idx(16, 8).masked_fill(torch.tensor([0, 1, 1, 1, 0, 0, 0, 1]) > 0, -100),
                                     rnd(16).abs() + 0.5)),
    "view_merge": lambda: (aten.view.default, (rnd(4, 4, 8), [16, 8])),
    "view_split": lambda: (aten.view.default, (rnd(4, 4, 8), [4, 4, 2, 4])),
    "view_mixed": lambda: (aten.reshape.default, (rnd(4, 6, 1, 4), [8, 1, 12])),
    "unsafe_view": lambda: (aten._unsafe_view.default, (rnd(16, 8), [4, 4, 8])),
    "flatten": lambda: (aten.flatten.using_ints, (rnd(4, 4, 8), 0, 1)),
    "unsqueeze": lambda: (aten.unsqueeze.default, (rnd(4, 8), 1)),
    "squeeze": lambda: (aten.squeeze.dim, (rnd(4, 1, 8), 1)),
    "transpose": lambda: (aten.transpose.int, (rnd(4, 4, 8), 1, 2)),
    "permute": lambda: (aten.permute.default, (rnd(4, 4, 8), [2, 0, 1])),
    "t": lambda: (aten.t.default, (rnd(4, 8),)),
    "expand": lambda: (aten.expand.default, (rnd(4, 1, 8), [2, 4, 4, 8])),
    "contiguous": lambda: (aten.contiguous.default, (rnd(4, 8),)),
    "clone": lambda: (aten.clone.default, (rnd(4, 8),)),
    "to_copy": lambda: (aten._to_copy.default, (rnd(4, 8),), {"dtype": torch.float64}),
    "split": lambda: (aten.split.Tensor, (rnd(4, 4, 12), 4, 2)),
    "split_sizes": lambda: (aten.split_with_sizes.default, (rnd(4, 12), [4, 8], 1)),
    "chunk": lambda: (aten.chunk.default, (rnd(4, 4, 8), 2, 1)),
    "cat": lambda: (aten.cat.default, ([rnd(4, 4), rnd(4, 8)], 1)),
    "stack": lambda: (aten.stack.default, ([rnd(4, 8), rnd(4, 8)], 1)),
    "slice": lambda: (aten.slice.Tensor, (rnd(4, 8, 4), 1, 2, 6)),
    "select": lambda: (aten.select.int, (rnd(4, 8, 4), 1, 3)),
    "index_select": lambda: (aten.index_select.default, (rnd(4, 8, 4), 1, idx(8, 4))),
    "repeat_interleave": lambda: (aten.repeat_interleave.self_int, (rnd(4, 2, 4), 2, 1)),
    "arange": lambda: (aten.arange.default, (8,), {"dtype": torch.float64}),
    # value-free creation from a tensor (its dtype and device only): a step's mask.new_ones(rows, 1)
    "new_ones": lambda: (aten.new_ones.default, (rnd(4, 8), [4, 1])),
    "new_full": lambda: (aten.new_full.default, (rnd(4, 4, 8), [2, 3], 1.5)),
    # ``&`` of attention masks (Hugging Face's mask functions over a KV cache's slots)
    "and": lambda: (aten.__and__.Tensor, (idx(4, 4, 1, 8), idx(4, 1, 4, 8))),
    # a KV-cache write: [batch, heads, slots, head_dim] rows written at 2 slots (autopar/rules/ops_cache.py)
    "index_copy": lambda: (aten.index_copy.default, (rnd(4, 4, 6, 2), 2, torch.tensor([3, 1]), rnd(4, 4, 2, 2))),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_strategy_matches_unsplit(case):
    c = CASES[case]()
    target, args = c[0], c[1]
    kwargs = c[2] if len(c) > 2 else {}
    meshes = MESHES if case not in ("conv2d", "sdpa_mask") else MESHES[:3]
    check_op(target, args, kwargs, meshes)


def test_index_copy_splits_the_cache_like_its_rows_but_never_the_written_dim():
    """The premise of a KV cache kept per rank: a tp strategy splits the heads of the cache and of
    the written rows alike (no gather of the cache), and none splits the slots or the index."""
    node, env = make_node(aten.index_copy.default, (rnd(4, 4, 6, 2), 2, torch.tensor([3, 1]), rnd(4, 4, 2, 2)))
    spec = spec_for(node)
    assert spec.rule == "index_copy"
    strats = enumerate_strategies(spec, Mesh((2,), ("tp",), 8), spec.inputs[0][:1])
    heads = [s for s in strats if s.inputs[0] is not None and s.inputs[0].dims[1] == (0,)]
    assert heads and all(s.inputs[2].dims[1] == (0,) and s.outputs[0].dims[1] == (0,) for s in heads)
    assert not any(s.inputs[0].dims[2] or s.inputs[1].dims[0] for s in strats if s.inputs[0] is not None)


def test_getitem_of_split():
    check_op(aten.split.Tensor, (rnd(4, 4, 12), 4, 2), getitem=1, min_strats=4)


def test_linear_has_megatron_strategies():
    node, env = make_node(aten.linear.default, (rnd(4, 4, 8), rnd(8, 8), rnd(8)))
    spec = spec_for(node)
    names = {s.name for s in enumerate_strategies(spec, Mesh((2,), ("tp",), 8))}
    assert {"R", "S(n)@tp", "S(k)@tp"} <= names
    row = next(s for s in enumerate_strategies(spec, Mesh((2,), ("tp",), 8)) if s.name == "S(k)@tp")
    assert row.outputs[0].partial == (0,) and row.inputs[2].partial == (0,)   # bias added once


def test_vocab_parallel_specials():
    node, _ = make_node(aten.cross_entropy_loss.default, (rnd(8, 16), idx(16, 8)))
    spec = spec_for(node)
    st = next(s for s in enumerate_strategies(spec, Mesh((2,), ("tp",), 8)) if s.splits == ("v",))
    assert st.special == ("vocab_parallel_ce",) and not st.outputs[0].partial
    assert st.comms == (("all_reduce", 0, 32.0),) * 3          # 8 rows x fp32, three times
    assert local_call(node, spec, st, (2,)).needs_algorithm == "vocab_parallel_ce"
    node, _ = make_node(aten.embedding.default, (rnd(16, 8), idx(16, 4, 4)))
    spec = spec_for(node)
    st = next(s for s in enumerate_strategies(spec, Mesh((2,), ("tp",), 8)) if s.splits == ("v",))
    assert st.outputs[0].partial == (0,) and st.comms == ()


def test_localize_rewrites_view_sizes_and_mean_scale():
    node, _ = make_node(aten.view.default, (rnd(4, 4, 8), [16, 8]))
    spec = spec_for(node)
    st = next(s for s in enumerate_strategies(spec, Mesh((2, 2), ("dp", "tp"), 8), frozenset(spec.inputs[0][0]))
              if s.splits[1] == spec.outputs[0][1])
    assert local_call(node, spec, st, (2, 2)).args[1] == [8, 4]     # batch halves on dp, hidden on tp
    st = next(s for s in enumerate_strategies(spec, Mesh((2, 2), ("dp", "tp"), 8), frozenset(spec.inputs[0][0]))
              if s.splits == (spec.inputs[0][0],) * 2)
    assert local_call(node, spec, st, (2, 2)).args[1] == [4, 8]
    node, _ = make_node(aten.mean.dim, (rnd(4, 4, 8), [1]))
    spec = spec_for(node)
    st = next(s for s in enumerate_strategies(spec, Mesh((2,), ("tp",), 8)) if s.splits == (spec.inputs[0][1],))
    assert local_call(node, spec, st, (2,)).scale == 0.5


# ---------------------------------------------------------------- saved tensors


def _measured_saved_bytes(target, args, kwargs):
    args = pytree.tree_map(lambda t: t.detach().clone().requires_grad_(True)
                           if isinstance(t, torch.Tensor) and t.is_floating_point() else t, args)
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        target(*args, **kwargs)
    return sum(seen.values())


def _spec_saved_bytes(node, env, spec):
    from autopar.pricing.saved_roots import saved_applies

    ins = tensor_inputs(node)
    outs = env[node] if isinstance(env[node], (tuple, list)) else (env[node],)
    total, counted = 0, set()
    for sv in spec.saved:
        if not saved_applies(sv, cuda=False, work16=False):   # measured here: CPU kernels, fp32
            continue
        if sv.kind == "input":
            t = env[ins[sv.index]]
            key = ins[sv.index]
        elif sv.kind == "output":
            t, key = outs[sv.index], ("out", sv.index)
        else:
            total += math.prod(spec.sizes[ch] for ch in sv.letters) * sv.itemsize
            continue
        if key not in counted:
            counted.add(key)
            total += t.numel() * t.element_size()
    return total


def f32(*s):
    return torch.randn(*s, generator=G)


SAVED_CASES = {
    "linear_bias": lambda: (aten.linear.default, (f32(4, 4, 8), f32(6, 8), f32(6))),
    "mm": lambda: (aten.mm.default, (f32(4, 8), f32(8, 4))),
    "bmm": lambda: (aten.bmm.default, (f32(2, 4, 8), f32(2, 8, 4))),
    "addmm": lambda: (aten.addmm.default, (f32(4), f32(4, 8), f32(8, 4))),
    "matmul": lambda: (aten.matmul.default, (f32(2, 3, 4), f32(4, 5))),
    "einsum": lambda: (aten.einsum.default, ("bij,bjk->bik", [f32(2, 3, 4), f32(2, 4, 5)])),
    "conv2d": lambda: (aten.conv2d.default, (f32(2, 4, 5, 5), f32(6, 4, 3, 3), f32(6))),
    "embedding": lambda: (aten.embedding.default, (f32(16, 8), idx(16, 4, 4))),
    "layer_norm": lambda: (aten.layer_norm.default, (f32(2, 3, 8), [8], f32(8), f32(8), 1e-5, False)),
    "rms_norm": lambda: (aten.rms_norm.default, (f32(2, 3, 8), [8], f32(8), 1e-6)),
    "softmax": lambda: (aten._softmax.default, (f32(2, 3, 8), -1, False)),
    "log_softmax": lambda: (aten.log_softmax.int, (f32(2, 3, 8), -1)),
    "sdpa_causal": lambda: (aten.scaled_dot_product_attention.default,
                            (f32(2, 4, 6, 8), f32(2, 4, 6, 8), f32(2, 4, 6, 8)), {"is_causal": True}),
    "sdpa_mask": lambda: (aten.scaled_dot_product_attention.default,
                          (f32(2, 4, 6, 8), f32(2, 4, 6, 8), f32(2, 4, 6, 8), f32(6, 6) > -1)),
    "sdpa_dropout": lambda: (aten.scaled_dot_product_attention.default,
                             (f32(2, 4, 6, 8), f32(2, 4, 6, 8), f32(2, 4, 6, 8)), {"dropout_p": 0.1}),
    "gelu": lambda: (aten.gelu.default, (f32(4, 8),)),
    "relu": lambda: (aten.relu.default, (f32(4, 8),)),
    "silu": lambda: (aten.silu.default, (f32(4, 8),)),
    "tanh": lambda: (aten.tanh.default, (f32(4, 8),)),
    "rsqrt": lambda: (aten.rsqrt.default, (f32(4, 8).abs() + 1,)),
    "dropout": lambda: (aten.dropout.default, (f32(2, 3, 8), 0.1, True)),
    "dropout0": lambda: (aten.dropout.default, (f32(2, 3, 8), 0.0, True)),
    "native_dropout": lambda: (aten.native_dropout.default, (f32(2, 3, 8), 0.1, True)),
    "add": lambda: (aten.add.Tensor, (f32(4, 8), f32(8))),
    "mul": lambda: (aten.mul.Tensor, (f32(4, 8), f32(8))),
    "mul_scalar": lambda: (aten.mul.Tensor, (f32(4, 8), 2.0)),
    "div": lambda: (aten.div.Tensor, (f32(4, 8), f32(8).abs() + 1)),
    "pow": lambda: (aten.pow.Tensor_Scalar, (f32(4, 8), 2)),
    "where": lambda: (aten.where.self, (f32(4, 8) > 0, f32(4, 8), f32(8))),
    "masked_fill": lambda: (aten.masked_fill.Scalar, (f32(4, 8), f32(4, 8) > 0, 0.0)),
    "amax": lambda: (aten.amax.default, (f32(2, 3, 8), [-1])),
    "mean": lambda: (aten.mean.dim, (f32(2, 3, 8), [-1])),
    "ce": lambda: (aten.cross_entropy_loss.default, (f32(6, 10), idx(10, 6))),
    "nll": lambda: (aten.nll_loss.default, (f32(6, 10), idx(10, 6))),
    "view": lambda: (aten.view.default, (f32(2, 3, 8), [6, 8])),
    "index_select": lambda: (aten.index_select.default, (f32(4, 8), 1, idx(8, 3))),
}


@pytest.mark.parametrize("case", sorted(SAVED_CASES))
def test_saved_tensor_bytes_match_autograd(case):
    c = SAVED_CASES[case]()
    target, args = c[0], c[1]
    kwargs = c[2] if len(c) > 2 else {}
    with torch.no_grad():
        node, env = make_node(target, args, kwargs)
    spec = spec_for(node)
    assert _spec_saved_bytes(node, env, spec) == _measured_saved_bytes(target, args, kwargs)


# ---------------------------------------------------------------- whole graphs


class TinyBlock(torch.nn.Module):
    """A GPT block with the GPT-2 op set, traced by torch.export."""

    def __init__(self, d=16, heads=2, vocab=32):
        super().__init__()
        self.heads = heads
        self.emb = torch.nn.Embedding(vocab, d)
        self.ln = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.fc = torch.nn.Linear(d, 4 * d)
        self.out = torch.nn.Linear(4 * d, d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, ids, tgt):
        b, s = ids.shape
        x = self.emb(ids)
        q, k, v = self.qkv(self.ln(x)).split(x.shape[-1], dim=2)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.dropout(self.proj(y.transpose(1, 2).reshape(b, s, -1)), 0.0)
        x = x + self.out(F.gelu(self.fc(self.ln(x))))
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), tgt.view(-1))


def _export_block():
    ids = torch.randint(0, 32, (4, 8))
    return torch.export.export(TinyBlock(), (ids, ids.clone()), strict=False).graph


def test_gpt_block_fully_covered():
    graph = _export_block()
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # a fallback would warn
        rows = coverage(graph)
    assert rows and all(r[2] != "fallback" for r in rows), [r for r in rows if r[2] == "fallback"]
    targets = {r[1] for r in rows}
    assert {"aten.linear.default", "aten.scaled_dot_product_attention.default",
            "aten.cross_entropy_loss.default", "aten.layer_norm.default"} <= targets


def test_fallback_replicates_and_warns_once():
    from autopar.rules import table

    node, _ = make_node(aten.cumsum.default, (rnd(4, 8), 1))
    # The warning is once per process: an earlier test (a Hugging Face model) may have used cumsum.
    table._warned.discard("aten.cumsum.default")
    with pytest.warns(UserWarning, match="replicated"):
        spec = spec_for(node)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec_for(node)       # second time: silent
    assert spec.rule == "fallback" and spec.replicate_only
    strats = enumerate_strategies(spec, Mesh((2, 2), ("dp", "tp"), 8), frozenset())
    assert len(strats) == 1 and strats[0].outputs[0].is_replicated()
    got = simulate(node, {**_env_of(node)}, strats[0], spec, (2, 2))
    assert torch.allclose(got[0], node.meta["val"])


def _env_of(node):
    env = {p: p.meta["val"] for p in tensor_inputs(node)}
    env[node] = node.meta["val"]
    return env
