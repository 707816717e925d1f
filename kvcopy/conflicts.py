"""Debug mode's check of the caller's own work against a TransferEngine's unfinished transfers.

A debug-mode engine watches the caches its transfers use (:func:`watch`). Before the caller's own work on a
watched cache (``copy_blocks`` on the engine's cache or pool, ``HostKVPool.free``), :func:`check_caller` asks
each watching engine whether an unfinished transfer still uses those blocks, and raises
:class:`TransferConflictError` if one does. It lives beside the copy core, not in the engine, because the core
calls it: the engine registers itself here, the core never imports the engine.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable

__all__ = ["TransferConflictError", "any_watched", "check_caller", "watch"]


class TransferConflictError(RuntimeError):
    """Debug mode: the caller's own work would touch a block that an unfinished transfer still uses."""


_watch_lock = threading.RLock()  # re-entrant: _unwatched may run from a collection inside watch()
# What debug-mode engines watch: a PagedKV (an engine's cache, or its pool's planes) -> the engines' checks.
_watched: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def any_watched() -> bool:
    """Whether a cache a debug-mode engine watched is still alive (the eager fast path, which skips the caller
    checks, runs only while none is)."""
    return _watched_alive[0] > 0


_watched_alive = [0]  # caches in _watched, counted without iterating it


def _unwatched() -> None:
    with _watch_lock:
        _watched_alive[0] -= 1


def watch(paged: object, side: str, engine: object) -> None:
    """Debug mode: ``engine``'s transfers use ``paged`` as its ``side``; check the caller's work on it."""
    with _watch_lock:
        if paged not in _watched:
            _watched_alive[0] += 1
            weakref.finalize(paged, _unwatched)
        _watched.setdefault(paged, weakref.WeakKeyDictionary())[engine] = side


def check_caller(what: str, paged: object, blocks: Iterable[int], *, writes: bool) -> None:
    """TransferConflictError when the caller's ``what`` reading (or writing) ``blocks`` of ``paged`` would
    touch a block that an unfinished transfer of a debug-mode engine uses. Free when nothing is watched."""
    if not _watched:
        return
    with _watch_lock:
        engines = list((_watched.get(paged) or {}).items())
    if engines:
        blocks = blocks.tolist() if hasattr(blocks, "tolist") else [int(b) for b in blocks]
    for engine, side in engines:
        found = engine.caller_conflict(side, blocks, writes=writes)
        if found is not None:
            block, transfer, verb = found
            which = f"{side} block {block}" if block >= 0 else f"{side} blocks"
            raise TransferConflictError(
                f"{what} would {'write' if writes else 'read'} {which}, which an unfinished "
                f"{transfer.direction} still {verb}; wait for that transfer first"
            )
