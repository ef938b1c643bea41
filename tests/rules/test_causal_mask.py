"""An explicit SDPA attn_mask proven causal from the traced graph (autopar/rules/causal_mask.py):
ring / Ulysses attention then run it as is_causal=True; any other mask keeps the priced
all-gathered-K/V fallback (tests/execution/test_sequence_parallel_exec.py executes both on Hugging Face
models)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.frontend.trace import trace
from autopar.models import HF_ZOO
from autopar.rules.causal_mask import is_causal_value, mask_is_causal
from autopar.rules.sequence_attention import CAUSAL_MASK, RING, ULYSSES

torch.set_num_threads(1)


def _sdpa_nodes(model, batch):
    g = trace(model, batch)
    nodes = [n for n in g.gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    assert nodes
    return nodes


class MaskAttention(torch.nn.Module):
    """One attention layer whose mask ``make(s, x, m)`` builds (x: the input, m: an optional mask input)."""

    def __init__(self, make, d=16, heads=2, seq=8):
        super().__init__()
        self.make, self.heads = make, heads
        self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.register_buffer("tri", torch.ones(seq, seq, dtype=torch.bool).tril(), persistent=False)

    def forward(self, x, m=None):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).split(d, 2))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.make(self, s, x, m))
        return self.out(y.transpose(1, 2).reshape(b, s, d)).pow(2).mean()


def _bool_tril(self, s, x, m):
    return torch.ones(s, s, dtype=torch.bool, device=x.device).tril()


def _arange_le(self, s, x, m):      # Hugging Face's form: kv position <= q position, per batch row
    pos = torch.arange(s, device=x.device)
    return (pos[None, None, None, :] <= pos[None, None, :, None]).expand(x.shape[0], 1, s, s)


def _additive(low):
    def make(self, s, x, m):
        return torch.full((s, s), low, device=x.device).triu(1)
    return make


CASES = {
    "bool-tril": (_bool_tril, True, ""),
    "arange-le": (_arange_le, True, ""),
    "additive-inf": (_additive(-math.inf), True, ""),
    "additive-finfo-min": (_additive(torch.finfo(torch.float32).min), True, ""),
    # -1e4 does not make a weight exactly 0 for every score: not provably causal
    "additive-1e4": (_additive(-1e4), False, "not the causal pattern"),
    "sliding-window": (lambda self, s, x, m: torch.ones(s, s, dtype=torch.bool, device=x.device).tril().triu(-2),
                       False, "not the causal pattern"),
    "anti-causal": (lambda self, s, x, m: torch.ones(s, s, dtype=torch.bool, device=x.device).triu(),
                    False, "not the causal pattern"),
    "from-a-buffer": (lambda self, s, x, m: self.tri[:s, :s], False, "depends on the graph input"),
    "from-an-input": (lambda self, s, x, m: m, False, "depends on the graph input"),
}


@pytest.mark.parametrize("key", list(CASES))
def test_which_masks_are_causal(key):
    make, want, why = CASES[key]
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16)
    batch = (x, torch.ones(8, 8, dtype=torch.bool).tril()) if key == "from-an-input" else (x,)
    (node,) = _sdpa_nodes(MaskAttention(make), batch)
    ok, reason = mask_is_causal(node)
    assert ok == want, reason
    assert why in reason


def test_mask_values():
    tril = torch.ones(4, 4, dtype=torch.bool).tril()
    assert is_causal_value(tril, 4, 4)[0]
    assert is_causal_value(tril.expand(3, 2, 4, 4), 4, 4)[0]          # broadcast over batch and heads
    assert not is_causal_value(tril[:, :3], 4, 3)[0]                    # cross-attention shapes
    assert not is_causal_value(tril[:1], 4, 4)[0]                        # a row broadcast over queries
    assert not is_causal_value(tril.long(), 4, 4)[0]
    bad = tril.clone().expand(2, 1, 4, 4).clone()
    bad[1, 0, 3, 0] = False                                              # one padded key in one row
    assert not is_causal_value(bad, 4, 4)[0]


def test_hf_models():
    for name, want in (("hf_llama", True), ("hf_qwen2", True), ("hf_mistral", False)):
        model, batch = HF_ZOO[name]()     # Mistral: sliding window 8 < sequence 16
        assert all(mask_is_causal(n)[0] == want for n in _sdpa_nodes(model, batch)), name


@pytest.mark.parametrize("mode, algo", [("ring", RING), ("ulysses", ULYSSES)])
def test_hf_llama_plans_the_mode_without_fallback(mode, algo):
    model, batch = HF_ZOO["hf_llama"]()
    import warnings
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2),
                            constraints={"sp": 2, "sp_mode": mode})
    assert not [x for x in w if "attn_mask" in str(x.message)]
    assert plan.degrees["sp_mode"] == mode
    attn = [op for op in plan.data["ops"] if "scaled_dot_product_attention" in op["target"]]
    assert attn and all(op["special"] == [algo, CAUSAL_MASK] for op in attn)
    assert all("(attn_mask causal)" in op["strategy"] for op in attn)


def test_hf_mistral_sliding_window_falls_back_with_the_reason():
    model, batch = HF_ZOO["hf_mistral"]()
    with pytest.warns(UserWarning, match=r"explicit attn_mask.*not provably causal: the mask's values are not the "
                                         r"causal pattern.*K/V all-gathered"):
        plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2),
                            constraints={"sp": 2, "sp_mode": "ring"})
    attn = [op for op in plan.data["ops"] if "scaled_dot_product_attention" in op["target"]]
    assert attn and all(op["splits"][plan.mesh.axis("sp")] == "s" and not op["special"] for op in attn)
