"""The model zoo: every tiny model trains on CPU and traces; published shapes have published
parameter counts; factories are deterministic; load_factory resolves every spec form."""
import sys

import pytest
import torch

from autopar.errors import PlanError
from autopar.models import HF_ZOO, ZOO, load_factory
from autopar.frontend.trace import trace

TINY = ["gpt2", "llama", "bert", "vit", "mlp"]


def _eager_vs_graph(model, x, tg):
    named = dict(model.named_parameters()) | dict(model.named_buffers())
    args = [named[tg.param_fqn[n.name]] for n in tg.gm.graph.nodes
            if n.op == "placeholder" and n.name in tg.param_fqn]
    out = tg.gm(*args, *x)
    return out[0] if isinstance(out, (tuple, list)) else out


@pytest.mark.parametrize("name", TINY)
def test_tiny_model_trains_and_traces(name):
    model, x = ZOO[name]()
    loss = model(*x)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    tg = trace(model, x)
    assert tg.source == "export"
    assert torch.allclose(_eager_vs_graph(model, x, tg), loss)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "vit"])
def test_transformers_have_one_block_group(name):
    model, x = ZOO[name](n_layer=3)
    tg = trace(model, x)
    assert [g.module_fqns for g in tg.blocks] == [["blocks.0", "blocks.1", "blocks.2"]]


@pytest.mark.parametrize("name", TINY)
def test_same_seed_same_weights(name):
    a, xa = ZOO[name](seed=3)
    b, xb = ZOO[name](seed=3)
    c, _ = ZOO[name](seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    assert all(torch.equal(u, v) for u, v in zip(xa, xb))


def test_building_does_not_touch_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    ZOO["gpt2"]()
    assert torch.equal(torch.rand(3), expected)


def test_dropout_is_configurable():
    model, x = ZOO["gpt2"](dropout=0.5)
    model.train()
    assert not torch.equal(model(*x), model(*x))
    model, x = ZOO["gpt2"]()          # default 0.0: deterministic in train mode
    assert torch.equal(model(*x), model(*x))


def test_llama_grouped_query_attention():
    model, _ = ZOO["llama"](n_head=4, n_kv_heads=2, d_model=64)
    assert model.blocks[0].wk.weight.shape == (32, 64)    # 2 kv heads x 16
    assert model.blocks[0].wq.weight.shape == (64, 64)
    assert model.head.weight is not model.tok.weight     # untied


# Published parameter counts (embeddings included; tied heads counted once).
@pytest.mark.parametrize("name,expected", [
    ("gpt2_small", 124.5e6), ("gpt2_medium", 354.8e6), ("gpt2_large", 774.0e6), ("gpt2_xl", 1.558e9),
    ("gpt3", 174.6e9), ("llama_7b", 6.74e9), ("bert_large", 335e6), ("vit_large", 304e6),
])
def test_published_shapes_on_meta(name, expected):
    model, x = ZOO[name]()
    assert all(p.is_meta for p in model.parameters()) and all(t.is_meta for t in x)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - expected) / expected < 0.01, n


def test_load_factory(tmp_path):
    assert load_factory("gpt2_xl") is ZOO["gpt2_xl"]
    assert load_factory("hf_gpt2") is HF_ZOO["hf_gpt2"]
    assert load_factory("autopar.models.mlp:mlp") is ZOO["mlp"]
    f = tmp_path / "mymodel.py"
    f.write_text("from autopar.models import mlp\n\ndef make(**kw):\n    return mlp.mlp(hidden=8, **kw)\n")
    model, x = load_factory(f"{f}:make")()
    assert model.out.in_features == 8
    with pytest.raises(PlanError, match="gpt2_xl"):
        load_factory("gpt5")
    with pytest.raises(PlanError, match="no callable"):
        load_factory("autopar.models.mlp:nope")
    with pytest.raises(PlanError, match="cannot import"):
        load_factory("no_such_pkg.mod:f")
    with pytest.raises(PlanError, match="does not exist"):
        load_factory(f"{tmp_path}/missing.py:f")


@pytest.mark.parametrize("name,container", [("hf_gpt2", "model.transformer.h"),
                                            ("hf_llama", "model.model.layers"),
                                            ("hf_bert", "model.bert.encoder.layer")])
def test_hf_models_train_and_trace(name, container):
    model, x = HF_ZOO[name](n_layer=2)
    loss = model(*x)
    loss.backward()
    assert loss.dim() == 0 and torch.isfinite(loss)
    tg = trace(model, x)
    assert torch.allclose(_eager_vs_graph(model, x, tg), loss, atol=1e-6)
    assert [g.name for g in tg.blocks] == [container] and len(tg.blocks[0].instances) == 2
    assert "aten.scaled_dot_product_attention.default" in {str(n.target) for n in tg.nodes()}
    if name == "hf_gpt2":
        assert tg.tied["model.lm_head.weight"][0] == "model.transformer.wte.weight"


def test_hf_without_transformers_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)   # makes `import transformers` fail
    with pytest.raises(PlanError, match="pip install transformers"):
        HF_ZOO["hf_gpt2"]()
