"""Hugging Face architectures beyond the CI suite (tests/models/test_hf_suite.py), trained under autopar
plans on 4 gloo processes against one eager process: SGD with momentum, 3 steps, every rank's losses
(rel 1e-5) and rank 0's parameters (rel 1e-4) compared (tests/helpers/exactness.py). Each architecture is
built from a tiny config (2 layers, hidden 64, vocab 256, sequence 16, batch 8; images 16x16),
never with downloaded weights. Prints one line per (architecture, plan) and a markdown table.

    .venv/bin/python -m benchmarks.hf_coverage [--archs falcon,gemma2] [--plans megatron,auto,zero3]

A failing case prints the error's last lines; a pin the model cannot take (ring attention on an
explicit-attention model, a schedule needing more layers) is reported as the error autopar raises.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from helpers.exactness import assert_matches_eager, train_eagerly  # noqa: E402

import autopar  # noqa: E402
from autopar.models import HF_ZOO, build  # noqa: E402
from autopar.models.hf import ImageLossWrapper, _config, _make, _transformers  # noqa: E402
from runtime.launch import run_local  # noqa: E402

torch.set_num_threads(1)   # forked ranks deadlock in OpenMP if the parent ran multi-threaded ops
V = 256
DEVICES = 4
OPT = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9}

# name -> (config class, model class, config, attention implementation); text models take
# (input_ids, labels), image models (pixel_values, labels)
TEXT = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM",
        dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=1, head_dim=16, max_position_embeddings=64), "sdpa"),
    "phi": ("PhiConfig", "PhiForCausalLM",
        dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64, partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0,
             attention_dropout=0.0), "sdpa"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
        dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, resid_pdrop=0.0, embd_pdrop=0.0,
             attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2), "sdpa"),
    "gptj": ("GPTJConfig", "GPTJForCausalLM",
        dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64, rotary_dim=8, resid_pdrop=0.0,
             embd_pdrop=0.0, attn_pdrop=0.0), "eager"),
    "falcon": ("FalconConfig", "FalconForCausalLM",
        dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
             parallel_attn=True, new_decoder_architecture=False, hidden_dropout=0.0, attention_dropout=0.0), "sdpa"),
    "opt": ("OPTConfig", "OPTForCausalLM",
        dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
             max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0, attention_dropout=0.0), "sdpa"),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM",
        dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64, multi_query=True, resid_pdrop=0.0,
             embd_pdrop=0.0, attn_pdrop=0.0), "sdpa"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
        dict(vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
             shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64), "sdpa"),
    "olmo": ("OlmoConfig", "OlmoForCausalLM",
        dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2), "sdpa"),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM",
        dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, residual_dropout=0.0, embedding_dropout=0.0,
             attention_dropout=0.0, sliding_window=None), "sdpa"),
    "distilbert": ("DistilBertConfig", "DistilBertForMaskedLM",
        dict(vocab_size=V, dim=64, n_layers=2, n_heads=4, hidden_dim=128, max_position_embeddings=64,
             dropout=0.0, attention_dropout=0.0), "sdpa"),
    "deberta_v2": ("DebertaV2Config", "DebertaV2ForMaskedLM",
        dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
             relative_attention=True, position_buckets=8, pos_att_type=["p2c", "c2p"]), "eager"),
    "electra": ("ElectraConfig", "ElectraForMaskedLM",
        dict(vocab_size=V, embedding_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0), "sdpa"),
}
IMAGE = {
    "swin": ("SwinConfig", "SwinForImageClassification",
        dict(image_size=16, patch_size=2, num_channels=3, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
             window_size=4, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
             drop_path_rate=0.0), "eager"),
    "convnext": ("ConvNextConfig", "ConvNextForImageClassification",
        dict(num_stages=2, image_size=16, num_channels=3, hidden_sizes=[16, 32], depths=[1, 1], patch_size=2,
             num_labels=10, drop_path_rate=0.0), "eager"),
    "deit": ("DeiTConfig", "DeiTForImageClassification",
        dict(image_size=16, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2,
             num_attention_heads=4, intermediate_size=128, num_labels=10, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0), "sdpa"),
}
# already factories of the zoo (autopar/models/hf.py), also trained in CI (tests/models/test_hf_suite.py)
ZOO_ARCHS = ("hf_albert", "hf_gemma2")
MOE = {"qwen2_moe"}   # runtime/moe.py's "autopar" experts (the default loops over nonzero())

# plan name -> (constraints, policy)
PLANS = {
    "megatron": ({"dp": 2, "tp": 2, "zero": 0, "num_micro_batches": 1}, "megatron"),
    "auto": ({"num_micro_batches": 1}, None),
    "zero3": ({"dp": 2, "tp": 2, "zero": 3, "num_micro_batches": 1}, "megatron"),
    "pp2": ({"pp": 2, "pp_schedule": "1f1b", "dp": 2, "tp": 1, "num_micro_batches": 2}, None),
    "ulysses": ({"dp": 2, "tp": 1, "sp": 2, "sp_mode": "ulysses", "num_micro_batches": 1}, None),
    "megatron_sp": ({"dp": 2, "tp": 2, "sp": 2, "sp_mode": "megatron", "num_micro_batches": 1}, "megatron"),
}


def factory(name):
    if name in ZOO_ARCHS:
        return HF_ZOO[name]()
    if name in TEXT:
        cfg, cls, kw, attn = TEXT[name]
        return _make(cfg, cls, kw, 8, 16, V, "cpu", 0, attn, "autopar" if name in MOE else None)
    cfg, cls, kw, attn = IMAGE[name]
    config = _config(cfg, kw, attn)
    config.problem_type = "single_label_classification"
    model = build(lambda: ImageLossWrapper(getattr(_transformers(), cls)(config)), "cpu", 0)
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(8, 3, 16, 16, generator=g), torch.randint(10, (8,), generator=g))


def _train(rank, world, name, plan_json):
    model, batch = factory(name)
    cm = autopar.compile(model, autopar.Cluster.preset("cpu", devices=world), example_inputs=batch,
                         plan=autopar.Plan.from_json(plan_json), **OPT)
    losses = [cm.step(*batch) for _ in range(3)]
    sd = {k: v.numpy() for k, v in cm.full_state_dict().items()}
    return losses, (sd if rank == 0 else None), cm.comm_stats()


def run_case(name: str, plan_name: str) -> tuple[bool, str]:
    cons, policy = PLANS[plan_name]
    try:
        model, batch = factory(name)
        plan = autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=DEVICES), constraints=cons,
                            policy=policy)
        model, batch = factory(name)
        opt = torch.optim.SGD(model.parameters(), lr=OPT["lr"], momentum=OPT["momentum"])
        ref_losses, ref_sd = train_eagerly(model, batch, opt, 3)
        res = run_local(_train, plan.mesh.size * plan.degrees["pp"], args=(name, plan.to_json()), timeout=300)
        assert_matches_eager([o[0] for o in res], res[0][1], ref_losses, ref_sd, label=f"{name}: ")
        d = plan.degrees
        moved = {k: v for k, v in res[0][2].items() if v}
        return True, (f"dp{d['dp']} tp{d['tp']} pp{d['pp']} sp{d['sp']}/{d['sp_mode']} zero{d['zero']}, "
                      f"bytes {moved}")
    except Exception as e:   # report and go on: this is a survey
        return False, f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", default=",".join(list(ZOO_ARCHS) + list(TEXT) + list(IMAGE)))
    ap.add_argument("--plans", default="megatron,auto,zero3")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    rows = []
    for name in args.archs.split(","):
        for plan_name in args.plans.split(","):
            t0 = time.perf_counter()
            ok, what = run_case(name, plan_name)
            rows.append((name, plan_name, ok, what))
            print(f"{'OK  ' if ok else 'FAIL'} {name:12s} {plan_name:12s} {time.perf_counter() - t0:5.1f} s  {what}",
                  flush=True)
    print("\n| architecture | plan | equals one process | plan and bytes moved, or the error |\n|---|---|---|---|")
    for name, plan_name, ok, what in rows:
        print(f"| {name} | {plan_name} | {'yes' if ok else 'NO'} | {what} |")
    print(f"\n{sum(r[2] for r in rows)} of {len(rows)} equal one process")


if __name__ == "__main__":
    main()
