"""Saved activations at full scale, on meta tensors: the plan's prediction against
saved_tensors_hooks, for one Megatron-LM layer (autopar/models/megatron.py) of the 22B shape of
Korthikanti et al. 2022 (h 6144, 64 heads, s 2048, micro-batch 1) and of the GPT-2 XL shape
(h 1600, 25 heads, s 1024), with attention written out (matmul, softmax, dropout, matmul) and as
SDPA, in bf16, planned for DGX-A100 (a CUDA cluster) with dp=1 and Megatron tp=1 / tp=8.

How it is measured (tests/helpers/saved_activations.py): the plan's per-rank program for rank 0 is
generated and run forward on meta tensors (nothing is allocated) with its collectives stubbed by
shape-only functions (one rank's saved tensors do not depend on what its peers send; the real
collectives' autograd functions save nothing), with dropout and SDPA rewritten to the ops CUDA
runs (native_dropout: a bool mask; flash / memory-efficient attention: q, k, v, output,
logsumexp), since meta tensors otherwise take the CPU decompositions. Distinct storages
(``untyped_storage()`` identity) are counted once, parameters excluded. With tp=1 the eager model
measured the same way gives the same bytes, independently of codegen.

The closed form of Korthikanti et al. counts the same tensors except two that PyTorch saves and
the paper leaves out: the causal mask of ``masked_fill`` (s² bytes, bool, not divided by tp) and
layer norm's fp32 mean and rstd (2 × 4 bytes per row, two norms); with those the explicit layer
matches the formula exactly (benchmarks/RESULTS-history.md, section "Activation memory").
"""
from __future__ import annotations

import functools

import pytest
import torch

import autopar
from autopar.models.megatron import megatron_layer
from autopar.pricing.saved_probe import cuda_kernels, saved_bytes
from autopar.frontend.trace import trace
from helpers.saved_activations import hidden_dropout_splits, rank_saved_bytes

SHAPES = {"22b": dict(hidden=6144, heads=64, seq=2048), "gpt2xl": dict(hidden=1600, heads=25, seq=1024)}


@functools.lru_cache(maxsize=None)
def layer(shape: str, attention: str):
    model, inputs = megatron_layer(attention=attention, dtype=torch.bfloat16, **SHAPES[shape])
    return model, inputs, trace(model, inputs)


def make_plan(shape, attention, tp, preset="dgx-a100"):
    model, inputs, traced = layer(shape, attention)
    cons = {"dp": 1, "tp": tp, "zero": 0, "checkpoint": "none", "num_micro_batches": 1}
    if tp > 1:
        cons["tp_mode"] = "1d"
    cluster = autopar.Cluster.preset(preset, devices=tp)
    plan = autopar.plan(model, inputs, cluster, traced=traced, precision="bf16", constraints=cons, policy="megatron")
    assert plan.degrees["tp"] == tp
    return plan, plan.data["predictions"]["memory_breakdown"]["activations"]


def closed_form(shape, tp):
    """Korthikanti et al. 2022 per layer (16-bit activations, 1-byte masks), TP without sequence
    parallelism: sbh(10 + 24/t + 5as/(ht)); t = 1 is the baseline sbh(34 + 5as/h)."""
    c = SHAPES[shape]
    s, b, h, a = c["seq"], 1, c["hidden"], c["heads"]
    return s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))


CASES = [("22b", "explicit", 1), ("22b", "explicit", 8), ("22b", "sdpa", 1), ("22b", "sdpa", 8),
         ("gpt2xl", "explicit", 1), ("gpt2xl", "sdpa", 1)]


@pytest.mark.parametrize("shape,attention,tp", CASES)
def test_prediction_equals_hooks_on_the_rank_program(shape, attention, tp):
    plan, predicted = make_plan(shape, attention, tp)
    model, inputs, traced = layer(shape, attention)
    measured = rank_saved_bytes(model, inputs, plan, traced, rank=0)
    # SDPA at tp=8: the plan reshards q, k, v into the attention (all-to-all); codegen runs the
    # collective in q's traced memory order (b, s, h, d), so flash attention's output is laid out
    # as in the trace and the projection's input is a view of it (codegen/reshard_calls.py, reshard).
    # SDPA with dropout: flash's RNG state on meta is a (2,) uint64 seed and a () uint64 offset,
    # 8 B more than the model's two 8-byte scalars (hence rel, not ==).
    assert predicted == pytest.approx(measured, rel=1e-6), (shape, attention, tp, predicted, measured)


@pytest.mark.parametrize("shape,attention", [("22b", "explicit"), ("22b", "sdpa")])
def test_eager_model_measures_the_same(shape, attention):
    """tp=1: the eager model under the CUDA-kernel emulation saves what the generated program saves."""
    plan, predicted = make_plan(shape, attention, 1)
    model, inputs, _ = layer(shape, attention)
    with cuda_kernels():
        eager = saved_bytes(model, *inputs, exclude=list(model.parameters()))
    assert eager == pytest.approx(predicted, abs=16)   # flash's RNG seed is a (2,) uint64 on meta: 8 B more


@pytest.mark.parametrize("tp", [1, 8])
def test_explicit_layer_is_the_closed_form_plus_what_it_omits(tp):
    """Measured bytes = Korthikanti et al.'s formula + the causal mask (s² bool) + the two layer
    norms' fp32 mean and rstd (16 bytes per row): exactly, with the two hidden-state dropout
    masks (sbh each in the formula: Megatron runs them on the all-reduced, replicated output)
    counted as the plan lays them out. At tp=8 the plan runs those dropouts and the residual
    adds on 1/t of the hidden dim: a reduce-scatter in place of the row-parallel linear's
    all-reduce and an all-gather before the next layer norm (the same bytes as the all-reduce,
    1/t of the dropout work), so each mask is sbh/t, as under Korthikanti et al.'s sequence
    parallelism."""
    plan, _ = make_plan("22b", "explicit", tp)
    model, inputs, traced = layer("22b", "explicit")
    measured = rank_saved_bytes(model, inputs, plan, traced, rank=0)
    c = SHAPES["22b"]
    s, sbh = c["seq"], c["seq"] * c["hidden"]
    splits = hidden_dropout_splits(plan)
    assert len(splits) == 2 and all(sbh % f == 0 for f in splits), splits
    masks = sum(sbh - sbh // f for f in splits)     # what the split masks save against sbh each
    assert measured == round(closed_form("22b", tp)) + s * s + 16 * s - masks


def test_cuda_dropout_masks_are_one_byte():
    """The device rule: on a CUDA cluster a dropout mask is 1 byte per element (native_dropout);
    on CPU it is x * mask, the mask in the working dtype (2 bytes under bf16). Each plan matches
    the measurement of its device's kernels, and the two differ by exactly one byte per masked
    element: three masks, the attention probabilities' (a s² per sequence) and two hidden ones."""
    shape = "gpt2xl"
    model, inputs, traced = layer(shape, "explicit")
    _, gpu = make_plan(shape, "explicit", 1, "dgx-a100")
    _, cpu = make_plan(shape, "explicit", 1, "cpu")
    with cuda_kernels():
        gpu_measured = saved_bytes(model, *inputs, exclude=list(model.parameters()))
    cpu_measured = saved_bytes(model, *inputs, exclude=list(model.parameters()))   # meta runs CPU's dropout
    c = SHAPES[shape]
    masked = c["heads"] * c["seq"] ** 2 + 2 * c["seq"] * c["hidden"]
    assert gpu == gpu_measured and cpu == cpu_measured
    assert cpu - gpu == masked


def test_cpu_sdpa_with_dropout_counts_the_fp32_math_path():
    """CPU with dropout runs SDPA's math path, which upcasts bf16 to fp32 and saves fp32 copies
    (meta runs the same path): the CPU plan counts them."""
    shape = "gpt2xl"
    model, inputs, _ = layer(shape, "sdpa")
    _, cpu = make_plan(shape, "sdpa", 1, "cpu")
    assert cpu == saved_bytes(model, *inputs, exclude=list(model.parameters()))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zoo_models_planned_for_cuda(name, precision):
    """Small zoo models (traced in fp32, as users pass them) planned for a GPU cluster against the
    CUDA-kernel measurement in the plan's working dtype: flash attention for bf16 (output laid out
    like q: GPT-2's q is a view of the QKV output, Llama's a contiguous RoPE result), memory-efficient
    attention for fp32 (output (b, s, h, d)); the cross-entropy's log-softmax in the working dtype.
    Within 0.5%: efficient attention's RNG seed/offset (16 B) and a pre-existing 1 KiB in Llama."""
    from autopar.models import ZOO

    model, inputs = ZOO[name](device="meta", seq=32, batch=2, dropout=0.1) if name == "gpt2" else \
        ZOO[name](device="meta", seq=32, batch=2)
    plan = autopar.plan(model, inputs, autopar.Cluster.preset("dgx-a100", devices=1), precision=precision,
                        constraints={"dp": 1, "tp": 1, "checkpoint": "none", "num_micro_batches": 1},
                        kernels="torch")   # the eager model's ops (the fused ones: test below)
    predicted = plan.data["predictions"]["memory_breakdown"]["activations"]
    model = model.to(torch.bfloat16 if precision == "bf16" else torch.float32)
    with cuda_kernels():
        measured = saved_bytes(model, *inputs, exclude=list(model.parameters()))
    assert predicted == pytest.approx(measured, rel=5e-3)


@pytest.mark.parametrize("precision,constraints,rel", [
    ("fp32", {"dp": 1, "tp": 1}, 2e-2), ("bf16", {"dp": 1, "tp": 1}, 2e-2),
    ("fp32", {"tp": 2}, 2e-2), ("bf16", {"tp": 2}, 2e-2),
    # Megatron-SP: 2.9% under (one 16 KiB tensor of 703 KB not priced; torch ops: 0.4%). Its bf16
    # plan splits the loss, which this harness cannot run (no global denominators).
    ("fp32", {"tp": 2, "sp_mode": "megatron", "sp": 2}, 3e-2)],
    ids=["fp32-single", "bf16-single", "fp32-tp2", "bf16-tp2", "fp32-megatron-sp"])
def test_fused_kernels_saved_bytes_equal_the_prediction(precision, constraints, rel):
    """With the Triton kernels (fused RMSNorm, SwiGLU and rotary, autopar/frontend/fuse.py) the plan's saved
    activations equal what rank 0's program saves, run on meta under CUDA kernels."""
    from autopar.models import ZOO

    model, inputs = ZOO["llama"](device="meta", seq=32, batch=2, d_model=128, n_head=4, ffn_hidden=352)
    cluster = autopar.Cluster.preset("dgx-a100", devices=constraints.get("tp", 1))
    plan = autopar.plan(model, inputs, cluster, precision=precision, kernels="triton",
                        constraints={**constraints, "checkpoint": "none", "num_micro_batches": 1})
    assert plan.fused == {"rms_norm": 5, "swiglu": 2, "rotary": 4, "linear_cross_entropy": 1}
    traced = trace(model, inputs, kernels=True)
    predicted = plan.data["predictions"]["memory_breakdown"]["activations"]
    measured = rank_saved_bytes(model, inputs, plan, traced, rank=0, cuda=True)
    assert predicted == pytest.approx(measured, rel=rel)
