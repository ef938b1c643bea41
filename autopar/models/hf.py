"""Hugging Face ``transformers`` models built FROM CONFIGS (no weights are ever downloaded),
wrapped so ``forward(input_ids, labels)`` returns the training loss. ``transformers`` is an
optional dependency: it is imported only when a factory here is called."""
from __future__ import annotations

import torch
import torch.nn as nn

from autopar.errors import PlanError
from autopar.models.common import build, example_tokens


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise PlanError("the hf_* models need Hugging Face transformers: "
                        "`pip install transformers` (or `pip install autopar[hf]`)") from e
    return transformers


class LossWrapper(nn.Module):
    """``forward(input_ids, labels) -> loss``; the HF model stays at ``.model`` so parameter
    FQNs read ``model.transformer.h.0...`` as in the HF checkpoint, prefixed by ``model.``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


class ImageLossWrapper(nn.Module):
    """``forward(pixel_values, labels) -> loss`` for image classifiers (e.g. ViT)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values, labels):
        return self.model(pixel_values=pixel_values, labels=labels).loss


ATTN = ("sdpa", "eager")


def _config(config_cls_name, config_kwargs, attn="sdpa", experts=None):
    if attn not in ATTN:
        raise PlanError(f"attn must be one of {ATTN}, got {attn!r}")
    config = getattr(_transformers(), config_cls_name)(**config_kwargs)
    # "sdpa" keeps attention as one aten.scaled_dot_product_attention node in the traced graph;
    # "eager" is the explicit matmul / softmax / matmul of each model's eager_attention_forward.
    config._attn_implementation = attn
    if experts is not None:   # MoE: "autopar" (runtime/moe.py): one opaque op with a static output shape
        if experts == "autopar":
            from runtime.moe import register_transformers
            register_transformers()
        config._experts_implementation = experts
    return config


def _make(config_cls_name, model_cls_name, config_kwargs, batch, seq, vocab, device, seed, attn="sdpa",
          experts=None):
    config = _config(config_cls_name, config_kwargs, attn, experts)
    model = build(lambda: LossWrapper(getattr(_transformers(), model_cls_name)(config)), device, seed)
    return model, example_tokens(batch, seq, vocab, device, seed, n=2)


def hf_gpt2(*, n_layer=2, n_head=4, d_model=64, vocab=256, seq=16, batch=8, dropout=0.0,
            device="cpu", seed=0):
    """transformers.GPT2LMHeadModel from a GPT2Config (tiny by default; head tied to wte)."""
    cfg = dict(n_layer=n_layer, n_head=n_head, n_embd=d_model, vocab_size=vocab, n_positions=seq,
               bos_token_id=vocab - 1, eos_token_id=vocab - 1, loss_type="ForCausalLM",
               resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return _make("GPT2Config", "GPT2LMHeadModel", cfg, batch, seq, vocab, device, seed)


def hf_llama(*, n_layer=2, n_head=4, n_kv_heads=2, d_model=64, ffn_hidden=176, vocab=256, seq=16,
             batch=8, dropout=0.0, device="cpu", seed=0, attn="sdpa"):
    """transformers.LlamaForCausalLM from a LlamaConfig (tiny by default, grouped-query attention)."""
    cfg = dict(num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_kv_heads,
               hidden_size=d_model, intermediate_size=ffn_hidden, vocab_size=vocab,
               max_position_embeddings=seq, attention_dropout=dropout, tie_word_embeddings=False,
               loss_type="ForCausalLM")
    return _make("LlamaConfig", "LlamaForCausalLM", cfg, batch, seq, vocab, device, seed, attn)


def _mask_labels(inputs, fraction, seed):
    """Keep a random ``fraction`` of the labels, -100 (ignored by the loss) elsewhere: a masked-LM
    batch whose rows hold different numbers of labelled positions."""
    if fraction >= 1.0:
        return inputs
    ids, labels = inputs
    if labels.is_meta:
        return inputs
    keep = torch.rand(labels.shape, generator=torch.Generator().manual_seed(seed + 2)) < fraction
    return ids, labels.masked_fill(~keep, -100)


def hf_bert(*, n_layer=2, n_head=4, d_model=64, vocab=256, seq=16, batch=8, dropout=0.0,
            device="cpu", seed=0, attn="sdpa", label_fraction=1.0):
    """transformers.BertForMaskedLM from a BertConfig (tiny by default); every position is labelled
    unless ``label_fraction`` < 1 (the others are -100, as in masked-LM training)."""
    cfg = dict(num_hidden_layers=n_layer, num_attention_heads=n_head, hidden_size=d_model,
               intermediate_size=4 * d_model, vocab_size=vocab, max_position_embeddings=seq,
               hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
               loss_type="ForMaskedLM")
    model, inputs = _make("BertConfig", "BertForMaskedLM", cfg, batch, seq, vocab, device, seed, attn)
    return model, _mask_labels(inputs, label_fraction, seed)


def hf_llama_eager(**kw):
    """hf_llama with explicit (eager) attention: matmul, masked softmax, matmul in the graph."""
    return hf_llama(**{"attn": "eager", **kw})


def hf_mistral(*, n_layer=2, n_head=4, n_kv_heads=2, d_model=64, ffn_hidden=128, vocab=256, seq=16,
               window=8, batch=8, dropout=0.0, device="cpu", seed=0, attn="sdpa"):
    """transformers.MistralForCausalLM: grouped-query attention with a sliding window of ``window``
    tokens (smaller than ``seq``, so the banded mask really matters)."""
    cfg = dict(num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_kv_heads,
               hidden_size=d_model, intermediate_size=ffn_hidden, vocab_size=vocab, sliding_window=window,
               max_position_embeddings=seq, attention_dropout=dropout, tie_word_embeddings=False)
    return _make("MistralConfig", "MistralForCausalLM", cfg, batch, seq, vocab, device, seed, attn)


def hf_qwen2(*, n_layer=2, n_head=4, n_kv_heads=2, d_model=64, ffn_hidden=128, vocab=256, seq=16,
             batch=8, dropout=0.0, device="cpu", seed=0, attn="sdpa"):
    """transformers.Qwen2ForCausalLM: grouped-query attention with q/k/v biases, tied embeddings."""
    cfg = dict(num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_kv_heads,
               hidden_size=d_model, intermediate_size=ffn_hidden, vocab_size=vocab,
               max_position_embeddings=seq, attention_dropout=dropout, tie_word_embeddings=True)
    return _make("Qwen2Config", "Qwen2ForCausalLM", cfg, batch, seq, vocab, device, seed, attn)


def hf_bloom(*, n_layer=2, n_head=4, d_model=64, vocab=256, seq=16, batch=8, dropout=0.0,
             device="cpu", seed=0):
    """transformers.BloomForCausalLM: ALiBi position biases (no position embeddings), fused qkv,
    embedding layer norm, tied head. Bloom has its own (eager baddbmm) attention."""
    cfg = dict(n_layer=n_layer, n_head=n_head, hidden_size=d_model, vocab_size=vocab,
               hidden_dropout=dropout, attention_dropout=dropout, bos_token_id=vocab - 1,
               eos_token_id=vocab - 1, pad_token_id=vocab - 1)
    return _make("BloomConfig", "BloomForCausalLM", cfg, batch, seq, vocab, device, seed, "eager")


def hf_mixtral(*, n_layer=2, n_head=4, n_kv_heads=2, d_model=64, ffn_hidden=64, experts=4, top_k=2,
               vocab=256, seq=16, batch=8, dropout=0.0, device="cpu", seed=0, attn="sdpa"):
    """transformers.MixtralForCausalLM: a sparse MoE MLP (``experts`` experts, top-``top_k``
    routing) with the "autopar" experts implementation (runtime/moe.py: one ``autopar::moe_experts``
    op with a static output shape, unlike the default per-expert loop over ``nonzero``; transformers'
    static "batched_mm" copies each token's expert weights)."""
    cfg = dict(num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_kv_heads,
               hidden_size=d_model, intermediate_size=ffn_hidden, vocab_size=vocab,
               num_local_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=seq,
               attention_dropout=dropout, tie_word_embeddings=False, output_router_logits=False,
               sliding_window=None)
    return _make("MixtralConfig", "MixtralForCausalLM", cfg, batch, seq, vocab, device, seed, attn,
                 experts="autopar")


def hf_gpt_neox(*, n_layer=2, n_head=4, d_model=64, vocab=256, seq=16, batch=8, dropout=0.0,
                device="cpu", seed=0, attn="sdpa"):
    """transformers.GPTNeoXForCausalLM: parallel attention + MLP residual (use_parallel_residual),
    partial rotary embeddings (rotary_pct 0.25), fused qkv."""
    cfg = dict(num_hidden_layers=n_layer, num_attention_heads=n_head, hidden_size=d_model,
               intermediate_size=4 * d_model, vocab_size=vocab, max_position_embeddings=seq,
               use_parallel_residual=True, rotary_pct=0.25, attention_dropout=dropout,
               hidden_dropout=dropout, tie_word_embeddings=False, bos_token_id=vocab - 1,
               eos_token_id=vocab - 1)
    return _make("GPTNeoXConfig", "GPTNeoXForCausalLM", cfg, batch, seq, vocab, device, seed, attn)


def hf_roberta(*, n_layer=2, n_head=4, d_model=64, vocab=256, seq=16, batch=8, dropout=0.0,
               device="cpu", seed=0, attn="sdpa"):
    """transformers.RobertaForMaskedLM (tiny): position ids computed from the tokens (padding_idx 1,
    cumsum), tied decoder; every position is labelled."""
    cfg = dict(num_hidden_layers=n_layer, num_attention_heads=n_head, hidden_size=d_model,
               intermediate_size=4 * d_model, vocab_size=vocab, max_position_embeddings=seq + 2,
               hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, pad_token_id=1,
               bos_token_id=0, eos_token_id=2, type_vocab_size=1)
    return _make("RobertaConfig", "RobertaForMaskedLM", cfg, batch, seq, vocab, device, seed, attn)


def hf_t5(*, n_layer=2, n_head=4, d_model=64, d_kv=16, ffn_hidden=128, vocab=256, seq=16, batch=8,
          dropout=0.0, device="cpu", seed=0, attn="sdpa"):
    """transformers.T5ForConditionalGeneration (encoder-decoder): relative position buckets, RMS
    norm, cross-attention; decoder inputs are the labels shifted right. T5 runs its own attention
    (matmul + position bias + softmax), whatever ``attn`` says."""
    cfg = dict(num_layers=n_layer, num_decoder_layers=n_layer, num_heads=n_head, d_model=d_model,
               d_kv=d_kv, d_ff=ffn_hidden, vocab_size=vocab, dropout_rate=dropout,
               relative_attention_num_buckets=8, relative_attention_max_distance=seq,
               decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, tie_word_embeddings=True)
    return _make("T5Config", "T5ForConditionalGeneration", cfg, batch, seq, vocab, device, seed, attn)


def hf_bart(*, n_layer=2, n_head=4, d_model=64, ffn_hidden=128, vocab=256, seq=16, batch=8,
            dropout=0.0, device="cpu", seed=0, attn="sdpa"):
    """transformers.BartForConditionalGeneration (encoder-decoder, learned positions, tied
    embeddings and head); decoder inputs are the labels shifted right."""
    cfg = dict(encoder_layers=n_layer, decoder_layers=n_layer, encoder_attention_heads=n_head,
               decoder_attention_heads=n_head, d_model=d_model, encoder_ffn_dim=ffn_hidden,
               decoder_ffn_dim=ffn_hidden, vocab_size=vocab, max_position_embeddings=seq,
               dropout=dropout, attention_dropout=dropout, activation_dropout=dropout,
               pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
               forced_eos_token_id=None, scale_embedding=False)
    return _make("BartConfig", "BartForConditionalGeneration", cfg, batch, seq, vocab, device, seed, attn)


def hf_albert(*, n_layer=2, n_head=4, d_model=64, d_embed=32, vocab=256, seq=16, batch=8, dropout=0.0,
              device="cpu", seed=0, attn="sdpa"):
    """transformers.AlbertForMaskedLM: one transformer layer's parameters shared by all ``n_layer``
    layers (the same module run again), a factorised embedding (``d_embed`` < hidden, projected
    up), the MLM decoder tied to the embedding."""
    cfg = dict(num_hidden_layers=n_layer, num_attention_heads=n_head, hidden_size=d_model,
               embedding_size=d_embed, intermediate_size=2 * d_model, vocab_size=vocab,
               max_position_embeddings=seq, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return _make("AlbertConfig", "AlbertForMaskedLM", cfg, batch, seq, vocab, device, seed, attn)


def hf_gemma2(*, n_layer=2, n_head=4, n_kv_heads=2, d_model=64, head_dim=16, ffn_hidden=128, vocab=256, seq=16,
              window=8, batch=8, dropout=0.0, device="cpu", seed=0, attn="eager"):
    """transformers.Gemma2ForCausalLM: layers alternating a sliding window (``window`` < ``seq``) and
    global attention, attention-logit and final-logit soft-capping (tanh), GeGLU MLP, pre- and
    post-norms, the embedding scaled by sqrt(hidden) and tied to the head. Eager attention (the
    soft-capping is written out), as transformers recommends for Gemma 2."""
    cfg = dict(num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_kv_heads,
               hidden_size=d_model, head_dim=head_dim, intermediate_size=ffn_hidden, vocab_size=vocab,
               sliding_window=window, max_position_embeddings=seq, attention_dropout=dropout)
    return _make("Gemma2Config", "Gemma2ForCausalLM", cfg, batch, seq, vocab, device, seed, attn)


def hf_vit(*, n_layer=2, n_head=4, d_model=64, image=16, patch=4, channels=3, classes=10, batch=8,
           dropout=0.0, device="cpu", seed=0, attn="sdpa"):
    """transformers.ViTForImageClassification: conv patch embedding, CLS token, learned positions;
    inputs (pixel_values, labels)."""
    cfg = dict(num_hidden_layers=n_layer, num_attention_heads=n_head, hidden_size=d_model,
               intermediate_size=4 * d_model, image_size=image, patch_size=patch, num_channels=channels,
               num_labels=classes, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    config = _config("ViTConfig", cfg, attn)
    config.problem_type = "single_label_classification"
    model = build(lambda: ImageLossWrapper(_transformers().ViTForImageClassification(config)), device, seed)
    if device == "meta":
        return model, (torch.empty(batch, channels, image, image, device="meta"),
                       torch.empty(batch, dtype=torch.long, device="meta"))
    g = torch.Generator().manual_seed(seed + 1)
    return model, (torch.randn(batch, channels, image, image, generator=g),
                   torch.randint(classes, (batch,), generator=g))
