"""Tiers below host RAM: a persistent disk store of KV blocks through NIXL's file backends.

:class:`DiskKVStore` (kvcopy/storage/store.py) keeps page-first blocks in a
directory (host pools' through NIXL's POSIX backend, a GPU cache's also
through its GDS backend), committed to its index (kvcopy/storage/commit_log.py) only
after their data is on disk, so a crash never leaves a torn or foreign block
that matches. :mod:`kvcopy.calibration.disk` measures its writes and reads into a
Profile (``kvcopy calibrate --disk``), for the Planner's
``decide(..., source="disk")``. examples/disk_prefix_cache.py is an
engine's prefix cache that survives a restart through it. NIXL is needed
(``pip install 'kvcopy[nixl]'``).
"""

from __future__ import annotations

from kvcopy.storage.store import CorruptBlockError, DiskKVStore, DiskTransfer

__all__ = ["CorruptBlockError", "DiskKVStore", "DiskTransfer"]
