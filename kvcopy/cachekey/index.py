"""BlockIndex: from the block hashes of kvcopy.cachekey.key.CacheKey to host block ids."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from kvcopy.cachekey.encoding import REPR_HASH_CHARS, hash_bytes

__all__ = ["BlockIndex"]


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
        for i, (h, host_id) in enumerate(zip(hashes, ids, strict=True)):
            old_id = pending.get(h, self._ids.get(h))
            if old_id is not None and old_id != host_id:
                raise ValueError(f"hashes[{i}]: {h[:REPR_HASH_CHARS]}... is already mapped to host block {old_id}")
            old_hash = pending_hashes.get(host_id, self._hashes.get(host_id))
            if old_hash is not None and old_hash != h:
                raise ValueError(
                    f"host_ids[{i}]: host block {host_id} already holds block {old_hash[:REPR_HASH_CHARS]}..."
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
        hash_bytes(h, f"{name}[{i}]")
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
