"""Reading a Hugging Face config.json into ModelSpec's fields (ModelSpec.from_hf_config and ModelSpec.preset
call this). What differs between families (which keys hold what, their defaults, MLP matrices, which layers
slide, the KV heads' keys, embedding projections, RoPE's keys) is one table, kvcopy.model.families; this
module applies it the same way to every family, and reads what the keys themselves say:

* Heads: ``num_key_value_heads`` absent means MHA; an explicit ``head_dim`` wins, else
  ``hidden_size / num_attention_heads`` (which must divide).
* MLA (any config with ``kv_lora_rank``): ``kv_lora_rank``, ``qk_rope_head_dim``,
  ``qk_nope_head_dim``, ``v_head_dim``; ``q_lora_rank`` null means a plain q projection.
* MoE: the layout is the one whose expert-count key is set (kvcopy.model.families.MOE_STYLES:
  ``num_local_experts``, every layer; ``n_routed_experts``, layer i is MoE when
  ``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0``, plus ``n_shared_experts``;
  ``num_experts``, layer i is MoE unless in ``mlp_only_layers`` or
  ``(i + 1) % decoder_sparse_step != 0``, plus ``shared_expert_intermediate_size``). A key of
  another layout is rejected.
* Sliding window ``W`` = ``sliding_window`` (or ``sliding_window_size``). It is off — every
  layer keeps all tokens — when null or when ``use_sliding_window`` is false, even if
  ``layer_types`` lists sliding layers (transformers then gives those layers no window).
  Otherwise the sliding layers are: ``layer_types`` when present; with a ``use_sliding_window``
  key, layers ``i >= max_window_layers`` (the first ``max_window_layers`` are full, as
  transformers builds them); the family's rule (``Family.slides``); with a
  ``sliding_window_pattern`` p, every layer but those with ``(i + 1) % p == 0``; else every layer.
* KV dtype: ``kv_dtype``, else the config's ``torch_dtype`` (or ``dtype``), else bfloat16.
* Name: ``name``, else ``_name_or_path``, else ``model_type`` (never the folder it sits in).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from kvcopy.model.dtypes import kv_dtype_name
from kvcopy.model.families import FAMILIES, MOE_STRUCTURE_KEYS, MOE_STYLES, ROPE_EXTRA_KEYS, SUPPORTED_FAMILIES, Family

__all__ = [
    "CONFIG_FILE",
    "DEFAULT_KV_DTYPE",
    "FULL_ATTENTION",
    "LAYER_TYPES",
    "SLIDING_ATTENTION",
    "read_config",
    "spec_from_config",
]

SpecT = TypeVar("SpecT")
CONFIG_FILE = "config.json"
_SHARED_EXPERT_GATE_OUTPUTS = 1  # Qwen2-MoE gates its shared expert with a hidden -> 1 projection
# The layer types a spec may hold (ModelSpec checks them).
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
# HF's own default would be float32, but no serving engine keeps its KV cache in fp32.
DEFAULT_KV_DTYPE = "bfloat16"


def read_config(path_or_dict: object) -> tuple[dict[str, Any], str, str | None]:
    """(config, where it came from, the directory name if read from a file)."""
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict), "<dict>", None
    if not isinstance(path_or_dict, (str, os.PathLike)):
        raise TypeError(f"path_or_dict: expected a path or a dict, got {type(path_or_dict).__name__}")
    path = Path(path_or_dict)
    if path.is_dir():
        path = path / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (expected a {CONFIG_FILE} or a directory holding one)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a valid JSON file ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got a JSON {type(config).__name__}")
    return config, str(path), path.resolve().parent.name or None


class _Config:
    """A config dict whose errors say where the config came from and which key is wrong."""

    def __init__(self, data: Mapping[str, Any], origin: str) -> None:
        self.data = data
        self.origin = origin
        self.model_type = data.get("model_type")

    def error(self, message: str) -> ValueError:
        return ValueError(f"config {self.origin} (model_type {self.model_type!r}): {message}")

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def is_set(self, key: str) -> bool:
        """Present with a value that does something (not null, 0, false or empty)."""
        return self.data.get(key) not in (None, 0, False, [], {})

    def get_int(self, key: str, *, default: int | None = None, minimum: int = 1) -> int:
        value = self.data.get(key)
        if value is None:
            if default is None:
                raise self.error(f"missing required key {key!r}")
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise self.error(f"{key!r}: expected {wanted}, got {value!r}")
        return value

    def optional_int(self, key: str) -> int | None:
        return self.get_int(key) if self.has(key) else None


def _unwrap_text_config(config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's text_config (keeping the top level's dtype), else the config."""
    text = config.get("text_config")
    if "num_hidden_layers" in config or not isinstance(text, Mapping):
        return config
    merged = dict(text)
    for key in ("torch_dtype", "dtype"):
        if key in config and key not in merged:
            merged[key] = config[key]
    return merged


def spec_from_config(
    make: Callable[..., SpecT],
    raw: Mapping[str, Any],
    origin: str,
    *,
    name: str | None,
    fallback_name: str | None,
    kv_dtype: torch.dtype | str | None,
    source: str,
    assume: str | None = None,
) -> SpecT:
    """``make(**fields)`` (ModelSpec) from a config dict; errors name the config and the key."""
    dtype = kv_dtype_name(kv_dtype, "kv_dtype") if kv_dtype is not None else None
    data = _unwrap_text_config(dict(raw))
    family = _family_of(data.get("model_type"), assume, origin)
    data = {**family.defaults, **{family.aliases.get(k, k): v for k, v in data.items()}}
    cfg = _Config(data, origin)
    num_layers = cfg.get_int("num_hidden_layers")
    hidden = cfg.get_int("hidden_size")
    vocab = cfg.get_int("vocab_size")
    if family.intermediate_default is not None and not cfg.is_set(family.intermediate_key):
        intermediate = family.intermediate_default * hidden
    else:
        intermediate = cfg.get_int(family.intermediate_key)
    attention = _attention(cfg, hidden, family)
    layer_types, window = _layer_pattern(cfg, num_layers, family)
    mlp, num_experts, per_tok, expert_params = _mlp(cfg, hidden, intermediate, num_layers, family)
    active = num_layers * attention["params"] + sum(mlp) + _embed_projections(cfg, hidden, family)
    weight_dtype = _config_dtype(cfg)
    theta, scaling = _rope(cfg, family)
    del fallback_name  # a folder's name says where a config sits, not which model it is
    name = name or data.get("_name_or_path") or cfg.model_type or "unknown"
    try:
        return make(
            name=name,
            num_layers=num_layers,
            hidden_size=hidden,
            num_attention_heads=attention["heads"],
            num_kv_heads=attention["kv_heads"],
            head_dim=attention["head_dim"],
            intermediate_size=intermediate,
            vocab_size=vocab,
            active_params=active,
            kv_dtype=dtype or weight_dtype,
            weight_dtype=weight_dtype,
            context_length=cfg.optional_int("max_position_embeddings"),
            attention=attention["kind"],
            kv_lora_rank=attention.get("kv_lora_rank"),
            qk_rope_head_dim=attention.get("qk_rope_head_dim"),
            qk_nope_head_dim=attention.get("qk_nope_head_dim"),
            v_head_dim=attention.get("v_head_dim"),
            sliding_window=window,
            layer_types=layer_types,
            num_experts=num_experts,
            num_experts_per_tok=per_tok,
            expert_params=expert_params,
            rope_theta=theta,
            rope_scaling=scaling,
            source=source,
        )
    except ValueError as err:
        raise cfg.error(str(err)) from None


def _family_of(model_type: object, assume: str | None, origin: str) -> Family:
    """The reading rules of a config's family; ValueError for a family kvcopy does not read."""
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if assume is not None:
        if assume not in FAMILIES:
            raise ValueError(
                f"assume: expected one of the supported families {', '.join(SUPPORTED_FAMILIES)}, got {assume!r}"
            )
        return FAMILIES[assume]
    raise ValueError(
        f"config {origin}: model_type {model_type!r} is not supported (its KV cache and FLOPs would be "
        f"guessed); supported: {', '.join(SUPPORTED_FAMILIES)}. To read it with one family's rules "
        f"anyway, pass assume='llama' (or another of them)"
    )


def _config_dtype(cfg: _Config) -> str:
    key = "torch_dtype" if cfg.has("torch_dtype") else "dtype"
    value = cfg.data.get(key)
    if value is None:
        return DEFAULT_KV_DTYPE
    try:
        return kv_dtype_name(value, key)
    except (TypeError, ValueError) as err:
        raise cfg.error(str(err)) from None


# --------------------------------------------------------------------------- attention


def _attention(cfg: _Config, hidden: int, family: Family) -> dict[str, Any]:
    """Head counts and sizes, and the attention parameters of one layer."""
    heads = cfg.get_int("num_attention_heads")
    if cfg.has("kv_lora_rank"):
        return _mla_attention(cfg, hidden, heads)
    if family.kv_heads == "falcon":  # Falcon-40B style: num_kv_heads; Falcon-7B: multi-query, one KV head
        if cfg.data.get("new_decoder_architecture"):
            kv_heads = cfg.get_int("num_kv_heads", default=heads)
        else:
            kv_heads = 1 if cfg.data.get("multi_query", True) else heads
    else:
        kv_heads = cfg.get_int("num_key_value_heads", default=heads)  # absent (or null): MHA
    if heads % kv_heads:
        raise cfg.error(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if cfg.has("head_dim"):
        head_dim = cfg.get_int("head_dim")
    elif hidden % heads:
        raise cfg.error(f"hidden_size {hidden} is not a multiple of num_attention_heads {heads}, and no head_dim")
    else:
        head_dim = hidden // heads
    # q and o: hidden x heads·head_dim each; k and v: hidden x kv_heads·head_dim each.
    params = 2 * hidden * head_dim * (heads + kv_heads)
    return {"kind": "mha", "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "params": params}


def _mla_attention(cfg: _Config, hidden: int, heads: int) -> dict[str, Any]:
    """DeepSeek MLA: low-rank q (optional) and kv projections; one latent cached per token."""
    kv_rank = cfg.get_int("kv_lora_rank")
    rope = cfg.get_int("qk_rope_head_dim")
    nope = cfg.get_int("qk_nope_head_dim")
    v_dim = cfg.get_int("v_head_dim")
    q_rank = cfg.optional_int("q_lora_rank")
    q_head = nope + rope
    # q: hidden -> heads·(nope + rope), directly or through q_a (hidden -> q_rank) and q_b.
    q = hidden * heads * q_head if q_rank is None else hidden * q_rank + q_rank * heads * q_head
    kv_a = hidden * (kv_rank + rope)  # hidden -> latent and the shared rope key
    kv_b = kv_rank * heads * (nope + v_dim)  # latent -> per-head k_nope and v
    out = heads * v_dim * hidden
    return {
        "kind": "mla",
        "heads": heads,
        "kv_heads": 1,
        "head_dim": kv_rank + rope,
        "params": q + kv_a + kv_b + out,
        "kv_lora_rank": kv_rank,
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": nope,
        "v_head_dim": v_dim,
    }


def _layer_pattern(cfg: _Config, num_layers: int, family: Family) -> tuple[tuple[str, ...], int | None]:
    """(layer types, window); see ModelSpec.from_hf_config for each family's reading."""
    explicit = cfg.data.get("layer_types")
    if explicit is not None:
        if not isinstance(explicit, Sequence) or isinstance(explicit, str) or len(explicit) != num_layers:
            raise cfg.error(
                f"'layer_types': expected a list of {num_layers} entries (num_hidden_layers), got {explicit!r}"
            )
        unknown = sorted({str(t) for t in explicit if t not in LAYER_TYPES})
        if unknown:
            raise cfg.error(f"'layer_types': unsupported layer types {unknown}; expected {LAYER_TYPES}")
    window_key = "sliding_window" if cfg.has("sliding_window") else "sliding_window_size"
    window = cfg.optional_int(window_key)
    if window is None or ("use_sliding_window" in cfg.data and not cfg.data["use_sliding_window"]):
        return (FULL_ATTENTION,) * num_layers, None
    if explicit is not None:
        return tuple(explicit), window
    if "use_sliding_window" in cfg.data:  # Qwen2/Qwen3: the first max_window_layers layers are full
        first = cfg.get_int("max_window_layers", minimum=0)
        slides = [i >= first for i in range(num_layers)]
    elif family.slides == "even":
        slides = [i % 2 == 0 for i in range(num_layers)]
    elif cfg.has("sliding_window_pattern") or cfg.has("_sliding_window_pattern"):
        key = "sliding_window_pattern" if cfg.has("sliding_window_pattern") else "_sliding_window_pattern"
        period = cfg.get_int(key)
        slides = [(i + 1) % period != 0 for i in range(num_layers)]
    else:  # Mistral-style: the window applies to every layer
        slides = [True] * num_layers
    return tuple(SLIDING_ATTENTION if s else FULL_ATTENTION for s in slides), window


# --------------------------------------------------------------------------- MLP and experts


def _mlp(
    cfg: _Config, hidden: int, intermediate: int, num_layers: int, family: Family
) -> tuple[list[int], int | None, int | None, int]:
    """(active MLP parameters of each layer, num_experts, num_experts_per_tok, parameters of one routed
    expert summed over the MoE layers)."""
    matrices = family.mlp_matrices
    dense = matrices * hidden * intermediate
    styles = [style for style, (key, _) in MOE_STYLES.items() if cfg.is_set(key)]
    if not styles:
        return [dense] * num_layers, None, None, 0
    if len(styles) > 1:
        keys = [MOE_STYLES[s][0] for s in styles]
        raise cfg.error(f"contradictory expert counts {keys}: expected one of them")
    style = styles[0]
    foreign = sorted(k for k in MOE_STRUCTURE_KEYS - MOE_STYLES[style][1] if cfg.is_set(k))
    if foreign:
        raise cfg.error(f"mixture-of-experts keys {foreign} describe a layout this parser does not count")
    experts = cfg.get_int(MOE_STYLES[style][0])
    per_tok = cfg.get_int("num_experts_per_tok")
    if per_tok > experts:
        raise cfg.error(f"num_experts_per_tok {per_tok} exceeds the {experts} experts")
    router = hidden * experts
    if style == "mixtral":
        return [per_tok * dense + router] * num_layers, experts, per_tok, dense * num_layers
    expert = matrices * hidden * cfg.get_int("moe_intermediate_size")
    if style == "deepseek":
        shared = cfg.get_int("n_shared_experts", default=0, minimum=0)
        first_moe = cfg.get_int("first_k_dense_replace", default=0, minimum=0)
        every = cfg.get_int("moe_layer_freq", default=1)
        moe = (per_tok + shared) * expert + router
        is_moe = [i >= first_moe and i % every == 0 for i in range(num_layers)]
        return [moe if m else dense for m in is_moe], experts, per_tok, expert * sum(is_moe)
    shared_size = cfg.get_int("shared_expert_intermediate_size", default=0, minimum=0)
    shared = matrices * hidden * shared_size + hidden * _SHARED_EXPERT_GATE_OUTPUTS if shared_size else 0
    step = cfg.get_int("decoder_sparse_step", default=1)
    dense_layers = cfg.data.get("mlp_only_layers") or []
    if not isinstance(dense_layers, Sequence) or not all(isinstance(i, int) for i in dense_layers):
        raise cfg.error(f"'mlp_only_layers': expected a list of layer indices, got {dense_layers!r}")
    moe = per_tok * expert + router + shared
    is_moe = [i not in dense_layers and (i + 1) % step == 0 for i in range(num_layers)]
    return [moe if m else dense for m in is_moe], experts, per_tok, expert * sum(is_moe)


def _embed_projections(cfg: _Config, hidden: int, family: Family) -> int:
    """A family's project_in / project_out (run on every token) when word_embed_proj_dim != hidden_size."""
    if not family.embed_projections:
        return 0
    embed = cfg.get_int("word_embed_proj_dim", default=hidden)
    return 0 if embed == hidden else 2 * embed * hidden


def _rope(cfg: _Config, family: Family) -> tuple[float | None, str | None]:
    """(rope_theta, canonical JSON of rope_scaling); newer configs nest both in rope_parameters."""
    params = cfg.data.get("rope_parameters")
    params = dict(params) if isinstance(params, Mapping) else {}
    theta = cfg.data.get("rope_theta", params.get("rope_theta"))
    if theta is None and family.rope_theta_fallback is not None:
        theta = cfg.data.get(family.rope_theta_fallback)
    if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0):
        raise cfg.error(f"'rope_theta': expected a positive number, got {theta!r}")
    scaling = cfg.data.get("rope_scaling")
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling.get("rope_type", "default") == "default" and len(scaling) <= 1:
            scaling = None
    if scaling is not None and not isinstance(scaling, Mapping):
        raise cfg.error(f"'rope_scaling': expected an object or null, got {scaling!r}")
    # Other keys that change what RoPE does to the cached keys: the base of the local (sliding) layers
    # (Gemma 3) and the share of each head that rotates (GPT-NeoX, Phi): part of the positional identity.
    extras = {key: cfg.data[key] for key in ROPE_EXTRA_KEYS if cfg.data.get(key) is not None}
    if extras:
        scaling = {**(scaling or {}), **extras}
    canonical = json.dumps(dict(scaling), sort_keys=True) if scaling is not None else None
    return (float(theta) if theta is not None else None), canonical
