"""ModelSpec: the KV-cache bytes and prefill FLOPs of a model, read from a Hugging Face config.json.

Formulas (shared/REFERENCE.md "Formulas", shared/DESIGN.md §1), per layer and token:

* MHA / GQA / MQA: ``2 · H_kv · d_h · b`` bytes (K and V; ``b`` bytes per element).
* MLA (DeepSeek-V2/V3): ``(kv_lora_rank + qk_rope_head_dim) · b`` bytes, one latent, no factor 2.
* A sliding-window layer keeps only the last ``W`` tokens.

Conventions (chosen here, tested in tests/test_model.py):

* Parameters are the weight matrices only: norms and biases are ignored (under 0.1% of any
  model here), and so are the token and position embeddings and the LM head.
* :meth:`ModelSpec.prefill_flops` does not count the LM head: engines compute logits for the
  last token of a prefill only, and a reload needs those logits as much as a recompute does.
* Fp8 scale buffers and paging slack are not counted in bytes: a uniform KV dtype is assumed.

How each family's config is read is documented at :meth:`ModelSpec.from_hf_config`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .model_presets import PRESETS

__all__ = ["ModelSpec", "SUPPORTED_FAMILIES"]

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
_LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
_ATTENTION_KINDS = ("mha", "mla")

# HF's own default would be float32, but no serving engine keeps its KV cache in fp32.
_DEFAULT_KV_DTYPE = "bfloat16"
_KV_PLANES = 2  # K and V; MLA stores one latent instead
_FLOPS_PER_MAC = 2  # one multiply plus one add
_SHARED_EXPERT_GATE_OUTPUTS = 1  # Qwen2-MoE gates its shared expert with a hidden -> 1 projection
_CONFIG_FILE = "config.json"



@dataclass(frozen=True)
class _Family:
    """How one family's config.json is read (model_type -> _Family in _FAMILIES).

    ``mlp_matrices``: 3 for a gated MLP (gate, up, down), 2 for a plain one (up, down).
    ``intermediate_key``: the key of the MLP width; ``intermediate_default``: the width as a multiple
    of hidden_size when the config omits it (None: required). ``aliases``: older key -> the key read.
    ``defaults``: keys the family's HF config class fills when config.json omits them.
    ``slides``: which layers slide when a window is set and no layer_types says: "all", "even" (Gemma 2),
    or "by_keys" (Qwen's max_window_layers, Gemma 3's sliding_window_pattern; else all).
    ``kv_heads``: "num_key_value_heads" (absent: MHA) or "falcon" (multi_query / num_kv_heads).
    """

    mlp_matrices: int = 3
    intermediate_key: str = "intermediate_size"
    intermediate_default: int | None = None
    aliases: Mapping[str, str] = dataclass_field(default_factory=dict)
    defaults: Mapping[str, Any] = dataclass_field(default_factory=dict)
    slides: str = "by_keys"
    kv_heads: str = "num_key_value_heads"


_GATED = _Family()
_PLAIN = _Family(mlp_matrices=2)
_FALCON = _Family(mlp_matrices=2, intermediate_key="ffn_hidden_size", intermediate_default=4, kv_heads="falcon",
                  aliases={"n_head": "num_attention_heads", "n_layer": "num_hidden_layers",
                           "n_head_kv": "num_kv_heads"})
# Every family kvcopy reads; any other model_type is an error unless the caller says how to read it (assume=).
_FAMILIES: dict[str, _Family] = {
    **dict.fromkeys(("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "phi3",
                     "deepseek_v2", "deepseek_v3"), _GATED),
    "gemma2": _Family(slides="even"),  # layer i slides when i is even (HF: (i + 1) % 2 != 0)
    # Keys that Gemma3TextConfig fills with a default and the hub's configs omit (4B and up).
    **dict.fromkeys(("gemma3", "gemma3_text"), _Family(defaults={
        "vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "sliding_window": 4096, "sliding_window_pattern": 6})),
    "opt": _Family(mlp_matrices=2, intermediate_key="ffn_dim"),
    **dict.fromkeys(("gpt_neox", "phi", "starcoder2"), _PLAIN),
    **dict.fromkeys(("falcon", "RefinedWeb", "RefinedWebModel"), _FALCON),
}
SUPPORTED_FAMILIES: tuple[str, ...] = tuple(sorted(_FAMILIES))

_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp8": "float8_e4m3fn",  # what vLLM and SGLang mean by a "fp8" KV cache
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
_INTEGER_KV_DTYPES = (torch.int8, torch.uint8)


# --------------------------------------------------------------------------- dtypes


def _dtype_name(dtype: torch.dtype | str, what: str = "dtype") -> str:
    """The torch name (``"bfloat16"``) of a KV dtype given as a torch.dtype or a string."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        key = _DTYPE_ALIASES.get(key, key)
        resolved = getattr(torch, key, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"{what}: unknown dtype {dtype!r}; expected a torch dtype name like 'bfloat16' or 'fp8'")
    else:
        raise TypeError(f"{what}: expected a torch.dtype or a string, got {type(dtype).__name__}")
    name = str(resolved).removeprefix("torch.")
    if name.endswith("_x2") or not (resolved.is_floating_point or resolved in _INTEGER_KV_DTYPES):
        raise ValueError(
            f"{what}: {name} is not a KV-cache dtype (expected a float type of 1 byte or more, int8 or uint8)"
        )
    return name


def _itemsize(name: str) -> int:
    return getattr(torch, name).itemsize


# --------------------------------------------------------------------------- arguments


def _positive_int(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what}: expected a positive int, got {value!r}")
    return value


def _count(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what}: expected a non-negative int, got {value!r}")
    return value


def _attended_pairs(cached: int, new: int, window: int | None) -> float:
    """Query-key pairs of ``new`` causal tokens after ``cached`` ones: ``∫_P^{P+n} min(t, W) dt``.

    The token at position ``t`` attends to ``min(t, W)`` positions (the continuous form of
    causal attention behind REFERENCE.md's ``n·P + n²/2``). No window: ``n·P + n²/2``.
    """
    end = cached + new
    if window is None or end <= window:
        return new * cached + new * new / 2
    if cached >= window:
        return new * window
    return (window * window - cached * cached) / 2 + (end - window) * window


# --------------------------------------------------------------------------- ModelSpec


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the KV footprint and the prefill cost of a model depend on.

    Build it with :meth:`from_hf_config` or :meth:`preset`; direct construction is validated.
    For MLA (``attention="mla"``) the cache holds one latent per token and layer, so
    ``num_kv_heads`` is 1 and ``head_dim`` is ``kv_lora_rank + qk_rope_head_dim`` (the head size
    of :meth:`kvcopy.PagedKV.from_mla` and of vLLM's MLA cache). ``layer_types`` says which layers
    slide (empty: all full). ``active_params``: non-embedding parameters used per token (for MoE,
    the routed experts a token visits, the shared experts and the router). ``expert_params``: the
    parameters of one routed expert summed over the MoE layers (0 for a dense model), so a
    forward whose tokens touch ``e`` experts per layer reads ``active_params + (e - k) ·
    expert_params`` of them. ``weight_dtype``: the checkpoint's dtype, which sets the bytes a
    forward reads (:meth:`weight_bytes`). ``context_length``: the longest sequence the model takes
    (``max_position_embeddings``), or None when the config does not say. ``tp``: the tensor-parallel
    ranks this spec is one rank of (:meth:`shard`); its heads and parameters are that rank's. ``rope_scaling`` is
    canonical JSON (a dict is accepted and canonicalised). ``kv_dtype`` accepts the aliases of
    :meth:`kv_bytes_per_token` and is stored as the torch name.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    active_params: int
    kv_dtype: str = _DEFAULT_KV_DTYPE
    attention: str = "mha"
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    expert_params: int = 0
    weight_dtype: str = _DEFAULT_KV_DTYPE
    context_length: int | None = None
    tp: int = 1
    rope_theta: float | None = None
    rope_scaling: str | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: expected a non-empty string, got {self.name!r}")
        for field in ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads", "head_dim",
                      "intermediate_size", "vocab_size", "active_params"):
            _positive_int(field, getattr(self, field))
        object.__setattr__(self, "kv_dtype", _dtype_name(self.kv_dtype, "kv_dtype"))
        object.__setattr__(self, "weight_dtype", _dtype_name(self.weight_dtype, "weight_dtype"))
        if self.context_length is not None:
            _positive_int("context_length", self.context_length)
        _positive_int("tp", self.tp)
        self._check_attention()
        self._check_layers()
        self._check_experts()
        if self.rope_theta is not None:
            theta = self.rope_theta
            if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
                raise ValueError(f"rope_theta: expected a positive number or None, got {self.rope_theta!r}")
            object.__setattr__(self, "rope_theta", float(self.rope_theta))
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", json.dumps(dict(self.rope_scaling), sort_keys=True))
        elif self.rope_scaling is not None and not isinstance(self.rope_scaling, str):
            raise ValueError(f"rope_scaling: expected canonical JSON, a dict or None, got {self.rope_scaling!r}")
        if not isinstance(self.source, str):
            raise ValueError(f"source: expected a string, got {self.source!r}")

    def _check_attention(self) -> None:
        mla_fields = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
        if self.attention == "mha":
            if self.num_attention_heads % self.num_kv_heads:
                raise ValueError(
                    f"num_attention_heads {self.num_attention_heads} is not a multiple of num_kv_heads "
                    f"{self.num_kv_heads}"
                )
            given = [f for f in mla_fields if getattr(self, f) is not None]
            if given:
                raise ValueError(f"{', '.join(given)}: only for attention='mla', this spec is 'mha'")
        elif self.attention == "mla":
            for field in mla_fields:
                _positive_int(field, getattr(self, field))
            latent = self.kv_lora_rank + self.qk_rope_head_dim
            if self.num_kv_heads != 1 or self.head_dim != latent:
                raise ValueError(
                    f"attention='mla' caches one latent per token-layer: expected num_kv_heads 1 and head_dim "
                    f"kv_lora_rank + qk_rope_head_dim = {latent}, got {self.num_kv_heads} and {self.head_dim}"
                )
        else:
            raise ValueError(f"attention: expected one of {_ATTENTION_KINDS}, got {self.attention!r}")

    def _check_layers(self) -> None:
        types = tuple(self.layer_types) if self.layer_types else (FULL_ATTENTION,) * self.num_layers
        if len(types) != self.num_layers:
            raise ValueError(f"layer_types: expected {self.num_layers} entries (num_layers), got {len(types)}")
        unknown = sorted({t for t in types if t not in _LAYER_TYPES})
        if unknown:
            raise ValueError(f"layer_types: unsupported {unknown}; expected {_LAYER_TYPES}")
        object.__setattr__(self, "layer_types", types)
        if self.sliding_window is not None:
            _positive_int("sliding_window", self.sliding_window)
        if SLIDING_ATTENTION in types and self.sliding_window is None:
            raise ValueError("layer_types: sliding layers need a sliding_window, got None")
        if SLIDING_ATTENTION not in types:
            object.__setattr__(self, "sliding_window", None)  # one canonical form: no layer slides

    def _check_experts(self) -> None:
        if (self.num_experts is None) != (self.num_experts_per_tok is None):
            raise ValueError("num_experts and num_experts_per_tok: give both or neither")
        _count("expert_params", self.expert_params)
        if self.expert_params and self.num_experts is None:
            raise ValueError("expert_params: only for a mixture-of-experts spec (num_experts is None)")
        if self.num_experts is not None and self.num_experts_per_tok * self.expert_params > self.active_params:
            raise ValueError(f"expert_params {self.expert_params} x num_experts_per_tok {self.num_experts_per_tok} "
                             f"exceeds active_params {self.active_params}")
        if self.num_experts is not None:
            _positive_int("num_experts", self.num_experts)
            _positive_int("num_experts_per_tok", self.num_experts_per_tok)
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok {self.num_experts_per_tok} exceeds num_experts {self.num_experts}"
                )

    # ------------------------------------------------------------------ bytes

    @property
    def num_sliding_layers(self) -> int:
        return self.layer_types.count(SLIDING_ATTENTION)

    def _layer_token_bytes(self, dtype: torch.dtype | str | None, kv_heads: int | None = None) -> int:
        """Bytes of one token in one layer (on one rank holding ``kv_heads`` heads, MHA)."""
        itemsize = _itemsize(self.kv_dtype if dtype is None else _dtype_name(dtype))
        if self.attention == "mla":
            return (self.kv_lora_rank + self.qk_rope_head_dim) * itemsize
        heads = self.num_kv_heads if kv_heads is None else kv_heads
        return _KV_PLANES * heads * self.head_dim * itemsize

    def kv_bytes_per_token(self, dtype: torch.dtype | str | None = None) -> int:
        """KV bytes of one token in all layers, sliding ones included (REFERENCE.md ``B_tok``).

        ``dtype``: None for :attr:`kv_dtype`, else a torch.dtype or a name such as
        ``"bfloat16"``, ``"float8_e4m3fn"``; aliases bf16, fp16, fp32, fp8 (= float8_e4m3fn),
        fp8_e5m2.
        """
        return self.num_layers * self._layer_token_bytes(dtype)

    def kv_bytes(self, num_tokens: int, dtype: torch.dtype | str | None = None) -> int:
        """KV bytes of a ``num_tokens`` prefix: a sliding layer keeps ``min(num_tokens, window)``.

        (REFERENCE.md ``B_SWA``.) A config whose window is switched off has no sliding layer.
        """
        tokens = _count("num_tokens", num_tokens)
        sliding = self.num_sliding_layers
        kept = (self.num_layers - sliding) * tokens
        if sliding:
            kept += sliding * min(tokens, self.sliding_window)
        return kept * self._layer_token_bytes(dtype)

    def block_nbytes(self, block_tokens: int, tp: int = 1, *, dtype: torch.dtype | str | None = None) -> int:
        """Bytes of one block of ``block_tokens`` tokens, all layers, on one tensor-parallel rank.

        KV heads are split across ranks: ``num_kv_heads // tp`` per rank, ``tp`` must divide
        ``num_kv_heads`` (ValueError otherwise); with fewer heads than ranks each rank holds one
        replicated head. MLA latents are replicated on every rank. Every layer is counted,
        sliding ones too: a block holds its tokens in all layers.
        """
        tokens = _positive_int("block_tokens", block_tokens)
        ranks = _positive_int("tp", tp)
        heads = None
        if self.attention == "mha":
            if self.num_kv_heads >= ranks:
                if self.num_kv_heads % ranks:
                    raise ValueError(
                        f"tp: {ranks} ranks cannot split {self.num_kv_heads} KV heads evenly; expected a divisor "
                        f"of num_kv_heads, or more ranks than heads (replicated)"
                    )
                heads = self.num_kv_heads // ranks
            else:
                heads = 1
        return tokens * self.num_layers * self._layer_token_bytes(dtype, heads)

    # ------------------------------------------------------------------ weight reads

    def experts_touched(self, num_tokens: int) -> float:
        """Expected routed experts per MoE layer that ``num_tokens`` tokens use, each choosing
        ``num_experts_per_tok`` of ``num_experts`` uniformly: ``E · (1 - (1 - k/E)^n)``; 0 for a dense model."""
        tokens = _count("num_tokens", num_tokens)
        if self.num_experts is None:
            return 0.0
        experts, per_tok = self.num_experts, self.num_experts_per_tok
        return experts * (1.0 - (1.0 - per_tok / experts) ** tokens)

    def weight_bytes(self, num_tokens: int, cached_tokens: int = 0) -> int:
        """Bytes one forward of ``num_tokens`` new tokens after ``cached_tokens`` cached ones reads from memory.

        The weights it uses, once each however many tokens share them: every non-expert weight, the
        routed experts the tokens touch (:meth:`experts_touched`, at most all of them) and the LM head
        (``vocab_size · hidden_size``; read once per forward), in :attr:`weight_dtype`; plus the KV of the
        cached prefix, which attention reads (:meth:`kv_bytes`). This is what bounds a short prefill: the
        memory-bound floor of the Planner's roofline.
        """
        tokens = _count("num_tokens", num_tokens)
        dense = self.active_params - (self.num_experts_per_tok or 0) * self.expert_params
        params = dense + self.experts_touched(tokens) * self.expert_params + self.vocab_size * self.hidden_size
        return int(params * _itemsize(self.weight_dtype)) + self.kv_bytes(cached_tokens)

    # ------------------------------------------------------------------ FLOPs

    def _attention_flops_per_pair(self) -> int:
        """FLOPs of one query-key pair in one layer: ``2 · H · (d_qk + d_v)`` (QKᵀ and A·V)."""
        if self.attention == "mla":
            d_qk, d_v = self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim
        else:
            d_qk = d_v = self.head_dim
        return _FLOPS_PER_MAC * self.num_attention_heads * (d_qk + d_v)

    def prefill_flops(self, num_tokens: int, cached_tokens: int = 0) -> float:
        """FLOPs to prefill ``num_tokens`` new tokens after ``cached_tokens`` cached ones.

        ``2 · N · n + Σ_layers 2 · H · (d_qk + d_v) · pairs``, with ``N`` = :attr:`active_params`
        (non-embedding, active for MoE; LM head not counted) and ``pairs`` the causal query-key
        pairs: ``n·P + n²/2`` for a full layer, and for a sliding layer with the attended span
        capped at the window, ``∫_P^{P+n} min(t, W) dt`` (``n·W`` once ``P >= W``). QKᵀ uses the
        query/key head dim and A·V the value head dim: both ``head_dim`` for MHA;
        ``qk_nope_head_dim + qk_rope_head_dim`` and ``v_head_dim`` for MLA (the expanded form engines
        prefill with; re-expanding cached latents is not counted).

        For MHA this is ``2·N·n + 4·n_layer·d_q·(n·P + n²/2)``, ``d_q = H · d_h``: it equals
        REFERENCE.md's ``F_prefill(T) = 2·N·T + 2·n_layer·d_q·T²`` at ``P = 0`` and satisfies
        ``F(P, n) = F_prefill(P + n) - F_prefill(P)``. (REFERENCE.md's ``F_extend`` prints half this
        attention term, which would contradict its own ``F_prefill``.)
        """
        new = _count("num_tokens", num_tokens)
        cached = _count("cached_tokens", cached_tokens)
        sliding = self.num_sliding_layers
        pairs = (self.num_layers - sliding) * _attended_pairs(cached, new, None)
        if sliding:
            pairs += sliding * _attended_pairs(cached, new, self.sliding_window)
        return float(_FLOPS_PER_MAC * self.active_params * new) + self._attention_flops_per_pair() * pairs

    # ------------------------------------------------------------------ tensor parallelism

    def shard(self, tp: int) -> ModelSpec:
        """The spec of one of ``tp`` tensor-parallel ranks (this spec must be unsharded).

        Query heads are split; KV heads too when there are at least as many as ranks (``tp`` must
        divide them), else each rank holds one, replicated; MLA latents are replicated on every rank.
        Parameters (so FLOPs and weight bytes) and the LM head's vocabulary are split evenly.
        ``shard(1)`` is the spec itself.
        """
        ranks = _positive_int("tp", tp)
        if ranks == 1:
            return self
        if self.tp != 1:
            raise ValueError(f"tp: this spec is already one of {self.tp} ranks; shard the unsharded spec")
        if self.num_attention_heads % ranks:
            raise ValueError(f"tp: {ranks} ranks cannot split {self.num_attention_heads} attention heads evenly")
        kv_heads = self.num_kv_heads
        if self.attention == "mha":
            if kv_heads >= ranks and kv_heads % ranks:
                raise ValueError(f"tp: {ranks} ranks cannot split {kv_heads} KV heads evenly; expected a divisor of "
                                 f"num_kv_heads, or more ranks than heads (replicated)")
            kv_heads = max(1, kv_heads // ranks)
        return dataclasses.replace(
            self, name=f"{self.name}@tp{ranks}", tp=ranks, num_attention_heads=self.num_attention_heads // ranks,
            num_kv_heads=kv_heads, active_params=-(-self.active_params // ranks),
            expert_params=-(-self.expert_params // ranks), vocab_size=-(-self.vocab_size // ranks),
        )

    # ------------------------------------------------------------------ identity

    def identity(self) -> dict[str, Any]:
        """Everything structural (every field but ``source``), JSON-serialisable, for a CacheKey.

        ``layer_types`` comes as a list and ``rope_scaling`` as the dict its canonical JSON encodes
        (or None), the form :class:`kvcopy.policy.cachekey.CacheKey` takes.
        """
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "source"}
        out["layer_types"] = list(self.layer_types)
        out["rope_scaling"] = None if self.rope_scaling is None else json.loads(self.rope_scaling)
        return out

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_hf_config(
        cls,
        path_or_dict: str | os.PathLike[str] | Mapping[str, Any],
        *,
        name: str | None = None,
        kv_dtype: torch.dtype | str | None = None,
        assume: str | None = None,
    ) -> ModelSpec:
        """A spec from a Hugging Face ``config.json``: its path, its directory, or its dict.

        Only the families in :data:`SUPPORTED_FAMILIES` are read; any other ``model_type`` is a
        ValueError listing them, unless ``assume`` names the family whose rules to read it with.

        A missing required key or a contradictory config is a ValueError naming the key;
        malformed JSON is a ValueError naming the file; a missing file is FileNotFoundError.
        A multimodal config is read through its ``text_config``.

        * Heads: ``num_key_value_heads`` absent means MHA; an explicit ``head_dim`` wins, else
          ``hidden_size / num_attention_heads`` (which must divide).
        * MLA (any config with ``kv_lora_rank``, e.g. DeepSeek-V2/V3): ``kv_lora_rank``,
          ``qk_rope_head_dim``, ``qk_nope_head_dim``, ``v_head_dim``; ``q_lora_rank`` null means a
          plain q projection.
        * MLP: OPT (``ffn_dim``), GPT-NeoX, Phi, StarCoder2 have two matrices, others three.
          MoE: Mixtral (``num_local_experts``: every layer), DeepSeek (``n_routed_experts``,
          ``n_shared_experts``, ``moe_intermediate_size``; layer i is MoE when
          ``i >= first_k_dense_replace`` and ``i % moe_layer_freq == 0``), Qwen-MoE
          (``num_experts``, ``moe_intermediate_size``, ``shared_expert_intermediate_size``; layer i
          is MoE unless in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``). Other MoE
          layouts are rejected.
        * Sliding window ``W`` = ``sliding_window`` (or ``sliding_window_size``). It is off — every
          layer keeps all tokens — when null or when ``use_sliding_window`` is false (Qwen2/Qwen3),
          even if ``layer_types`` lists sliding layers (transformers then gives those layers no
          window). Otherwise the sliding layers are: ``layer_types`` when present; Qwen2/Qwen3 (a
          ``use_sliding_window`` key) layers ``i >= max_window_layers`` (the first
          ``max_window_layers`` are full, as transformers' Qwen2Config builds them); Gemma 2 the
          even layers; a ``sliding_window_pattern`` p (Gemma 3) every layer but those with
          ``(i + 1) % p == 0``; any other config (Mistral, Phi-3) every layer.
        * KV dtype: ``kv_dtype``, else the config's ``torch_dtype`` (or ``dtype``), else bfloat16.
        * Name: ``name``, else ``_name_or_path``, else ``model_type`` (never the folder it sits in).
        """
        config, origin, directory = _read_config(path_or_dict)
        return _spec_from_config(config, origin, name=name, fallback_name=directory, kv_dtype=kv_dtype,
                                 source=origin, assume=assume)

    @classmethod
    def preset(cls, name: str, *, kv_dtype: torch.dtype | str | None = None) -> ModelSpec:
        """A spec for a common model, from its public config.json embedded here (see ``source``)."""
        if name not in PRESETS:
            raise ValueError(f"preset: unknown model {name!r}; known: {', '.join(sorted(PRESETS))}")
        repo, config = PRESETS[name]
        source = f"https://huggingface.co/{repo}/blob/main/config.json"
        return _spec_from_config(config, f"preset {name!r}", name=name, fallback_name=None, kv_dtype=kv_dtype,
                                 source=source)

    @staticmethod
    def preset_names() -> tuple[str, ...]:
        """The names :meth:`preset` knows."""
        return tuple(sorted(PRESETS))


# --------------------------------------------------------------------------- reading config.json


def _read_config(path_or_dict: object) -> tuple[dict[str, Any], str, str | None]:
    """(config, where it came from, the directory name if read from a file)."""
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict), "<dict>", None
    if not isinstance(path_or_dict, (str, os.PathLike)):
        raise TypeError(f"path_or_dict: expected a path or a dict, got {type(path_or_dict).__name__}")
    path = Path(path_or_dict)
    if path.is_dir():
        path = path / _CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (expected a {_CONFIG_FILE} or a directory holding one)")
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


def _spec_from_config(
    raw: Mapping[str, Any],
    origin: str,
    *,
    name: str | None,
    fallback_name: str | None,
    kv_dtype: torch.dtype | str | None,
    source: str,
    assume: str | None = None,
) -> ModelSpec:
    dtype = _dtype_name(kv_dtype, "kv_dtype") if kv_dtype is not None else None
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
    active = num_layers * attention["params"] + sum(mlp) + _opt_projections(cfg, hidden)
    weight_dtype = _config_dtype(cfg)
    theta, scaling = _rope(cfg)
    del fallback_name  # a folder's name says where a config sits, not which model it is
    name = name or data.get("_name_or_path") or cfg.model_type or "unknown"
    try:
        return ModelSpec(
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


def _family_of(model_type: object, assume: str | None, origin: str) -> _Family:
    """The reading rules of a config's family; ValueError for a family kvcopy does not read."""
    if model_type in _FAMILIES:
        return _FAMILIES[model_type]  # type: ignore[index]
    if assume is not None:
        if assume not in _FAMILIES:
            raise ValueError(f"assume: expected one of the supported families {', '.join(SUPPORTED_FAMILIES)}, "
                             f"got {assume!r}")
        return _FAMILIES[assume]
    raise ValueError(f"config {origin}: model_type {model_type!r} is not supported (its KV cache and FLOPs would be "
                     f"guessed); supported: {', '.join(SUPPORTED_FAMILIES)}. To read it with one family's rules "
                     f"anyway, pass assume='llama' (or another of them)")


def _config_dtype(cfg: _Config) -> str:
    key = "torch_dtype" if cfg.has("torch_dtype") else "dtype"
    value = cfg.data.get(key)
    if value is None:
        return _DEFAULT_KV_DTYPE
    try:
        return _dtype_name(value, key)
    except (TypeError, ValueError) as err:
        raise cfg.error(str(err)) from None


# --------------------------------------------------------------------------- attention


def _attention(cfg: _Config, hidden: int, family: _Family) -> dict[str, Any]:
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
        "kind": "mla", "heads": heads, "kv_heads": 1, "head_dim": kv_rank + rope, "params": q + kv_a + kv_b + out,
        "kv_lora_rank": kv_rank, "qk_rope_head_dim": rope, "qk_nope_head_dim": nope, "v_head_dim": v_dim,
    }


def _layer_pattern(cfg: _Config, num_layers: int, family: _Family) -> tuple[tuple[str, ...], int | None]:
    """(layer types, window); see ModelSpec.from_hf_config for each family's reading."""
    explicit = cfg.data.get("layer_types")
    if explicit is not None:
        if not isinstance(explicit, Sequence) or isinstance(explicit, str) or len(explicit) != num_layers:
            raise cfg.error(
                f"'layer_types': expected a list of {num_layers} entries (num_hidden_layers), got {explicit!r}"
            )
        unknown = sorted({str(t) for t in explicit if t not in _LAYER_TYPES})
        if unknown:
            raise cfg.error(f"'layer_types': unsupported layer types {unknown}; expected {_LAYER_TYPES}")
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

_MOE_STYLES: dict[str, tuple[str, frozenset[str]]] = {
    # style: (the key that names the expert count, the MoE keys the style reads)
    "deepseek": ("n_routed_experts", frozenset({
        "n_routed_experts", "n_shared_experts", "moe_intermediate_size", "first_k_dense_replace", "moe_layer_freq",
    })),
    "mixtral": ("num_local_experts", frozenset({"num_local_experts"})),
    "qwen_moe": ("num_experts", frozenset({
        "num_experts", "moe_intermediate_size", "shared_expert_intermediate_size", "decoder_sparse_step",
        "mlp_only_layers",
    })),
}
# Keys that change which layers are MoE or how big their experts are: one a style does not read
# would be silently miscounted, so it is an error (Llama 4's interleaved layers, for one).
_MOE_STRUCTURE_KEYS = frozenset().union(*(keys for _, keys in _MOE_STYLES.values())) | {
    "interleave_moe_layer_step", "intermediate_size_mlp", "moe_layers", "num_shared_experts",
}


def _mlp(cfg: _Config, hidden: int, intermediate: int, num_layers: int,
         family: _Family) -> tuple[list[int], int | None, int | None, int]:
    """(active MLP parameters of each layer, num_experts, num_experts_per_tok, parameters of one routed
    expert summed over the MoE layers)."""
    matrices = family.mlp_matrices
    dense = matrices * hidden * intermediate
    styles = [style for style, (key, _) in _MOE_STYLES.items() if cfg.is_set(key)]
    if not styles:
        return [dense] * num_layers, None, None, 0
    if len(styles) > 1:
        keys = [_MOE_STYLES[s][0] for s in styles]
        raise cfg.error(f"contradictory expert counts {keys}: expected one of them")
    style = styles[0]
    foreign = sorted(k for k in _MOE_STRUCTURE_KEYS - _MOE_STYLES[style][1] if cfg.is_set(k))
    if foreign:
        raise cfg.error(f"mixture-of-experts keys {foreign} describe a layout this parser does not count")
    experts = cfg.get_int(_MOE_STYLES[style][0])
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


def _opt_projections(cfg: _Config, hidden: int) -> int:
    """OPT's project_in / project_out (run on every token) when word_embed_proj_dim != hidden_size."""
    if cfg.model_type != "opt":
        return 0
    embed = cfg.get_int("word_embed_proj_dim", default=hidden)
    return 0 if embed == hidden else 2 * embed * hidden


_ROPE_EXTRA_KEYS = ("rope_local_base_freq", "rotary_pct", "partial_rotary_factor")


def _rope(cfg: _Config) -> tuple[float | None, str | None]:
    """(rope_theta, canonical JSON of rope_scaling); newer configs nest both in rope_parameters."""
    params = cfg.data.get("rope_parameters")
    params = dict(params) if isinstance(params, Mapping) else {}
    theta = cfg.data.get("rope_theta", params.get("rope_theta"))
    if theta is None and cfg.model_type == "gpt_neox":
        theta = cfg.data.get("rotary_emb_base")
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
    extras = {key: cfg.data[key] for key in _ROPE_EXTRA_KEYS if cfg.data.get(key) is not None}
    if extras:
        scaling = {**(scaling or {}), **extras}
    canonical = json.dumps(dict(scaling), sort_keys=True) if scaling is not None else None
    return (float(theta) if theta is not None else None), canonical
