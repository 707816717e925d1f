"""The disk store's index: which slot holds which block hash, as an append-only log that a crash cannot tear.

A store block is valid only once its data is on disk, so the log is the
commit point (docs/decisions.md, "The disk store's commit scheme"):

1. before a slot is reused, a FREE record for it is appended and synced, so
   after a crash the slot's old hash never points at bytes being overwritten;
2. the data is written and synced;
3. a COMMIT record (slot, hash, the data's 64-bit XXH3 checksum) is appended
   and synced.

Each record carries its own CRC-32; replay stops at the first record that is
short or does not check (the tail a crash tore) and truncates the file
there, so a later append starts on a record boundary. A COMMIT whose data is
later found not to match its checksum (a lost write the disk acknowledged) is
refused when read, never returned. The log is compacted into a fresh file
(written, synced, renamed over the old one) once it holds more than
COMPACT_FACTOR records per slot.

Pure Python and os: no I/O layer of kvcopy's own (the data goes through
NIXL, kvcopy/storage/disk.py).
"""

from __future__ import annotations

import os
import struct
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["COMMIT", "FREE", "CommitLog", "Entry"]

MAGIC = b"KVCOPYLOG1\n\0\0\0\0\0"  # the file's first 16 bytes: format and version
COMMIT, FREE = 1, 2
# kind, sequence number, slot, block hash (the 32 bytes of a SHA-256 hex digest), the data's XXH3-64; then the
# record's own CRC-32 over those fields (a record is 64 bytes: zlib's CRC is fast enough there).
_FIELDS = struct.Struct("<4sB3xQI32sQ")
_RECORD_MAGIC = b"KVR1"
RECORD_BYTES = _FIELDS.size + 4
# Compact when the log holds this many records per slot: a compaction rewrites at most one record per slot, so
# the log stays within this factor of its live size and compacting costs a small fraction of the appends.
COMPACT_FACTOR = 8


@dataclass(frozen=True)
class Entry:
    """A committed block: its slot, its hash (hex) and the XXH3-64 checksum of its bytes."""

    slot: int
    block_hash: str
    checksum: int


def _hash_bytes(block_hash: str) -> bytes:
    raw = bytes.fromhex(block_hash)
    if len(raw) != 32:
        raise ValueError(f"block_hashes: expected SHA-256 hex digests (64 hex digits), got {block_hash!r}")
    return raw


def _record(kind: int, seq: int, slot: int, block_hash: bytes, checksum: int) -> bytes:
    body = _FIELDS.pack(_RECORD_MAGIC, kind, seq, slot, block_hash, checksum)
    return body + struct.pack("<I", zlib.crc32(body))


class CommitLog:
    """The log at ``path`` for a store of ``num_slots`` slots: replayed (and a torn tail cut off) when opened,
    created empty when missing. :meth:`commit` and :meth:`free` return once their records are synced."""

    def __init__(self, path: str | os.PathLike[str], num_slots: int) -> None:
        self.path = os.fspath(path)
        self.num_slots = num_slots
        self._by_hash: dict[str, Entry] = {}
        self._by_slot: OrderedDict[int, Entry] = OrderedDict()  # least recently committed or used first
        self._seq = 0
        self._records = 0
        self._fd = self._open()

    # ------------------------------------------------------------------ replay

    def _open(self) -> int:
        if os.path.exists(self.path + ".compact"):  # a compaction a crash interrupted: the old log is whole
            os.remove(self.path + ".compact")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            data = b""
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read()
            if len(data) < len(MAGIC) or not data.startswith(MAGIC):
                if data and not MAGIC.startswith(data):  # something else, or a torn header of a fresh log
                    raise ValueError(f"{self.path}: not a kvcopy disk-store log")
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
            if magic != _RECORD_MAGIC or kind not in (COMMIT, FREE) or slot >= self.num_slots:
                break
            self._apply(kind, slot, raw_hash.hex(), checksum)
            self._seq = max(self._seq, seq)
            self._records += 1
            at += RECORD_BYTES
        return at

    def _apply(self, kind: int, slot: int, block_hash: str, checksum: int) -> None:
        old = self._by_slot.pop(slot, None)
        if old is not None and self._by_hash.get(old.block_hash) is old:
            del self._by_hash[old.block_hash]
        if kind == COMMIT:
            previous = self._by_hash.get(block_hash)
            if previous is not None:  # the same hash committed to another slot: the newer wins
                self._by_slot.pop(previous.slot, None)
            entry = Entry(slot, block_hash, checksum)
            self._by_slot[slot] = entry
            self._by_hash[block_hash] = entry

    # ------------------------------------------------------------------ appends

    def _append(self, records: Iterable[tuple[int, int, bytes, int]]) -> None:
        payload = b""
        for kind, slot, raw_hash, checksum in records:
            self._seq += 1
            payload += _record(kind, self._seq, slot, raw_hash, checksum)
        if not payload:
            return
        os.write(self._fd, payload)
        os.fsync(self._fd)
        self._records += len(payload) // RECORD_BYTES

    def free(self, slots: Iterable[int]) -> None:
        """Forgets what ``slots`` hold, durably: call before overwriting them."""
        slots = [s for s in slots if s in self._by_slot]
        self._append((FREE, s, bytes(32), 0) for s in slots)
        for slot in slots:
            self._apply(FREE, slot, "", 0)

    def commit(self, entries: Iterable[Entry]) -> None:
        """Records ``entries`` (their data already synced), durably; then compacts if the log has grown."""
        entries = list(entries)
        raw = [_hash_bytes(e.block_hash) for e in entries]
        self._append((COMMIT, e.slot, h, e.checksum) for e, h in zip(entries, raw))
        for entry in entries:
            self._apply(COMMIT, entry.slot, entry.block_hash, entry.checksum)
        if self._records > COMPACT_FACTOR * max(self.num_slots, 1):
            self.compact()

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
            os.fsync(fd)
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
        os.lseek(self._fd, 0, os.SEEK_END)
        self._seq, self._records = len(live), len(live)

    # ------------------------------------------------------------------ lookups

    def get(self, block_hash: str) -> Entry | None:
        return self._by_hash.get(block_hash)

    def entry_at(self, slot: int) -> Entry | None:
        """What ``slot`` holds, or None."""
        return self._by_slot.get(slot)

    def touch(self, slots: Iterable[int]) -> None:
        """Marks ``slots`` most recently used (in memory: after a reopen the order is the commit order)."""
        for slot in slots:
            if slot in self._by_slot:
                self._by_slot.move_to_end(slot)

    def least_recent(self, count: int, keep: set[int] = frozenset()) -> list[int]:  # type: ignore[assignment]
        """Up to ``count`` occupied slots, least recently used first, skipping ``keep``."""
        out = []
        for slot in self._by_slot:
            if len(out) == count:
                break
            if slot not in keep:
                out.append(slot)
        return out

    @property
    def occupied(self) -> set[int]:
        return set(self._by_slot)

    def __len__(self) -> int:
        return len(self._by_slot)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
