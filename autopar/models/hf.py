"""Hugging Face ``transformers`` models built FROM CONFIGS (no weights are ever downloaded),
wrapped so ``forward(input_ids, labels)`` returns the training loss. ``transformers`` is an
optional dependency: it is imported only when a factory here is called."""
from __future__ import annotations

import torch
import torch.nn as nn

from autopar.errors import PlanError
from autopar.models import build, example_tokens


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


def _make(config_cls_name, model_cls_name, config_kwargs, batch, seq, vocab, device, seed):
    tf = _transformers()
    config = getattr(tf, config_cls_name)(**config_kwargs)
    # sdpa keeps attention as one aten.scaled_dot_product_attention node in the traced graph.
    config._attn_implementation = "sdpa"
    model = build(lambda: LossWrapper(getattr(tf, model_cls_name)(config)), device, seed)
    return model, example_tokens(batch, seq, vocab, device, seed, n=2)


def hf_gpt2(*, n_layer=2, n_head=4, d_model=64, vocab=256, seq=16, batch=8, dropout=0.0,
            device="cpu", seed=0):
    """transformers.GPT2LMHeadModel from a GPT2Config (tiny by default; head tied to wte)."""
    cfg = dict(n_layer=n_layer, n_head=n_head, n_embd=d_model, vocab_size=vocab, n_positions=seq,
               bos_token_id=vocab - 1, eos_token_id=vocab - 1, loss_type="ForCausalLM",
               resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    return _make("GPT2Config", "GPT2LMHeadModel", cfg, batch, seq, vocab, device, seed)


def hf_llama(*, n_layer=2, n_head=4, n_kv_heads=2, d_model=64, ffn_hidden=176, vocab=256, seq=16,
             batch=8, dropout=0.0, device="cpu", seed=0):
    """transformers.LlamaForCausalLM from a LlamaConfig (tiny by default, grouped-query attention)."""
    cfg = dict(num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_kv_heads,
               hidden_size=d_model, intermediate_size=ffn_hidden, vocab_size=vocab,
               max_position_embeddings=seq, attention_dropout=dropout, tie_word_embeddings=False,
               loss_type="ForCausalLM")
    return _make("LlamaConfig", "LlamaForCausalLM", cfg, batch, seq, vocab, device, seed)


def hf_bert(*, n_layer=2, n_head=4, d_model=64, vocab=256, seq=16, batch=8, dropout=0.0,
            device="cpu", seed=0):
    """transformers.BertForMaskedLM from a BertConfig (tiny by default); every position is labelled."""
    cfg = dict(num_hidden_layers=n_layer, num_attention_heads=n_head, hidden_size=d_model,
               intermediate_size=4 * d_model, vocab_size=vocab, max_position_embeddings=seq,
               hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
               loss_type="ForMaskedLM")
    return _make("BertConfig", "BertForMaskedLM", cfg, batch, seq, vocab, device, seed)
