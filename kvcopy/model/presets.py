"""Presets: common models' public config.json values, for ModelSpec.preset.

Each entry is (the Hugging Face repo, the keys of its public config.json that
kvcopy.model.spec reads), copied from https://huggingface.co/<repo>/blob/main/config.json
so that a preset needs no network; the numbers were checked against the
models' published parameter counts.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]

# What every Llama 3.1 config.json says alike (8B and 70B): GQA with 8 KV heads, the vocabulary, and the
# llama3 RoPE scaling to 128K positions.
_LLAMA_3_1: dict[str, Any] = {
    "model_type": "llama",
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.1-8b": (
        "meta-llama/Llama-3.1-8B",
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            **_LLAMA_3_1,
        },
    ),
    "llama-3.1-70b": (
        "meta-llama/Llama-3.1-70B",
        {
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_attention_heads": 64,
            "num_hidden_layers": 80,
            **_LLAMA_3_1,
        },
    ),
    "qwen2.5-7b": (
        "Qwen/Qwen2.5-7B-Instruct",
        {
            "model_type": "qwen2",
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_attention_heads": 28,
            "num_hidden_layers": 28,
            "num_key_value_heads": 4,
            "vocab_size": 152064,
            "rope_theta": 1000000.0,
            "sliding_window": 131072,
            "use_sliding_window": False,
            "max_window_layers": 28,
            "max_position_embeddings": 32768,
            "torch_dtype": "bfloat16",
        },
    ),
    "qwen3-8b": (
        "Qwen/Qwen3-8B",
        {
            "model_type": "qwen3",
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_attention_heads": 32,
            "num_hidden_layers": 36,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "rope_theta": 1000000,
            "sliding_window": None,
            "use_sliding_window": False,
            "max_window_layers": 36,
            "max_position_embeddings": 40960,
            "torch_dtype": "bfloat16",
        },
    ),
    "mistral-7b": (
        "mistralai/Mistral-7B-v0.1",
        {
            "model_type": "mistral",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "vocab_size": 32000,
            "rope_theta": 10000.0,
            "sliding_window": 4096,
            "max_position_embeddings": 32768,
            "torch_dtype": "bfloat16",
        },
    ),
    "mixtral-8x7b": (
        "mistralai/Mixtral-8x7B-v0.1",
        {
            "model_type": "mixtral",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "vocab_size": 32000,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "max_position_embeddings": 32768,
            "torch_dtype": "bfloat16",
        },
    ),
    "gemma-2-9b": (
        "google/gemma-2-9b-it",
        {
            "model_type": "gemma2",
            "hidden_size": 3584,
            "intermediate_size": 14336,
            "num_attention_heads": 16,
            "num_hidden_layers": 42,
            "num_key_value_heads": 8,
            "head_dim": 256,
            "vocab_size": 256000,
            "rope_theta": 10000.0,
            "sliding_window": 4096,
            "sliding_window_size": 4096,
            "query_pre_attn_scalar": 256,
            "max_position_embeddings": 8192,
            "torch_dtype": "bfloat16",
        },
    ),
    "deepseek-v3": (
        "deepseek-ai/DeepSeek-V3",
        {
            "model_type": "deepseek_v3",
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "num_attention_heads": 128,
            "num_hidden_layers": 61,
            "num_key_value_heads": 128,
            "vocab_size": 129280,
            "kv_lora_rank": 512,
            "q_lora_rank": 1536,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 2048,
            "first_k_dense_replace": 3,
            "moe_layer_freq": 1,
            "rope_theta": 10000,
            "rope_scaling": {
                "beta_fast": 32,
                "beta_slow": 1,
                "factor": 40,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096,
                "type": "yarn",
            },
            "max_position_embeddings": 163840,
            "torch_dtype": "bfloat16",
        },
    ),
}
