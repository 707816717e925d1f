"""DiskKVStore: KV blocks on a local disk through NIXL's file backends, persistent and never torn.

One store block is one page-first block of the pool it is laid out like. A
put writes a pool's blocks into free (or least recently used) slots in NIXL
transfers of at most 512 requests (kvcopy.storage.staging), its runs of adjacent
slots and pool ids merged into one descriptor each by kvcopy's range planner;
once the data is synced its
entries are committed to the index (kvcopy.storage.commit_log), so a block
whose put did not complete is never matched. A get reads slots back into
pool blocks in one transfer and checks each block's XXH3-64 checksum against
the one committed with it: a mismatch is a CorruptBlockError naming the
slot, never data returned as valid. Verification is on unless a get says
``verify=False``: XXH3 (python-xxhash) hashes as fast as memory reads, a
small share of a disk read (docs/measurements.md, "The disk store"; why
XXH3, and not CRC-32 or compiled threaded hashing: docs/decisions.md).

Backends (``backend=``): ``"posix"``, NIXL's POSIX backend, moves host pools'
blocks; ``"gds"``, NIXL's GDS backend (GPUDirect Storage through cuFile),
also moves a GPU cache's blocks (a PagedKV on a CUDA device) to and from the
file without the host, through a bounded page-first staging buffer on the GPU
(kvcopy.storage.staging), their checksums taken in bounded chunks on the host
(kvcopy.storage.gpu_blocks); its DMA follows no CUDA stream, so each round of a
GPU's blocks first waits for the work queued on the current stream;
``"auto"`` picks GDS for a store laid out like a GPU cache where it starts,
else POSIX. The files are the same either way: a store written through one
reopens through the other.

Room (kvcopy.storage.room): a store's data file is ``num_blocks`` blocks long, and ``room`` of them are backed
on the disk, the rest holes. A store made with ``room`` below ``num_blocks`` takes that much of the disk and
no more; :meth:`DiskKVStore.grow` backs more blocks, :meth:`DiskKVStore.give_back` frees some (its spare
blocks, then its least recently used ones, forgotten durably before their bytes go). A put fills the room,
then evicts within it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Callable, Sequence

import torch
import xxhash

from kvcopy._checks import boolean, non_negative_int, path_argument, positive_int, sequence_argument
from kvcopy.cachekey.key import context_hash_of
from kvcopy.host.pool import HostKVPool
from kvcopy.ids import BlockIds, prepare_host_ids
from kvcopy.layout import PagedKV
from kvcopy.nixl.registration import registration_of
from kvcopy.nixl.transfer import NixlTransfer, RemoteTransferError, WrittenBlocks
from kvcopy.storage.commit_log import Batch, CommitLog, Entry, block_hash_of
from kvcopy.storage.files import (
    BACKENDS,
    DATA,
    INDEX,
    create_files,
    file_agent,
    file_table,
    layout_difference,
    layout_of,
    max_blocks,
    open_data,
    read_header,
)
from kvcopy.storage.gpu_blocks import paged_checksums
from kvcopy.storage.room import Room
from kvcopy.storage.rounds import Rounds
from kvcopy.storage.staging import GDS_REQUESTS, Round, Staging, plan_rounds, staging_blocks
from kvcopy.storage.transfer import DiskTransfer

__all__ = ["BACKENDS", "CorruptBlockError", "DiskKVStore", "DiskTransfer"]


def _check_backend(backend: object) -> None:
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected one of {BACKENDS} (a str), got {type(backend).__name__} {backend!r:.80}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")


class CorruptBlockError(ValueError):
    """A block read from disk does not match the checksum committed with it. ``slots``: the store slots."""

    def __init__(self, message: str, slots: list[int]) -> None:
        super().__init__(message)
        self.slots = slots


class DiskKVStore:
    """A directory of ``num_blocks`` page-first KV blocks for one CacheKey context: see :meth:`create` and
    :meth:`open`. A context manager; not thread-safe (use it from one thread, like a KVPeer), but for
    :meth:`contains`."""

    def __init__(self, path: str, header: dict, backend: str, *, gpu: bool = False) -> None:
        """Use :meth:`create` or :meth:`open`; ``header``: the store's checked header.json; ``gpu``: laid out
        like a GPU cache (``backend="auto"`` then tries GPUDirect Storage first)."""
        self.path = path
        self.num_blocks = int(header["num_blocks"])
        self._layout = {k: header[k] for k in ("layout", "planes", "nbytes_per_block")}
        self._block_nbytes = int(header["nbytes_per_block"])
        self._index = CommitLog(os.path.join(path, INDEX), self.num_blocks, create=False)
        try:
            self._room = Room(path, header, self._index)  # the data file's backed blocks matched to its header
        except BaseException:
            self._index.close()
            raise
        plane_bytes = [int(n) for n, _ in self._layout["planes"]]
        self._fd = -1
        try:
            name = f"kvcopy-disk-{uuid.uuid4().hex[:12]}"
            self._agent, self.backend, self.queue = file_agent(name, backend, gpu=gpu)
            # GDS moves a GPU cache's blocks one plane-block per request: O_DIRECT only if each is aligned
            per_plane = plane_bytes if self.backend == "gds" else None
            self._fd, self.direct = open_data(path, self._block_nbytes, per_plane)
            size = self.num_blocks * self._block_nbytes
            self._file = self._agent.register_memory([(0, size, self._fd, "")], "FILE")
        except BaseException:  # no NIXL backend here: nothing stays open
            if self._fd >= 0:
                os.close(self._fd)
            self._room.close()
            self._index.close()
            raise
        self._table = file_table(plane_bytes)  # the file as a plane table, for kvcopy's range planner
        # each pool's NIXL registration, memory kind and device id, by id
        self._pools: dict[int, tuple[HostKVPool, object, str, int]] = {}
        self._busy: dict[int, int] = {}  # slots an unfinished put writes or get reads: never reused or evicted
        # the puts and gets NIXL may still be moving: close() ends each before it frees what their IO uses
        # (held here too, so that a transfer its caller dropped is not released by its finalizer mid-IO)
        self._in_flight: set[DiskTransfer] = set()
        # NIXL requests in flight (within GDS_REQUESTS), the transfers whose rounds they are, oldest first, and
        # the GPU staging buffers, by device (kvcopy.storage.staging)
        self._posted = 0
        self._rounds_in_flight: list[Rounds] = []
        self._staging: dict[torch.device, Staging] = {}
        self._closed = False  # no more match, put or get
        self._freed = False  # the registrations, the index and the data file released

    # ------------------------------------------------------------------ making and opening

    @staticmethod
    def _paged(like: object) -> PagedKV:
        if isinstance(like, HostKVPool):
            return like.paged
        if isinstance(like, PagedKV):
            return like
        raise TypeError(f"like: expected a HostKVPool or a PagedKV, got {type(like).__name__}")

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        like: HostKVPool | PagedKV,
        num_blocks: int,
        *,
        cache_key: object,
        backend: str = "auto",
        room: int | None = None,
    ) -> DiskKVStore:
        """A new store, its room reserved now: OSError when it does not fit, and nothing is left behind.

        Parameters:

        - ``path``: a directory that must not exist.
        - ``like``: the HostKVPool (or an engine's PagedKV) whose blocks it keeps: a store block is one
          page-first block of it.
        - ``num_blocks``: blocks the store holds.
        - ``cache_key``: the CacheKey whose blocks it holds; a store opened under another context refuses.
        - ``backend``: ``"posix"``, ``"gds"`` or ``"auto"`` (see the module documentation).
        - ``room``: blocks backed on the disk now, from 0 to ``num_blocks`` (None, the default: every block);
          the others are holes until :meth:`grow` backs them.
        """
        path = os.fspath(path_argument("path", path))
        paged = cls._paged(like)
        context_hash = context_hash_of(cache_key)
        _check_backend(backend)
        num_blocks = positive_int("num_blocks", num_blocks)
        most = max_blocks(paged.nbytes_per_block)
        if num_blocks > most:
            raise ValueError(
                f"num_blocks: expected at most {most} blocks of {paged.nbytes_per_block} bytes (a store numbers its "
                f"slots in 32 bits, and its data file's size is a file offset), got {num_blocks}"
            )
        room = num_blocks if room is None else non_negative_int("room", room)
        if room > num_blocks:
            raise ValueError(f"room: expected at most num_blocks ({num_blocks}) blocks, got {room}")
        create_files(path, layout_of(paged), num_blocks, context_hash, room)
        try:
            return cls.open(path, like, cache_key=cache_key, backend=backend)
        except BaseException:  # the backend would not start here: nothing half-made is left
            shutil.rmtree(path, ignore_errors=True)
            raise

    @classmethod
    def open(
        cls, path: str | os.PathLike[str], like: HostKVPool | PagedKV, *, cache_key: object, backend: str = "auto"
    ) -> DiskKVStore:
        """The store at ``path``, as its last process left it (killed or not). ValueError when it holds another
        CacheKey context or another block layout than ``like``'s, naming what differs; FileFormatError (a
        ValueError) naming the file and the field when its files are not what a store writes or disagree (a
        header whose block count is not the data file's, a log with a slot beyond it, a missing log), with
        nothing changed. FileNotFoundError naming ``path`` where there is no store; NotADirectoryError naming it
        where it is a file (or lies under one), not a store. Opening cuts off only a torn tail of the log
        (records a crash left unchecked) and matches the data file's backed blocks to its room
        (kvcopy.storage.room). The parameters are :meth:`create`'s."""
        path = os.fspath(path_argument("path", path))
        paged = cls._paged(like)
        context_hash = context_hash_of(cache_key)
        _check_backend(backend)
        header = read_header(path)
        if header["context_hash"] != context_hash:
            raise ValueError(
                f"cache_key: {path} holds blocks of CacheKey context {header['context_hash']}, not {context_hash}: "
                "a block of another model configuration is never read as this one's"
            )
        differs = layout_difference(header, layout_of(paged))
        if differs is not None:
            raise ValueError(f"like: {path} holds {differs} (like's)")
        return cls(path, header, backend, gpu=paged.device.type == "cuda")

    # ------------------------------------------------------------------ the pool side

    def _pool(self, pool: object, pool_ids: BlockIds, count: int) -> tuple[HostKVPool | PagedKV, torch.Tensor]:
        """``pool`` checked (a page-first HostKVPool; with GPUDirect Storage also a GPU cache's PagedKV) and
        registered once, and ``pool_ids`` checked against it."""
        if not (isinstance(pool, HostKVPool) or (isinstance(pool, PagedKV) and pool.device.type == "cuda")):
            where = f" on {pool.device}" if isinstance(pool, PagedKV) else ""
            raise TypeError(
                f"pool: expected a HostKVPool (or a GPU's PagedKV with backend 'gds'), got {type(pool).__name__}{where}"
            )
        on_gpu = isinstance(pool, PagedKV)  # a GPU's (checked above)
        if on_gpu and self.backend != "gds":
            raise ValueError(
                f"pool: a GPU's blocks move through GPUDirect Storage; this store opened NIXL {self.backend} "
                "(open it with backend='gds' or 'auto' on a GPU that has it, or go through a host pool)"
            )
        paged = self._paged(pool)
        if id(pool) not in self._pools:  # a host pool checked and registered once: its layout never changes
            if isinstance(pool, HostKVPool) and pool.layout != "page_first":
                raise ValueError(
                    f"pool: the store keeps page_first blocks, this pool is laid out {pool.layout} (make it with "
                    "layout='page_first')"
                )
            differs = layout_difference(self._layout, layout_of(paged))
            if differs is not None:
                raise ValueError(f"pool: the store holds {differs} (the pool's)")
        ids = prepare_host_ids(pool_ids, "pool_ids", paged.num_blocks, unique=True)
        if ids.numel() != count:
            raise ValueError(f"pool_ids: expected {count} ids, got {ids.numel()}")
        # A host pool is registered with NIXL once (and kept, so its id is never another's); a GPU cache never:
        # its blocks move through the store's staging buffer, so a new PagedKV over the same tensors (one per
        # call, say) neither registers them again nor is kept alive by the store.
        if isinstance(pool, HostKVPool) and id(pool) not in self._pools:
            reg = registration_of(pool)
            registered = self._agent.register_memory(list(reg.regions), reg.memory)
            self._pools[id(pool)] = (pool, registered, reg.memory, reg.device_id)
        if isinstance(pool, PagedKV):
            self._staging_for(pool)  # made here, before a put evicts anything: out of GPU memory changes nothing
        return pool, ids

    def _hold(self, slots: list[int]) -> Callable[[], None]:
        for slot in slots:
            self._busy[slot] = self._busy.get(slot, 0) + 1

        def release() -> None:
            for slot in slots:
                self._busy[slot] -= 1
                if not self._busy[slot]:
                    del self._busy[slot]

        return release

    def _transfer(
        self,
        op: str,
        pool: HostKVPool | PagedKV,
        ids: torch.Tensor,
        slots: list[int],
        finish: Callable[[], None],
        ended: Callable[[], None] | None = None,
    ) -> DiskTransfer:
        """Posts the first round of the put (``op`` "WRITE") or get ("READ") of pool blocks ``ids`` to or from
        store ``slots`` (kvcopy.storage.staging: a GPU cache's through its staging buffer); the rest are posted
        as the returned transfer is polled. ``ended``: run once it ends (well or not), its slots free."""
        slot_ids = torch.tensor(slots, dtype=torch.int64)
        paged = self._paged(pool)
        staging = self._staging_for(paged) if isinstance(pool, PagedKV) else None
        rounds = plan_rounds(
            paged.plane_table,
            ids,
            self._table,
            slot_ids,
            staging_table=None if staging is None else staging.paged.plane_table,
            per_round=0 if staging is None else staging.blocks,
        )
        if not rounds:  # nothing to move (NIXL refuses an empty transfer)
            return DiskTransfer(None, finish, ended or (lambda: None))
        written = WrittenBlocks("local", ids if op == "READ" else slot_ids)
        free_slots = self._hold(slots)
        ending: list[DiskTransfer] = []  # the DiskTransfer below, once made

        def release() -> None:  # once, when it ends: its slots free, and no longer in flight
            free_slots()
            self._in_flight.difference_update(ending)
            ending.clear()  # (the transfer holds this closure: no cycle keeps the pool alive after it)
            if ended is not None:
                ended()

        def explain(error: Exception) -> Exception | None:
            return self._failure_cause(error, op.lower(), written)

        try:
            moving = Rounds(self, op, pool, rounds, staging, written)  # its first round posted
        except Exception as err:
            release()
            raise (explain(err) or err) from err
        except BaseException:
            release()
            raise
        disk = DiskTransfer(moving, finish, release, explain)
        ending.append(disk)
        self._in_flight.add(disk)
        return disk

    def _staging_for(self, paged: PagedKV) -> Staging:
        """The staging buffer of ``paged``'s device (made and registered on first use; one per device)."""
        if paged.device not in self._staging:
            self._staging[paged.device] = Staging(paged, staging_blocks(self._block_nbytes), self._agent)
        return self._staging[paged.device]

    def _reserve(self, moving: Rounds, round_: Round) -> None:
        """Takes room for ``round_`` of ``moving`` once it fits: the store's requests in flight within
        GDS_REQUESTS and, for a staged round, its staging buffer free, each by waiting for the oldest other
        round in flight to end."""
        staging = moving.staging
        while self._posted + len(round_.ranges) > GDS_REQUESTS or (
            staging is not None and staging.user not in (None, moving)
        ):
            other = next(m for m in self._rounds_in_flight if m is not moving)
            other.settle()  # its round in flight ends; it starts its next one when polled
        if staging is not None:
            staging.user = moving
        self._posted += len(round_.ranges)
        self._rounds_in_flight.append(moving)

    def _post(self, moving: Rounds, round_: Round) -> NixlTransfer:
        """Posts ``round_`` of ``moving`` (reserved) to NIXL: one transfer of its requests."""
        staging = moving.staging
        if staging is not None:
            kind, device_id = staging.memory, staging.device_id
        else:
            _, _, kind, device_id = self._pools[id(moving.pool)]
        memory = [(m, n, device_id) for m, _, n in round_.ranges]
        file = [(f, n, self._fd) for _, f, n in round_.ranges]
        agent = self._agent
        handle = agent.initialize_xfer(
            moving.op, agent.get_xfer_descs(memory, kind), agent.get_xfer_descs(file, "FILE"), agent.name
        )
        nbytes = sum(n for *_, n in round_.ranges)
        transfer = NixlTransfer(agent, handle, moving.op.lower(), len(round_.ranges), nbytes, moving.written)
        if agent.transfer(handle) == "ERR":
            transfer.done()  # raises
        return transfer

    def _round_ended(self, moving: Rounds, round_: Round) -> None:
        """``round_`` of ``moving`` ended in NIXL (well or not): its requests and staging buffer free."""
        self._posted -= len(round_.ranges)
        self._rounds_in_flight.remove(moving)
        if moving.staging is not None and moving.staging.user is moving:
            moving.staging.user = None

    def _failure_cause(self, error: Exception, what: str, written: WrittenBlocks) -> Exception | None:
        """A failed NIXL transfer's error, with its cause where the store can tell it (NIXL's says only that
        it failed): a data file shorter than its blocks (truncated while open) or gone; else None."""
        name = os.path.join(self.path, DATA)
        expected = self.num_blocks * self._block_nbytes
        try:
            size = os.fstat(self._fd).st_size
        except OSError as err:
            cause = f"the data file {name} cannot be read ({err})"
        else:
            if size >= expected:
                return None
            cause = (
                f"the data file {name} is {size} bytes, shorter than the {expected} its {self.num_blocks} blocks "
                "need (truncated while the store was open?)"
            )
        return RemoteTransferError(f"{what} failed: {cause}; {written} hold no valid data", written)

    def _checksums(self, pool: HostKVPool | PagedKV, ids: torch.Tensor) -> list[int]:
        if isinstance(pool, PagedKV):  # a GPU's blocks: gathered and copied to the host (kvcopy.storage.gpu_blocks)
            return paged_checksums(pool, ids)
        view, size = pool.buffer.numpy().data, pool.nbytes_per_block  # page-first: block i is one slice of it
        return [xxhash.xxh3_64_intdigest(view[i * size : (i + 1) * size]) for i in ids.tolist()]

    # ------------------------------------------------------------------ put, match, get

    def put(self, block_hashes: Sequence[str], pool: HostKVPool | PagedKV, pool_ids: BlockIds) -> DiskTransfer:
        """Writes ``pool``'s blocks ``pool_ids`` as the blocks of ``block_hashes``; they match once the returned
        transfer is done. Hashes already stored are kept (and count as used). New blocks go to spare blocks of
        the store's room; once it has none, the least recently used blocks are evicted.

        A block hash is the hex digest string of a SHA-256, as CacheKey.block_hashes gives it (64 hex digits;
        uppercase ones are taken as their lowercase). Every argument is checked before anything is evicted or
        written: a hash that is not a str (raw digest bytes, an int, None) or a ``block_hashes`` that is not a
        sequence of them (a single str) is a TypeError; a hash of another length or with other characters,
        a length mismatch, duplicate hashes, more blocks than the store holds or more new blocks than its room
        has free or evictable a ValueError; pool ids out of range an IndexError, and pool ids not on the host a
        ValueError."""
        self._check_open()
        hashes = self._hashes(block_hashes)
        if len(set(hashes)) != len(hashes):
            raise ValueError("block_hashes: expected distinct hashes, got a repeated one")
        pool, ids = self._pool(pool, pool_ids, len(hashes))
        if len(hashes) > self.num_blocks:
            raise ValueError(f"block_hashes: {len(hashes)} blocks do not fit a store of {self.num_blocks}")
        index = self._index
        found = [index.get(h) for h in hashes]
        new = [(h, i) for h, i, entry in zip(hashes, ids.tolist(), found, strict=True) if entry is None]
        stored = [entry.slot for entry in found if entry is not None]
        room = self._room
        spare = room.spare
        evictable = index.least_recent(len(new) - min(spare, len(new)), keep=set(stored) | set(self._busy))
        if spare + len(evictable) < len(new):
            raise ValueError(
                f"block_hashes: {len(new)} new blocks, but the store's room of {room.blocks} blocks has only "
                f"{spare + len(evictable)} spare or neither in use by an unfinished put or get nor kept by this "
                "one"
            )
        # every argument checked: from here on the store changes
        free = room.take(len(new))
        slots = free + evictable[: len(new) - len(free)]
        index.touch(stored)  # in the order given, as used again
        index.free(slots[len(free) :])  # evicted: durably forgotten before they are overwritten
        new_ids = torch.tensor([i for _, i in new], dtype=torch.int64)
        records: list[Batch] = []

        def commit() -> None:
            if not new:  # every hash was stored already: nothing was written, nothing to sync or commit
                return
            os.fdatasync(self._fd)  # the bytes, and the extents a first write converts; not the file's times
            index.append(records[0])

        def ended() -> None:  # a block not committed (the put failed) leaves its slot spare
            room.restore(slots, self._busy)

        transfer = self._transfer("WRITE", pool, new_ids, slots, commit, ended)
        try:  # while NIXL writes (both only read the pool blocks): the checksums, and the COMMIT records
            checksums = self._checksums(pool, new_ids)
            records.append(index.prepare(Entry(s, h, c) for s, (h, _), c in zip(slots, new, checksums, strict=True)))
        except BaseException:  # (a GPU's gather failed, say): nothing is committed, the slots come free again
            transfer._abandon()
            raise
        with contextlib.suppress(Exception):  # a GPU's first round, gathered by now, goes to NIXL (an error is
            transfer.done()  # kept in the transfer, raised by its wait and done)
        return transfer

    @staticmethod
    def _hashes(block_hashes: object) -> list[str]:
        """``block_hashes`` as the store's form of each (kvcopy.storage.commit_log.block_hash_of), every one
        checked."""
        sequence = sequence_argument("block_hashes", block_hashes, "block hashes (hex digest strings)")
        return [block_hash_of(h, f"block_hashes[{i}]") for i, h in enumerate(sequence)]

    def match(self, block_hashes: Sequence[str]) -> list[int]:
        """The slots of the longest prefix of ``block_hashes`` the store holds, in order. The hashes are checked
        as :meth:`put` checks them (a single str is a TypeError, not a sequence of characters)."""
        self._check_open()
        slots = []
        for h in self._hashes(block_hashes):
            entry = self._index.get(h)
            if entry is None:
                break
            slots.append(entry.slot)
        self._index.touch(slots)
        return slots

    def contains(self, block_hash: str) -> bool:
        """Whether the store holds a committed block of ``block_hash`` (checked as :meth:`put` checks a hash);
        not a use. It reads one entry of the in-memory index, so it is the one call that may come from another
        thread while the store's own thread puts, gets and evicts: a block evicted after it answered then fails
        the later get as any block no longer held does."""
        self._check_open()
        return self._index.get(block_hash_of(block_hash, "block_hash")) is not None

    def touch(self, block_hashes: Sequence[str]) -> None:
        """Marks the blocks of ``block_hashes`` the store holds as used now, in that order (the others are
        ignored): the least recently used are evicted first."""
        self._check_open()
        entries = (self._index.get(h) for h in self._hashes(block_hashes))
        self._index.touch([entry.slot for entry in entries if entry is not None])

    def discard(self, block_hashes: Sequence[str]) -> int:
        """Forgets the blocks of ``block_hashes`` the store holds, durably (a block found corrupt, say): they
        never match again, and their slots are free. Returns how many it held."""
        self._check_open()
        entries = [e for e in (self._index.get(h) for h in self._hashes(block_hashes)) if e is not None]
        self._index.free(entry.slot for entry in entries)
        self._room.restore((entry.slot for entry in entries), self._busy)
        return len(entries)

    def get(
        self, slots: BlockIds, pool: HostKVPool | PagedKV, pool_ids: BlockIds, *, verify: bool = True
    ) -> DiskTransfer:
        """Reads store ``slots`` into ``pool``'s blocks ``pool_ids``; the transfer's ``done``/``wait`` raise
        CorruptBlockError for a block that does not match its committed checksum, naming its slot.
        ``verify=False`` skips that check (the hash of every byte read, 6-16% of a get on the CPU VM, and a
        GPU's blocks copied to the host for it): for a disk trusted not to lose or corrupt what it
        acknowledged. A crash still never leaves a torn block matched; that is the commit scheme's doing."""
        self._check_open()
        boolean("verify", verify)
        slot_ids = prepare_host_ids(slots, "slots", self.num_blocks, unique=False)
        entries = {e.slot: e for e in (self._index.entry_at(s) for s in slot_ids.tolist()) if e is not None}
        empty = [s for s in slot_ids.tolist() if s not in entries]
        if empty:
            raise ValueError(f"slots: {empty} hold no committed block")
        pool, ids = self._pool(pool, pool_ids, slot_ids.numel())

        def check() -> None:
            if not verify:
                return
            bad = [
                s
                for s, c in zip(slot_ids.tolist(), self._checksums(pool, ids), strict=True)
                if c != entries[s].checksum
            ]
            if bad:
                raise CorruptBlockError(f"slots {bad}: read back different from what was committed", bad)

        read = slot_ids.tolist()
        return self._transfer("READ", pool, ids, read, check, lambda: self._room.restore(read, self._busy))

    # ------------------------------------------------------------------ room

    @property
    def room(self) -> int:
        """Blocks of the data file backed on the disk (held, being written, or spare): what the store takes."""
        return self._room.blocks

    @property
    def spare(self) -> int:
        """Blocks of the room that hold nothing: new blocks a put writes before it evicts any."""
        return self._room.spare

    def grow(self, blocks: int) -> None:
        """Backs ``blocks`` more of the data file's blocks on the disk (fallocate), spare from then on; the
        header counts them once the store closes (killed before: the next open punches those that hold
        nothing). TypeError for a non-int, ValueError below 0 or beyond ``num_blocks - room``; OSError when the
        filesystem has not the room; each with the store as it was."""
        self._check_open()
        blocks = non_negative_int("blocks", blocks)
        if blocks > self.num_blocks - self._room.blocks:
            raise ValueError(
                f"blocks: expected at most {self.num_blocks - self._room.blocks} (num_blocks {self.num_blocks} - "
                f"room {self._room.blocks}), got {blocks}"
            )
        if blocks:
            self._room.grow(blocks, self._busy)

    def give_back(self, blocks: int) -> int:
        """Frees ``blocks`` of the store's room on the disk: its spare blocks first, then its least recently used
        blocks (not those a put or get in flight uses), each forgotten durably before its bytes are punched
        (FALLOC_FL_PUNCH_HOLE). Returns how many stored blocks it evicted. TypeError for a non-int, ValueError
        below 0 or beyond what is free to go, OSError where the filesystem cannot punch holes; each with the
        store as it was."""
        self._check_open()
        blocks = non_negative_int("blocks", blocks)
        if blocks > self._room.blocks:
            raise ValueError(f"blocks: expected at most the store's room ({self._room.blocks}), got {blocks}")
        return self._room.give_back(blocks, self._busy) if blocks else 0

    def drop_page_cache(self) -> None:
        """Drops the data file's pages from the page cache, so the next get reads the disk (cold); nothing to
        drop when the store reads with O_DIRECT (``direct``)."""
        self._check_open()
        if not self.direct:
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    # ------------------------------------------------------------------ end

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"DiskKVStore {self.path}: closed")

    def close(self) -> None:
        """Ends every put and get still in flight, writes the order its blocks were used in (when it changed:
        the log compacted), then closes its files and NIXL registrations; then match, put and get raise a
        "closed" ValueError. A second close does nothing.

        Their IO still reads or writes the registered memory and the data file, so none is freed under it (a
        ``with`` block left by an exception while a put is in flight, say): close waits until NIXL reports each
        ended, then ends it as its own ``wait`` would (a put's blocks committed, a get's checked); whatever
        error one ends with is kept for its own ``wait`` and ``done``, not raised here. Interrupted while it
        waits (KeyboardInterrupt), it frees nothing, and a later close carries on."""
        if self._freed:
            return
        self._closed = True
        self._end_in_flight()
        self._freed = True
        for _, registered, _, _ in self._pools.values():
            self._agent.deregister_memory(registered)
        self._pools.clear()  # nothing of the pools is held: their owners may free or unmap them
        for staging in self._staging.values():
            self._agent.deregister_memory(staging.registered)
        self._agent.deregister_memory(self._file)
        if self._index.reordered:  # the order of use, kept for the next open (evictions follow it)
            with contextlib.suppress(OSError):
                self._index.compact()
        self._room.close()
        self._index.close()
        os.close(self._fd)

    def _end_in_flight(self) -> None:
        """Waits for every transfer in flight to end in NIXL, and ends it (see :meth:`close`)."""
        for transfer in list(self._in_flight):
            with contextlib.suppress(Exception):  # its own error, kept in it: raised by its wait and done
                transfer.wait()
            self._in_flight.discard(transfer)  # (ended now, well or badly)

    def __enter__(self) -> DiskKVStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
