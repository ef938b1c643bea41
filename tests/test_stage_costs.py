"""Where a pipelined plan's reshards run (autopar/search/stage_costs.py): an edge key stands for
every graph edge between two representatives, and its bytes go to the block instances those edges
actually enter. (Spread evenly over the consumer's repeats until 2026-11-26, the embedding's
reshard into the first block was a third on the other pipeline rank: the executed zero-bubble x
Megatron-SP test then moved 48 KB a step more on tp than its stage's prediction.)"""
from __future__ import annotations

from autopar.frontend.trace import trace
from autopar.mesh import Mesh
from autopar.models import ZOO
from autopar.rules.candidates import candidates
from autopar.search.stage_costs import _edge_shares
from codegen.stages import pipeline_units


def test_edges_into_blocks_go_to_the_instances_they_enter():
    graph = trace(*ZOO["llama"](n_layer=4))
    cands = candidates(graph, Mesh((2,), ("tp",), devices_per_node=2))
    order = {n.name: k for k, n in enumerate(graph.gm.graph.nodes)}
    units = pipeline_units(graph)
    first_block = min(order[graph.blocks[g].instances[i][0]] for g, i in units)
    shares = _edge_shares(cands, graph, order, first_block)
    assert len(units) == 4
    # the embedding's output enters the first instance only, all of it
    emb = [k for k in shares if k[0] == "embedding" and cands.nodes[k[1]].repeats == 4]
    assert emb, sorted(shares)[:10]
    for k in emb:
        assert shares[k] == [(units[0], 1.0)], (k, shares[k])
    # the previous instance's output enters instances 1..3, a third each
    inter = [k for k, v in shares.items() if {p for p, _ in v} == set(units[1:])]
    assert inter and all(abs(w - 1 / 3) < 1e-12 for k in inter for _, w in shares[k])
    # an edge inside the block runs in every instance, a quarter each; and every key's shares sum to 1
    inside = [k for k, v in shares.items() if {p for p, _ in v} == set(units)]
    assert inside and all(abs(w - 1 / 4) < 1e-12 for k in inside for _, w in shares[k])
    assert all(abs(sum(w for _, w in v) - 1) < 1e-12 for v in shares.values())
