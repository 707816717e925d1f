"""The host tier: a pool of host blocks shaped like a device cache (:class:`HostKVPool`), the memory under it
(exact-size mappings, NUMA binding, page-locking in chunks) and the ids it hands out (:class:`BlockAllocator`).
Depends on the copy core's layout and ids only."""

from __future__ import annotations

from kvcopy.host.allocator import BlockAllocator
from kvcopy.host.pool import HostKVPool, HostLayout, KVLike, as_paged

__all__ = ["BlockAllocator", "HostKVPool", "HostLayout", "KVLike", "as_paged"]
