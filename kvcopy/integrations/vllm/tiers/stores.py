"""The stores of kvcopy's disk tier under its ``path``: one per identity, within one budget of bytes.

``path`` holds a folder per identity, ``kvcopy-<the CacheKey's context hash, 16 digits>``, with:

- ``identity.json``: the identity's fields (kvcopy.integrations.vllm.tiers.identity), read to say what differs
  when another identity is found; its modification time is when an engine last opened the store;
- ``lock``: held (``flock``) by the engine that has the store open, released by the kernel when that process
  ends, even by SIGKILL;
- ``capped``: present when the store was made smaller than its share beside other engines' stores;
- ``store/``: the :class:`~kvcopy.storage.DiskKVStore`, one block per row of vLLM's primary tier.

``bytes_to_use`` is the budget of ``path`` across identities. An engine's own store takes at most its share
of it (``bytes_to_use`` over vLLM's data-parallel replicas on every node, each an identity of its own) and at
most what stores other engines hold open leave. It opens its own identity's store as it is when its size is
the budget's, or smaller but made so beside other engines' stores (``capped``: it keeps its size, said in the
log; remove its folder to grow it), else makes it anew, and removes the stores of other identities that no
engine holds, least recently opened first, until its own fits. A store another engine holds open is never
removed. Everything is checked before anything is removed or made, and engines starting together on one
``path`` decide one after the other (``PATH_LOCK``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvcopy._checks import positive_int
from kvcopy.host.pool import HostKVPool
from kvcopy.integrations.vllm.tiers.identity import TierIdentity, differences
from kvcopy.storage.files import DATA
from kvcopy.storage.store import DiskKVStore

__all__ = ["FOLDER_PREFIX", "TierStore", "open_tier_store", "stores_nbytes"]

logger = logging.getLogger("kvcopy.integrations.vllm")

FOLDER_PREFIX = "kvcopy-"
IDENTITY_FILE = "identity.json"
LOCK_FILE = "lock"
# Present while the store is smaller than its share of the budget because stores other engines held open left
# no more room when it was made: it then keeps its size (and chunks) when opened alone; without it, a store
# smaller than the budget (bytes_to_use raised, fewer replicas) is made anew at the budget's size.
CAPPED_FILE = "capped"
# Held (flock) by an engine while it sizes, removes and opens stores under path, so that two engines starting
# together never count the same room nor remove a folder the other is opening. Not a FOLDER_PREFIX name.
PATH_LOCK = "kvcopy.lock"
STORE_DIR = "store"
# Digits of the context hash that name a folder: 64 bits, no two identities of one path alike.
NAME_DIGITS = 16


@dataclass
class TierStore:
    """The tier's open store, the lock that keeps it its own, and what opening it found: the stores of other
    identities (``refused``) and the ones removed for room (``removed``)."""

    store: DiskKVStore
    folder: str
    lock_fd: int
    refused: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)

    def close(self) -> None:
        """Closes the store (its IO in flight ended first), then lets go of its lock."""
        try:
            self.store.close()
        finally:
            if self.lock_fd >= 0:
                os.close(self.lock_fd)  # the lock goes with it
                self.lock_fd = -1


@dataclass
class _Other:
    folder: str
    nbytes: int
    opened: float  # when an engine last opened it
    in_use: bool


def _store_nbytes(folder: str) -> int:
    """Bytes the store in ``folder`` reserves (its data file); 0 when it has none."""
    try:
        return os.stat(os.path.join(folder, STORE_DIR, DATA)).st_size
    except OSError:
        return 0


def stores_nbytes(path: str) -> int:
    """Bytes the tier's stores under ``path`` reserve (all identities): room a new store may take back."""
    if not os.path.isdir(path):
        return 0
    folders = (os.path.join(path, n) for n in os.listdir(path) if n.startswith(FOLDER_PREFIX))
    return sum(_store_nbytes(folder) for folder in folders)


def _lock(folder: str) -> int | None:
    """The folder's lock, held (an open fd); None when another process holds it."""
    fd = os.open(os.path.join(folder, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError as err:
        os.close(fd)
        raise _unlockable(os.path.dirname(folder), err) from None
    return fd


@contextlib.contextmanager
def _deciding(path: str) -> Iterator[None]:
    """Holds ``path``'s PATH_LOCK while the caller decides; waits, saying so, for an engine that holds it."""
    lock = os.path.join(path, PATH_LOCK)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("kvcopy disk tier: waiting for another engine deciding under %s (it holds %s)", path, lock)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:
            raise _unlockable(path, err) from None
        yield
    finally:
        os.close(fd)  # the lock goes with it


def _unlockable(path: str, err: OSError) -> ValueError:
    return ValueError(f"path: {path!r} is on a filesystem where kvcopy cannot take a lock (flock: {err})")


def _others(path: str, own: str) -> list[_Other]:
    """The folders of other identities under ``path``, least recently opened first; each one no process holds
    is left locked by nobody (its lock was only tried)."""
    found = []
    for name in sorted(os.listdir(path)):
        folder = os.path.join(path, name)
        if not name.startswith(FOLDER_PREFIX) or folder == own or not os.path.isdir(folder):
            continue
        fd = _lock(folder)
        if fd is not None:
            os.close(fd)
        try:
            opened = os.stat(os.path.join(folder, IDENTITY_FILE)).st_mtime
        except OSError:
            opened = 0.0
        found.append(_Other(folder, _store_nbytes(folder), opened, in_use=fd is None))
    return sorted(found, key=lambda o: o.opened)


def _say_what_differs(others: list[_Other], identity: TierIdentity) -> None:
    """Logs, once, what differs between this identity and the most recently opened other one."""
    if not others:
        return
    latest = others[-1].folder
    try:
        with open(os.path.join(latest, IDENTITY_FILE)) as f:
            old = json.load(f)
        changed = ", ".join(differences(old, identity.fields)) or "nothing recorded"
    except (OSError, ValueError) as err:
        changed = f"its identity cannot be read ({err})"
    logger.warning(
        "kvcopy disk tier: %d store(s) under %s hold chunks of another identity, never served to this engine; "
        "the most recent differs in: %s",
        len(others),
        os.path.dirname(latest),
        changed,
    )


def open_tier_store(
    path: str, identity: TierIdentity, like: HostKVPool, bytes_to_use: int, backend: str, *, replicas: int = 1
) -> TierStore:
    """Opens (or makes) the store of ``identity`` under ``path``, within ``bytes_to_use`` across identities, its
    share of it one of ``replicas`` (see the module documentation). ValueError naming ``path`` or
    ``bytes_to_use`` when it cannot: another engine of the same identity holds the store, not one row fits, or
    the filesystem has not the room."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise ValueError(f"path: {path!r} is not a directory that can be made ({err})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"path: {path!r} is not a directory kvcopy can write")
    replicas = positive_int("replicas", replicas)
    with _deciding(path):
        return _open_own(path, identity, like, bytes_to_use, backend, replicas)


def _open_own(
    path: str, identity: TierIdentity, like: HostKVPool, bytes_to_use: int, backend: str, replicas: int
) -> TierStore:
    row_bytes = like.nbytes_per_block
    own = os.path.join(path, FOLDER_PREFIX + identity.cache_key.context_hash[:NAME_DIGITS])
    os.makedirs(own, exist_ok=True)
    lock_fd = _lock(own)
    if lock_fd is None:
        raise ValueError(f"path: another engine of the same identity has the store {own} open")
    try:
        others = _others(path, own)
        in_use = sum(o.nbytes for o in others if o.in_use)
        share = bytes_to_use // replicas
        rows = min(max(bytes_to_use - in_use, 0), share) // row_bytes
        if rows < 1:
            raise ValueError(
                f"bytes_to_use: {bytes_to_use} bytes under {path!r} hold no row of {row_bytes} bytes"
                + (f" in a share of {replicas} data-parallel replicas" if replicas > 1 else "")
                + (f" beside the {in_use} bytes of stores other engines have open" if in_use else "")
            )
        wanted = rows * row_bytes
        existing = _store_nbytes(own)
        capped = os.path.exists(os.path.join(own, CAPPED_FILE))  # made smaller beside other engines' stores
        fits = 0 < existing <= wanted and existing % row_bytes == 0 and (existing == wanted or capped)
        kept = existing if fits else 0  # reused as it is
        own_rows = kept // row_bytes if kept else rows
        if own_rows < rows:
            logger.warning(
                "kvcopy disk tier: the store in %s keeps the %d rows it was made with beside other engines' stores "
                "(the budget now allows %d); remove the folder to grow it (its chunks go with it)",
                own,
                own_rows,
                rows,
            )
        own_bytes = own_rows * row_bytes
        removable = [o for o in others if not o.in_use]
        removed, room = [], 0
        for other in removable:  # least recently opened first, until the budget holds the own store
            if in_use + own_bytes + sum(o.nbytes for o in removable if o not in removed) <= bytes_to_use:
                break
            removed.append(other)
            room += other.nbytes
        free = shutil.disk_usage(path).free + room + existing  # (the own store's bytes, when it is made anew)
        if own_bytes > free:
            raise ValueError(
                f"bytes_to_use: {bytes_to_use} bytes, but the filesystem of {path!r} has room for "
                f"{free} (free space, the own store and the stores kvcopy would remove)"
            )
        # checked: from here on, the path changes
        _say_what_differs(others, identity)
        for other in removed:
            shutil.rmtree(other.folder, ignore_errors=True)
            logger.info("kvcopy disk tier: removed %s (another identity's store) for room", other.folder)
        store = _open_or_make(own, like, own_rows, identity, backend, reuse=kept > 0)
        if own_rows < share // row_bytes:
            open(os.path.join(own, CAPPED_FILE), "w").close()
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(own, CAPPED_FILE))
        with open(os.path.join(own, IDENTITY_FILE), "w") as f:
            json.dump(identity.fields, f, indent=1, sort_keys=True)  # (its time: when it was last opened)
    except BaseException:
        os.close(lock_fd)
        raise
    return TierStore(store, own, lock_fd, [o.folder for o in others], [o.folder for o in removed])


def _open_or_make(
    folder: str, like: HostKVPool, rows: int, identity: TierIdentity, backend: str, *, reuse: bool
) -> DiskKVStore:
    """The store in ``folder``: reopened when ``reuse`` and it opens, else made anew (what was there removed)."""
    path = os.path.join(folder, STORE_DIR)
    if reuse:
        try:
            return DiskKVStore.open(path, like, cache_key=identity.cache_key, backend=backend)
        except ValueError as err:  # its files are not what a store writes: nothing of it can be served
            logger.warning("kvcopy disk tier: the store %s cannot be opened (%s); made anew", path, err)
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)
    return DiskKVStore.create(path, like, rows, cache_key=identity.cache_key, backend=backend)
