"""ModelSpec: the KV-cache bytes and prefill FLOPs of a model, read from a Hugging Face config.json.

Formulas (docs/measurements.md), per layer and token:

* MHA / GQA / MQA: ``2 · H_kv · d_h · b`` bytes (K and V; ``b`` bytes per element).
* MLA (DeepSeek-V2/V3): ``(kv_lora_rank + qk_rope_head_dim) · b`` bytes, one latent, no factor 2.
* A sliding-window layer keeps only the last ``W`` tokens.

Conventions (chosen here, tested in tests/model/test_model_spec.py):

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
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvcopy._checks import non_negative_int, positive_int
from kvcopy.model.dtypes import dtype_itemsize, kv_dtype_name
from kvcopy.model.families import SUPPORTED_FAMILIES
from kvcopy.model.hf_config import (
    DEFAULT_KV_DTYPE,
    FULL_ATTENTION,
    LAYER_TYPES,
    SLIDING_ATTENTION,
    read_config,
    spec_from_config,
)
from kvcopy.model.presets import PRESETS

__all__ = ["SUPPORTED_FAMILIES", "ModelSpec", "forward_costs"]


_KV_PLANES = 2  # K and V; MLA stores one latent instead
_FLOPS_PER_MAC = 2  # one multiply plus one add


# --------------------------------------------------------------------------- arguments


def _attended_pairs(cached: int, new: int, window: int | None) -> float:
    """Query-key pairs of ``new`` causal tokens after ``cached`` ones: ``∫_P^{P+n} min(t, W) dt``.

    The token at position ``t`` attends to ``min(t, W)`` positions (the continuous form of
    causal attention behind the ``n·P + n²/2`` of docs/measurements.md). No window: ``n·P + n²/2``.
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
    kv_dtype: str = DEFAULT_KV_DTYPE
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
    weight_dtype: str = DEFAULT_KV_DTYPE
    context_length: int | None = None
    tp: int = 1
    rope_theta: float | None = None
    rope_scaling: str | None = None
    source: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name: expected a non-empty string, got {self.name!r}")
        for field in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "active_params",
        ):
            positive_int(field, getattr(self, field))
        object.__setattr__(self, "kv_dtype", kv_dtype_name(self.kv_dtype, "kv_dtype"))
        object.__setattr__(self, "weight_dtype", kv_dtype_name(self.weight_dtype, "weight_dtype"))
        if self.context_length is not None:
            positive_int("context_length", self.context_length)
        positive_int("tp", self.tp)
        check_attention(self)
        layer_types, window = checked_layers(self)
        object.__setattr__(self, "layer_types", layer_types)
        object.__setattr__(self, "sliding_window", window)
        check_experts(self)
        if self.rope_theta is not None:
            theta = self.rope_theta
            if isinstance(theta, bool) or not isinstance(theta, (int, float)):
                raise TypeError(f"rope_theta: expected a positive number or None, got {type(theta).__name__}")
            if not theta > 0:
                raise ValueError(f"rope_theta: expected a positive number or None, got {self.rope_theta!r}")
            object.__setattr__(self, "rope_theta", float(self.rope_theta))
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", json.dumps(dict(self.rope_scaling), sort_keys=True))
        elif self.rope_scaling is not None and not isinstance(self.rope_scaling, str):
            raise ValueError(f"rope_scaling: expected canonical JSON, a dict or None, got {self.rope_scaling!r}")
        if not isinstance(self.source, str):
            raise ValueError(f"source: expected a string, got {self.source!r}")

    # ------------------------------------------------------------------ bytes

    @property
    def num_sliding_layers(self) -> int:
        return self.layer_types.count(SLIDING_ATTENTION)

    def _layer_token_bytes(self, dtype: torch.dtype | str | None, kv_heads: int | None = None) -> int:
        """Bytes of one token in one layer (on one rank holding ``kv_heads`` heads, MHA)."""
        itemsize = dtype_itemsize(self.kv_dtype if dtype is None else kv_dtype_name(dtype))
        if self.attention == "mla":
            assert self.kv_lora_rank is not None and self.qk_rope_head_dim is not None  # check_attention
            return (self.kv_lora_rank + self.qk_rope_head_dim) * itemsize
        heads = self.num_kv_heads if kv_heads is None else kv_heads
        return _KV_PLANES * heads * self.head_dim * itemsize

    def kv_bytes_per_token(self, dtype: torch.dtype | str | None = None) -> int:
        """KV bytes of one token in all layers, sliding ones included (docs/measurements.md ``B_tok``).

        ``dtype``: None for :attr:`kv_dtype`, else a torch.dtype or a name such as
        ``"bfloat16"``, ``"float8_e4m3fn"``; aliases bf16, fp16, fp32, fp8 (= float8_e4m3fn),
        fp8_e5m2.
        """
        return self.num_layers * self._layer_token_bytes(dtype)

    def kv_bytes(self, num_tokens: int, dtype: torch.dtype | str | None = None) -> int:
        """KV bytes of a ``num_tokens`` prefix: a sliding layer keeps ``min(num_tokens, window)``.

        (docs/measurements.md ``B_SWA``.) A config whose window is switched off has no sliding layer.
        """
        tokens = non_negative_int("num_tokens", num_tokens)
        sliding = self.num_sliding_layers
        kept = (self.num_layers - sliding) * tokens
        if sliding:
            assert self.sliding_window is not None  # checked_layers: sliding layers have a window
            kept += sliding * min(tokens, self.sliding_window)
        return kept * self._layer_token_bytes(dtype)

    def block_nbytes(self, block_tokens: int, tp: int = 1, *, dtype: torch.dtype | str | None = None) -> int:
        """Bytes of one block of ``block_tokens`` tokens, all layers, on one tensor-parallel rank.

        KV heads are split across ranks: ``num_kv_heads // tp`` per rank, ``tp`` must divide
        ``num_kv_heads`` (ValueError otherwise); with fewer heads than ranks each rank holds one
        replicated head. MLA latents are replicated on every rank. Every layer is counted,
        sliding ones too: a block holds its tokens in all layers.
        """
        tokens = positive_int("block_tokens", block_tokens)
        ranks = positive_int("tp", tp)
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
        tokens = non_negative_int("num_tokens", num_tokens)
        if self.num_experts is None:
            return 0.0
        experts, per_tok = self.num_experts, self.num_experts_per_tok
        assert per_tok is not None  # check_experts: both or neither
        return experts * (1.0 - (1.0 - per_tok / experts) ** tokens)

    def weight_bytes(self, num_tokens: int, cached_tokens: int = 0) -> int:
        """Bytes one forward of ``num_tokens`` new tokens after ``cached_tokens`` cached ones reads from memory.

        The weights it uses, once each however many tokens share them: every non-expert weight, the
        routed experts the tokens touch (:meth:`experts_touched`, at most all of them) and the LM head
        (``vocab_size · hidden_size``; read once per forward), in :attr:`weight_dtype`; plus the KV of the
        cached prefix, which attention reads (:meth:`kv_bytes`). This is what bounds a short prefill: the
        memory-bound floor of the Planner's roofline.
        """
        tokens = non_negative_int("num_tokens", num_tokens)
        dense = self.active_params - (self.num_experts_per_tok or 0) * self.expert_params
        params = dense + self.experts_touched(tokens) * self.expert_params + self.vocab_size * self.hidden_size
        return int(params * dtype_itemsize(self.weight_dtype)) + self.kv_bytes(cached_tokens)

    # ------------------------------------------------------------------ FLOPs

    def _attention_flops_per_pair(self) -> int:
        """FLOPs of one query-key pair in one layer: ``2 · H · (d_qk + d_v)`` (QKᵀ and A·V)."""
        if self.attention == "mla":
            nope, rope, d_v = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
            assert nope is not None and rope is not None and d_v is not None  # check_attention
            d_qk = nope + rope
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
        docs/measurements.md's ``F_prefill(T) = 2·N·T + 2·n_layer·d_q·T²`` at ``P = 0`` and satisfies
        ``F(P, n) = F_prefill(P + n) - F_prefill(P)``. (The published ``F_extend`` prints half this
        attention term, which would contradict its own ``F_prefill``.)
        """
        new = non_negative_int("num_tokens", num_tokens)
        cached = non_negative_int("cached_tokens", cached_tokens)
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
        ranks = positive_int("tp", tp)
        if ranks == 1:
            return self
        if self.tp != 1:
            raise ValueError(f"tp: this spec is already one of {self.tp} ranks; shard the unsharded spec")
        if self.num_attention_heads % ranks:
            raise ValueError(f"tp: {ranks} ranks cannot split {self.num_attention_heads} attention heads evenly")
        kv_heads = self.num_kv_heads
        if self.attention == "mha":
            if kv_heads >= ranks and kv_heads % ranks:
                raise ValueError(
                    f"tp: {ranks} ranks cannot split {kv_heads} KV heads evenly; expected a divisor of "
                    f"num_kv_heads, or more ranks than heads (replicated)"
                )
            kv_heads = max(1, kv_heads // ranks)
        return dataclasses.replace(
            self,
            name=f"{self.name}@tp{ranks}",
            tp=ranks,
            num_attention_heads=self.num_attention_heads // ranks,
            num_kv_heads=kv_heads,
            active_params=-(-self.active_params // ranks),
            expert_params=-(-self.expert_params // ranks),
            vocab_size=-(-self.vocab_size // ranks),
        )

    # ------------------------------------------------------------------ identity

    def identity(self) -> dict[str, Any]:
        """Everything structural (every field but ``source``), JSON-serialisable, for a CacheKey.

        ``layer_types`` comes as a list and ``rope_scaling`` as the dict its canonical JSON encodes
        (or None), the form :class:`kvcopy.cachekey.key.CacheKey` takes.
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

        How each key is read, family by family (heads, MLA, MLP and MoE layouts, sliding windows, KV
        dtype, name): kvcopy/model/hf_config.py's module documentation.
        """
        config, origin, directory = read_config(path_or_dict)
        return spec_from_config(
            cls, config, origin, name=name, fallback_name=directory, kv_dtype=kv_dtype, source=origin, assume=assume
        )

    @classmethod
    def preset(cls, name: str, *, kv_dtype: torch.dtype | str | None = None) -> ModelSpec:
        """A spec for a common model, from its public config.json embedded here (see ``source``)."""
        if name not in PRESETS:
            raise ValueError(f"preset: unknown model {name!r}; known: {', '.join(sorted(PRESETS))}")
        repo, config = PRESETS[name]
        source = f"https://huggingface.co/{repo}/blob/main/config.json"
        return spec_from_config(
            cls, config, f"preset {name!r}", name=name, fallback_name=None, kv_dtype=kv_dtype, source=source
        )

    @staticmethod
    def preset_names() -> tuple[str, ...]:
        """The names :meth:`preset` knows."""
        return tuple(sorted(PRESETS))


def forward_costs(spec: ModelSpec, new: Sequence[int], cached: Sequence[int]) -> tuple[float, float]:
    """(FLOPs, bytes read) of one forward in which request i computes ``new[i]`` tokens after ``cached[i]``:
    each request's FLOPs, the weights read once for all of them, each request's cached KV read once."""
    flops = sum(spec.prefill_flops(n, p) for n, p in zip(new, cached, strict=True))
    read = spec.weight_bytes(sum(new), 0) + sum(spec.kv_bytes(p) for p in cached)
    return float(flops), float(read)


# --------------------------------------------------------------------------- checks

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
            if getattr(spec, field) is None:
                raise ValueError(f"{field}: attention='mla' needs it, got None")
            positive_int(field, getattr(spec, field))
        assert spec.kv_lora_rank is not None and spec.qk_rope_head_dim is not None  # (just checked)
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
    experts, per_tok = spec.num_experts, spec.num_experts_per_tok
    if experts is None or per_tok is None:  # neither (checked above): a dense model
        if spec.expert_params:
            raise ValueError("expert_params: only for a mixture-of-experts spec (num_experts is None)")
        return
    if per_tok * spec.expert_params > spec.active_params:
        raise ValueError(
            f"expert_params {spec.expert_params} x num_experts_per_tok {per_tok} "
            f"exceeds active_params {spec.active_params}"
        )
    positive_int("num_experts", experts)
    positive_int("num_experts_per_tok", per_tok)
    if per_tok > experts:
        raise ValueError(f"num_experts_per_tok {per_tok} exceeds num_experts {experts}")
