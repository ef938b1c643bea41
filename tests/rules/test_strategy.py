"""Strategy enumeration properties: data axes split the batch, counts stay small, Megatron
linear strategies exist, divisibility is respected, and batch dims propagate through a graph."""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.mesh import Mesh
from autopar.rules import spec_for, tensor_inputs
from autopar.rules.spec import OpSpec
from autopar.rules.strategy import enumerate_strategies, propagate_batch

aten = torch.ops.aten
DP_TP = Mesh((2, 2), ("dp", "tp"), 8)


def _node(target, *args):
    g = fx.Graph()
    nargs = []
    for a in args:
        if isinstance(a, torch.Tensor):
            p = g.placeholder(f"x{len(nargs)}")
            p.meta["val"] = a
            nargs.append(p)
        else:
            nargs.append(a)
    n = g.call_function(target, tuple(nargs))
    n.meta["val"] = target(*args)
    return n


def _linear_spec(b=8, s=4, k=8, n=16, bias=True):
    args = [torch.randn(b, s, k), torch.randn(n, k)] + ([torch.randn(n)] if bias else [])
    return spec_for(_node(aten.linear.default, *args))


def _graph_batches(graph, mesh):
    """Per call_function node: (spec, batch letters, strategies), inputs' dim 0 is the batch."""
    bd, out = {}, {}
    for n in graph.nodes:
        if n.op == "placeholder":
            bd[n.name] = (frozenset() if n.name.startswith("p_") else frozenset({0}),)
        elif n.op == "call_function":
            spec = spec_for(n)
            ins = []
            for p in tensor_inputs(n):
                outs = bd.get(p.name, (frozenset(),))
                ins.append(outs[n.args[1]] if n.target is operator.getitem else outs[0])
            letters, obd = propagate_batch(spec, ins)
            bd[n.name] = tuple(obd)
            out[n.name] = (n, spec, letters, obd, enumerate_strategies(spec, mesh, letters))
    return out


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.head = torch.nn.Linear(16, 32, bias=False)

    def forward(self, x, tgt):
        b, s, d = x.shape
        q, k, v = self.qkv(x).split(16, dim=2)
        q, k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        logits = self.head(y)
        return F.cross_entropy(logits.view(-1, 32), tgt.view(-1))


def _model_graph():
    return torch.export.export(Model(), (torch.randn(4, 8, 16), torch.randint(0, 32, (4, 8))), strict=False).graph


def test_linear_has_column_row_and_replicated():
    spec = _linear_spec()
    strats = enumerate_strategies(spec, Mesh((2,), ("tp",), 8), frozenset())
    by = {s.splits: s for s in strats}
    assert (None,) in by and by[(None,)].outputs[0].is_replicated()
    col = by[("n",)]
    assert col.inputs[1].dims == ((0,), ()) and col.outputs[0].dims[2] == (0,) and not col.outputs[0].partial
    row = by[("k",)]
    assert row.inputs[0].dims[2] == (0,) and row.inputs[1].dims == ((), (0,)) and row.outputs[0].partial == (0,)
    assert col.work_fraction == row.work_fraction == 0.5 and by[(None,)].work_fraction == 1.0


def test_linear_count_on_dp_tp_and_data_axis_splits_batch():
    spec = _linear_spec()
    b = frozenset(spec.inputs[0][0])
    strats = enumerate_strategies(spec, DP_TP, b)
    assert 3 <= len(strats) <= 6
    assert all(s.splits[0] == spec.inputs[0][0] for s in strats)
    assert {s.splits[1] for s in strats} >= {"n", "k", None}
    assert all(s.work_fraction <= 0.5 for s in strats)


def test_no_batch_letter_means_data_axis_replicated_or_partial():
    spec = _linear_spec()
    strats = enumerate_strategies(spec, DP_TP, frozenset())
    assert all(s.splits[0] in (None, "P") for s in strats)


def test_strategies_are_deduplicated_and_layouts_valid():
    g = _model_graph()
    for name, (n, spec, letters, _, strats) in _graph_batches(g, Mesh((2, 2, 2), ("dp", "tp", "tp2"), 8)).items():
        keys = [(s.inputs, s.outputs) for s in strats]
        assert len(keys) == len(set(keys)), name
        assert 1 <= len(strats) <= 40, (name, len(strats))
        for s in strats:
            for lay in [l for l in s.inputs if l is not None] + list(s.outputs):
                used = [a for axes in lay.dims for a in axes] + list(lay.partial)
                assert len(used) == len(set(used)), (name, s.name)


def test_graph_data_axis_always_splits_batch():
    g = _model_graph()
    for name, (n, spec, letters, obd, strats) in _graph_batches(g, DP_TP).items():
        if letters:
            assert all(s.splits[0] in letters for s in strats), (name, [s.name for s in strats])


def test_propagate_batch_through_view_transpose_linear_ce():
    g = _model_graph()
    info = _graph_batches(g, DP_TP)
    by_target = {}
    for name, (n, spec, letters, obd, _) in info.items():
        by_target.setdefault(str(n.target), []).append(obd)
    assert by_target["aten.linear.default"][0] == [frozenset({0})]
    assert by_target["aten.transpose.int"][0] == [frozenset({0})]                # (b, h, s, d)
    assert by_target["aten.scaled_dot_product_attention.default"][0] == [frozenset({0})]
    views = by_target["aten.view.default"]
    assert [frozenset({0})] in views                                          # (b*s, v) keeps the batch leading
    ce = next(v for v in info.values() if v[0].target is aten.cross_entropy_loss.default)
    assert ce[2] and ce[3] == [frozenset()]                                   # batch contracted into the loss
    assert all(0 in s.outputs[0].partial for s in ce[4])                      # loss partial over dp


def test_propagate_batch_unit():
    spec = OpSpec("x", ("abc",), ("cab",), dict(a=4, b=4, c=4), unsplittable=frozenset("b"))
    letters, outs = propagate_batch(spec, [frozenset({0, 1})])
    assert letters == frozenset("a") and outs == [frozenset({1})]


def test_vocab_parallel_ce_comm_bytes_use_local_rows():
    n = _node(aten.cross_entropy_loss.default, torch.randn(16, 32), torch.randint(0, 32, (16,)))
    spec = spec_for(n)
    strats = enumerate_strategies(spec, DP_TP, frozenset(spec.inputs[1]))
    vp = next(s for s in strats if s.splits == (spec.inputs[1], "v"))
    assert vp.comms == (("all_reduce", 1, 8 * 4.0),) * 3      # 16 rows / dp 2, fp32
    assert vp.outputs[0].partial == (0,)                      # dp partial (batch mean), tp whole


def test_replicate_only_single_strategy():
    spec = OpSpec("fallback", ("ab",), ("ab",), dict(a=4, b=4), unsplittable=frozenset("ab"), replicate_only=True)
    strats = enumerate_strategies(spec, DP_TP, frozenset("a"))
    assert len(strats) == 1 and strats[0].inputs[0].is_replicated() and strats[0].work_fraction == 1.0


@settings(max_examples=40, deadline=None)
@given(b=st.sampled_from([1, 2, 3, 4, 6, 8]), k=st.sampled_from([2, 3, 4, 8, 12]),
       n=st.sampled_from([1, 2, 4, 6, 8]), shape=st.sampled_from([(2,), (4,), (2, 2), (2, 3), (2, 2, 2)]),
       bias=st.booleans())
def test_divisibility_respected(b, k, n, shape, bias):
    names = ("dp", "tp", "tp2")[:len(shape)]
    mesh = Mesh(shape, names, 8)
    spec = _linear_spec(b=b, s=2, k=k, n=n, bias=bias)
    strats = enumerate_strategies(spec, mesh, frozenset(spec.inputs[0][0]))
    assert strats
    sizes_of = [(b, 2, k), (n, k), (n,)]
    for s in strats:
        for lay, full in zip(s.inputs, sizes_of):
            for d, axes in enumerate(lay.dims):
                assert full[d] % math.prod(shape[a] for a in axes) == 0
        splits = [x for x in s.splits if x not in (None, "P")]
        assert math.isclose(s.work_fraction, 1 / math.prod(shape[a] for a, x in enumerate(s.splits)
                                                            if x not in (None, "P")))
        assert len(splits) <= len(shape)
        if b % shape[0] == 0:
            assert s.splits[0] == spec.inputs[0][0]       # data parallelism is not optional
