"""The rule of ``aten.scatter.src`` (autopar/rules/ops_cache.py), what a per-row KV-cache write
traces to: every strategy's per-rank call recombines to the unsplit scatter, tp splits the cache's
heads and the written rows' alike, and no strategy splits the slots or the written positions."""
from __future__ import annotations

import torch

from autopar.mesh import Mesh
from autopar.rules import spec_for
from autopar.rules.strategy import enumerate_strategies
from tests.rules.test_rules import MESHES, check_op, make_node, rnd

aten = torch.ops.aten


def _args():
    """A [batch 4, heads 4, slots 6, head_dim 2] cache; each row writes 2 slots of its own."""
    g = torch.Generator().manual_seed(2)
    slots = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(4)])
    return rnd(4, 4, 6, 2), 2, slots[:, None, :, None].expand(4, 4, 2, 2).contiguous(), rnd(4, 4, 2, 2)


def test_every_scatter_strategy_matches_unsplit():
    check_op(aten.scatter.src, _args(), meshes=MESHES)


def test_scatter_splits_the_cache_like_its_rows_but_never_the_written_dim():
    node, _ = make_node(aten.scatter.src, _args())
    spec = spec_for(node)
    assert spec.rule == "scatter"
    strats = enumerate_strategies(spec, Mesh((2,), ("tp",), 8), spec.inputs[0][:1])
    heads = [s for s in strats if s.inputs[0] is not None and s.inputs[0].dims[1] == (0,)]
    assert heads and all(s.inputs[1].dims[1] == (0,) and s.inputs[2].dims[1] == (0,)
                         and s.outputs[0].dims[1] == (0,) for s in heads)
    assert not any(s.inputs[0].dims[2] or s.inputs[1].dims[2] for s in strats if s.inputs[0] is not None)


def test_a_scatter_whose_index_is_narrower_than_the_cache_runs_replicated():
    node, _ = make_node(aten.scatter.src, (rnd(4, 4, 6, 2), 2, torch.zeros(4, 2, 2, 2, dtype=torch.long),
                                           rnd(4, 2, 2, 2)))
    spec = spec_for(node)
    assert all(set(ls) <= spec.unsplittable for ls in spec.inputs + spec.outputs)
