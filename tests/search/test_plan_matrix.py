"""Every zoo model plans on every cluster shape: dgx-a100 with 1, 2 and 16 nodes and 4 CPU processes.

Tiny models run at their default sizes; the published shapes (gpt2_xl, gpt3, llama_7b, ...) keep
their widths, sequence and vocabulary but are cut to 2 layers (on the meta device) so the matrix
stays minutes, not hours. On 16 nodes (128 devices) the global batch must be at least
128 / 8 = 16 (dp × tp = devices, tp within one node of 8), so the batch is raised to 16 there.
Each (model, batch) is traced once and passed to autopar.plan as ``traced=``. Of the Hugging Face
zoo, GPT-2, Llama and BERT are in the matrix; the other architectures are planned (and trained) on 4
CPU processes by tests/models/test_hf_suite.py: on these cluster shapes they would add ~25 minutes."""
import pytest

import autopar
from autopar.models import HF_ZOO, ZOO
from autopar.frontend.trace import trace

pytestmark = pytest.mark.slow

PUBLISHED = {"gpt2_small", "gpt2_medium", "gpt2_large", "gpt2_xl", "gpt3", "llama_7b", "bert_large", "vit_large"}
MATRIX_HF = ("hf_bert", "hf_gpt2", "hf_llama")
FACTORIES = {**ZOO, **{k: HF_ZOO[k] for k in MATRIX_HF}}
CLUSTERS = {
    "dgx-a100x1": lambda: autopar.Cluster.preset("dgx-a100", nodes=1),
    "dgx-a100x2": lambda: autopar.Cluster.preset("dgx-a100", nodes=2),
    "dgx-a100x16": lambda: autopar.Cluster.preset("dgx-a100", nodes=16),
    "cpu4": lambda: autopar.Cluster.preset("cpu", devices=4),
}

# A 2-layer GPT-3 (d=12288, vocab 50304: 4.2B parameters, 16 bytes each with AdamW in fp32) cannot
# fit 4 CPU processes of 4 GiB each, whatever the sharding: the planner must say so with the smallest
# peak it can reach, and that figure must be real (a budget of exactly that much plans).
EXPECT_OOM = {("gpt3", "cpu4")}

_traced: dict = {}


def traced(name: str, big_batch: bool):
    key = (name, big_batch)
    if key not in _traced:
        kw = {}
        if name in PUBLISHED:
            kw["n_layer"] = 2
        if big_batch:
            kw["batch"] = 16
        model, inputs = FACTORIES[name](**kw)
        _traced[key] = (model, inputs, trace(model, inputs))
    return _traced[key]


def test_matrix_covers_the_whole_zoo():
    assert set(ZOO) | set(MATRIX_HF) == set(FACTORIES) and set(MATRIX_HF) <= set(HF_ZOO)
    assert PUBLISHED <= set(ZOO)


@pytest.mark.parametrize("cluster_name", list(CLUSTERS))
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_plans(name, cluster_name):
    cluster = CLUSTERS[cluster_name]()
    model, inputs, g = traced(name, big_batch=cluster.num_devices > 64)
    if (name, cluster_name) in EXPECT_OOM:
        with pytest.raises(autopar.MemoryBudgetError) as ei:
            autopar.plan(model, inputs, cluster, traced=g)
        assert ei.value.min_peak_bytes > cluster.device.memory_bytes
        assert "smallest peak" in str(ei.value)
        p = autopar.plan(model, inputs, cluster, traced=g, memory_budget=ei.value.min_peak_bytes)
        # budgets hold to the solver's relative tolerance (1e-9: a few bytes of 17 GB)
        assert p.peak_memory <= ei.value.min_peak_bytes * (1 + 1e-9)
        return
    p = autopar.plan(model, inputs, cluster, traced=g)
    d = p.degrees
    assert d["dp"] * d["tp"] * d["pp"] * (1 if d["sp_mode"] == "megatron" else d["sp"]) == cluster.num_devices, d
    assert d["tp"] <= cluster.devices_per_node
    assert 0 < p.peak_memory <= cluster.device.memory_bytes
    assert p.step_time > 0
    assert 0 < p.mfu < 1
    # the mesh is one stage's; under pipelining the stages' point-to-point bytes are reported as "pp"
    assert set(p.comm_bytes) == set(p.mesh.names) | ({"pp"} if d["pp"] > 1 else set())
    assert p.fingerprint == g.fingerprint
