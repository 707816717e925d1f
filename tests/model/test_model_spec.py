"""ModelSpec: KV bytes, prefill FLOPs and parameter counts from real Hugging Face configs.

Every expected number is derived by hand in the test, with its arithmetic written out. The
config dicts are the models' public config.json files (huggingface.co/<repo>/blob/main/config.json),
minus token ids and training-only keys.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcopy.model.spec import ModelSpec

KiB = 1024
MiB = 1024 * KiB

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}

LLAMA_31_70B = {
    **LLAMA_31_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
}

MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32000,
}

QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 32768,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 152064,
}

QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

GEMMA2_9B = {
    "architectures": ["Gemma2ForCausalLM"],
    "attention_bias": False,
    "attn_logit_softcapping": 50.0,
    "cache_implementation": "hybrid",
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 3584,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "gemma2",
    "num_attention_heads": 16,
    "num_hidden_layers": 42,
    "num_key_value_heads": 8,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "sliding_window_size": 4096,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 256000,
}

GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "vocab_size": 262144,
}

# google/gemma-3-4b-it: multimodal; its text_config leaves heads, head_dim, vocab and the
# pattern to transformers' Gemma3TextConfig defaults (8 heads, 4 KV heads, 256, 262208, 6).
GEMMA3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model", "num_hidden_layers": 27},
}

MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 32000,
}

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

OPT_67B = {
    "_remove_final_layer_norm": False,
    "activation_function": "relu",
    "architectures": ["OPTForCausalLM"],
    "do_layer_norm_before": True,
    "ffn_dim": 16384,
    "hidden_size": 4096,
    "max_position_embeddings": 2048,
    "model_type": "opt",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "torch_dtype": "float16",
    "use_cache": True,
    "vocab_size": 50272,
    "word_embed_proj_dim": 4096,
}

GPT_NEOX_20B = {
    "architectures": ["GPTNeoXForCausalLM"],
    "hidden_act": "gelu_fast",
    "hidden_size": 6144,
    "intermediate_size": 24576,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 2048,
    "model_type": "gpt_neox",
    "num_attention_heads": 64,
    "num_hidden_layers": 44,
    "rotary_emb_base": 10000,
    "rotary_pct": 0.25,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
    "use_cache": True,
    "use_parallel_residual": True,
    "vocab_size": 50432,
}


def spec(config: dict, **kwargs) -> ModelSpec:
    return ModelSpec.from_hf_config(copy.deepcopy(config), **kwargs)


def small(**overrides) -> dict:
    """A tiny Llama-style config for hand-computed FLOPs."""
    config = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 1000,
    }
    return {**config, **overrides}


# --------------------------------------------------------------------------- bytes per token


def test_llama_31_8b():
    s = spec(LLAMA_31_8B)
    assert (s.num_layers, s.num_attention_heads, s.num_kv_heads, s.head_dim) == (32, 32, 8, 128)
    assert s.attention == "mha" and s.kv_dtype == "bfloat16"
    assert s.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 131072 == 128 * KiB
    assert s.kv_bytes(1000) == 1000 * 131072
    assert s.layer_types == ("full_attention",) * 32 and s.sliding_window is None
    assert s.num_experts is None and s.num_experts_per_tok is None
    # q, o: 4096·4096 each; k, v: 4096·1024 each; MLP gate, up, down: 4096·14336 each.
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    assert s.active_params == 32 * per_layer == 6_979_321_856
    assert s.rope_theta == 500000.0
    assert s.rope_scaling == json.dumps(LLAMA_31_8B["rope_scaling"], sort_keys=True)
    assert json.loads(s.rope_scaling)["rope_type"] == "llama3"


def test_llama_31_70b():
    s = spec(LLAMA_31_70B)
    assert s.kv_bytes_per_token() == 2 * 80 * 8 * 128 * 2 == 327680
    per_layer = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672
    assert s.active_params == 80 * per_layer == 68_451_041_280


def test_qwen25_7b_window_switched_off():
    s = spec(QWEN25_7B)
    assert s.kv_bytes_per_token() == 2 * 28 * 4 * 128 * 2 == 57344
    # use_sliding_window false: the 131072 window is ignored, every layer keeps every token.
    assert s.sliding_window is None and s.layer_types == ("full_attention",) * 28
    assert s.kv_bytes(200_000) == 200_000 * 57344
    # The model card's "Non-Embedding: 6.53B" (biases, about 0.2M per layer, are not counted).
    per_layer = 2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944
    assert s.active_params == 28 * per_layer == 6_525_288_448


def test_qwen2_window_applies_from_max_window_layers():
    s = spec({**QWEN25_7B, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 20})
    # transformers' Qwen2Config: layer i slides when i >= max_window_layers.
    assert s.layer_types == ("full_attention",) * 20 + ("sliding_attention",) * 8
    per_layer_token = 2 * 4 * 128 * 2
    assert s.kv_bytes(10_000) == per_layer_token * (20 * 10_000 + 8 * 4096)
    assert s.kv_bytes(100) == 100 * s.kv_bytes_per_token()


def test_qwen3_explicit_head_dim_overrides_hidden_over_heads():
    s = spec(QWEN3_06B)
    assert s.head_dim == 128 != 1024 // 16
    assert s.kv_bytes_per_token() == 2 * 28 * 8 * 128 * 2 == 114688
    # q, o: 1024·(16·128) each; k, v: 1024·(8·128) each; gated MLP 3·1024·3072.
    assert s.active_params == 28 * (2 * 1024 * 2048 + 2 * 1024 * 1024 + 3 * 1024 * 3072)


def test_mistral_7b_slides_on_every_layer():
    s = spec(MISTRAL_7B_V01)
    assert s.sliding_window == 4096 and s.layer_types == ("sliding_attention",) * 32
    assert s.kv_bytes_per_token() == 131072  # all layers, every token
    assert s.kv_bytes(1000) == 1000 * 131072  # below the window
    assert s.kv_bytes(4096) == 4096 * 131072
    assert s.kv_bytes(10_000) == 4096 * 131072  # above: capped at the window
    assert spec({**MISTRAL_7B_V01, "sliding_window": None}).kv_bytes(10_000) == 10_000 * 131072


def test_gemma2_9b_alternates_sliding_and_full():
    s = spec(GEMMA2_9B)
    assert (s.num_layers, s.num_kv_heads, s.head_dim, s.sliding_window) == (42, 8, 256, 4096)
    assert s.layer_types[:4] == ("sliding_attention", "full_attention", "sliding_attention", "full_attention")
    assert s.layer_types.count("sliding_attention") == 21
    per_layer_token = 2 * 8 * 256 * 2  # 8192 bytes
    assert s.kv_bytes_per_token() == 42 * per_layer_token == 344064
    assert s.kv_bytes(3000) == 3000 * 344064  # below the window: like a full model
    assert s.kv_bytes(8192) == per_layer_token * (21 * 8192 + 21 * 4096)  # above: sliding half capped
    # head_dim 256 with 16 heads is 4096 != hidden 3584: the explicit head_dim is what counts.
    per_layer = 2 * 3584 * (16 * 256) + 2 * 3584 * (8 * 256) + 3 * 3584 * 14336
    assert s.active_params == 42 * per_layer == 8_323_596_288


def test_gemma3_sliding_window_pattern():
    s = spec(GEMMA3_1B)
    full = [i for i, t in enumerate(s.layer_types) if t == "full_attention"]
    assert full == [5, 11, 17, 23]  # (i + 1) % 6 == 0
    assert s.sliding_window == 512
    per_layer_token = 2 * 1 * 256 * 2
    assert s.kv_bytes(2000) == per_layer_token * (4 * 2000 + 22 * 512)


def test_gemma3_multimodal_reads_text_config_with_hf_defaults():
    s = spec(GEMMA3_4B_IT)
    assert (s.num_layers, s.num_attention_heads, s.num_kv_heads, s.head_dim) == (34, 8, 4, 256)
    assert s.vocab_size == 262208 and s.sliding_window == 1024 and s.kv_dtype == "bfloat16"
    assert [i for i, t in enumerate(s.layer_types) if t == "full_attention"] == [5, 11, 17, 23, 29]
    assert s.kv_bytes_per_token() == 2 * 34 * 4 * 256 * 2


def test_explicit_layer_types_win():
    types = ["full_attention", "sliding_attention"] * 13
    s = spec({**GEMMA3_1B, "layer_types": types})
    assert s.layer_types == tuple(types)


def test_layer_types_ignored_when_the_window_is_off():
    s = spec({**QWEN3_06B, "layer_types": ["sliding_attention"] * 28})
    assert s.layer_types == ("full_attention",) * 28 and s.sliding_window is None


def test_mixtral_active_params():
    s = spec(MIXTRAL_8X7B)
    assert (s.num_experts, s.num_experts_per_tok) == (8, 2)
    assert s.sliding_window is None  # sliding_window null
    assert s.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 131072
    attention = 2 * 4096 * 4096 + 2 * 4096 * 1024  # 41_943_040
    experts = 2 * 3 * 4096 * 14336  # 2 active experts of 3 matrices: 352_321_536
    router = 4096 * 8
    assert s.active_params == 32 * (attention + experts + router) == 12_617_515_008
    # With both embedding matrices (2·32000·4096) that is the published "12.9B active".
    assert round((s.active_params + 2 * 32000 * 4096) / 1e9, 1) == 12.9


def test_deepseek_v3_mla():
    s = spec(DEEPSEEK_V3)
    assert s.attention == "mla" and (s.kv_lora_rank, s.qk_rope_head_dim) == (512, 64)
    assert (s.qk_nope_head_dim, s.v_head_dim) == (128, 128)
    assert (s.num_kv_heads, s.head_dim) == (1, 512 + 64)  # one latent per token-layer
    assert s.kv_bytes_per_token() == 61 * (512 + 64) * 2 == 70272  # no factor 2
    assert s.kv_bytes_per_token("fp8") == 61 * 576 * 1 == 35136
    assert (s.num_experts, s.num_experts_per_tok) == (256, 8)
    q = 7168 * 1536 + 1536 * 128 * (128 + 64)  # q_a, q_b
    kv = 7168 * (512 + 64) + 512 * 128 * (128 + 128)  # kv_a_proj_with_mqa, kv_b
    o = 128 * 128 * 7168
    dense_mlp = 3 * 7168 * 18432  # first_k_dense_replace = 3 layers
    moe_mlp = (8 + 1) * 3 * 7168 * 2048 + 7168 * 256  # 8 routed + 1 shared expert, router
    assert s.active_params == 61 * (q + kv + o) + 3 * dense_mlp + 58 * moe_mlp == 35_697_917_952
    # With both embedding matrices (2·129280·7168), the published "37B activated".
    assert 37e9 < s.active_params + 2 * 129280 * 7168 < 38e9


def test_mla_without_q_lora_rank():
    config = {
        "model_type": "deepseek_v2",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 96,
        "vocab_size": 100,
        "kv_lora_rank": 16,
        "q_lora_rank": None,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 4,
        "v_head_dim": 8,
    }
    s = spec(config)
    q = 64 * 4 * (8 + 4)
    kv = 64 * (16 + 4) + 16 * 4 * (8 + 8)
    o = 4 * 8 * 64
    assert s.active_params == 2 * (q + kv + o + 3 * 64 * 96)
    assert s.kv_bytes_per_token() == 2 * (16 + 4) * 2


def test_opt_67b():
    s = spec(OPT_67B)
    assert s.kv_dtype == "float16" and s.num_kv_heads == 32 and s.head_dim == 128  # MHA, 4096 / 32
    assert s.intermediate_size == 16384  # ffn_dim
    assert s.kv_bytes_per_token() == 2 * 32 * 32 * 128 * 2 == 524288
    # q, k, v, o: 4096·4096 each; fc1, fc2: 4096·16384 each (no gate).
    assert s.active_params == 32 * (4 * 4096 * 4096 + 2 * 4096 * 16384) == 6_442_450_944
    assert s.rope_theta is None


def test_opt_word_embed_projection_counts():
    s = spec({**OPT_67B, "word_embed_proj_dim": 512})
    assert s.active_params == 6_442_450_944 + 2 * 512 * 4096  # project_in and project_out


def test_gpt_neox_20b():
    s = spec(GPT_NEOX_20B)
    assert (s.num_kv_heads, s.head_dim, s.kv_dtype) == (64, 96, "float16")  # 6144 / 64
    assert s.kv_bytes_per_token() == 2 * 44 * 64 * 96 * 2 == 1_081_344
    # fused qkv 3·6144² + dense 6144²; MLP 2·6144·24576.
    assert s.active_params == 44 * (4 * 6144 * 6144 + 2 * 6144 * 24576) == 19_931_332_608
    assert s.rope_theta == 10000.0  # rotary_emb_base


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "fp8", "fp8_e5m2", torch.float8_e4m3fn, torch.uint8])
def test_one_byte_dtypes_halve_bf16(dtype):
    s = spec(LLAMA_31_8B)
    assert s.kv_bytes_per_token(dtype) == 131072 // 2
    assert s.kv_bytes(100, dtype) == 100 * 65536
    assert s.block_nbytes(16, dtype=dtype) == 16 * 65536


@pytest.mark.parametrize("dtype", ["bfloat16", "bf16", "torch.bfloat16", "float16", "fp16", torch.float16])
def test_two_byte_dtypes(dtype):
    assert spec(LLAMA_31_8B).kv_bytes_per_token(dtype) == 131072


def test_kv_dtype_from_config_override_and_default():
    assert spec({**LLAMA_31_8B, "torch_dtype": "float32"}).kv_bytes_per_token() == 2 * 131072
    assert spec({**LLAMA_31_8B, "torch_dtype": "float32"}, kv_dtype="fp8").kv_dtype == "float8_e4m3fn"
    no_dtype = {k: v for k, v in LLAMA_31_8B.items() if k != "torch_dtype"}
    assert spec(no_dtype).kv_dtype == "bfloat16"
    assert spec({**no_dtype, "dtype": "float16"}).kv_dtype == "float16"  # newer transformers' key
    assert ModelSpec.preset("llama-3.1-8b", kv_dtype=torch.float8_e5m2).kv_bytes_per_token() == 65536


@pytest.mark.parametrize("dtype", ["int4", "nonsense", "bool", "complex64", "float4_e2m1fn_x2", torch.int32])
def test_bad_dtypes(dtype):
    with pytest.raises(ValueError, match="dtype"):
        spec(LLAMA_31_8B).kv_bytes_per_token(dtype)


def test_bad_torch_dtype_in_config_names_the_key():
    with pytest.raises(ValueError, match="torch_dtype"):
        spec({**LLAMA_31_8B, "torch_dtype": "nonsense"})


# --------------------------------------------------------------------------- blocks


def test_block_nbytes_tensor_parallel():
    s = spec(LLAMA_31_8B)  # 8 KV heads
    assert s.block_nbytes(16) == 16 * 131072 == 2 * MiB
    assert s.block_nbytes(16, tp=2) == 1 * MiB  # 4 heads per rank
    assert s.block_nbytes(16, tp=8) == 16 * 32 * 2 * 1 * 128 * 2 == 256 * KiB  # 1 head per rank
    assert s.block_nbytes(16, tp=16) == 256 * KiB  # fewer heads than ranks: 1 replicated head per rank
    with pytest.raises(ValueError, match="tp"):
        s.block_nbytes(16, tp=3)  # 8 heads do not split over 3 ranks
    for bad in (0, -1):
        with pytest.raises(ValueError, match="tp"):
            s.block_nbytes(16, tp=bad)
    with pytest.raises(TypeError, match="tp"):
        s.block_nbytes(16, tp=True)  # a bool is not a rank count
    with pytest.raises(ValueError, match="block_tokens"):
        s.block_nbytes(0)


def test_block_nbytes_mla_replicated():
    s = spec(DEEPSEEK_V3)
    for tp in (1, 2, 8, 16):
        assert s.block_nbytes(64, tp=tp) == 64 * 61 * 576 * 2


def test_block_nbytes_counts_sliding_layers():
    s = spec(GEMMA2_9B)
    assert s.block_nbytes(16) == 16 * s.kv_bytes_per_token()


# --------------------------------------------------------------------------- FLOPs


def test_prefill_flops_by_hand():
    s = spec(small())
    # attention per layer: q, o 64·64 each; k, v 64·32 each. MLP 3·64·128.
    n_ne = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)
    assert s.active_params == n_ne == 73728
    d_q = 4 * 16  # H · d_h
    n = 10
    # QKᵀ and A·V, 2 FLOPs per multiply-add each, over n²/2 causal pairs per layer.
    assert s.prefill_flops(n) == 2 * n_ne * n + 2 * 2 * (2 * d_q) * (n * n / 2)
    assert s.prefill_flops(n) == 2 * n_ne * n + 2 * 2 * d_q * n * n  # docs/measurements.md F_prefill
    assert s.prefill_flops(0) == 0.0


def test_prefill_flops_cached_tokens():
    s = spec(small())
    n_ne, d_q, P, n = 73728, 64, 30, 10
    expected = 2 * n_ne * n + 4 * 2 * d_q * (n * P + n * n / 2)
    assert s.prefill_flops(n, cached_tokens=P) == expected
    assert s.prefill_flops(n, cached_tokens=P) > s.prefill_flops(n)
    # Extending is the difference of two prefills.
    assert s.prefill_flops(n, P) == pytest.approx(s.prefill_flops(P + n) - s.prefill_flops(P))
    assert s.prefill_flops(0, cached_tokens=P) == 0.0


def test_prefill_flops_sliding_window_caps_the_span():
    W = 8
    s = spec(small(sliding_window=W))  # Mistral-style: both layers slide
    dense = spec(small())
    n_ne, per_pair = 73728, 2 * 4 * (16 + 16)
    assert s.prefill_flops(W) == dense.prefill_flops(W)  # inside the window nothing changes
    # Past the window every new token attends to W positions: n·W pairs per layer.
    assert s.prefill_flops(5, cached_tokens=20) == 2 * n_ne * 5 + 2 * per_pair * 5 * W
    # Crossing it: ∫_4^12 min(t, 8) dt = (8² - 4²)/2 + (12 - 8)·8 = 24 + 32.
    assert s.prefill_flops(8, cached_tokens=4) == 2 * n_ne * 8 + 2 * per_pair * (24 + 32)


def test_prefill_flops_moe_uses_active_params():
    s = spec(MIXTRAL_8X7B)
    n = 100
    attention = 32 * 2 * 32 * (128 + 128) * (n * n / 2)  # 32 layers · 2 FLOPs · H · (d_qk + d_v) per pair
    assert s.prefill_flops(n) == 2 * 12_617_515_008 * n + attention


def test_prefill_flops_mla_dims():
    s = spec(DEEPSEEK_V3)
    n = 10
    per_pair = 2 * 128 * ((128 + 64) + 128)  # QKᵀ with the 192-wide q/k head, A·V with the 128-wide v head
    assert s.prefill_flops(n) == 2 * 35_697_917_952 * n + 61 * per_pair * (n * n / 2)


def test_prefill_flops_do_not_count_the_lm_head():
    assert spec(small(vocab_size=10)).prefill_flops(50) == spec(small(vocab_size=100_000)).prefill_flops(50)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 5000), st.integers(0, 5000))
def test_prefill_and_kv_bytes_properties(cached, new):
    s = ModelSpec.preset("gemma-2-9b")
    assert s.prefill_flops(new, cached) == pytest.approx(s.prefill_flops(cached + new) - s.prefill_flops(cached))
    assert s.kv_bytes(new) <= new * s.kv_bytes_per_token()
    assert s.kv_bytes(new) <= s.kv_bytes(new + cached)


@pytest.mark.parametrize(
    ("args", "error"), [((-1,), ValueError), ((10, -1), ValueError), ((1.5,), TypeError), (("10",), TypeError)]
)
def test_prefill_flops_rejects_bad_counts(args, error):
    with pytest.raises(error):
        spec(small()).prefill_flops(*args)


# --------------------------------------------------------------------------- files and errors


def test_from_file_and_directory(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA_31_8B))
    from_file = ModelSpec.from_hf_config(path)
    from_str = ModelSpec.from_hf_config(str(path))
    from_dir = ModelSpec.from_hf_config(tmp_path)
    assert from_file == from_str == from_dir
    assert from_file.source == str(path)
    assert from_file.name == "llama"  # the config's model_type: not the folder it sits in
    assert from_file.identity() == spec(LLAMA_31_8B).identity()
    assert ModelSpec.from_hf_config(path, name="my-llama").name == "my-llama"
    named = tmp_path / "named"
    named.mkdir()
    (named / "config.json").write_text(json.dumps({**LLAMA_31_8B, "_name_or_path": "meta-llama/Llama-3.1-8B"}))
    assert ModelSpec.from_hf_config(named).name == "meta-llama/Llama-3.1-8B"


def test_bad_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        ModelSpec.from_hf_config(tmp_path / "nowhere.json")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        ModelSpec.from_hf_config(tmp_path)  # a directory without config.json
    with pytest.raises(TypeError):
        ModelSpec.from_hf_config(42)


def test_malformed_json_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"num_hidden_layers": 32,')
    with pytest.raises(ValueError, match=r"config\.json"):
        ModelSpec.from_hf_config(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        ModelSpec.from_hf_config(path)


@pytest.mark.parametrize(
    "key", ["num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"]
)
def test_missing_key_is_named(key):
    config = {k: v for k, v in LLAMA_31_8B.items() if k != key}
    with pytest.raises(ValueError, match=f"missing required key '{key}'"):
        spec(config)


@pytest.mark.parametrize(
    "config, key",
    [
        ({k: v for k, v in OPT_67B.items() if k != "ffn_dim"}, "ffn_dim"),
        ({k: v for k, v in DEEPSEEK_V3.items() if k != "qk_rope_head_dim"}, "qk_rope_head_dim"),
        ({k: v for k, v in DEEPSEEK_V3.items() if k != "moe_intermediate_size"}, "moe_intermediate_size"),
        ({k: v for k, v in MIXTRAL_8X7B.items() if k != "num_experts_per_tok"}, "num_experts_per_tok"),
        (
            {k: v for k, v in QWEN25_7B.items() if k != "max_window_layers"} | {"use_sliding_window": True},
            "max_window_layers",
        ),
    ],
)
def test_missing_family_key_is_named(config, key):
    with pytest.raises(ValueError, match=f"missing required key '{key}'"):
        spec(config)


def test_missing_num_key_value_heads_means_mha():
    config = {k: v for k, v in LLAMA_31_8B.items() if k != "num_key_value_heads"}
    assert spec(config).num_kv_heads == 32


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"num_key_value_heads": 5}, "not a multiple of num_key_value_heads"),
        ({"num_key_value_heads": 64}, "not a multiple of num_key_value_heads"),
        ({"hidden_size": 4100}, "hidden_size 4100 is not a multiple"),
        ({"hidden_size": 0}, "'hidden_size': expected a positive integer"),
        ({"num_hidden_layers": -2}, "'num_hidden_layers'"),
        ({"intermediate_size": 1.5}, "'intermediate_size'"),
        ({"head_dim": 0}, "'head_dim'"),
        ({"layer_types": ["full_attention"] * 3}, "layer_types"),
        ({"layer_types": ["linear_attention"] * 32, "sliding_window": 64}, "linear_attention"),
        ({"rope_scaling": "yarn"}, "rope_scaling"),
        ({"num_local_experts": 8, "num_experts_per_tok": 9}, "exceeds"),
    ],
)
def test_contradictory_configs(overrides, match):
    with pytest.raises(ValueError, match=match):
        spec({**LLAMA_31_8B, **overrides})


def test_explicit_head_dim_allows_indivisible_hidden():
    assert spec({**LLAMA_31_8B, "hidden_size": 4100, "head_dim": 128}).head_dim == 128


@pytest.mark.parametrize("model_type", ["gpt2", "mamba", "my_llama", None])
def test_an_unsupported_model_type_is_an_error_listing_the_supported_ones(model_type):
    config = {**LLAMA_31_8B, "model_type": model_type}
    with pytest.raises(ValueError, match=rf"model_type {model_type!r} is not supported.*supported: .*falcon.*llama"):
        spec(config)
    # The caller may say how to read it: with the Llama rules, it is Llama's cache.
    assert ModelSpec.from_hf_config(config, assume="llama").kv_bytes_per_token() == 131072
    with pytest.raises(ValueError, match="assume: expected one of the supported families"):
        ModelSpec.from_hf_config(config, assume="mamba")


FALCON_7B = {
    "model_type": "falcon",
    "hidden_size": 4544,
    "num_attention_heads": 71,
    "num_hidden_layers": 32,
    "multi_query": True,
    "new_decoder_architecture": False,
    "vocab_size": 65024,
    "torch_dtype": "bfloat16",
}
FALCON_40B = {
    "model_type": "falcon",
    "hidden_size": 8192,
    "num_attention_heads": 128,
    "num_hidden_layers": 60,
    "num_kv_heads": 8,
    "new_decoder_architecture": True,
    "vocab_size": 65024,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(
    ("config", "per_token"),
    [
        (FALCON_7B, 8192),
        (FALCON_40B, 122880),
        # The original RefinedWeb names of the same models.
        (
            {
                "model_type": "RefinedWebModel",
                "hidden_size": 4544,
                "n_head": 71,
                "n_layer": 32,
                "multi_query": True,
                "vocab_size": 65024,
                "torch_dtype": "bfloat16",
            },
            8192,
        ),
        (
            {
                "model_type": "RefinedWeb",
                "hidden_size": 8192,
                "n_head": 128,
                "n_head_kv": 8,
                "n_layer": 60,
                "new_decoder_architecture": True,
                "vocab_size": 65024,
                "torch_dtype": "bfloat16",
            },
            122880,
        ),
    ],
)
def test_falcon_kv_bytes(config, per_token):
    """Falcon-7B caches one multi-query KV head; Falcon-40B 8 (2 x layers x heads x 64 x 2 bytes)."""
    s = spec(config)
    assert s.kv_bytes_per_token() == per_token
    assert s.head_dim == 64 and s.intermediate_size == 4 * s.hidden_size  # ffn_hidden_size's default


def test_falcon_7b_parameters():
    """About 6.9B non-embedding parameters: q/k/v/o with one KV head and a 4x plain MLP per layer."""
    s = spec(FALCON_7B)
    per_layer = 2 * 4544 * 64 * (71 + 1) + 2 * 4544 * 4 * 4544
    assert s.active_params == 32 * per_layer


def test_unknown_moe_layout_is_rejected():
    llama4_like = {
        **LLAMA_31_8B,
        "model_type": "llama4_text",
        "num_local_experts": 16,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 1,
        "intermediate_size_mlp": 16384,
    }
    with pytest.raises(ValueError, match="llama4_text' is not supported"):
        spec(llama4_like)
    with pytest.raises(ValueError, match="interleave_moe_layer_step"):  # read as Llama-style: still refused
        spec(llama4_like, assume="llama")
    with pytest.raises(ValueError, match="contradictory"):
        spec({**MIXTRAL_8X7B, "n_routed_experts": 8})


def test_qwen_moe_layers():
    config = {
        **small(model_type="qwen2_moe"),
        "num_hidden_layers": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [0],
    }
    s = spec(config)
    attention = 2 * 64 * 64 + 2 * 64 * 32
    dense = 3 * 64 * 128
    moe = 2 * 3 * 64 * 32 + 64 * 8 + 3 * 64 * 64 + 64  # 2 experts, router, shared expert and its gate
    assert s.active_params == 4 * attention + dense + 3 * moe
    assert (s.num_experts, s.num_experts_per_tok) == (8, 2)


# --------------------------------------------------------------------------- presets and identity


@pytest.mark.parametrize("name", ModelSpec.preset_names())
def test_presets_load(name):
    s = ModelSpec.preset(name)
    assert s.name == name
    assert s.source.startswith("https://huggingface.co/") and s.source.endswith("/config.json")
    assert s.kv_bytes_per_token() > 0 and s.active_params > 0
    json.dumps(s.identity())


def test_preset_names_cover_the_issue():
    assert {
        "llama-3.1-8b",
        "llama-3.1-70b",
        "qwen2.5-7b",
        "mistral-7b",
        "mixtral-8x7b",
        "gemma-2-9b",
        "deepseek-v3",
    } <= set(ModelSpec.preset_names())


@pytest.mark.parametrize(
    "name, config",
    [
        ("llama-3.1-8b", LLAMA_31_8B),
        ("llama-3.1-70b", LLAMA_31_70B),
        ("qwen2.5-7b", QWEN25_7B),
        ("mistral-7b", MISTRAL_7B_V01),
        ("mixtral-8x7b", MIXTRAL_8X7B),
        ("gemma-2-9b", GEMMA2_9B),
        ("deepseek-v3", DEEPSEEK_V3),
    ],
)
def test_presets_match_the_full_configs(name, config):
    assert ModelSpec.preset(name).identity() == spec(config, name=name).identity()


def test_unknown_preset_lists_the_names():
    with pytest.raises(ValueError, match=r"llama-3\.1-8b.*mistral-7b"):
        ModelSpec.preset("unknown")


def test_identity():
    s = spec(GEMMA2_9B, name="g")
    ident = s.identity()
    assert "source" not in ident
    assert set(ident) == {f for f in ModelSpec.__dataclass_fields__ if f != "source"}
    assert json.loads(json.dumps(ident)) == ident
    assert ident["layer_types"][:2] == ["sliding_attention", "full_attention"]
    assert spec(LLAMA_31_8B).identity()["rope_scaling"] == LLAMA_31_8B["rope_scaling"]  # a dict, as CacheKey takes
    other_source = spec(GEMMA2_9B, name="g")
    assert other_source.identity() == ident
    assert spec(GEMMA2_9B, name="g", kv_dtype="fp8").identity() != ident


def test_direct_construction_is_validated_and_frozen():
    base = dict(
        name="m",
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=100,
        active_params=1000,
    )
    s = ModelSpec(**base, kv_dtype="bf16", rope_scaling={"b": 1, "a": 2})
    assert s.kv_dtype == "bfloat16" and s.layer_types == ("full_attention", "full_attention")
    assert s.rope_scaling == '{"a": 2, "b": 1}'
    assert hash(s) == hash(ModelSpec(**base, rope_scaling='{"a": 2, "b": 1}'))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_layers = 3  # type: ignore[misc]
    for bad, match in [
        ({"num_kv_heads": 3}, "not a multiple"),
        ({"attention": "gqa"}, "attention"),
        ({"attention": "mla"}, "kv_lora_rank"),
        ({"kv_lora_rank": 8}, "only for attention='mla'"),
        ({"layer_types": ("sliding_attention", "full_attention")}, "sliding_window"),
        ({"num_experts": 4}, "both or neither"),
        ({"active_params": 0}, "active_params"),
    ]:
        with pytest.raises(ValueError, match=match):
            ModelSpec(**{**base, **bad})


@pytest.mark.parametrize(
    ("key", "a", "b"),
    [("rope_local_base_freq", 10000.0, 20000.0), ("rotary_pct", 0.25, 0.5), ("partial_rotary_factor", 0.5, 1.0)],
)
def test_rope_keys_that_change_the_cached_keys_are_part_of_the_identity(key, a, b):
    one, other = spec({**LLAMA_31_8B, key: a}), spec({**LLAMA_31_8B, key: b})
    assert json.loads(one.rope_scaling)[key] == a
    assert one.identity() != other.identity()
    assert spec(LLAMA_31_8B).identity() != one.identity()
