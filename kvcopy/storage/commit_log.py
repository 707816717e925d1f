"""The disk store's index: which slot holds which block hash, as an append-only log that a crash cannot tear.

A store block is valid only once its data is on disk, so the log is the
commit point (docs/decisions.md, "The disk store's commit scheme"):

1. before a slot is reused, a FREE record for it is appended and synced, so
   after a crash the slot's old hash never points at bytes being overwritten;
2. the data is written and synced;
3. a COMMIT record (slot, hash, the data's 64-bit XXH3 checksum) is appended
   and synced.

Each record carries its own CRC-32; replay stops at the first record that is
short or does not check (the tail a crash tore, or zeros) and truncates the
file there, so a later append starts on a record boundary and nothing a crash
left after it is ever read again. Appends overwrite zeros written ahead of
them, EXTEND_BYTES at a time, so their fdatasync flushes the records alone:
no change of the file's size or extents for the filesystem's journal to
commit. A COMMIT whose data is later found not to match its checksum (a lost
write the disk acknowledged) is refused when read, never returned. The log is
compacted into a fresh file (written, synced, renamed over the old one) once
it holds more than COMPACT_FACTOR records per slot.

Pure Python and os: no I/O layer of kvcopy's own (the data goes through
NIXL, kvcopy/storage/store.py).
"""

from __future__ import annotations

import heapq
import os
import string
import struct
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from kvcopy._checks import FileFormatError

__all__ = ["COMMIT", "FREE", "HASH_HEX_DIGITS", "Batch", "CommitLog", "Entry", "block_hash_of"]

MAGIC = b"KVCOPYLOG1\n\0\0\0\0\0"  # the file's first 16 bytes: format and version
COMMIT, FREE = 1, 2
# a block hash: a SHA-256 digest (32 bytes in a record), as 64 hex digits everywhere else
HASH_HEX_DIGITS = 64
_HEX_DIGITS = frozenset(string.hexdigits)
# kind, sequence number, slot, block hash (the 32 bytes of a SHA-256 hex digest), the data's XXH3-64; then the
# record's own CRC-32 over those fields (a record is 64 bytes: zlib's CRC is fast enough there).
_FIELDS = struct.Struct("<4sB3xQI32sQ")
_RECORD_MAGIC = b"KVR1"
RECORD_BYTES = _FIELDS.size + 4
# The log's file grows by this many zero bytes at a time, ahead of its appends (16,384 records): one journal
# commit per that many records, where an append that grew the file would cost one each (about 0.2 ms on ext4).
EXTEND_BYTES = 1 << 20
# Compact when the log holds this many records per slot: a compaction rewrites at most one record per slot, so
# the log stays within this factor of its live size and compacting costs a small fraction of the appends.
COMPACT_FACTOR = 8


@dataclass(frozen=True)
class Entry:
    """A committed block: its slot, its hash (hex) and the XXH3-64 checksum of its bytes."""

    slot: int
    block_hash: str
    checksum: int


def block_hash_of(value: object, name: str = "block_hashes") -> str:
    """``value`` as the store's one form of a block hash: the lowercase hex digest string of a SHA-256 (what
    CacheKey.block_hashes gives), uppercase hex digits lowered, so that a hash matches alike before and after
    a reopen (the log keeps its 32 bytes). TypeError for anything but a str (raw digest bytes, an int, None),
    ValueError for another length or a character that is no hex digit."""
    if not isinstance(value, str):
        raise TypeError(
            f"{name}: expected a block hash as a hex digest string ({HASH_HEX_DIGITS} hex digits), got "
            f"{type(value).__name__} {value!r:.80}"
        )
    if len(value) != HASH_HEX_DIGITS or not _HEX_DIGITS.issuperset(value):
        raise ValueError(
            f"{name}: expected a SHA-256 hex digest ({HASH_HEX_DIGITS} hex digits), got {len(value)} characters "
            f"{value!r:.80}"
        )
    return value.lower()


def _hash_bytes(block_hash: str) -> bytes:
    return bytes.fromhex(block_hash_of(block_hash))


def _record(kind: int, seq: int, slot: int, block_hash: bytes, checksum: int) -> bytes:
    body = _FIELDS.pack(_RECORD_MAGIC, kind, seq, slot, block_hash, checksum)
    return body + struct.pack("<I", zlib.crc32(body))


@dataclass(frozen=True)
class Batch:
    """COMMIT records encoded ahead of their append (:meth:`CommitLog.prepare`): ``entries`` and their bytes."""

    entries: list[Entry]
    payload: bytes


class CommitLog:
    """The log at ``path`` for a store of ``num_slots`` slots: replayed (and a torn tail cut off) when opened,
    created empty when missing (with ``create``; else a missing or headless log is a FileFormatError: a
    store's log is made with it, and opening it empty would forget every block). A whole record that does not
    fit the store (a slot beyond ``num_slots``, say) is a FileFormatError naming it, and nothing is cut off:
    only a tail whose records do not check (what a crash tears) is. :meth:`commit` and :meth:`free` return
    once their records are synced."""

    def __init__(self, path: str | os.PathLike[str], num_slots: int, *, create: bool = True) -> None:
        self.path = os.fspath(path)
        self.num_slots = num_slots
        self._create = create
        self._by_hash: dict[str, Entry] = {}
        self._by_slot: OrderedDict[int, Entry] = OrderedDict()  # least recently committed or used first
        self._seq = 0
        self._records = 0
        self.reordered = False  # touched since the log last recorded the order of use (compact writes it)
        self._unused: list[int] = []
        self._fd = self._open()
        self._end = self._size = os.lseek(self._fd, 0, os.SEEK_END)  # where the next record goes; the file's end
        # Every slot that holds nothing is in this min-heap (some that hold a block too, dropped when met), so a
        # put finds its free slots, lowest first, without a pass over the whole store: see :meth:`unused`.
        self._unused = [s for s in range(num_slots) if s not in self._by_slot]  # sorted: a heap

    # ------------------------------------------------------------------ replay

    def _open(self) -> int:
        if os.path.exists(self.path + ".compact"):  # a compaction a crash interrupted: the old log is whole
            os.remove(self.path + ".compact")
        if not self._create and not os.path.exists(self.path):
            raise FileFormatError(
                self.path,
                "(the file)",
                "the store's index, made with it",
                "nothing: the file is missing (opened as an empty store, every block the store holds would be lost)",
            )
        fd = os.open(self.path, os.O_RDWR | (os.O_CREAT if self._create else 0), 0o644)
        try:
            data = b""
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read()
            if len(data) < len(MAGIC) or not data.startswith(MAGIC):
                if (data and not MAGIC.startswith(data)) or not self._create:  # something else, or a torn header
                    raise FileFormatError(self.path, "magic", f"a kvcopy disk-store log, starting {MAGIC!r}", data[:16])
                os.ftruncate(fd, 0)
                os.write(fd, MAGIC)
                os.fsync(fd)
                return fd
            end = self._replay(data)
            if end < len(data):
                os.ftruncate(fd, end)  # the tail a crash tore: never read again
                os.fsync(fd)
            os.lseek(fd, end, os.SEEK_SET)
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _replay(self, data: bytes) -> int:
        """Applies every whole, checked record; returns where the last one ends."""
        at = len(MAGIC)
        while at + RECORD_BYTES <= len(data):
            body = data[at : at + _FIELDS.size]
            (check,) = struct.unpack_from("<I", data, at + _FIELDS.size)
            if zlib.crc32(body) != check:
                break
            magic, kind, seq, slot, raw_hash, checksum = _FIELDS.unpack(body)
            # a whole record (its CRC checks) that does not fit: not a torn tail; never cut off, refused
            record = f"record {(at - len(MAGIC)) // RECORD_BYTES}"
            if magic != _RECORD_MAGIC or kind not in (COMMIT, FREE):
                raise FileFormatError(self.path, record, "a COMMIT or FREE record of this format", body[:8])
            if slot >= self.num_slots:
                raise FileFormatError(
                    self.path, f"{record} slot", f"a slot below the store's {self.num_slots} (header.json)", slot
                )
            self._apply(kind, slot, raw_hash.hex(), checksum)
            self._seq = max(self._seq, seq)
            self._records += 1
            at += RECORD_BYTES
        return at

    def _apply(self, kind: int, slot: int, block_hash: str, checksum: int) -> None:
        self._apply_entry(kind, slot, Entry(slot, block_hash, checksum) if kind == COMMIT else None)

    def _apply_entry(self, kind: int, slot: int, entry: Entry | None) -> None:
        old = self._by_slot.pop(slot, None)
        if old is not None and self._by_hash.get(old.block_hash) is old:
            del self._by_hash[old.block_hash]
        if kind == COMMIT and entry is not None:
            previous = self._by_hash.get(entry.block_hash)
            if previous is not None and self._by_slot.pop(previous.slot, None) is not None:
                self._vacate(previous.slot)  # the same hash committed to another slot: the newer wins
            self._by_slot[slot] = entry
            self._by_hash[entry.block_hash] = entry
        elif old is not None:
            self._vacate(slot)

    def _vacate(self, slot: int) -> None:
        heapq.heappush(self._unused, slot)  # (during replay: a heap rebuilt once it ends)

    # ------------------------------------------------------------------ appends

    def _encode(self, records: Iterable[tuple[int, int, bytes, int]]) -> bytes:
        """Records as bytes, numbered in the order they are encoded (the number is informational: replay applies
        records in file order)."""
        out = []
        for kind, slot, raw_hash, checksum in records:
            self._seq += 1
            out.append(_record(kind, self._seq, slot, raw_hash, checksum))
        return b"".join(out)

    def _append(self, payload: bytes) -> None:
        if not payload:
            return
        end = self._end + len(payload)
        if end > self._size:  # zeros ahead, written and synced with these records
            size = -(-end // EXTEND_BYTES) * EXTEND_BYTES
            os.pwrite(self._fd, bytes(size - self._size), self._size)
            self._size = size
        os.pwrite(self._fd, payload, self._end)
        os.fdatasync(self._fd)
        self._end = end
        self._records += len(payload) // RECORD_BYTES

    def free(self, slots: Iterable[int]) -> None:
        """Forgets what ``slots`` hold, durably: call before overwriting them."""
        slots = [s for s in slots if s in self._by_slot]
        self._append(self._encode((FREE, s, bytes(32), 0) for s in slots))
        for slot in slots:
            self._apply_entry(FREE, slot, None)

    def prepare(self, entries: Iterable[Entry]) -> Batch:
        """``entries`` encoded as COMMIT records, not yet written: a put encodes them while its data is in
        flight, and :meth:`append` then only writes and syncs them."""
        entries = list(entries)
        raw = [_hash_bytes(e.block_hash) for e in entries]
        return Batch(entries, self._encode((COMMIT, e.slot, h, e.checksum) for e, h in zip(entries, raw, strict=True)))

    def append(self, batch: Batch) -> None:
        """Records ``batch`` (its data already synced), durably; then compacts if the log has grown."""
        self._append(batch.payload)
        for entry in batch.entries:
            self._apply_entry(COMMIT, entry.slot, entry)
        if self._records > COMPACT_FACTOR * max(self.num_slots, 1):
            self.compact()

    def commit(self, entries: Iterable[Entry]) -> None:
        """Records ``entries`` (their data already synced), durably: :meth:`prepare` and :meth:`append`."""
        self.append(self.prepare(entries))

    def compact(self) -> None:
        """Rewrites the log as one COMMIT per live entry (in LRU order), then renames it over the old one."""
        temporary = self.path + ".compact"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            live = list(self._by_slot.values())
            payload = MAGIC + b"".join(
                _record(COMMIT, i + 1, e.slot, _hash_bytes(e.block_hash), e.checksum) for i, e in enumerate(live)
            )
            os.write(fd, payload)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, self.path)
        directory = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself is durable
        finally:
            os.close(directory)
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_RDWR)
        self._end = self._size = len(payload)
        self._seq, self._records = len(live), len(live)
        self.reordered = False

    # ------------------------------------------------------------------ lookups

    def get(self, block_hash: str) -> Entry | None:
        return self._by_hash.get(block_hash)

    def entry_at(self, slot: int) -> Entry | None:
        """What ``slot`` holds, or None."""
        return self._by_slot.get(slot)

    def touch(self, slots: Iterable[int]) -> None:
        """Marks ``slots`` most recently used (in memory, until :meth:`compact` writes the order: after a reopen
        the order is the last compaction's, then the commits since)."""
        for slot in slots:
            if slot in self._by_slot:
                self._by_slot.move_to_end(slot)
                self.reordered = True

    def slots(self) -> list[int]:
        """The slots that hold a block, least recently used first."""
        return list(self._by_slot)

    def unused(self, count: int, skip: set[int] | dict[int, int]) -> list[int]:
        """Up to ``count`` slots that hold no block, lowest first, skipping ``skip`` (slots an unfinished put is
        writing); the slots stay unused until committed."""
        out: list[int] = []
        held: list[int] = []  # popped, still unused: pushed back (the chosen ones too, until their commit lands)
        while self._unused and len(out) < count:
            slot = heapq.heappop(self._unused)
            if slot in self._by_slot or (held and held[-1] == slot):  # holds a block now, or a repeat
                continue
            held.append(slot)
            if slot not in skip:
                out.append(slot)
        for slot in held:
            heapq.heappush(self._unused, slot)
        return out

    def least_recent(self, count: int, keep: AbstractSet[int] = frozenset()) -> list[int]:
        """Up to ``count`` occupied slots, least recently used first, skipping ``keep``."""
        out: list[int] = []
        for slot in self._by_slot:
            if len(out) == count:
                break
            if slot not in keep:
                out.append(slot)
        return out

    def __len__(self) -> int:
        return len(self._by_slot)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
