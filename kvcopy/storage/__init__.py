"""Tiers below host RAM: a persistent disk store of KV blocks through NIXL's file backends.

:class:`DiskKVStore` (kvcopy/storage/disk.py) keeps page-first host blocks in
a directory, committed to its index (kvcopy/storage/_commit_log.py) only
after their data is on disk, so a crash never leaves a torn or foreign block
that matches. In progress (issue [disk]): the calibration of the disk link,
the planner's "reload from disk" and an engine using it are still to come.
NIXL is needed (``pip install 'kvcopy[nixl]'``).
"""

from __future__ import annotations

from .disk import CorruptBlockError, DiskKVStore, DiskTransfer

__all__ = ["CorruptBlockError", "DiskKVStore", "DiskTransfer"]
