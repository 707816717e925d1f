"""The stores of kvcopy's disk tier under its ``path``: one per identity, sharing one budget of bytes by use.

``path`` holds a folder per identity, ``kvcopy-<the CacheKey's context hash, 16 digits>``, with:

- ``identity.json``: the identity's fields (kvcopy.integrations.vllm.tiers.identity), read to say what differs
  when another identity is found;
- ``lock``: held (``flock``) by the engine that has the store open, released by the kernel when that process
  ends, even by SIGKILL;
- ``used``: when an engine last used the store (nanoseconds since the epoch, and past every other store's, so
  the order is strict): written when it opens the store and when it closes it;
- ``wanting``: while the engine that holds the store has less room than its fair share and found none to take,
  the bytes it asks for;
- ``store/``: the :class:`~kvcopy.storage.DiskKVStore`, one block per row of vLLM's primary tier. Its room
  (kvcopy.storage.room: the blocks its data file backs on the disk) is what it takes of the budget.

``bytes_to_use`` is the budget of ``path`` across identities: the stores' rooms together stay within it (each
counted as its header says, or as what its data file takes on the disk when that is more: a store grown
since, open in another engine, or left by a crash; kvcopy.storage.room.room_nbytes). An
engine's store may hold up to its share of it (its cap: ``bytes_to_use`` over vLLM's data-parallel replicas on
every node, each an identity of its own). A new store has no room; it grows as it fills:

- When a cascade has more new chunks than the store has spare blocks, the IO thread tries ``path``'s lock
  (``PATH_LOCK``; held by another engine, the cascade goes within the room it has) and grows its store by an
  extent (GROW_EXTENT_BYTES, at most 1/GROW_STEPS of its cap, at least what the cascade needs), within its
  cap, into the room no store has: a ``fallocate``.
- Room the stores no engine holds can give, the tier's taker thread takes (under the lock, waited for), the
  least recently used store first: each gives back its least recently used chunks
  (kvcopy.storage.room.ClosedStore, kept open from one take to the next) and is removed once empty; one whose
  files cannot be read (it serves nothing) is removed whole, first. The taker works an extent ahead of the
  cascades, once the spare is below half an extent; a cascade left short waits for it.
- Where none is left (each other store held), the store evicts its own least recently used chunks, as a full
  store does, and asks for room (``wanting``) while it has less than its fair share: the budget over the
  engines holding a store under ``path``, within its cap.
- An engine that holds more than its fair share while another asks gives back, at its next decision, its least
  recently used chunks, down to its fair share. No engine changes a store another engine holds.
- A store that could not grow decides again once an extent's worth of new chunks has been cascaded into it, so
  a full store takes the lock once per extent.

Engines deciding at once on one ``path`` take turns on ``PATH_LOCK``, so they never count the same room twice;
at open, everything is checked before anything is made.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvcopy._checks import positive_int
from kvcopy.host.pool import HostKVPool
from kvcopy.integrations.vllm.tiers.identity import TierIdentity, differences
from kvcopy.storage.files import DATA
from kvcopy.storage.room import ClosedStore, extend_store, room_nbytes
from kvcopy.storage.store import DiskKVStore

__all__ = ["FOLDER_PREFIX", "TierStore", "open_tier_store", "stores_nbytes"]

logger = logging.getLogger("kvcopy.integrations.vllm")

FOLDER_PREFIX = "kvcopy-"
IDENTITY_FILE = "identity.json"
LOCK_FILE = "lock"
USED_FILE = "used"
WANTING_FILE = "wanting"
# Left by kvcopy before stores grew (a store made smaller beside other engines' open stores); removed on open.
CAPPED_FILE = "capped"
# Held (flock) by an engine while it sizes, takes, gives back, removes and opens stores under path, so that two
# engines never count the same room nor remove a folder the other is opening. Not a FOLDER_PREFIX name.
PATH_LOCK = "kvcopy.lock"
STORE_DIR = "store"
# Digits of the context hash that name a folder: 64 bits, no two identities of one path alike.
NAME_DIGITS = 16
# A store grows by this much at a time: each growth takes the path's lock, reads the other stores' headers and
# fallocates, a millisecond or a few on a disk busy with the cascades' writes, paid once per GiB cascaded (half a
# second of a fast disk's writes).
GROW_EXTENT_BYTES = 1 << 30
# ... and by at most this fraction of its cap, so that a small budget is taken from other identities' stores a
# few chunks at a time (their least recently used), not all at once.
GROW_STEPS = 16


@dataclass
class _Other:
    """Another identity's folder under ``path``, as found under the path's lock."""

    folder: str
    nbytes: int  # its store's room: what it takes of the budget
    used: int  # when an engine last used it (USED_FILE; 0 when unknown)
    in_use: bool  # an engine holds it
    wants: int  # bytes its engine asks for (WANTING_FILE), 0 when none
    readable: bool  # its store's files read (False: it serves nothing)


def _read_int(name: str) -> int:
    """The int a small file holds; 0 when it is missing or holds none."""
    try:
        with open(name) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def _write_int(name: str, value: int) -> None:
    """Writes ``value`` to a small file whole (a new file renamed over it); removes the file for 0."""
    if not value:
        with contextlib.suppress(FileNotFoundError):
            os.remove(name)
        return
    with open(name + ".new", "w") as f:
        f.write(str(value))
    os.replace(name + ".new", name)


def _disk_nbytes(folder: str) -> int:
    """Bytes the data file of the store in ``folder`` takes on the disk (its allocated blocks); 0 without one."""
    try:
        return os.stat(os.path.join(folder, STORE_DIR, DATA)).st_blocks * 512
    except OSError:
        return 0


def stores_nbytes(path: str) -> int:
    """Bytes the tier's stores under ``path`` take on the disk (all identities): room a new budget may count on."""
    if not os.path.isdir(path):
        return 0
    folders = (os.path.join(path, n) for n in os.listdir(path) if n.startswith(FOLDER_PREFIX))
    return sum(_disk_nbytes(folder) for folder in folders)


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
def _deciding(path: str, *, wait: bool = True, say_wait: bool = True) -> Iterator[bool]:
    """Holds ``path``'s PATH_LOCK while the caller decides, and says so (True); when an engine holds it, waits
    for it (saying so in the log with ``say_wait``: an engine starting), or, without ``wait``, yields False at
    once (the IO thread: it does not stall on an engine that replays a large index while it decides)."""
    lock = os.path.join(path, PATH_LOCK)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        held = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held = False
        except OSError as err:
            raise _unlockable(path, err) from None
        if not held and wait:
            if say_wait:
                logger.info("kvcopy disk tier: waiting for another engine deciding under %s (it holds %s)", path, lock)
            fcntl.flock(fd, fcntl.LOCK_EX)
            held = True
        yield held
    finally:
        os.close(fd)  # the lock goes with it


def _unlockable(path: str, err: OSError) -> ValueError:
    return ValueError(f"path: {path!r} is on a filesystem where kvcopy cannot take a lock (flock: {err})")


def _others(path: str, own: str) -> list[_Other]:
    """The folders of other identities under ``path``, least recently used first; each one no process holds is
    left locked by nobody (its lock was only tried)."""
    found = []
    for name in sorted(os.listdir(path)):
        folder = os.path.join(path, name)
        if not name.startswith(FOLDER_PREFIX) or folder == own or not os.path.isdir(folder):
            continue
        fd = _lock(folder)
        if fd is not None:
            os.close(fd)
        try:
            nbytes, readable = room_nbytes(os.path.join(folder, STORE_DIR)), True
        except (OSError, ValueError):  # no store, or files that are not one: it serves nothing
            nbytes, readable = _disk_nbytes(folder), False
        wants = _read_int(os.path.join(folder, WANTING_FILE)) if fd is None else 0
        used = _read_int(os.path.join(folder, USED_FILE))
        found.append(_Other(folder, nbytes, used, in_use=fd is None, wants=wants, readable=readable))
    return sorted(found, key=lambda o: o.used)


def _stamp(path: str, own: str) -> None:
    """Writes the own folder's USED_FILE: now, and past every other folder's (under PATH_LOCK: a strict order)."""
    latest = 0
    for name in os.listdir(path):
        if name.startswith(FOLDER_PREFIX):
            latest = max(latest, _read_int(os.path.join(path, name, USED_FILE)))
    _write_int(os.path.join(own, USED_FILE), max(time.time_ns(), latest + 1))


def _say_what_differs(others: list[_Other], identity: TierIdentity) -> None:
    """Logs, once, what differs between this identity and the most recently used other one."""
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


class _Taker:
    """A thread of the tier's that takes room from the stores no engine holds (``take``: TierStore.take_room,
    under the path's lock), so that the IO thread's growths find it free: ahead of need, or while a cascade
    waits. Started when first asked; a give-back of a large store (its index replayed, its chunks' holes
    punched: tens of milliseconds a GiB on a filesystem that discards what it frees) then runs beside the
    cascades, not before them."""

    def __init__(self, take: Callable[[int], None]) -> None:
        self._take = take
        self._cond = threading.Condition()
        self._asked = 0  # bytes of free room asked for, not yet taken up
        self._busy = False
        self._stopping = False
        self._thread: threading.Thread | None = None

    def ask(self, nbytes: int) -> None:
        """Asks for ``nbytes`` of free room (at least: the largest asked since it last ran)."""
        with self._cond:
            if self._stopping:
                return
            self._asked = max(self._asked, nbytes)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvcopy-disk-tier-room", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    @property
    def working(self) -> bool:
        """Whether it has room to take, or is taking it."""
        with self._cond:
            return bool(self._asked or self._busy)

    def wait(self) -> None:
        """Waits until what was asked has been taken (or could not be)."""
        with self._cond:
            while (self._asked or self._busy) and self._thread is not None and self._thread.is_alive():
                self._cond.wait()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._asked or self._stopping):
                    self._cond.wait()
                if self._stopping:
                    return
                nbytes, self._asked, self._busy = self._asked, 0, True
            try:
                self._take(nbytes)
            except Exception:  # (a store's files, a filesystem): the cascades go on within their room
                logger.exception("kvcopy disk tier: taking room from other identities' stores failed")
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def stop(self) -> None:
        """Ends the thread, once what it is taking is taken."""
        with self._cond:
            self._stopping, self._asked = True, 0
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()


@dataclass
class TierStore:
    """The tier's open store, the lock that keeps it its own, its budget, and what opening it found: the stores
    of other identities (``refused``); ``removed``: the other stores removed for room since."""

    store: DiskKVStore
    folder: str
    lock_fd: int
    path: str
    bytes_to_use: int
    row_bytes: int  # a block's (a chunk's) bytes
    cap: int  # the most blocks the store may take: its share of the budget
    refused: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    # new chunks to cascade before deciding again, after a decision that found no room
    countdown: int = field(default=0, init=False)
    asking: bool = field(default=False, init=False)  # below its fair share and left short: it asks for room
    asked: int = field(default=0, init=False)  # the bytes its WANTING_FILE says (written when that changes)
    # the other store it takes room from, kept open between decisions (opening one replays its index), and its
    # USED_FILE's stamp then (another stamp: an engine has opened it since)
    victim: ClosedStore | None = field(default=None, init=False)
    victim_used: int = field(default=0, init=False)
    takeable: bool = field(default=False, init=False)  # the last look found stores no engine holds
    free_seen: int = field(default=0, init=False)  # the room no store had after the last decision, bytes
    taker: _Taker = field(init=False)

    def __post_init__(self) -> None:
        self.taker = _Taker(self.take_room)

    @property
    def extent(self) -> int:
        """Blocks a store grows by at a time (at least; more when a cascade needs more)."""
        return max(1, min(GROW_EXTENT_BYTES // self.row_bytes, self.cap // GROW_STEPS))

    def room_for(self, new: int) -> None:
        """Makes room for a cascade of ``new`` chunks the store does not hold (see the module): nothing while the
        store has that many spare blocks; else grows it into the room no store has (the path's lock tried, not
        waited for), waiting for the taker thread where stores no engine holds can give room; or asks for room,
        or gives back room another engine asks for. What it could not get, the cascade takes by evicting the
        store's own least recently used chunks. Then, once the spare is below half an extent, the taker frees
        the next extent's room ahead, while the cascades use the spare."""
        store = self.store
        short = new - store.spare
        if short > 0 and self.countdown > 0:
            self.countdown -= new
        elif short > 0:
            grown, decided = self._try_decide(short)
            if not decided and self.taker.working:  # the lock is the taker's, taking room ahead: wait for it
                self.taker.wait()
                grown, decided = self._try_decide(short)
            if decided and grown < short and self.takeable:  # room the taker can free: the cascade waits for it
                self.taker.ask(min(self.cap - store.room, max(short - grown, self.extent)) * self.row_bytes)
                self.taker.wait()
                more, decided = self._try_decide(short - grown)
                grown += more
            # a store at its share that could not grow (or found the path's lock held) decides again an extent
            # later; one below its share and left short, at once
            self.countdown = self.extent if grown < short and not (decided and self.asking) else 0
        ahead = self.takeable and store.room < self.cap and self.free_seen < self.extent * self.row_bytes
        if ahead and store.spare - new < self.extent // 2:
            self.taker.ask(min(self.cap - store.room, self.extent) * self.row_bytes)

    def _try_decide(self, short: int) -> tuple[int, bool]:
        """A decision, if the path's lock is free now: (blocks grown, whether it decided)."""
        with _deciding(self.path, wait=False) as deciding:
            return (self._decide(short) if deciding else 0), deciding

    def _decide(self, short: int) -> int:
        """One decision under the path's lock for a cascade ``short`` blocks short; returns the blocks the store
        grew by (into the room no store has: the taker thread takes from other stores)."""
        store, row_bytes = self.store, self.row_bytes
        others = _others(self.path, self.folder)
        held = [o for o in others if o.in_use]
        fair = min(self.cap, self.bytes_to_use // (1 + len(held)) // row_bytes)
        asked = sum(o.wants for o in held)
        free = self.bytes_to_use - store.room * row_bytes - sum(o.nbytes for o in others)
        self.takeable = any(not o.in_use for o in others)
        grown = 0
        if asked and store.room >= fair:
            # others ask and this engine has its share: it takes nothing, and gives back what they lack
            lack = asked - max(free, 0)
            give = min(store.room - fair, -(-lack // row_bytes)) if lack > 0 else 0
            if give:
                try:
                    evicted = store.give_back(give)
                except ValueError:  # (its chunks in use by puts and gets in flight: at a later decision)
                    pass
                else:
                    logger.info(
                        "kvcopy disk tier: %s gave back %d blocks (%d chunks evicted) to engines asking for room",
                        self.folder,
                        give,
                        evicted,
                    )
        else:
            step = min(self.cap - store.room, max(short, self.extent))
            grown = min(step, max(free, 0) // row_bytes)
            if grown:
                try:
                    store.grow(grown)
                except OSError as err:  # the filesystem is fuller than the budget: the cascade evicts instead
                    logger.warning("kvcopy disk tier: %s could not grow by %d blocks: %s", self.folder, grown, err)
                    grown = 0
        self.free_seen = free - grown * row_bytes
        # it asks once it is left short below its share with no other store to take from, until it has its share
        self.asking = store.room < fair and not self.takeable and (self.asking or grown < short)
        asking = (fair - store.room) * row_bytes if self.asking else 0
        if asking != self.asked:  # (a file written only when it changes: a rename costs milliseconds under load)
            _write_int(os.path.join(self.folder, WANTING_FILE), asking)
            self.asked = asking
        return grown

    def take_room(self, nbytes: int) -> None:
        """On the taker thread: makes the room no store has reach ``nbytes`` (within the budget), under the path's
        lock (waited for), by taking from the stores no engine holds, the unreadable first, then the least
        recently used."""
        row_bytes = self.row_bytes
        with _deciding(self.path, say_wait=False):
            others = _others(self.path, self.folder)
            free = self.bytes_to_use - self.store.room * row_bytes - sum(o.nbytes for o in others)
            unheld = sorted((o for o in others if not o.in_use), key=lambda o: (o.readable, o.used))
            for other in unheld:
                if free >= nbytes:
                    break
                free += self._take(other, nbytes - max(free, 0))
            self.takeable = any(not o.in_use and o.folder not in self.removed for o in others)
            self.free_seen = free

    def _take(self, other: _Other, nbytes: int) -> int:
        """Takes at least ``nbytes`` of room from ``other``, a store no engine held when found: its least
        recently used chunks given back, it removed once empty (or whole when its files cannot be read, or its
        filesystem cannot punch holes). Returns the bytes freed; 0 when an engine has opened it since."""
        fd = _lock(other.folder)
        if fd is None:
            return 0
        try:
            if other.readable:
                try:
                    victim = self._opened(other)
                    freed, left = victim.give_back(nbytes), victim.held
                except (OSError, ValueError) as err:  # no chunk of it can go alone: the store goes
                    logger.warning("kvcopy disk tier: %s cannot give back room by chunks (%s)", other.folder, err)
                else:
                    if left:
                        logger.info(
                            "kvcopy disk tier: took %d bytes from %s (another identity's store, used least "
                            "recently): its least recently used chunks evicted, %d left",
                            freed,
                            other.folder,
                            left,
                        )
                        return freed
            self._drop_victim()
            shutil.rmtree(other.folder, ignore_errors=True)
            self.removed.append(other.folder)
            logger.info("kvcopy disk tier: removed %s (another identity's store, empty or unreadable)", other.folder)
            return other.nbytes
        finally:
            os.close(fd)

    def _opened(self, other: _Other) -> ClosedStore:
        """``other``'s store opened to give back room: the one kept from the last decision when it is the same,
        unchanged since (and opened by no engine since: the same USED_FILE stamp), else opened anew."""
        path = os.path.join(other.folder, STORE_DIR)
        victim = self.victim
        if victim is not None and (victim.path != path or self.victim_used != other.used or not victim.unchanged()):
            self._drop_victim()
        if self.victim is None:
            self.victim, self.victim_used = ClosedStore(path), other.used
        return self.victim

    def _drop_victim(self) -> None:
        if self.victim is not None:
            self.victim.close()
            self.victim = None

    def close(self) -> None:
        """Closes the store (its IO in flight ended first), records its last use, then lets go of its lock."""
        self.taker.stop()
        self._drop_victim()
        try:
            self.store.close()
        finally:
            if self.lock_fd >= 0:
                try:
                    _write_int(os.path.join(self.folder, WANTING_FILE), 0)
                    with _deciding(self.path, say_wait=False):
                        _stamp(self.path, self.folder)
                except (OSError, ValueError):  # (its last use unrecorded: it counts from its last decision)
                    pass
                finally:
                    os.close(self.lock_fd)  # the lock goes with it
                    self.lock_fd = -1


def open_tier_store(
    path: str, identity: TierIdentity, like: HostKVPool, bytes_to_use: int, backend: str, *, replicas: int = 1
) -> TierStore:
    """Opens (or makes) the store of ``identity`` under ``path``, within ``bytes_to_use`` across identities, its
    cap one of ``replicas`` shares of it (see the module documentation). ValueError naming ``path`` or
    ``bytes_to_use`` when it cannot: another engine of the same identity holds the store, or not one row fits
    its share."""
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
        share = bytes_to_use // replicas
        cap = share // row_bytes
        if cap < 1:
            raise ValueError(
                f"bytes_to_use: {bytes_to_use} bytes under {path!r} hold no row of {row_bytes} bytes"
                + (f" in a share of {replicas} data-parallel replicas" if replicas > 1 else "")
            )
        others = _others(path, own)
        # checked: from here on, the path changes
        _say_what_differs(others, identity)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(own, CAPPED_FILE))
        store = _open_or_make(os.path.join(own, STORE_DIR), like, cap, identity, backend)
        try:
            if store.room > cap:  # a lowered budget, or more replicas: its least recently used chunks go
                evicted = store.give_back(store.room - cap)
                logger.info("kvcopy disk tier: %s gave back room above its share (%d chunks evicted)", own, evicted)
            with open(os.path.join(own, IDENTITY_FILE), "w") as f:
                json.dump(identity.fields, f, indent=1, sort_keys=True)
            _write_int(os.path.join(own, WANTING_FILE), 0)
            _stamp(path, own)
        except BaseException:
            store.close()
            raise
    except BaseException:
        os.close(lock_fd)
        raise
    return TierStore(store, own, lock_fd, path, bytes_to_use, row_bytes, cap, [o.folder for o in others])


def _open_or_make(path: str, like: HostKVPool, cap: int, identity: TierIdentity, backend: str) -> DiskKVStore:
    """The store at ``path``, its blocks raised to ``cap`` (a raised budget: holes, its chunks kept); made anew
    with no room when there is none or its files are not a store's (nothing of it can be served)."""
    if os.path.isdir(path):
        try:
            extend_store(path, cap)
            return DiskKVStore.open(path, like, cache_key=identity.cache_key, backend=backend)
        except ValueError as err:
            logger.warning("kvcopy disk tier: the store %s cannot be opened (%s); made anew", path, err)
        shutil.rmtree(path, ignore_errors=True)
    return DiskKVStore.create(path, like, cap, cache_key=identity.cache_key, backend=backend, room=0)
