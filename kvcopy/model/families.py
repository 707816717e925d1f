"""The rules for reading each model family's config.json, in one place: which keys hold what, the
defaults a family's HF config class fills in, which layers slide, how MoE layers are laid out, and
which keys change RoPE. kvcopy.model.hf_config applies them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

__all__ = ["FAMILIES", "MOE_STRUCTURE_KEYS", "MOE_STYLES", "ROPE_EXTRA_KEYS", "SUPPORTED_FAMILIES", "Family"]


@dataclass(frozen=True)
class Family:
    """How one family's config.json is read (model_type -> Family in FAMILIES).

    ``mlp_matrices``: 3 for a gated MLP (gate, up, down), 2 for a plain one (up, down).
    ``intermediate_key``: the key of the MLP width; ``intermediate_default``: the width as a multiple
    of hidden_size when the config omits it (None: required). ``aliases``: older key -> the key read.
    ``defaults``: keys the family's HF config class fills when config.json omits them.
    ``slides``: which layers slide when a window is set and no layer_types says: "all", "even" (Gemma 2),
    or "by_keys" (Qwen's max_window_layers, Gemma 3's sliding_window_pattern; else all).
    ``kv_heads``: "num_key_value_heads" (absent: MHA) or "falcon" (multi_query / num_kv_heads).
    ``embed_projections``: the embeddings are projected in and out of the model width when
    ``word_embed_proj_dim`` differs from it (OPT), two more matrices run on every token.
    ``rope_theta_fallback``: the key holding RoPE's base when ``rope_theta`` is absent (GPT-NeoX's
    ``rotary_emb_base``).
    """

    mlp_matrices: int = 3
    intermediate_key: str = "intermediate_size"
    intermediate_default: int | None = None
    aliases: Mapping[str, str] = dataclass_field(default_factory=dict)
    defaults: Mapping[str, Any] = dataclass_field(default_factory=dict)
    slides: str = "by_keys"
    kv_heads: str = "num_key_value_heads"
    embed_projections: bool = False
    rope_theta_fallback: str | None = None


_GATED = Family()
_PLAIN = Family(mlp_matrices=2)
_FALCON = Family(
    mlp_matrices=2,
    intermediate_key="ffn_hidden_size",
    intermediate_default=4,
    kv_heads="falcon",
    aliases={"n_head": "num_attention_heads", "n_layer": "num_hidden_layers", "n_head_kv": "num_kv_heads"},
)
# Every family kvcopy reads; any other model_type is an error unless the caller says how to read it (assume=).
FAMILIES: dict[str, Family] = {
    **dict.fromkeys(
        (
            "llama",
            "mistral",
            "mixtral",
            "qwen2",
            "qwen2_moe",
            "qwen3",
            "qwen3_moe",
            "gemma",
            "phi3",
            "deepseek_v2",
            "deepseek_v3",
        ),
        _GATED,
    ),
    "gemma2": Family(slides="even"),  # layer i slides when i is even (HF: (i + 1) % 2 != 0)
    # Keys that Gemma3TextConfig fills with a default and the hub's configs omit (4B and up).
    **dict.fromkeys(
        ("gemma3", "gemma3_text"),
        Family(
            defaults={
                "vocab_size": 262208,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "head_dim": 256,
                "sliding_window": 4096,
                "sliding_window_pattern": 6,
            }
        ),
    ),
    "opt": Family(mlp_matrices=2, intermediate_key="ffn_dim", embed_projections=True),
    "gpt_neox": Family(mlp_matrices=2, rope_theta_fallback="rotary_emb_base"),
    **dict.fromkeys(("phi", "starcoder2"), _PLAIN),
    **dict.fromkeys(("falcon", "RefinedWeb", "RefinedWebModel"), _FALCON),
}
SUPPORTED_FAMILIES: tuple[str, ...] = tuple(sorted(FAMILIES))

# --------------------------------------------------------------------------- MoE layouts

MOE_STYLES: dict[str, tuple[str, frozenset[str]]] = {
    # style: (the key that names the expert count, the MoE keys the style reads)
    "deepseek": (
        "n_routed_experts",
        frozenset(
            {
                "n_routed_experts",
                "n_shared_experts",
                "moe_intermediate_size",
                "first_k_dense_replace",
                "moe_layer_freq",
            }
        ),
    ),
    "mixtral": ("num_local_experts", frozenset({"num_local_experts"})),
    "qwen_moe": (
        "num_experts",
        frozenset(
            {
                "num_experts",
                "moe_intermediate_size",
                "shared_expert_intermediate_size",
                "decoder_sparse_step",
                "mlp_only_layers",
            }
        ),
    ),
}
# Keys that change which layers are MoE or how big their experts are: one a style does not read
# would be silently miscounted, so it is an error (Llama 4's interleaved layers, for one).
MOE_STRUCTURE_KEYS = frozenset().union(*(keys for _, keys in MOE_STYLES.values())) | {
    "interleave_moe_layer_step",
    "intermediate_size_mlp",
    "moe_layers",
    "num_shared_experts",
}

# Keys besides rope_theta / rope_scaling that change what RoPE does to the cached keys: the base of the local
# (sliding) layers (Gemma 3) and the share of each head that rotates (GPT-NeoX, Phi).
ROPE_EXTRA_KEYS = ("rope_local_base_freq", "rotary_pct", "partial_rotary_factor")
