"""What makes a tier's stored chunks reusable: everything in vLLM's configuration that changes a chunk's bytes.

vLLM's own ``fs`` tier names its directory after the model path string, the KV-cache dtype, tp/pp, tokens per
hash and the layer groups, so a restart under another RoPE scaling (``hf_overrides``), another ``rope_theta`` or
an edited config.json at the same path serves the old chunks (docs/engines.md). kvcopy's disk tier keys its
store with a :class:`~kvcopy.CacheKey` over:

- the model: its name or path, revision and code revision (the weights' identity: a weights file changed in
  place without a new revision is not seen; say so with ``cache_key_extra``), the contents of its config as vLLM
  resolved it (``hf_overrides`` applied: rope scaling and theta, layer structure) and ``hf_overrides`` itself;
- the tokenizer: its name, revision and mode;
- the dtype, the KV-cache dtype and the quantization;
- the layer groups (tokens per block, layer names, sliding window), tokens per hash and ``blocks_per_chunk``;
- the row layout (a row's bytes, the bytes of a chunk, the page per worker, the KV-cache layout,
  ``canonical_layout``, ``replicated_layout``);
- tp, pp, pcp, dcp, the data-parallel index and the rank;
- ``cache_key_extra``: what the tier's own configuration adds (a weights fingerprint, say).

The model's config is the engine's :class:`vllm.config.VllmConfig`: vLLM gives a spec only an
``OffloadingConfig``, so the tier takes the config current in the process (as vLLM's workers set it) or else
the one vLLM's scheduler-side connector was built with (found on the call stack that builds the tier). Where
neither is found the key holds a fresh random value: the tier serves what it stored in this process and
nothing across a restart, and says so once.
"""

from __future__ import annotations

import inspect
import json
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvcopy.cachekey.key import CacheKey

__all__ = ["TierIdentity", "differences", "engine_vllm_config", "tier_identity"]

logger = logging.getLogger("kvcopy.integrations.vllm")

# How many callers up the stack the tier looks for the engine's VllmConfig: the scheduler-side connector that
# builds the spec's manager, and through it the tier, is 4 to 6 calls above the tier's constructor.
_CALLERS_SEARCHED = 16
# Entries of a model config that do not change a KV block's bytes, left out so that upgrading transformers is not
# a new identity.
_CONFIG_ENTRIES_IGNORED = ("transformers_version",)


@dataclass(frozen=True)
class TierIdentity:
    """The fields of a tier's identity (plain JSON: written beside its store, compared with another store's to
    say what differs) and the CacheKey over them."""

    fields: dict[str, Any]
    cache_key: CacheKey
    known: bool  # False: the engine's VllmConfig was not found (a fresh random key)


def engine_vllm_config() -> Any | None:
    """The engine's VllmConfig: the one current in this process, else the first ``vllm_config`` a caller holds
    (within _CALLERS_SEARCHED calls); None when neither is found."""
    from vllm.config import VllmConfig, get_current_vllm_config_or_none

    current = get_current_vllm_config_or_none()
    if current is not None:
        return current
    frame = inspect.currentframe()
    try:
        for _ in range(_CALLERS_SEARCHED):
            if frame is None:
                break
            candidate = frame.f_locals.get("vllm_config")
            if isinstance(candidate, VllmConfig):
                return candidate
            frame = frame.f_back
    finally:
        del frame  # a frame held in a local keeps its whole stack alive
    return None


def _plain(value: Any) -> Any:
    """``value`` as plain JSON types (anything else by its repr), keys sorted."""
    return json.loads(json.dumps(value, sort_keys=True, default=repr))


def _model_fields(vllm_config: Any) -> dict[str, Any]:
    model = vllm_config.model_config
    hf_config = {k: v for k, v in model.hf_config.to_dict().items() if k not in _CONFIG_ENTRIES_IGNORED}
    overrides = model.hf_overrides
    return {
        "model": str(model.model),
        "revision": model.revision,
        "code_revision": model.code_revision,
        "hf_config": _plain(hf_config),
        "hf_overrides": repr(overrides) if callable(overrides) else _plain(overrides),
        "tokenizer": {
            "name": str(model.tokenizer),
            "revision": model.tokenizer_revision,
            "mode": str(model.tokenizer_mode),
        },
        "dtype": str(model.dtype),
        "quantization": model.quantization,
        "cache_dtype": str(vllm_config.cache_config.cache_dtype),
    }


def tier_identity(offloading_spec: Any, row_bytes: int, cache_key_extra: str | None) -> TierIdentity:
    """The identity of the chunks a tier of ``offloading_spec`` (rows of ``row_bytes``) stores."""
    config = offloading_spec.config
    parallel = config.parallel
    vllm_config = engine_vllm_config()
    fields: dict[str, Any] = {
        "model_name": config.model.name,
        "model_dtype": config.model.dtype,
        "groups": [
            {
                "group_id": g.group_id,
                "tokens_per_block": g.tokens_per_block,
                "layer_names": list(g.layer_names),
                "sliding_window_size_in_chunks": g.sliding_window_size_in_chunks,
            }
            for g in config.groups
        ],
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "row_layout": {
            "row_bytes": row_bytes,
            "kv_bytes_per_chunk": getattr(offloading_spec, "kv_bytes_per_chunk", None),
            "cpu_page_size_per_worker": getattr(offloading_spec, "cpu_page_size_per_worker", None),
            "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
            "kv_cache_layout": config.kv_cache_layout,
            "canonical_layout": config.canonical_layout,
            "replicated_layout": config.replicated_layout,
        },
        "parallel": {
            "tp": parallel.tp_size,
            "pp": parallel.pp_size,
            "pcp": parallel.pcp_size,
            "dcp": parallel.dcp_size,
            "data_parallel_index": parallel.data_parallel_index,
            "rank": parallel.rank,
        },
        "cache_key_extra": cache_key_extra,
    }
    if vllm_config is not None:
        fields["engine"] = _model_fields(vllm_config)
    else:
        fields["engine"] = {"unknown": uuid.uuid4().hex}  # never equal to another process's
        logger.warning(
            "kvcopy disk tier: the engine's VllmConfig was not found, so the model's config (rope scaling, "
            "hf_overrides, tokenizer, quantization) cannot be part of the store's identity; the tier serves what "
            "it stores in this process and nothing across a restart"
        )
    fields = _plain(fields)
    engine = fields["engine"]
    cache_key = CacheKey(
        {"name": str(config.model.name), "tier": fields},
        block_tokens=config.cache.tokens_per_hash * config.cache.blocks_per_chunk,
        weights_id=f"{engine.get('model', config.model.name)}@{engine.get('revision')}",
        tokenizer=None,  # (in the fields: the identity holds it)
        kv_dtype=str(engine.get("cache_dtype", config.model.dtype)),
        rope_theta=None,  # (in hf_config)
        rope_scaling=None,
    )
    return TierIdentity(fields, cache_key, known=vllm_config is not None)


def differences(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The fields that differ between two identities' fields, as dotted paths (``engine.hf_config.rope_theta``),
    sorted; a field only one has counts as differing."""
    found = []
    for key in sorted(set(old) | set(new)):
        path = f"{prefix}{key}"
        a, b = old.get(key, _MISSING), new.get(key, _MISSING)
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            found.extend(differences(a, b, f"{path}."))
        elif a != b:
            found.append(path)
    return found


_MISSING = object()
