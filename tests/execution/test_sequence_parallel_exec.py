"""Sequence parallelism planned and executed end to end (issue 7): Megatron-SP on the tensor axis,
Ulysses and ring attention on a sequence axis, on the zoo GPT-2 and Llama (causal, GQA, RoPE) and
Hugging Face's LlamaForCausalLM (SDPA given an explicit mask built from position ids, which the
planner proves causal: autopar/rules/causal_mask.py).

Every case trains 3 steps of SGD with momentum in fp32 on forked gloo ranks and must match one
eager process (losses rel 1e-5, parameters rel 1e-4), and asserts its premise: the plan's degrees
name the mode, the attention ops run the mode's algorithm, the bytes counted at run time on every
mesh axis equal the plan's ``comm_bytes`` (one step, after a warm-up step), and the mode's own
traffic is there (reduce-scatter + all-gather on the tensor axis for Megatron-SP; all-to-all for
Ulysses; ring K/V and dK/dV transfers for ring attention, equal to ``ring_attention_bytes``)."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar.models import HF_ZOO
from autopar.rules.sequence_attention import CAUSAL_MASK
from runtime.launch import run_local
from helpers.sequence_parallel import (ZOO, attention_ops, attention_shape, measure_saved,
                                      predicted_saved, run_case)

torch.set_num_threads(1)


# Hugging Face Llama (transformers' LlamaForCausalLM, SDPA attention, GQA 4 heads / 2 kv heads,
# seq 16): tp=4 gets 4 kv heads so the k/v projections' heads divide by 4
HF_TP4 = {"n_kv_heads": 4}


@pytest.mark.slow
@pytest.mark.parametrize("name, tp, kw", [("gpt2", 2, {}), ("llama", 2, {}), ("gpt2", 4, {}), ("llama", 4, {}),
                                          ("hf_llama", 2, {}), ("hf_llama", 4, HF_TP4)])
def test_megatron_sp(name, tp, kw):
    plan, res = run_case(name, tp, {"tp": tp, "sp_mode": "megatron"}, **kw)
    assert plan.degrees["sp_mode"] == "megatron" and plan.degrees["sp"] == plan.degrees["tp"] == tp
    # the norms (GPT-2: layer_norm; Llama: RMSNorm written out, its mean over the hidden dim)
    norms = [op for op in plan.data["ops"] if op["target"] in ("aten.layer_norm.default", "aten.mean.dim")]
    assert norms and all(op["splits"][plan.mesh.axis("tp")] is not None for op in norms)
    kinds = res[0][3]
    # the all-reduce of the row-parallel output became reduce-scatter + all-gather
    assert kinds.get("tp:reduce_scatter", 0) > 0 and kinds.get("tp:all_gather", 0) > 0, kinds


def _check_sequence_mode(plan, res, name, mode, kw=None):
    from runtime.ring_attention import ring_attention_bytes
    from runtime.ulysses import ulysses_bytes
    if mode == "sequence":   # attention with q split and K/V all-gathered by resharding
        assert plan.degrees["sp_mode"] == "sequence"
        mm = [op for op in plan.data["ops"] if op["target"] == "aten.matmul.default"] or attention_ops(plan)
        assert mm and all(op["splits"][plan.mesh.axis("sp")] and not op["special"] for op in mm)
        for kinds in (out[3] for out in res):
            assert kinds.get("sp:all_gather", 0) > 0 and not any(k.startswith("sp:ring") or k == "sp:all_to_all"
                                                                    for k in kinds), kinds
        return
    algo = {"ulysses": "ulysses_attention", "ring": "ring_attention",
            "ring-contiguous": "ring_attention_contiguous"}[mode]
    sp = plan.degrees["sp"]
    assert plan.degrees["sp_mode"] == mode, plan.degrees
    attn = attention_ops(plan)
    # Hugging Face decoders pass SDPA an explicit mask: proven causal, it runs as is_causal=True;
    # an encoder's padding mask is no causal mask: Ulysses runs it whole
    special = [algo, CAUSAL_MASK] if name.startswith("hf_") and name not in ENCODERS else [algo]
    assert attn and all(op["special"] == special for op in attn), [op["strategy"] for op in attn]
    b, h, s, d, layers = attention_shape(name, kw)
    b //= plan.degrees["dp"]
    if "tp" in plan.mesh.names:   # heads split over the tensor axis too
        h //= plan.mesh.shape[plan.mesh.axis("tp")] if attn[0]["splits"][plan.mesh.axis("tp")] else 1
    # a recomputed attention (full or selective checkpointing) runs its forward transfers twice
    again = plan.degrees.get("checkpoint", "none") != "none"
    for kinds in (out[3] for out in res):
        if mode == "ulysses":
            want = ulysses_bytes(b, h, h, s, d, sp, 4)
            got = kinds.get("sp:all_to_all", 0)
        else:
            want = ring_attention_bytes(b, h, s, d, sp, 4)
            got = kinds.get("sp:ring_kv", 0) + kinds.get("sp:ring_dkv", 0)
        assert got == layers * (want.total_bytes + (want.forward_bytes if again else 0)), (kinds, want)


ENCODERS = {"hf_bert", "hf_roberta"}

SEQUENCE_CASES = {
    "gpt2-ulysses-sp2": ("gpt2", 2, {"sp": 2, "sp_mode": "ulysses"}),
    "llama-ulysses-sp2": ("llama", 2, {"sp": 2, "sp_mode": "ulysses"}),
    "gpt2-ring-sp2": ("gpt2", 2, {"sp": 2, "sp_mode": "ring"}),
    "llama-ring-sp2": ("llama", 2, {"sp": 2, "sp_mode": "ring"}),
    "gpt2-ring-contiguous-sp2": ("gpt2", 2, {"sp": 2, "sp_mode": "ring-contiguous"}),
    "llama-ring-contiguous-sp2": ("llama", 2, {"sp": 2, "sp_mode": "ring-contiguous"}),
    "gpt2-explicit-attention-sp2": ("gpt2", 2, {"sp": 2}, {"attention": "explicit"}),
    # Hugging Face Llama passes SDPA an explicit mask, built from arange position ids; the planner
    # proves it causal (autopar/rules/causal_mask.py) and runs ring / Ulysses attention with is_causal
    "hf_llama-ring-sp2": ("hf_llama", 2, {"sp": 2, "sp_mode": "ring"}),
    "hf_llama-ring-contiguous-sp2": ("hf_llama", 2, {"sp": 2, "sp_mode": "ring-contiguous"}),
    "hf_llama-ulysses-sp2": ("hf_llama", 2, {"sp": 2, "sp_mode": "ulysses"}),
    # an encoder's padding mask (not causal) runs whole under Ulysses, each rank its heads' rows
    "hf_bert-ulysses-sp2": ("hf_bert", 2, {"sp": 2, "sp_mode": "ulysses"}),
    # checkpointed attention reruns only its forward transfers in backward (the ring sends more
    # backward than forward: fp32 dK/dV), and the plan's bytes must say so
    "llama-ring-sp2-checkpointed": ("llama", 2, {"sp": 2, "sp_mode": "ring", "checkpoint": "full"}),
    "gpt2-ring-contiguous-sp2-selective": ("gpt2", 2, {"sp": 2, "sp_mode": "ring-contiguous",
                                                       "checkpoint": "selective"}),
    # Mistral's sliding-window mask (window 8 < seq 16) is not causal: ring attention falls back to
    # sequence-split queries with K/V all-gathered by resharding (priced, warned)
    "hf_mistral-ring-sp2-sliding-window": ("hf_mistral", 2, {"sp": 2, "sp_mode": "ring"}, {}, "sequence"),
}


@pytest.mark.slow
@pytest.mark.parametrize("key", list(SEQUENCE_CASES))
def test_sequence_axis(key):
    name, n, cons, *rest = SEQUENCE_CASES[key]
    kw = rest[0] if rest else {}
    mode = rest[1] if len(rest) > 1 else cons.get("sp_mode", "sequence")
    plan, res = run_case(name, n, cons, **kw)
    _check_sequence_mode(plan, res, name, mode, kw)


FOUR_PROCESS_CASES = {
    "llama-ulysses-sp4": ("llama", 4, {"sp": 4, "sp_mode": "ulysses"}),
    "llama-ring-sp4": ("llama", 4, {"sp": 4, "sp_mode": "ring"}),
    "gpt2-ring-contiguous-sp4": ("gpt2", 4, {"sp": 4, "sp_mode": "ring-contiguous"}),
    "gpt2-ulysses-sp4": ("gpt2", 4, {"sp": 4, "sp_mode": "ulysses"}),
    "gpt2-ring-sp4": ("gpt2", 4, {"sp": 4, "sp_mode": "ring"}),
    "llama-ring-contiguous-sp4": ("llama", 4, {"sp": 4, "sp_mode": "ring-contiguous"}),
    "llama-dp2-ring-sp2": ("llama", 4, {"dp": 2, "sp": 2, "sp_mode": "ring"}),
    "gpt2-tp2-ulysses-sp2": ("gpt2", 4, {"tp": 2, "sp": 2, "sp_mode": "ulysses"}),
    "hf_llama-ring-sp4": ("hf_llama", 4, {"sp": 4, "sp_mode": "ring"}),
    "hf_llama-ring-contiguous-sp4": ("hf_llama", 4, {"sp": 4, "sp_mode": "ring-contiguous"}),
    "hf_llama-ulysses-sp4": ("hf_llama", 4, {"sp": 4, "sp_mode": "ulysses"}),
    # the dp=2 x ring sp=2 and tp=2 x Ulysses sp=2 on more of its models
    "gpt2-dp2-ring-sp2": ("gpt2", 4, {"dp": 2, "sp": 2, "sp_mode": "ring"}),
    "hf_llama-dp2-ring-sp2": ("hf_llama", 4, {"dp": 2, "sp": 2, "sp_mode": "ring"}),
    "llama-tp2-ulysses-sp2": ("llama", 4, {"tp": 2, "sp": 2, "sp_mode": "ulysses"}),
    "hf_bert-dp2-ulysses-sp2": ("hf_bert", 4, {"dp": 2, "sp": 2, "sp_mode": "ulysses"}),
    "hf_llama-tp2-ulysses-sp2": ("hf_llama", 4, {"tp": 2, "sp": 2, "sp_mode": "ulysses"}, HF_TP4),
}


@pytest.mark.slow
@pytest.mark.parametrize("name, kw", [("llama", {}), ("gpt2", {}), ("hf_llama", HF_TP4)])
def test_dp2_tp2_ring_sp2_on_8_processes(name, kw):
    # Megatron's column/row linears on the tensor axis (the CPU cost model alone keeps them whole)
    plan, res = run_case(name, 8, {"dp": 2, "tp": 2, "sp": 2, "sp_mode": "ring"}, policy="megatron", **kw)
    _check_sequence_mode(plan, res, name, "ring", kw)


@pytest.mark.slow
@pytest.mark.parametrize("key", list(FOUR_PROCESS_CASES))
def test_sequence_axis_with_data_or_tensor_axis(key):
    name, n, cons, *kw = FOUR_PROCESS_CASES[key]
    plan, res = run_case(name, n, cons, **(kw[0] if kw else {}))
    for k, v in cons.items():
        assert plan.degrees[k] == v, plan.degrees
    _check_sequence_mode(plan, res, name, cons["sp_mode"], kw[0] if kw else None)


# ------------------------------------------------------------------ bad input: clear errors naming the op

class MaskedAttention(torch.nn.Module):
    """One attention layer given an explicit (sliding-window) boolean mask."""

    def __init__(self, d=16, heads=2, seq=8):
        super().__init__()
        self.qkv, self.out, self.heads = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d), heads
        self.register_buffer("mask", torch.ones(seq, seq, dtype=torch.bool).tril().triu(-2), persistent=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).split(d, 2))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.mask[:s, :s])
        return self.out(y.transpose(1, 2).reshape(b, s, d)).pow(2).mean()


def _plan(model, batch, n, constraints):
    return autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=n), constraints=constraints)


def test_ring_needs_seq_divisible_by_2sp():
    model, batch = ZOO["gpt2"](seq=6)
    with pytest.raises(autopar.PlanError, match=r"scaled_dot_product_attention.*sequence length 6 does not divide "
                                                r"into 4 chunks"):
        _plan(model, batch, 2, {"sp": 2, "sp_mode": "ring"})


def test_ulysses_needs_heads_divisible_by_sp():
    model, batch = ZOO["gpt2"](n_head=2, d_model=32)
    with pytest.raises(autopar.PlanError, match=r"scaled_dot_product_attention.*2 heads over sp=4"):
        _plan(model, batch, 4, {"sp": 4, "sp_mode": "ulysses"})


def test_ring_with_a_general_mask_falls_back_to_gathered_kv():
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match=r"scaled_dot_product_attention has an explicit attn_mask.*K/V all-gathered"):
        plan = _plan(MaskedAttention(), (torch.randn(4, 8, 16),), 2, {"sp": 2, "sp_mode": "ring"})
    (attn,) = attention_ops(plan)
    assert attn["splits"][plan.mesh.axis("sp")] == "s" and not attn["special"]
    assert plan.degrees["sp_mode"] == "sequence"


def test_ulysses_runs_a_general_mask_whole():
    """A sliding-window mask (not causal) is what ring attention cannot split; Ulysses attends the
    whole sequence for a share of the heads, so it runs the mask as it is: the plan keeps Ulysses,
    with no warning, and the op's mask input stays whole on the sequence axis."""
    import warnings

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)   # no fallback warning
        plan = _plan(MaskedAttention(), (torch.randn(4, 8, 16),), 2, {"sp": 2, "sp_mode": "ulysses"})
    (attn,) = attention_ops(plan)
    assert attn["special"] == ["ulysses_attention"] and plan.degrees["sp_mode"] == "ulysses"
    sp = plan.mesh.axis("sp")
    assert all(sp not in axes for axes in attn["inputs"][3]["dims"]), attn["inputs"][3]


def test_ulysses_keeps_a_learned_bias_mask_gathered():
    """T5's self-attention mask carries its learned relative-position bias (gradients flow to it):
    Ulysses, which keeps the mask whole on the axis, does not run it; the op falls back to K/V
    all-gathered, and says why."""
    model, batch = HF_ZOO["hf_t5"]()
    with pytest.warns(UserWarning, match=r"ulysses attention cannot run \(.*gradients flow to the attn_mask"):
        plan = _plan(model, batch, 2, {"sp": 2, "sp_mode": "ulysses"})
    specials = [op["special"] for op in attention_ops(plan)]
    assert [] in specials, specials   # the biased self-attention: gathered K/V


def test_ulysses_refuses_attention_dropout():
    model, batch = ZOO["gpt2"](dropout=0.1)
    with pytest.raises(autopar.PlanError, match=r"scaled_dot_product_attention.*dropout"):
        _plan(model, batch, 2, {"sp": 2, "sp_mode": "ulysses"})


@pytest.mark.parametrize("cons, msg", [
    ({"sp_mode": "diagonal"}, "must be one of"),
    ({"sp_mode": "hybrid"}, "needs the size of the sequence axes"),
    ({"sp": 1, "sp_mode": "ring"}, "contradict"),
    ({"sp": 2, "tp": 4, "sp_mode": "megatron"}, "sp must equal tp"),
    ({"sp": 0}, "positive integer"),
])
def test_bad_sequence_pins(cons, msg):
    model, batch = ZOO["gpt2"]()
    with pytest.raises(autopar.ConstraintError, match=msg):
        _plan(model, batch, 4, cons)


def test_show_names_the_mode_per_attention_op():
    model, batch = ZOO["llama"]()
    plan = _plan(model, batch, 2, {"sp": 2, "sp_mode": "ulysses"})
    assert plan.degrees["sp_mode"] == "ulysses"
    names = [op["strategy"] for op in attention_ops(plan)]
    assert names and all("[ulysses_attention]" in s for s in names), names
    from autopar.plans.report import show_text
    text = show_text(plan, limit=None)
    assert "sp=2 (ulysses)" in text and text.count("[ulysses") >= len(names), text


def test_attention_mode_pin_needs_an_sdpa_op():
    # ring attention is an SDPA algorithm; explicit attention runs Ulysses head-split
    # (tests/execution/test_ulysses_explicit.py) but has no ring form
    model, batch = ZOO["gpt2"](attention="explicit")
    with pytest.raises(autopar.PlanError, match=r"no such op"):
        _plan(model, batch, 2, {"sp": 2, "sp_mode": "ring"})


# ------------------------------------------------------------------ saved activations: prediction vs measurement


SAVED_CASES = [("llama", {"sp": 2, "sp_mode": "ulysses"}), ("llama", {"sp": 2, "sp_mode": "ring"}),
               ("llama", {"sp": 2, "sp_mode": "ring-contiguous"}), ("llama", {"tp": 2, "sp_mode": "megatron"}),
               ("hf_llama", {"sp": 2, "sp_mode": "ring"}), ("hf_llama", {"sp": 2, "sp_mode": "ring-contiguous"}),
               ("hf_llama", {"sp": 2, "sp_mode": "ulysses"}), ("gpt2", {"sp": 2, "sp_mode": "ulysses"}),
               ("gpt2", {"sp": 2, "sp_mode": "ring"}), ("gpt2", {"sp": 2, "sp_mode": "ring-contiguous"}),
               ("gpt2", {"tp": 2, "sp_mode": "megatron"}), ("hf_llama", {"tp": 2, "sp_mode": "megatron"}),
               ("hf_bert", {"sp": 2, "sp_mode": "ulysses"})]   # its padding mask kept whole


@pytest.mark.slow
@pytest.mark.parametrize("name, cons", SAVED_CASES, ids=[f"{n}-{c['sp_mode']}" for n, c in SAVED_CASES])
def test_saved_activations_match_prediction(name, cons):
    """saved_tensors_hooks on every rank against the plan, within 2%: exact for Ulysses, contiguous
    ring and Megatron-SP on the zoo Llama and GPT-2 (whose attention output the trace lays out like
    its (b, s, h, d) q: ring attention returns it so, and Ulysses' saved output is its own buffer,
    autopar/rules/sequence_attention.py ``saves_as_run``); zig-zag ring also saves the int64 permutation
    indices of its reshards (< 1%). Hugging Face Llama computes its RoPE cos/sin tables (from positions,
    whole on every rank): the sequence-split rows the RoPE multiplies save are views of them, so
    the whole (1, s, head_dim) tables stay alive where the plan prices their 1/sp rows.
    Megatron-SP saves the all-gathered copies its reshards make beside the sequence-split
    originals (an RMSNorm's input, a replicated attention output's column slice), and on
    Hugging Face Llama with one local key/value head ``repeat_kv``'s reshape is a view, not the
    copy the trace makes: the plan counts both (autopar/pricing/saved_copies.py). On GPT-2 the
    loss reads its targets split, as a view of the whole int64 batch (half of it is not priced),
    and divides by the global token count (a 4-byte scalar, not priced)."""
    model, batch = ZOO[name]()
    cluster = autopar.Cluster.preset("cpu", devices=2)
    plan = autopar.plan(model, batch, cluster, precision="fp32", optimizer="sgd",
                        constraints={"num_micro_batches": 1, **cons})
    assert plan.degrees["sp_mode"] == cons["sp_mode"]
    pred = predicted_saved(plan)
    unpriced = 0
    if name == "hf_llama" and "sp" in cons:   # RoPE tables (BERT has learned positions)
        _, _, s, d, _ = attention_shape(name)
        unpriced = 2 * s * d * 4 * (cons["sp"] - 1) // cons["sp"]     # cos + sin, fp32, the rows not priced
    if name == "gpt2" and cons["sp_mode"] == "megatron":
        targets = batch[-1].numel() * batch[-1].element_size()
        unpriced = targets * (cons["tp"] - 1) // cons["tp"] + 4          # the targets' other half, the denominator
    for meas in run_local(measure_saved, 2, args=(name, plan.to_json()), timeout=300):
        assert abs(meas - pred) <= 0.02 * pred, (meas, pred)
        if cons["sp_mode"] != "ring":
            assert meas == pred + unpriced, (meas, pred, unpriced)
