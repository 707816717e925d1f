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
:class:`BlockIndex` maps those block hashes to host block ids for pool users.

Every hash is SHA-256 over a canonical byte encoding (canonical JSON, token
ids as little-endian int64): the same inputs give the same hex digests in any
process and on any machine. Nothing depends on Python's ``hash()``, object
ids, dict or set ordering, or the platform's byte order.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import torch

__all__ = ["BlockIndex", "CacheKey", "FORMAT_VERSION", "SupportsIdentity", "TokenIds", "weights_fingerprint"]

# Bumped whenever the encoding of a key or a block changes, so that hashes
# written by an older kvcopy can never match ones computed under new rules.
FORMAT_VERSION = 2
# Hashed along with the fields: a digest of some other JSON document with the
# same fields can never collide with a CacheKey's by construction.
_DOMAIN = "kvcopy.CacheKey"
# Fields of a model identity that a CacheKey carries as fields of its own,
# because serving can override them (rope scaling at serving time, an fp8 KV
# cache for a bf16 model). They are taken out of :attr:`CacheKey.model_identity`
# so the key depends on the values in effect only.
_SEPARATE_FIELDS = ("rope_theta", "rope_scaling", "kv_dtype")
# Token ids are hashed as this numpy dtype: little-endian int64 whatever the host's byte order.
_TOKEN_DTYPE = np.dtype("<i8")
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
# A block hash is a SHA-256 hex digest.
_HASH_HEX_CHARS = 64
# Hex digits of the context hash shown by repr: enough to tell keys apart by eye.
_REPR_HASH_CHARS = 12
# weights_fingerprint reads this much of a checkpoint file at every stride (and its header, size and
# name): enough to tell fine-tunes and quantisations apart without reading hundreds of GB.
_FINGERPRINT_SAMPLE_BYTES = 1 << 20
_FINGERPRINT_STRIDE_BYTES = 64 << 20
_CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")

TokenIds = Sequence[int] | np.ndarray | torch.Tensor


@runtime_checkable
class SupportsIdentity(Protocol):
    """Anything that describes a model by a JSON-serialisable dict (e.g. ``kvcopy.ModelSpec``).

    The dict should name everything about the model that shapes its KV cache:
    model name and revision, layer counts, heads, head_dim, attention kind,
    MLA dims, sliding windows, layer types, rope_theta, rope_scaling, kv_dtype.
    """

    def identity(self) -> Mapping[str, Any]: ...


class _FromModel(enum.Enum):
    """Default of an overridable field: take the value from the model identity."""

    FROM_MODEL = "from the model identity"


_FROM_MODEL = _FromModel.FROM_MODEL


# --------------------------------------------------------------------------- canonical JSON


def _canonical(value: Any, where: str) -> Any:
    """``value`` as plain JSON types whose encoding does not depend on how it was written.

    Mappings must have str keys (JSON would turn ``1`` and ``"1"`` into the same
    key); tuples become lists; numpy scalars become Python numbers; a torch
    dtype becomes its name (``"bfloat16"``); a float with an integral value
    becomes an int, so ``10000`` and ``10000.0`` encode the same; other floats
    are written as ``repr`` writes them (shortest round-trip form). NaN and
    infinities are refused, and so are sets (no order) and any other type.
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(f"{where}: expected a finite number, got {number!r}")
        return int(number) if number.is_integer() else number
    if isinstance(value, torch.dtype):
        return _dtype_name(value)
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: expected str keys, got {type(key).__name__} key {key!r}")
            out[key] = _canonical(item, f"{where}[{key!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [_canonical(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise TypeError(
        f"{where}: expected JSON-serialisable values (None, bool, int, float, str, list, dict), "
        f"got {type(value).__name__}"
    )


def _canonical_json(value: Any) -> str:
    """The one encoding every hash here is taken over (ASCII, sorted keys, no spaces)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- field checks


def _check_str(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a str, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name}: expected a non-empty str, got ''")
    return value


def _check_block_tokens(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"block_tokens: expected a positive int, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"block_tokens: expected a positive int, got {value!r}")
    return int(value)


def _check_rope_theta(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"rope_theta: expected a positive number or None, got {type(value).__name__}")
    theta = float(value)
    if not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"rope_theta: expected a positive finite number or None, got {value!r}")
    return theta


def _check_rope_scaling(value: object) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"rope_scaling: expected a dict or None, got {type(value).__name__}")
    return _canonical(value, "rope_scaling")


def _check_kv_dtype(value: object) -> str:
    if isinstance(value, torch.dtype):
        return _dtype_name(value)
    return _check_str(value, "kv_dtype")


def _fingerprint_of(value: object, name: str) -> str | None:
    """A string as given; bytes or a tensor's bytes as their SHA-256 hex; None as None."""
    if value is None:
        return None
    if isinstance(value, str):
        return _check_str(value, name)
    if isinstance(value, torch.Tensor):
        value = value.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return hashlib.sha256(bytes(value)).hexdigest()
    raise TypeError(f"{name}: expected a str, bytes, a tensor or None, got {type(value).__name__}")


def weights_fingerprint(directory: str | os.PathLike[str]) -> str:
    """A SHA-256 (hex) naming the weights in a local checkpoint directory.

    Over every checkpoint file (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.gguf``, by name): its
    name, its size, and 1 MiB at every 64 MiB of it from the start (the safetensors header included),
    so reading it costs about 1.5% of the checkpoint. Two checkpoints that differ anywhere in the
    sampled bytes (a fine-tune changes every tensor; so does a quantisation) get different
    fingerprints. FileNotFoundError without such a file.
    """
    root = Path(directory)
    files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix in _CHECKPOINT_SUFFIXES) if (
        root.is_dir()) else []
    if not files:
        raise FileNotFoundError(f"{root}: no checkpoint files ({', '.join(_CHECKPOINT_SUFFIXES)}) to fingerprint")
    digest = hashlib.sha256(b"kvcopy.weights_fingerprint/1")
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            for offset in range(0, size, _FINGERPRINT_STRIDE_BYTES):
                f.seek(offset)
                digest.update(f.read(_FINGERPRINT_SAMPLE_BYTES))
    return digest.hexdigest()


def _model_identity(model: object) -> dict[str, Any]:
    if isinstance(model, Mapping):
        identity: object = model
    elif isinstance(model, SupportsIdentity):
        identity = model.identity()
        if not isinstance(identity, Mapping):
            raise TypeError(f"model: expected identity() to return a dict, got {type(identity).__name__}")
    else:
        raise TypeError(f"model: expected a dict or an object with identity() -> dict, got {type(model).__name__}")
    if not identity:
        raise ValueError("model: expected a non-empty identity (model name, layer structure, ...), got {}")
    return _canonical(identity, "model")


# --------------------------------------------------------------------------- token ids


def _token_bytes(token_ids: TokenIds) -> bytes:
    """``token_ids`` as little-endian int64 bytes, after checking they are integers in int64 range.

    A torch tensor on a device is copied to the host first (this waits for the device).
    """
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dtype == torch.bool or token_ids.is_floating_point() or token_ids.is_complex():
            raise TypeError(f"token_ids: expected an integer tensor, got dtype {token_ids.dtype}")
        array = token_ids.detach().cpu().numpy()
    elif isinstance(token_ids, np.ndarray):
        array = token_ids
    elif isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise TypeError(
            f"token_ids: expected a sequence of ints, a numpy array or a torch tensor, got {type(token_ids).__name__}"
        )
    else:
        if not all(type(token) is int for token in token_ids):  # the common case skips the per-item checks
            for i, token in enumerate(token_ids):
                if isinstance(token, (bool, np.bool_)) or not isinstance(token, (int, np.integer)):
                    raise TypeError(f"token_ids[{i}]: expected an int, got {type(token).__name__} {token!r}")
        try:
            array = np.asarray(token_ids, dtype=np.int64)
        except OverflowError:
            i, bad = next((i, t) for i, t in enumerate(token_ids) if not _INT64_MIN <= int(t) <= _INT64_MAX)
            raise ValueError(f"token_ids[{i}]: expected an int64 value, got {bad}") from None
        return array.astype(_TOKEN_DTYPE, copy=False).tobytes()
    if array.ndim != 1:
        raise ValueError(f"token_ids: expected a 1-D array of token ids, got shape {list(array.shape)}")
    if array.dtype.kind not in "iu":
        raise TypeError(f"token_ids: expected an integer dtype, got {array.dtype}")
    if array.dtype.kind == "u" and array.dtype.itemsize == 8 and array.size and int(array.max()) > _INT64_MAX:
        raise ValueError(f"token_ids: expected int64 values, got {int(array.max())}")
    return array.astype(_TOKEN_DTYPE, copy=False).tobytes()


# --------------------------------------------------------------------------- CacheKey


class CacheKey:
    """The fingerprint of everything that makes a saved KV cache reusable.

    ``model``: a dict or an object with ``identity() -> dict`` (e.g. a
    ``kvcopy.ModelSpec``) naming the model and its layer structure; see
    :class:`SupportsIdentity`. ``weights_id``: what identifies the weights —
    a revision or commit hash, or :func:`weights_fingerprint` of a local
    checkpoint. Required unless the identity's ``name`` carries a revision
    (``"org/model@rev"``): a bare family or directory name does not identify
    weights (two fine-tunes share it), and a key built on one is a ValueError.
    ``block_tokens``: tokens per cache block. ``tokenizer``: recorded, not
    hashed (the blocks hash token ids). ``tp_rank``: which tensor-parallel
    rank's shard the cache holds; the rank count is the identity's ``tp``
    (``ModelSpec.shard``), 1 when absent. ``scales``: the KV quantisation
    scales in effect (a tensor or bytes, hashed, or the caller's fingerprint
    string); None when the cache is not scaled.

    ``rope_theta``, ``rope_scaling`` and ``kv_dtype`` default to the model
    identity's entries of those names and may be overridden (rope scaling at
    serving time can differ from the config, and an fp8 KV cache can serve a
    bf16 model). Those entries are taken out of :attr:`model_identity`: the key
    depends on the values in effect. A ``kv_dtype`` found in neither place is a
    ValueError; a missing rope entry is None. ``adapter``: an identity of the
    adapter (e.g. LoRA name plus a hash of its weights), None for the base
    model. ``scale_policy``: how KV values are scaled, e.g. ``"none"``,
    ``"per-tensor"``, ``"per-block fp8 scales"``.

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
        rope_theta: float | None | Literal[_FromModel.FROM_MODEL] = _FROM_MODEL,
        rope_scaling: Mapping[str, Any] | None | Literal[_FromModel.FROM_MODEL] = _FROM_MODEL,
    ) -> None:
        identity = _model_identity(model)
        self._tokenizer = None if tokenizer is None else _check_str(tokenizer, "tokenizer")
        self._block_tokens = _check_block_tokens(block_tokens)
        if weights_id is None:
            name = identity.get("name")
            if not (isinstance(name, str) and "@" in name.strip("@")):
                raise ValueError(f"weights_id: the model is named {name!r}, which does not identify its weights "
                                 f"(fine-tunes share a name); pass weights_id= a revision, a commit hash or "
                                 f"kvcopy.policy.cachekey.weights_fingerprint(checkpoint_dir)")
            weights_id = name
        self._weights_id = _check_str(weights_id, "weights_id")
        tp_size = identity.get("tp", 1)
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"model: expected the identity's 'tp' to be a positive int, got {tp_size!r}")
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank: expected an int in [0, {tp_size}) (the identity's tp), got {tp_rank!r}")
        self._tp_size, self._tp_rank = tp_size, tp_rank
        self._scales = _fingerprint_of(scales, "scales")
        if kv_dtype is None:
            if identity.get("kv_dtype") is None:
                raise ValueError("kv_dtype: not given and the model identity has no 'kv_dtype' entry")
            kv_dtype = identity["kv_dtype"]
        self._kv_dtype = _check_kv_dtype(kv_dtype)
        self._scale_policy = _check_str(scale_policy, "scale_policy")
        self._adapter = None if adapter is None else _check_str(adapter, "adapter")
        self._rope_theta = _check_rope_theta(identity.get("rope_theta") if rope_theta is _FROM_MODEL else rope_theta)
        self._rope_scaling = _check_rope_scaling(
            identity.get("rope_scaling") if rope_scaling is _FROM_MODEL else rope_scaling
        )
        self._model_identity = {k: v for k, v in identity.items() if k not in _SEPARATE_FIELDS}
        payload = _canonical_json(_canonical(self._fields(), "CacheKey"))
        self._digest = hashlib.sha256(payload.encode("ascii")).digest()
        self._context_hash = self._digest.hex()

    def _fields(self) -> dict[str, Any]:
        """What :attr:`context_hash` is taken over (all of :meth:`to_dict` but the hash itself)."""
        return {
            "domain": _DOMAIN,
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
        return json.loads(_canonical_json(self._model_identity))

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
        return None if self._rope_scaling is None else json.loads(_canonical_json(self._rope_scaling))

    @property
    def context_hash(self) -> str:
        """SHA-256 (hex) of the canonical JSON of every field and the format version."""
        return self._context_hash

    # ------------------------------------------------------------------ blocks

    def block_hashes(self, token_ids: TokenIds, *, parent: str | None = None,
                     extra_keys: Sequence[str | bytes | None] | None = None) -> list[str]:
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
        data = memoryview(_token_bytes(token_ids))
        if parent is None:
            prev = self._digest
        else:
            prev = _hash_bytes(parent, "parent")
        step = self._block_tokens * _TOKEN_DTYPE.itemsize
        num_blocks = len(data) // step
        if extra_keys is not None and len(extra_keys) != num_blocks:
            raise ValueError(f"extra_keys: expected one entry per full block ({num_blocks}), got {len(extra_keys)}")
        extras = [None] * num_blocks if extra_keys is None else [_extra_digest(e, i) for i, e in enumerate(extra_keys)]
        hashes: list[str] = []
        for i in range(num_blocks):
            h = hashlib.sha256(prev)
            h.update(data[i * step : (i + 1) * step])
            if extras[i] is not None:
                h.update(extras[i])
            prev = h.digest()
            hashes.append(h.hexdigest())
        return hashes

    def num_full_blocks(self, num_tokens: int) -> int:
        """How many blocks :meth:`block_hashes` hashes for ``num_tokens`` tokens."""
        return num_tokens // self._block_tokens

    # ------------------------------------------------------------------ persistence

    def to_dict(self) -> dict[str, Any]:
        """Every field, the format version and the context hash, as plain JSON types."""
        out = json.loads(_canonical_json(self._fields()))
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
        if any(k in identity for k in _SEPARATE_FIELDS):
            raise ValueError(f"data['model_identity']: must not hold {_SEPARATE_FIELDS} (they are fields of their own)")
        if identity.get("tp", 1) != data["tp_size"]:
            raise ValueError(f"data['tp_size']: {data['tp_size']!r} but the model identity's tp is "
                             f"{identity.get('tp', 1)!r}")
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
            f"CacheKey({self._context_hash[:_REPR_HASH_CHARS]}, weights_id={self._weights_id!r}, "
            f"kv_dtype={self._kv_dtype!r}, block_tokens={self._block_tokens})"
        )


def _extra_digest(value: object, index: int) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = value.encode("utf-8")
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"extra_keys[{index}]: expected str, bytes or None, got {type(value).__name__}")
    return hashlib.sha256(bytes(value)).digest()


def _hash_bytes(value: object, name: str) -> bytes:
    """The 32 digest bytes of a hex block hash, after checking its form."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a hex block hash (str), got {type(value).__name__}")
    if len(value) != _HASH_HEX_CHARS:
        raise ValueError(f"{name}: expected {_HASH_HEX_CHARS} hex digits, got {len(value)} characters")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ValueError(f"{name}: expected hex digits, got {value!r}") from None


# --------------------------------------------------------------------------- BlockIndex


class BlockIndex:
    """Host-side lookup from block hash (:meth:`CacheKey.block_hashes`) to host block id.

    One index can serve several keys (models, adapters, tokenizers): every
    block hash already names its key, so a lookup under a changed key matches
    nothing. Each hash maps to one host block and each host block holds one
    hash; :meth:`insert` refuses to remap either (remove first, and free the
    block the old mapping held). Not thread-safe: guard it with the same lock
    as the pool's allocator.
    """

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._hashes: dict[int, str] = {}

    def insert(self, hashes: Sequence[str], host_ids: Sequence[int] | np.ndarray | torch.Tensor) -> None:
        """Maps ``hashes[i]`` to ``host_ids[i]``; all or nothing.

        Re-inserting a mapping already present is a no-op. ValueError if the
        lengths differ, or a hash or host id is already mapped (here or earlier
        in the same call) to something else.
        """
        hashes = _check_hashes(hashes, "hashes")
        ids = _check_host_ids(host_ids)
        if len(hashes) != len(ids):
            raise ValueError(f"host_ids: expected {len(hashes)} ids like hashes, got {len(ids)}")
        pending: dict[str, int] = {}
        pending_hashes: dict[int, str] = {}
        for i, (h, host_id) in enumerate(zip(hashes, ids)):
            old_id = pending.get(h, self._ids.get(h))
            if old_id is not None and old_id != host_id:
                raise ValueError(f"hashes[{i}]: {h[:_REPR_HASH_CHARS]}... is already mapped to host block {old_id}")
            old_hash = pending_hashes.get(host_id, self._hashes.get(host_id))
            if old_hash is not None and old_hash != h:
                raise ValueError(
                    f"host_ids[{i}]: host block {host_id} already holds block {old_hash[:_REPR_HASH_CHARS]}..."
                )
            pending[h] = host_id
            pending_hashes[host_id] = h
        self._ids.update(pending)
        self._hashes.update(pending_hashes)

    def match(self, hashes: Iterable[str]) -> list[int]:
        """Host ids of the longest leading run of ``hashes`` present, stopping at the first miss.

        With ``hashes`` from :meth:`CacheKey.block_hashes` of a request's
        prefix, this is the reusable part of the prefix, in block order.
        """
        out: list[int] = []
        for h in hashes:
            host_id = self._ids.get(h)
            if host_id is None:
                break
            out.append(host_id)
        return out

    def remove(self, hashes: Iterable[str]) -> list[int]:
        """Drops ``hashes``; returns the host ids they held (to free), skipping hashes not present."""
        freed: list[int] = []
        for h in hashes:
            host_id = self._ids.pop(h, None)
            if host_id is not None:
                del self._hashes[host_id]
                freed.append(host_id)
        return freed

    def get(self, block_hash: str) -> int | None:
        """The host id of one block hash, or None."""
        return self._ids.get(block_hash)

    def hash_of(self, host_id: int) -> str | None:
        """The block hash a host block holds, or None (for eviction by host id)."""
        return self._hashes.get(host_id)

    def clear(self) -> None:
        self._ids.clear()
        self._hashes.clear()

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._ids

    def __repr__(self) -> str:
        return f"BlockIndex({len(self._ids)} blocks)"


def _check_hashes(hashes: Sequence[str], name: str) -> list[str]:
    if isinstance(hashes, (str, bytes)) or not isinstance(hashes, Sequence):
        raise TypeError(f"{name}: expected a sequence of hex block hashes, got {type(hashes).__name__}")
    for i, h in enumerate(hashes):
        _hash_bytes(h, f"{name}[{i}]")
    return list(hashes)


def _check_host_ids(host_ids: Sequence[int] | np.ndarray | torch.Tensor) -> list[int]:
    if isinstance(host_ids, torch.Tensor):
        if host_ids.dtype == torch.bool or host_ids.is_floating_point() or host_ids.is_complex():
            raise TypeError(f"host_ids: expected an integer tensor, got dtype {host_ids.dtype}")
        host_ids = host_ids.tolist()
    elif isinstance(host_ids, np.ndarray):
        if host_ids.dtype.kind not in "iu":
            raise TypeError(f"host_ids: expected an integer dtype, got {host_ids.dtype}")
        host_ids = host_ids.tolist()
    elif isinstance(host_ids, (str, bytes)) or not isinstance(host_ids, Sequence):
        raise TypeError(f"host_ids: expected a sequence of ints, got {type(host_ids).__name__}")
    out: list[int] = []
    for i, host_id in enumerate(host_ids):
        if isinstance(host_id, (bool, np.bool_)) or not isinstance(host_id, (int, np.integer)):
            raise TypeError(f"host_ids[{i}]: expected an int, got {type(host_id).__name__} {host_id!r}")
        if host_id < 0:
            raise ValueError(f"host_ids[{i}]: expected a non-negative host block id, got {host_id}")
        out.append(int(host_id))
    return out
