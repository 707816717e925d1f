"""CacheKey: a stable fingerprint of everything that makes a saved KV cache reusable.

A saved cache is valid only for the exact same token prefix under the same model
configuration: model and layer structure, the weights themselves, positional
scaling (RoPE), adapter (LoRA), KV dtype, scale policy and scale values, and
the tensor-parallel rank that holds it. The tokenizer is recorded but not
hashed: the block hashes are over token ids, and the KV of the same ids is the
same whatever tokenizer produced them. A
:class:`CacheKey` hashes all of those into :attr:`CacheKey.context_hash`, and
:meth:`CacheKey.block_hashes` chains that hash through the prefix one full block
of tokens at a time, so a shared prefix matches block by block. A
:class:`~kvcopy.cachekey.index.BlockIndex` maps those block hashes to host block ids for pool users.

Every hash is SHA-256 over a canonical byte encoding (canonical JSON, token
ids as little-endian int64): the same inputs give the same hex digests in any
process and on any machine. Nothing depends on Python's ``hash()``, object
ids, dict or set ordering, or the platform's byte order.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from kvcopy._checks import non_negative_int, positive_int
from kvcopy.cachekey.encoding import (
    DOMAIN,
    FORMAT_VERSION,
    FROM_MODEL,
    REPR_HASH_CHARS,
    SEPARATE_FIELDS,
    TOKEN_DTYPE,
    FromModel,
    SupportsIdentity,
    TokenIds,
    canonical,
    canonical_json,
    check_block_tokens,
    check_kv_dtype,
    check_rope_scaling,
    check_rope_theta,
    check_str,
    extra_digest,
    fingerprint_of,
    hash_bytes,
    identity_of_model,
    token_bytes,
    weights_fingerprint,
)

# BlockIndex, which maps these hashes to host blocks, is kvcopy.cachekey.index's (the room exports both).
__all__ = ["FORMAT_VERSION", "CacheKey", "SupportsIdentity", "TokenIds", "context_hash_of", "weights_fingerprint"]


class CacheKey:
    """The fingerprint of everything that makes a saved KV cache reusable.

    Parameters:

    - ``model``: a dict or an object with ``identity() -> dict`` (e.g. a ``kvcopy.ModelSpec``) naming the
      model and its layer structure; see :class:`SupportsIdentity`.
    - ``weights_id``: what identifies the weights — a revision or commit hash, or :func:`weights_fingerprint`
      of a local checkpoint. Required unless the identity's ``name`` carries a revision (``"org/model@rev"``):
      a bare family or directory name does not identify weights (two fine-tunes share it), and a key built on
      one is a ValueError.
    - ``block_tokens``: tokens per cache block.
    - ``tokenizer``: recorded, not hashed (the blocks hash token ids).
    - ``tp_rank``: which tensor-parallel rank's shard the cache holds; the rank count is the identity's ``tp``
      (``ModelSpec.shard``), 1 when absent.
    - ``scales``: the KV quantisation scales in effect (a tensor or bytes, hashed, or the caller's
      fingerprint string); None when the cache is not scaled.
    - ``rope_theta``, ``rope_scaling``, ``kv_dtype``: default to the model identity's entries of those names
      and may be overridden (rope scaling at serving time can differ from the config, and an fp8 KV cache
      can serve a bf16 model). Those entries are taken out of :attr:`model_identity`: the key depends on the
      values in effect. A ``kv_dtype`` found in neither place is a ValueError; a missing rope entry is None.
    - ``adapter``: an identity of the adapter (e.g. LoRA name plus a hash of its weights), None for the base
      model.
    - ``scale_policy``: how KV values are scaled, e.g. ``"none"``, ``"per-tensor"``, ``"per-block fp8
      scales"``.

    There is no system-prompt field: the system prompt's tokens are the first
    tokens of the prefix, so :meth:`block_hashes` already covers it (a
    different system prompt changes the hash of every block from its first).

    All strings are compared exactly (``"bf16"`` and ``"bfloat16"`` are two
    different keys): pick one spelling, e.g. torch dtype names, which is what
    a ``torch.dtype`` passed as ``kv_dtype`` becomes. A changed field makes a
    different key, and every block hash under it differs: a lookup under it is
    a miss, never a wrong hit. Keys compare and hash by :attr:`context_hash`.
    """

    __slots__ = (
        "_adapter",
        "_block_tokens",
        "_context_hash",
        "_digest",
        "_kv_dtype",
        "_model_identity",
        "_rope_scaling",
        "_rope_theta",
        "_scale_policy",
        "_scales",
        "_tokenizer",
        "_tp_rank",
        "_tp_size",
        "_weights_id",
    )

    def __init__(
        self,
        model: SupportsIdentity | Mapping[str, Any],
        *,
        block_tokens: int,
        weights_id: str | None = None,
        tokenizer: str | None = None,
        kv_dtype: str | torch.dtype | None = None,
        scale_policy: str = "none",
        scales: str | bytes | torch.Tensor | None = None,
        adapter: str | None = None,
        tp_rank: int = 0,
        rope_theta: float | Literal[FromModel.FROM_MODEL] | None = FROM_MODEL,
        rope_scaling: Mapping[str, Any] | Literal[FromModel.FROM_MODEL] | None = FROM_MODEL,
    ) -> None:
        identity = identity_of_model(model)
        self._tokenizer = None if tokenizer is None else check_str(tokenizer, "tokenizer")
        self._block_tokens = check_block_tokens(block_tokens)
        if weights_id is None:
            name = identity.get("name")
            if not (isinstance(name, str) and "@" in name.strip("@")):
                raise ValueError(
                    f"weights_id: the model is named {name!r}, which does not identify its weights "
                    f"(fine-tunes share a name); pass weights_id= a revision, a commit hash or "
                    f"kvcopy.cachekey.key.weights_fingerprint(checkpoint_dir)"
                )
            weights_id = name
        self._weights_id = check_str(weights_id, "weights_id")
        tp_size = identity.get("tp", 1)
        tp_size = positive_int("model: the identity's 'tp'", tp_size)
        if not non_negative_int("tp_rank", tp_rank) < tp_size:
            raise ValueError(f"tp_rank: expected an int in [0, {tp_size}) (the identity's tp), got {tp_rank!r}")
        self._tp_size, self._tp_rank = tp_size, tp_rank
        self._scales = fingerprint_of(scales, "scales")
        if kv_dtype is None:
            if identity.get("kv_dtype") is None:
                raise ValueError("kv_dtype: not given and the model identity has no 'kv_dtype' entry")
            kv_dtype = identity["kv_dtype"]
        self._kv_dtype = check_kv_dtype(kv_dtype)
        self._scale_policy = check_str(scale_policy, "scale_policy")
        self._adapter = None if adapter is None else check_str(adapter, "adapter")
        self._rope_theta = check_rope_theta(identity.get("rope_theta") if rope_theta is FROM_MODEL else rope_theta)
        self._rope_scaling = check_rope_scaling(
            identity.get("rope_scaling") if rope_scaling is FROM_MODEL else rope_scaling
        )
        self._model_identity = {k: v for k, v in identity.items() if k not in SEPARATE_FIELDS}
        payload = canonical_json(canonical(self._fields(), "CacheKey"))
        self._digest = hashlib.sha256(payload.encode("ascii")).digest()
        self._context_hash = self._digest.hex()

    def _fields(self) -> dict[str, Any]:
        """What :attr:`context_hash` is taken over (all of :meth:`to_dict` but the hash itself)."""
        return {
            "domain": DOMAIN,
            "format": FORMAT_VERSION,
            "model_identity": self._model_identity,
            "weights_id": self._weights_id,
            "rope_theta": self._rope_theta,
            "rope_scaling": self._rope_scaling,
            "adapter": self._adapter,
            "kv_dtype": self._kv_dtype,
            "scale_policy": self._scale_policy,
            "scales": self._scales,
            "tp_size": self._tp_size,
            "tp_rank": self._tp_rank,
            "block_tokens": self._block_tokens,
        }

    # ------------------------------------------------------------------ fields

    @property
    def model_identity(self) -> dict[str, Any]:
        """The model identity in canonical form, without rope_theta, rope_scaling and kv_dtype (a copy)."""
        return json.loads(canonical_json(self._model_identity))

    @property
    def tokenizer(self) -> str | None:
        """The tokenizer recorded with the key (not part of its hash)."""
        return self._tokenizer

    @property
    def weights_id(self) -> str:
        return self._weights_id

    @property
    def tp_rank(self) -> int:
        return self._tp_rank

    @property
    def tp_size(self) -> int:
        return self._tp_size

    @property
    def scales(self) -> str | None:
        """The fingerprint of the KV scales in effect, or None."""
        return self._scales

    @property
    def block_tokens(self) -> int:
        return self._block_tokens

    @property
    def kv_dtype(self) -> str:
        return self._kv_dtype

    @property
    def scale_policy(self) -> str:
        return self._scale_policy

    @property
    def adapter(self) -> str | None:
        return self._adapter

    @property
    def rope_theta(self) -> float | None:
        return self._rope_theta

    @property
    def rope_scaling(self) -> dict[str, Any] | None:
        """The rope scaling in effect, in canonical form (a copy), or None."""
        return None if self._rope_scaling is None else json.loads(canonical_json(self._rope_scaling))

    @property
    def context_hash(self) -> str:
        """SHA-256 (hex) of the canonical JSON of every field and the format version."""
        return self._context_hash

    # ------------------------------------------------------------------ blocks

    def block_hashes(
        self, token_ids: TokenIds, *, parent: str | None = None, extra_keys: Sequence[str | bytes | None] | None = None
    ) -> list[str]:
        """The chained hash (hex) of each FULL block of ``token_ids``.

        ``h_0 = sha256(context || tokens of block 0)``,
        ``h_i = sha256(h_{i-1} || tokens of block i)``, where ``context`` and
        ``h_{i-1}`` are the 32 raw digest bytes and a block's tokens are
        ``block_tokens`` little-endian int64s. Block i's hash thus names the
        whole prefix up to its end under this key: two prefixes sharing their
        first k full blocks share the first k hashes, and a change to any
        token changes the hash of its block and of every later one.

        A trailing partial block (``len(token_ids) % block_tokens`` tokens) is
        not hashed: it cannot be reused as a block, so it gets no hash.

        ``parent``: continue a chain instead of starting one: the hash of the
        last full block already hashed (under this key), with ``token_ids``
        the tokens after it. ``key.block_hashes(t[n * b:], parent=h[n - 1])``
        equals ``key.block_hashes(t)[n:]`` when ``h = key.block_hashes(t)``.

        ``token_ids``: a sequence of ints, a 1-D integer numpy array or torch
        tensor (a device tensor is copied to the host, which waits for it);
        values must fit int64. The hashes of equal ids are the same whichever
        container or integer dtype holds them.

        ``extra_keys``: one entry per full block, hashed into that block after
        its tokens (and so into every later one): what else decides the block's
        KV, e.g. the hash of an image or audio clip whose placeholder tokens
        the block holds, or any bytes the engine gives. None (or a None entry)
        adds nothing; ``h_i = sha256(h_{i-1} || tokens || sha256(extra_i))``.
        """
        data = memoryview(token_bytes(token_ids))
        prev = self._digest if parent is None else hash_bytes(parent, "parent")
        step = self._block_tokens * TOKEN_DTYPE.itemsize
        num_blocks = len(data) // step
        if extra_keys is not None and len(extra_keys) != num_blocks:
            raise ValueError(f"extra_keys: expected one entry per full block ({num_blocks}), got {len(extra_keys)}")
        extras = [None] * num_blocks if extra_keys is None else [extra_digest(e, i) for i, e in enumerate(extra_keys)]
        hashes: list[str] = []
        for i in range(num_blocks):
            h = hashlib.sha256(prev)
            h.update(data[i * step : (i + 1) * step])
            extra = extras[i]
            if extra is not None:
                h.update(extra)
            prev = h.digest()
            hashes.append(h.hexdigest())
        return hashes

    def num_full_blocks(self, num_tokens: int) -> int:
        """How many blocks :meth:`block_hashes` hashes for ``num_tokens`` tokens."""
        return num_tokens // self._block_tokens

    # ------------------------------------------------------------------ persistence

    def to_dict(self) -> dict[str, Any]:
        """Every field, the format version and the context hash, as plain JSON types."""
        out = json.loads(canonical_json(self._fields()))
        del out["domain"]
        out["rope_theta"] = self._rope_theta  # as a float: the canonical form writes 10000.0 as 10000
        out["tokenizer"] = self._tokenizer  # recorded, not hashed
        out["context_hash"] = self._context_hash
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CacheKey:
        """The key :meth:`to_dict` described.

        ValueError for another format version, a missing or unknown field, or a
        ``context_hash`` that does not match the fields (a record written by a
        different encoding or edited by hand).
        """
        if not isinstance(data, Mapping):
            raise TypeError(f"data: expected a dict, got {type(data).__name__}")
        expected = {
            "format", "model_identity", "weights_id", "tokenizer", "rope_theta", "rope_scaling", "adapter",
            "kv_dtype", "scale_policy", "scales", "tp_size", "tp_rank", "block_tokens", "context_hash",
        }  # fmt: skip
        if data.get("format") != FORMAT_VERSION:
            raise ValueError(f"data: expected format {FORMAT_VERSION}, got {data.get('format')!r}")
        missing, unknown = expected - data.keys(), data.keys() - expected
        if missing or unknown:
            raise ValueError(f"data: missing fields {sorted(missing)}, unknown fields {sorted(map(str, unknown))}")
        identity = data["model_identity"]
        if not isinstance(identity, Mapping):
            raise TypeError(f"data['model_identity']: expected a dict, got {type(identity).__name__}")
        if any(k in identity for k in SEPARATE_FIELDS):
            raise ValueError(f"data['model_identity']: must not hold {SEPARATE_FIELDS} (they are fields of their own)")
        if identity.get("tp", 1) != data["tp_size"]:
            raise ValueError(
                f"data['tp_size']: {data['tp_size']!r} but the model identity's tp is {identity.get('tp', 1)!r}"
            )
        key = cls(
            identity,
            weights_id=data["weights_id"],
            tokenizer=data["tokenizer"],
            block_tokens=data["block_tokens"],
            kv_dtype=data["kv_dtype"],
            scale_policy=data["scale_policy"],
            scales=data["scales"],
            adapter=data["adapter"],
            tp_rank=data["tp_rank"],
            rope_theta=data["rope_theta"],
            rope_scaling=data["rope_scaling"],
        )
        if key.context_hash != data["context_hash"]:
            raise ValueError(
                f"data['context_hash']: the fields hash to {key.context_hash}, the record says {data['context_hash']!r}"
            )
        return key

    # ------------------------------------------------------------------ dunder

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CacheKey):
            return NotImplemented
        return self._context_hash == other._context_hash

    def __hash__(self) -> int:
        return hash(self._context_hash)

    def __repr__(self) -> str:
        return (
            f"CacheKey({self._context_hash[:REPR_HASH_CHARS]}, weights_id={self._weights_id!r}, "
            f"kv_dtype={self._kv_dtype!r}, block_tokens={self._block_tokens})"
        )


def context_hash_of(cache_key: object) -> str:
    """``cache_key``'s context hash, what a pool shared with a peer or kept on disk is labelled with; TypeError
    naming ``cache_key`` for anything but a CacheKey (or an object that has one)."""
    context_hash = getattr(cache_key, "context_hash", None)
    if not isinstance(context_hash, str):
        raise TypeError(f"cache_key: expected a CacheKey, got {type(cache_key).__name__}")
    return context_hash
