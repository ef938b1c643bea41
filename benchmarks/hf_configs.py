"""Published Hugging Face ``config.json`` values of six open models (the shapes only; no weights),
written to files by tests/cli/test_hf_config_cli.py and benchmarks/bench_hf_configs.py so nothing is
downloaded. Values as in each model's config.json on the Hugging Face hub (meta-llama/Meta-Llama-3-8B,
meta-llama/Meta-Llama-3-70B, Qwen/Qwen2-7B, mistralai/Mistral-7B-v0.1, mistralai/Mixtral-8x7B-v0.1,
google/gemma-2-9b)."""
from __future__ import annotations

import json
from pathlib import Path

_LLAMA3 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
    "initializer_range": 0.02, "max_position_embeddings": 8192, "mlp_bias": False, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256,
}

CONFIGS: dict[str, dict] = {
    "Llama-3-8B": {**_LLAMA3, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                   "num_hidden_layers": 32, "num_key_value_heads": 8},
    "Llama-3-70B": {**_LLAMA3, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
                    "num_hidden_layers": 80, "num_key_value_heads": 8},
    "Qwen2-7B": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 3584,
        "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 131072,
        "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
    },
    "Mistral-7B": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000,
    },
    "Mixtral-8x7B": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "attention_dropout": 0.0,
        "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
        "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000,
    },
    "Gemma-2-9B": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "attention_bias": False,
        "attention_dropout": 0.0, "attn_logit_softcapping": 50.0, "bos_token_id": 2,
        "cache_implementation": "hybrid", "eos_token_id": 1, "final_logit_softcapping": 30.0, "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
        "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8, "pad_token_id": 0,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
        "torch_dtype": "float32", "use_cache": True, "vocab_size": 256000,
    },
}

# published parameter counts (billions), to check the built model against
PARAMS_B = {"Llama-3-8B": 8.03, "Llama-3-70B": 70.55, "Qwen2-7B": 7.62, "Mistral-7B": 7.24,
            "Mixtral-8x7B": 46.70, "Gemma-2-9B": 9.24}


def write_config(name: str, directory, **overrides) -> Path:
    """``directory/<name>/config.json`` with ``CONFIGS[name]`` (and ``overrides``); returns its path."""
    d = Path(directory) / name
    d.mkdir(parents=True, exist_ok=True)
    path = d / "config.json"
    path.write_text(json.dumps({**CONFIGS[name], **overrides}, indent=2))
    return path
