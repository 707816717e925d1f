"""Cache identity: when a saved KV cache is valid for a request. :class:`CacheKey` fingerprints everything
that makes a cache reusable (model and layer structure, weights, tokenizer, positional scaling, adapter, KV
dtype and scales, tensor-parallel rank) and hashes a prompt's full blocks; :class:`BlockIndex` maps those
hashes to the host blocks that hold them."""

from __future__ import annotations

from kvcopy.cachekey.index import BlockIndex
from kvcopy.cachekey.key import (
    FORMAT_VERSION,
    CacheKey,
    SupportsIdentity,
    TokenIds,
    context_hash_of,
    weights_fingerprint,
)

__all__ = [
    "FORMAT_VERSION",
    "BlockIndex",
    "CacheKey",
    "SupportsIdentity",
    "TokenIds",
    "context_hash_of",
    "weights_fingerprint",
]
