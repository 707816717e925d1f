"""The consistency checks of a ModelSpec's fields (ModelSpec.__post_init__ runs them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcopy.policy._args import non_negative_int, positive_int
from kvcopy.policy.model_config import FULL_ATTENTION, LAYER_TYPES, SLIDING_ATTENTION

if TYPE_CHECKING:
    from kvcopy.policy.model import ModelSpec

__all__ = ["ATTENTION_KINDS", "check_attention", "check_experts", "checked_layers"]

ATTENTION_KINDS = ("mha", "mla")


def check_attention(spec: ModelSpec) -> None:
    """ValueError unless the heads and MLA fields fit the spec's attention kind."""
    mla_fields = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    if spec.attention == "mha":
        if spec.num_attention_heads % spec.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {spec.num_attention_heads} is not a multiple of num_kv_heads {spec.num_kv_heads}"
            )
        given = [f for f in mla_fields if getattr(spec, f) is not None]
        if given:
            raise ValueError(f"{', '.join(given)}: only for attention='mla', this spec is 'mha'")
    elif spec.attention == "mla":
        for field in mla_fields:
            positive_int(field, getattr(spec, field))
        latent = spec.kv_lora_rank + spec.qk_rope_head_dim
        if spec.num_kv_heads != 1 or spec.head_dim != latent:
            raise ValueError(
                f"attention='mla' caches one latent per token-layer: expected num_kv_heads 1 and head_dim "
                f"kv_lora_rank + qk_rope_head_dim = {latent}, got {spec.num_kv_heads} and {spec.head_dim}"
            )
    else:
        raise ValueError(f"attention: expected one of {ATTENTION_KINDS}, got {spec.attention!r}")


def checked_layers(spec: ModelSpec) -> tuple[tuple[str, ...], int | None]:
    """The spec's layer types (all full attention when none are given) and its window, in one canonical form
    (no window when no layer slides); ValueError when they do not fit."""
    types = tuple(spec.layer_types) if spec.layer_types else (FULL_ATTENTION,) * spec.num_layers
    if len(types) != spec.num_layers:
        raise ValueError(f"layer_types: expected {spec.num_layers} entries (num_layers), got {len(types)}")
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        raise ValueError(f"layer_types: unsupported {unknown}; expected {LAYER_TYPES}")
    if spec.sliding_window is not None:
        positive_int("sliding_window", spec.sliding_window)
    if SLIDING_ATTENTION in types and spec.sliding_window is None:
        raise ValueError("layer_types: sliding layers need a sliding_window, got None")
    return types, (spec.sliding_window if SLIDING_ATTENTION in types else None)


def check_experts(spec: ModelSpec) -> None:
    """ValueError unless the mixture-of-experts fields fit together."""
    if (spec.num_experts is None) != (spec.num_experts_per_tok is None):
        raise ValueError("num_experts and num_experts_per_tok: give both or neither")
    non_negative_int("expert_params", spec.expert_params)
    if spec.expert_params and spec.num_experts is None:
        raise ValueError("expert_params: only for a mixture-of-experts spec (num_experts is None)")
    if spec.num_experts is not None and spec.num_experts_per_tok * spec.expert_params > spec.active_params:
        raise ValueError(
            f"expert_params {spec.expert_params} x num_experts_per_tok {spec.num_experts_per_tok} "
            f"exceeds active_params {spec.active_params}"
        )
    if spec.num_experts is not None:
        positive_int("num_experts", spec.num_experts)
        positive_int("num_experts_per_tok", spec.num_experts_per_tok)
        if spec.num_experts_per_tok > spec.num_experts:
            raise ValueError(f"num_experts_per_tok {spec.num_experts_per_tok} exceeds num_experts {spec.num_experts}")
