"""The stage memory floor's layout (autopar/search/stage_memory_floor.py ``block_floors``: what each
representative charges and where, read off the graph once per mesh's candidates) changes no floor:
a mesh's ZeRO / checkpoint / micro-batch variants priced one after another on the same candidates
get the floors a fresh layout gives them."""
from __future__ import annotations

import pytest

import autopar
from autopar.frontend.trace import trace
from autopar.mesh import Mesh
from autopar.models import ZOO
from autopar.pricing.price import Settings, price
from autopar.rules.candidates import candidates
from autopar.search.stage_memory_floor import block_floors


def _without_layout(cands):
    for key in [k for k in cands.edge_cache if isinstance(k, tuple) and k[:1] == ("stage memory layout",)]:
        del cands.edge_cache[key]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_layout_kept_across_a_meshs_variants_gives_the_fresh_floors(name):
    model, batch = ZOO[name](n_layer=4)
    g = trace(model, batch)
    cluster = autopar.Cluster.preset("cpu", devices=4)
    for mesh in (Mesh((2, 2), ("dp", "tp"), 4), Mesh((4,), ("dp",), 4)):
        cands = candidates(g, mesh)
        fresh, kept = [], []
        for zero in (0, 1, 3):
            for ck in ("none", "full", None):
                for m in (1, 2):
                    P = price(cands, cluster, Settings(zero=zero, checkpoint=ck, num_micro_batches=m), edges=False)
                    kept.append(block_floors(g, cands, P, ck))   # the layout of the first variant, reused
                    _without_layout(cands)
                    fresh.append(block_floors(g, cands, P, ck))
                    assert kept[-1] == fresh[-1], (mesh, zero, ck, m)
        assert len({f.static for f in fresh}) > 1   # the variants differ: the check is not vacuous
