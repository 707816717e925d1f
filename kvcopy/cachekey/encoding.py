"""What a CacheKey is made of: the canonical encoding every kvcopy hash is taken over, the checks of
each field, the model identity and the weights fingerprint (kvcopy.cachekey.key uses them)."""

from __future__ import annotations

import enum
import hashlib
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from kvcopy._checks import positive_int
from kvcopy.model.dtypes import torch_name

__all__ = [
    "DOMAIN",
    "FORMAT_VERSION",
    "FROM_MODEL",
    "HASH_HEX_CHARS",
    "REPR_HASH_CHARS",
    "SEPARATE_FIELDS",
    "TOKEN_DTYPE",
    "FromModel",
    "SupportsIdentity",
    "TokenIds",
    "canonical",
    "canonical_json",
    "check_block_tokens",
    "check_kv_dtype",
    "check_rope_scaling",
    "check_rope_theta",
    "check_str",
    "extra_digest",
    "fingerprint_of",
    "hash_bytes",
    "identity_of_model",
    "token_bytes",
    "weights_fingerprint",
]

# Bumped whenever the encoding of a key or a block changes, so that hashes
# written by an older kvcopy can never match ones computed under new rules.
FORMAT_VERSION = 2
# Hashed along with the fields: a digest of some other JSON document with the
# same fields can never collide with a CacheKey's by construction.
DOMAIN = "kvcopy.CacheKey"
# Fields of a model identity that a CacheKey carries as fields of its own,
# because serving can override them (rope scaling at serving time, an fp8 KV
# cache for a bf16 model). They are taken out of :attr:`CacheKey.model_identity`
# so the key depends on the values in effect only.
SEPARATE_FIELDS = ("rope_theta", "rope_scaling", "kv_dtype")
# Token ids are hashed as this numpy dtype: little-endian int64 whatever the host's byte order.
TOKEN_DTYPE = np.dtype("<i8")
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
# A block hash is a SHA-256 hex digest.
HASH_HEX_CHARS = 64
# Hex digits of the context hash shown by repr: enough to tell keys apart by eye.
REPR_HASH_CHARS = 12
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


class FromModel(enum.Enum):
    """Default of an overridable field: take the value from the model identity."""

    FROM_MODEL = "from the model identity"


FROM_MODEL = FromModel.FROM_MODEL


# --------------------------------------------------------------------------- canonical JSON


def canonical(value: Any, where: str) -> Any:
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
        return torch_name(value)
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where}: expected str keys, got {type(key).__name__} key {key!r}")
            out[key] = canonical(item, f"{where}[{key!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [canonical(item, f"{where}[{i}]") for i, item in enumerate(value)]
    raise TypeError(
        f"{where}: expected JSON-serialisable values (None, bool, int, float, str, list, dict), "
        f"got {type(value).__name__}"
    )


def canonical_json(value: Any) -> str:
    """The one encoding every hash here is taken over (ASCII, sorted keys, no spaces)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


# --------------------------------------------------------------------------- field checks


def check_str(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a str, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name}: expected a non-empty str, got ''")
    return value


def check_block_tokens(value: object) -> int:
    return positive_int("block_tokens", value)


def check_rope_theta(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"rope_theta: expected a positive number or None, got {type(value).__name__}")
    theta = float(value)
    if not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"rope_theta: expected a positive finite number or None, got {value!r}")
    return theta


def check_rope_scaling(value: object) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"rope_scaling: expected a dict or None, got {type(value).__name__}")
    return canonical(value, "rope_scaling")


def check_kv_dtype(value: object) -> str:
    if isinstance(value, torch.dtype):
        return torch_name(value)
    return check_str(value, "kv_dtype")


def fingerprint_of(value: object, name: str) -> str | None:
    """A string as given; bytes or a tensor's bytes as their SHA-256 hex; None as None."""
    if value is None:
        return None
    if isinstance(value, str):
        return check_str(value, name)
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
    files = (
        sorted(p for p in root.iterdir() if p.is_file() and p.suffix in _CHECKPOINT_SUFFIXES) if (root.is_dir()) else []
    )
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


def identity_of_model(model: object) -> dict[str, Any]:
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
    return canonical(identity, "model")


# --------------------------------------------------------------------------- token ids


def token_bytes(token_ids: TokenIds) -> bytes:
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
        return array.astype(TOKEN_DTYPE, copy=False).tobytes()
    if array.ndim != 1:
        raise ValueError(f"token_ids: expected a 1-D array of token ids, got shape {list(array.shape)}")
    if array.dtype.kind not in "iu":
        raise TypeError(f"token_ids: expected an integer dtype, got {array.dtype}")
    if array.dtype.kind == "u" and array.dtype.itemsize == 8 and array.size and int(array.max()) > _INT64_MAX:
        raise ValueError(f"token_ids: expected int64 values, got {int(array.max())}")
    return array.astype(TOKEN_DTYPE, copy=False).tobytes()


# --------------------------------------------------------------------------- CacheKey


def extra_digest(value: object, index: int) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = value.encode("utf-8")
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"extra_keys[{index}]: expected str, bytes or None, got {type(value).__name__}")
    return hashlib.sha256(bytes(value)).digest()


def hash_bytes(value: object, name: str) -> bytes:
    """The 32 digest bytes of a hex block hash, after checking its form."""
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a hex block hash (str), got {type(value).__name__}")
    if len(value) != HASH_HEX_CHARS:
        raise ValueError(f"{name}: expected {HASH_HEX_CHARS} hex digits, got {len(value)} characters")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ValueError(f"{name}: expected hex digits, got {value!r}") from None
