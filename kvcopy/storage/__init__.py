"""Tiers below host RAM: a persistent disk store of KV blocks (issue [disk]; in progress).

So far the store's index, :mod:`kvcopy.storage._commit_log`: which slot holds which block hash, committed
only after the block's data is on disk, as an append-only log a crash cannot tear.
"""

from __future__ import annotations

__all__: list[str] = []
