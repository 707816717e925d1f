"""A disk store's room: the blocks of its data file that take space on the disk, grown and given back.

A store's data file is ``num_blocks`` blocks long, but only its room is backed on the disk (fallocate); the
others are holes, which take nothing. The backed blocks are the ones that hold a committed block, the ones a
put in flight writes, and spare ones (backed, holding nothing). A put takes spare blocks first, then evicts
the store's least recently used blocks within its room.

- **Growing** backs holes (the lowest first): ``posix_fallocate`` over their runs, a few microseconds, with
  no header written: what the data file takes on the disk (its allocated blocks, which the kernel counts at
  once) is the room another process counts (:func:`room_nbytes`).
- **Giving back** punches holes (``fallocate(FALLOC_FL_PUNCH_HOLE)``): the spare blocks first, then the least
  recently used blocks, each durably forgotten (its FREE record synced, kvcopy.storage.commit_log) before its
  bytes go, so no committed block ever reads the zeros of a hole; then header.json's ``room`` is lowered.
- **Closing** writes the room to the header; **opening** matches the file to it: the lowest ``room - blocks
  held`` free blocks are the spare (fallocate over them: nothing to do where they are backed already), every
  other free block is punched (nothing to do on a hole), and a room below the blocks the index holds is raised
  to them. So a crash at any point of a growth, a give-back or a put that evicted blocks (SIGKILL, or a power
  loss) leaves a store whose index is what its commit log says (a block reads as valid only through a COMMIT
  made after its data was synced), and whose data file the next open brings back within its room: blocks
  grown since the header was written are spare again if held, punched if not.

The header is rewritten whole (a new file, synced, renamed over it; its directory not synced: a power loss may
leave the previous room, which the open repairs as above). None of this changes a byte of a block the store
holds, the data file's length or its alignment: the store's reads and writes (NIXL, O_DIRECT) go on as before,
to blocks that are backed. A store no process has open can give back room too (:class:`ClosedStore`),
without its block layout or CacheKey: kvcopy's vLLM disk tier takes room from other identities' stores that
way.
"""

from __future__ import annotations

import ctypes
import errno
import heapq
import os
from collections.abc import Collection, Iterable
from typing import Any

from kvcopy.storage.commit_log import CommitLog
from kvcopy.storage.files import DATA, HEADER, INDEX, read_header, write_header

__all__ = ["ClosedStore", "Room", "extend_store", "give_back_room", "room_nbytes", "slot_runs"]

# fallocate(2)'s mode bits: free the range's blocks, keep the file's length (linux/falloc.h).
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
# The errors of a filesystem that cannot punch holes (fallocate's mode refused).
NO_HOLES = (errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS)

_libc: Any = None


def _fallocate() -> Any:
    """libc's fallocate64 (Python's os has posix_fallocate only, which never frees)."""
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate64.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        libc.fallocate64.restype = ctypes.c_int
        _libc = libc
    return _libc.fallocate64


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Frees the disk blocks under ``[offset, offset + length)`` of the file ``fd``, keeping its length: the
    range then reads zeros and takes no space. OSError (errno in NO_HOLES where the filesystem cannot)."""
    if _fallocate()(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fallocate(PUNCH_HOLE) of {length} bytes at {offset}: {os.strerror(err)}")


def slot_runs(slots: Iterable[int]) -> list[tuple[int, int]]:
    """``slots`` as runs of adjacent ones, ``(first, count)``, lowest first."""
    runs: list[tuple[int, int]] = []
    for slot in sorted(set(slots)):
        if runs and runs[-1][0] + runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((slot, 1))
    return runs


class Room:
    """The backed blocks of the store at ``path`` (its checked ``header``, its open ``index``), matched to the
    header when made (see the module). ``blocks``: the room; ``spare``: backed blocks that hold nothing. A room
    below the blocks the index holds (a growth whose header a power loss turned back) is raised to them."""

    def __init__(self, path: str, header: dict[str, Any], index: CommitLog) -> None:
        self.path = path
        self._header = header
        self._index = index
        self._block = int(header["nbytes_per_block"])
        self.num_blocks = int(header["num_blocks"])
        self.blocks = int(header["room"])
        self._written = self.blocks  # the room header.json says
        held = len(index)
        self._fd = os.open(os.path.join(path, DATA), os.O_RDWR)  # not O_DIRECT: fallocate's fallback writes bytes
        try:
            if held > self.blocks:  # a growth whose header the power loss turned back: its blocks are committed
                self._write_room(held)
            self.can_punch = self._can_punch()
            spare = self._lowest_free(self.blocks - held)
            self._spare = set(spare)
            self._heap = spare  # sorted: a heap (lowest first; stale entries skipped when popped)
            self._match_disk(spare)
        except BaseException:
            os.close(self._fd)
            raise

    @property
    def spare(self) -> int:
        """Backed blocks that hold nothing: what a put writes before it evicts."""
        return len(self._spare)

    def _can_punch(self) -> bool:
        """Whether the filesystem punches holes: tried past the file's end (nothing there to lose)."""
        try:
            punch_hole(self._fd, self.num_blocks * self._block, self._block)
        except OSError as err:
            if err.errno in NO_HOLES:
                return False
            raise
        return True

    def _lowest_free(self, count: int) -> list[int]:
        """The ``count`` lowest slots that hold no block (one pass: a full store's spare is most of its slots)."""
        out: list[int] = []
        entry_at = self._index.entry_at
        for slot in range(self.num_blocks):
            if len(out) == count:
                break
            if entry_at(slot) is None:
                out.append(slot)
        return out

    def _match_disk(self, spare: list[int]) -> None:
        """Backs the spare blocks and punches every other free one (see the module)."""
        top = spare[-1] + 1 if spare else 0  # below it, every slot is held or spare: all backed
        if top:
            try:
                os.posix_fallocate(self._fd, 0, top * self._block)
            except OSError:  # the disk filled since a growth a crash cut short: the room is what is held
                self._spare.clear()
                self._heap = []
                self._punch(spare)
                self._write_room(len(self._index))
                return
        if not self.can_punch:
            return
        held_above = sorted(s for s in self._index.slots() if s >= top)
        start = top
        for slot in [*held_above, self.num_blocks]:
            if slot > start:
                punch_hole(self._fd, start * self._block, (slot - start) * self._block)
            start = slot + 1

    def _punch(self, slots: Iterable[int]) -> None:
        if self.can_punch:
            for first, count in slot_runs(slots):
                punch_hole(self._fd, first * self._block, count * self._block)

    def _write_room(self, blocks: int) -> None:
        """Sets the room and writes it to the header (its directory not synced: a room a power loss turned back
        is what the open repairs)."""
        self._header["room"] = blocks
        write_header(self.path, self._header, sync_directory=False)
        self.blocks = self._written = blocks

    def take(self, count: int) -> list[int]:
        """Up to ``count`` spare blocks, lowest first: the caller's now (a put writes them)."""
        out: list[int] = []
        while self._heap and len(out) < count:
            slot = heapq.heappop(self._heap)
            if slot in self._spare:  # (else stale: taken or given back since)
                self._spare.discard(slot)
                out.append(slot)
        return out

    def restore(self, slots: Iterable[int], busy: Collection[int]) -> None:
        """Blocks of the room that hold nothing now (a put that ended without committing them, a discarded
        block), but those still in ``busy`` (a get in flight reads a discarded block: spare once it ends):
        spare again."""
        for slot in slots:
            if slot not in self._spare and slot not in busy and self._index.entry_at(slot) is None:
                self._spare.add(slot)
                heapq.heappush(self._heap, slot)

    def grow(self, count: int, busy: Collection[int]) -> None:
        """Backs ``count`` more blocks (holes, lowest first; ``busy``: blocks a put in flight writes, not holes),
        spare from then on. OSError when the filesystem has not the room, with the room as it was."""
        holes = self._index.unused(count, skip=set(busy) | self._spare)
        if len(holes) < count:  # (the caller checks: the room is at most num_blocks)
            raise ValueError(f"blocks: {count} more do not fit the store's {self.num_blocks} blocks")
        try:
            for first, run in slot_runs(holes):
                os.posix_fallocate(self._fd, first * self._block, run * self._block)
        except OSError as err:
            self._punch(holes)
            raise OSError(
                err.errno, f"{count} blocks ({count * self._block} bytes) more do not fit on {self.path}'s filesystem"
            ) from err
        self.blocks += count
        self._spare.update(holes)
        for slot in holes:
            heapq.heappush(self._heap, slot)

    def give_back(self, count: int, busy: Collection[int]) -> int:
        """Gives back ``count`` blocks of room: spare ones first (the highest), then the least recently used
        blocks not in ``busy``, durably forgotten before their bytes are punched. Returns how many blocks it
        evicted. ValueError when fewer are free to go; OSError (errno in NO_HOLES) where the filesystem cannot
        punch holes; either with nothing changed."""
        from_spare = sorted(self._spare)[len(self._spare) - min(count, len(self._spare)) :]
        evicted = self._index.least_recent(count - len(from_spare), keep=set(busy))
        if len(from_spare) + len(evicted) < count:
            raise ValueError(
                f"blocks: {count} to give back, but only {len(from_spare) + len(evicted)} are spare or held and "
                "not in use by a put or get"
            )
        if not self.can_punch:
            raise OSError(errno.EOPNOTSUPP, f"{self.path}'s filesystem cannot punch holes: no room can be given back")
        self._index.free(evicted)  # forgotten, durably, before their bytes go
        self._spare.difference_update(from_spare)
        self._punch([*from_spare, *evicted])
        self._write_room(self.blocks - count)  # lowered last: never less than the disk holds
        return len(evicted)

    def close(self) -> None:
        """Writes the room to the header, if it grew since it was written (an error there is the crash the next
        open repairs), and closes the file."""
        if self._fd < 0:
            return
        try:
            if self.blocks != self._written:
                self._write_room(self.blocks)
        except OSError:
            pass
        finally:
            os.close(self._fd)
            self._fd = -1


def room_nbytes(path: str) -> int:
    """Bytes of the room of the store at ``path``, as another process counts it: its header's room, or what its
    data file takes on the disk (its allocated blocks, in whole blocks) when that is more: a store that grew
    since its header was written, open in another process or left by a crash. The errors of
    :func:`kvcopy.storage.files.read_header`."""
    header = read_header(path)
    block = int(header["nbytes_per_block"])
    allocated = os.stat(os.path.join(path, DATA)).st_blocks * 512
    return max(int(header["room"]), allocated // block) * block


class ClosedStore:
    """The store at ``path``, which no process has open (kvcopy's vLLM disk tier holds its folder lock while it
    uses it), opened from its files to give back room: no NIXL agent, block layout or CacheKey. Opening replays
    its index (seconds for a store of hundreds of thousands of blocks), so a caller that takes room from it
    again and again keeps it open between, and asks :meth:`unchanged` first: its files as this object left
    them (a process that opened the store since has changed them, or made new ones). The errors of opening a
    store's files (FileFormatError, OSError)."""

    def __init__(self, path: str) -> None:
        self.path = path
        header = read_header(path)
        self._block = int(header["nbytes_per_block"])
        self._index = CommitLog(os.path.join(path, INDEX), int(header["num_blocks"]), create=False)
        try:
            self._room = Room(path, header, self._index)
        except BaseException:
            self._index.close()
            raise
        self._files = self._stat()

    def _stat(self) -> tuple[tuple[int, int, int], ...]:
        """Each file's inode, length and modification time (a rename makes another inode; an append, another
        time)."""
        stats = (os.stat(os.path.join(self.path, name)) for name in (HEADER, INDEX, DATA))
        return tuple((st.st_ino, st.st_size, st.st_mtime_ns) for st in stats)

    def unchanged(self) -> bool:
        """Whether the store's files are as this object left them."""
        try:
            return self._stat() == self._files
        except OSError:  # (removed)
            return False

    @property
    def held(self) -> int:
        """Blocks the store holds."""
        return len(self._index)

    def give_back(self, nbytes: int) -> int:
        """Gives back at least ``nbytes`` of the store's room (all of it, if it has less): its spare blocks, then
        its least recently used ones, as :meth:`Room.give_back` does. Returns the bytes given back. OSError
        (errno in NO_HOLES) where the filesystem cannot punch holes, with nothing changed."""
        count = min(self._room.blocks, -(-nbytes // self._block))
        if count:
            self._room.give_back(count, busy=())
            self._files = self._stat()
        return count * self._block

    def close(self) -> None:
        self._room.close()
        self._index.close()


def give_back_room(path: str, nbytes: int) -> tuple[int, int]:
    """Gives back at least ``nbytes`` of the room of the store at ``path``, which no process has open (see
    :class:`ClosedStore`, which this opens and closes). Returns (bytes given back, blocks it holds after)."""
    store = ClosedStore(path)
    try:
        return store.give_back(nbytes), store.held
    finally:
        store.close()


def extend_store(path: str, num_blocks: int) -> None:
    """Raises the block count of the store at ``path``, which no process has open, to ``num_blocks`` (a longer
    data file, the new blocks holes; its room unchanged); nothing when it has as many. The file first, then the
    header: a crash between leaves a data file longer than its header's blocks, which opens as before."""
    header = read_header(path)
    if num_blocks <= int(header["num_blocks"]):
        return
    os.truncate(os.path.join(path, DATA), num_blocks * int(header["nbytes_per_block"]))
    write_header(path, {**header, "num_blocks": num_blocks})
