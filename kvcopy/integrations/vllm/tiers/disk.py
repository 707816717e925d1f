"""KVCopyDiskTier: a secondary tier of vLLM's tiered offloading on kvcopy's crash-safe disk store.

Configured in ``secondary_tiers`` of vLLM's ``TieringOffloadingSpec`` (or kvcopy's spec)::

    {"type": "KVCopyDiskTier", "module_path": "kvcopy.integrations.vllm", "path": "/mnt/nvme/kv",
     "bytes_to_use": 200_000_000_000}

with ``"backend"`` (``"auto"``, ``"posix"`` or ``"gds"``: the store's NIXL backend) and ``"cache_key_extra"``
(a string added to the store's identity) optional. A chunk is one row of vLLM's primary tier (every worker's
slot of it, as opaque bytes), one block of a :class:`~kvcopy.storage.DiskKVStore`:

- a cascade (``submit_store``) puts the job's rows, a promotion (``submit_load``) gets them back, each one NIXL
  transfer of the rows' runs (kvcopy's range planner), checked against the checksum committed with each block;
  a block that fails its check is not loaded (the job reports the chunks that did in ``successful_keys``, and
  vLLM computes from the failed one on), is counted, and is dropped from the store;
- entries are committed only once their data is synced, so a crash never leaves a block that matches and is
  torn; a new process of the same identity finds every chunk committed before;
- ``lookup`` answers from the store's in-memory index, on the scheduler's thread, without touching the disk;
- the store's identity (kvcopy.integrations.vllm.tiers.identity) holds everything of vLLM's configuration that
  changes a chunk's bytes: a store of another identity is never served (the tier says once what differs and
  starts a store of its own), and ``bytes_to_use`` bounds ``path`` across identities: a store grows as it
  fills, taking the room no store has, then other identities' least recently used chunks
  (kvcopy.integrations.vllm.tiers.stores).

The tier runs in vLLM's scheduler process, under the tiering manager's lock. Its puts, gets and their
checksums run on one IO thread of its own: ``submit_store``, ``submit_load`` and ``touch`` only queue work.
"""

from __future__ import annotations

import collections
import gc
import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import TIER_LABEL, JobResult, SecondaryTierManager, TransferJob

from kvcopy._checks import path_argument, positive_int
from kvcopy.host.pool import HostKVPool
from kvcopy.integrations.vllm._config import suggestion
from kvcopy.integrations.vllm.tiers.identity import engine_vllm_config, tier_identity
from kvcopy.integrations.vllm.tiers.stores import TierStore, open_tier_store, stores_nbytes
from kvcopy.layout import PagedKV
from kvcopy.storage.files import BACKENDS
from kvcopy.storage.store import CorruptBlockError, DiskTransfer

__all__ = ["METRICS", "KVCopyDiskTier", "TierKeys", "check_tier_config"]

logger = logging.getLogger("kvcopy.integrations.vllm")

# The tier's own keys in its configuration (vLLM pops "type", "module_path" and "backpressure").
TIER_KEYS = ("path", "bytes_to_use", "backend", "cache_key_extra", "locality")
# How long the IO thread sleeps between polls of the transfers in flight: a disk read of one chunk takes
# 0.1 ms and up, and a poll costs a few microseconds.
POLL_S = 0.0002

_PREFIX = "vllm:kv_offload_kvcopy_disk_"
METRICS: dict[str, str] = {
    f"{_PREFIX}stored_blocks": "Chunks the kvcopy disk tier stored (cascades), by tier.",
    f"{_PREFIX}stored_bytes": "Bytes of the chunks the kvcopy disk tier stored, by tier.",
    f"{_PREFIX}loaded_blocks": "Chunks the kvcopy disk tier loaded into the primary tier (promotions), by tier.",
    f"{_PREFIX}loaded_bytes": "Bytes of the chunks the kvcopy disk tier loaded, by tier.",
    f"{_PREFIX}corrupt_blocks": "Chunks whose checksum failed on promotion: not loaded, dropped from the store.",
    f"{_PREFIX}identity_refusals": "Stores of another identity found under the tier's path: never served.",
}
PROMOTION_LATENCY = f"{_PREFIX}promotion_latency_seconds"
# Promotion latency buckets, seconds: from one small chunk read from the page cache to a long prefix from a
# slow disk.
PROMOTION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def store_hash(key: OffloadKey) -> str:
    """The store's block hash of a vLLM offload key (a block hash and a group index): its SHA-256, in hex."""
    return hashlib.sha256(bytes(key)).hexdigest()


@dataclass
class _Job:
    """A job queued for, or in flight on, the IO thread."""

    job: TransferJob
    keys: list[OffloadKey]
    hashes: list[str]
    rows: list[int]
    transfer: DiskTransfer | None = None
    posted: float = 0.0
    slots: tuple[int, ...] = ()  # a load: the slots of the prefix of its chunks the store held when posted
    new: int = 0  # a store: how many of its chunks the store did not hold yet


@dataclass(frozen=True)
class TierKeys:
    """The tier's keys, checked."""

    path: str
    bytes_to_use: int
    backend: str
    cache_key_extra: str | None


# What vLLM's factory takes out of a tier's configuration (or passes through) before the tier's own keys.
_FRAMEWORK_KEYS = ("type", "module_path", "backpressure", "locality")


def check_tier_config(config: Mapping[str, object]) -> TierKeys:
    """A KVCopyDiskTier configuration checked before anything is made, each error naming its key: ValueError for
    a missing or bad value (``path`` not a directory that can be made, ``bytes_to_use`` <= 0 or beyond the
    filesystem's free space with the tier's stores already there, an unknown ``backend``, an unknown key),
    TypeError for a wrong type. kvcopy's spec calls it in both roles; the tier when it is built."""
    for name in config:
        if name not in TIER_KEYS and name not in _FRAMEWORK_KEYS:
            keys = ", ".join(TIER_KEYS)
            raise ValueError(
                f"{name}: not a key of KVCopyDiskTier (its keys: {keys}){suggestion(str(name), TIER_KEYS)}"
            )
    path, bytes_to_use = config.get("path"), config.get("bytes_to_use")
    backend, extra = config.get("backend", "auto"), config.get("cache_key_extra")
    if path is None:
        raise ValueError("path: required (the directory the tier's stores are kept in)")
    checked_path = os.fspath(path_argument("path", path))
    if os.path.exists(checked_path) and not os.path.isdir(checked_path):
        raise ValueError(f"path: {checked_path!r} exists and is not a directory")
    existing = _nearest_existing(checked_path)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"path: {checked_path!r} is not a directory that can be made ({existing!r} is in the way)")
    if bytes_to_use is None:
        raise ValueError("bytes_to_use: required (the bytes the tier may use under path)")
    budget = positive_int("bytes_to_use", bytes_to_use)
    room = shutil.disk_usage(existing).free + stores_nbytes(checked_path)
    if budget > room:
        raise ValueError(
            f"bytes_to_use: {budget} bytes, but the filesystem of {checked_path!r} has room for {room} (free space "
            "and the tier's stores already there)"
        )
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected one of {BACKENDS}, got {type(backend).__name__} {backend!r:.40}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}{suggestion(backend, BACKENDS)}")
    if extra is not None and not isinstance(extra, str):
        raise TypeError(f"cache_key_extra: expected a str, got {type(extra).__name__}")
    return TierKeys(checked_path, budget, backend, extra)


def _nearest_existing(path: str) -> str:
    """``path``, or the nearest of its parents that exists."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


class KVCopyDiskTier(SecondaryTierManager):
    """vLLM's ``SecondaryTierManager`` on a kvcopy :class:`~kvcopy.storage.DiskKVStore` (see the module).

    Keys: ``path`` (required: a directory, made if missing), ``bytes_to_use`` (required: the bytes the tier's
    stores may take under ``path``, across identities, shared by use; at most the filesystem's free space),
    ``backend``
    (``"auto"``, ``"posix"`` or ``"gds"``) and ``cache_key_extra`` (a string added to the identity). A missing
    or bad value is a ValueError, a wrong type a TypeError, and an unknown key a ValueError, each naming the
    key, when the tier is built.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        *,
        path: object = None,
        bytes_to_use: object = None,
        backend: object = "auto",
        cache_key_extra: object = None,
        locality: str | None = None,
        **unknown: object,
    ) -> None:
        keys = check_tier_config(
            {
                "path": path,
                "bytes_to_use": bytes_to_use,
                "backend": backend,
                "cache_key_extra": cache_key_extra,
                **unknown,
            }
        )
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        assert primary_kv_view.shape is not None  # (vLLM's view: rows of the primary tier)
        num_rows, row_bytes = primary_kv_view.shape[0], self.block_size_bytes
        like = PagedKV.from_planes([torch.empty((1, row_bytes), dtype=torch.uint8)])
        identity = tier_identity(offloading_spec, row_bytes, keys.cache_key_extra)
        # one store per data-parallel replica (each an identity), each its share of bytes_to_use
        replicas = offloading_spec.config.parallel.data_parallel_size
        self._pool: HostKVPool | None = HostKVPool.over(primary_kv_view, like, num_rows, pin_memory=False)
        try:
            self._tier_store: TierStore = open_tier_store(
                keys.path, identity, self._pool, keys.bytes_to_use, keys.backend, replicas=replicas
            )
        except BaseException:
            self._release_pool()
            raise
        try:
            self._start(tier_type, _tier_label(offloading_spec, tier_type, path))
        except BaseException:  # vLLM never gets the tier, so never shuts it down: its store and lock go here
            try:
                self._tier_store.close()
            finally:
                self._release_pool()
            raise
        logger.info(
            "kvcopy disk tier %r: room for %d chunks of %d bytes in %s, growing as it fills up to %d",
            tier_type,
            self.store.room,
            row_bytes,
            self._tier_store.folder,
            self._tier_store.cap,
        )

    def _start(self, tier_type: str, label: str) -> None:
        """The tier's state and its IO thread, started, over the store just opened; ``label``: its metrics'."""
        self.store = self._tier_store.store
        _warn_if_hashes_change_per_process()
        self._stats = OffloadingConnectorStats()
        self._labels = (label,)
        self._count("identity_refusals", len(self._tier_store.refused))
        self._lock = threading.Condition()
        self._loads: collections.deque[_Job] = collections.deque()  # queued, run before stores
        self._stores: collections.deque[_Job] = collections.deque()
        self._touches: list[list[str]] = []
        self._in_flight: list[_Job] = []
        self._finished: list[JobResult] = []
        self._busy = False  # the IO thread is running a job's post or end
        self._stopping = False
        self._io = threading.Thread(target=self._run, name=f"kvcopy-disk-tier-{tier_type}", daemon=True)
        self._io.start()

    # ------------------------------------------------------------------ metrics

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        """The tier's counters and its promotion-latency histogram, each labelled by tier."""
        definitions: dict[str, OffloadingMetricMetadata] = {
            name: OffloadingCounterMetadata(documentation=doc, labelnames=(TIER_LABEL,))
            for name, doc in METRICS.items()
        }
        definitions[PROMOTION_LATENCY] = OffloadingHistogramMetadata(
            documentation="Seconds from a promotion job's creation until the kvcopy disk tier finished it, by tier.",
            labelnames=(TIER_LABEL,),
            buckets=PROMOTION_BUCKETS,
        )
        return definitions

    def _count(self, what: str, value: int) -> None:
        if value:
            self._stats.increase_counter(f"{_PREFIX}{what}", value, self._labels)

    def get_stats(self) -> OffloadingConnectorStats | None:
        with self._lock:
            stats, self._stats = self._stats, OffloadingConnectorStats()
        return None if stats.is_empty() else stats

    # ------------------------------------------------------------------ the scheduler's calls

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT when the store holds the chunk, else MISS: from the store's index in memory, never the disk."""
        return LookupResult.HIT if self.store.contains(store_hash(key)) else LookupResult.MISS

    def _queue(self, job: TransferJob, into: collections.deque[_Job]) -> None:
        keys = list(job.keys)
        rows = [int(row) for row in job.chunk_ids]
        if len(keys) != len(rows):
            raise ValueError(f"job {job.job_id}: {len(keys)} keys but {len(rows)} chunk_ids")
        with self._lock:
            into.append(_Job(job, keys, [store_hash(k) for k in keys], rows))
            self._lock.notify_all()

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Queues a cascade: the job's primary rows, put in the store by the IO thread."""
        self._queue(job_metadata, self._stores)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Queues a promotion: the job's chunks, read into its primary rows by the IO thread (before stores)."""
        self._queue(job_metadata, self._loads)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """The chunks of ``keys`` were used: the store evicts them last (on the IO thread)."""
        hashes = [store_hash(k) for k in keys]
        if hashes:
            with self._lock:
                self._touches.append(hashes)
                self._lock.notify_all()

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._loads or self._stores or self._in_flight or self._finished or self._busy)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        """Waits until every job submitted has ended (its result then in :meth:`get_finished_jobs`)."""
        with self._lock:
            while self._loads or self._stores or self._in_flight or self._busy:
                if not self._io.is_alive():
                    raise RuntimeError("kvcopy disk tier: its IO thread ended with jobs left")
                self._lock.wait(POLL_S * 10)

    def shutdown(self) -> None:
        """Ends every job (waiting for its IO), stops the IO thread, closes the store and lets go of every view
        of the primary tier's memory, so vLLM can unmap it."""
        if self._pool is None:
            return
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._io.join()
        try:
            self._tier_store.close()
        finally:
            self._release_pool()
            # A failed transfer's error chain (its cause's frames) can keep the pool's views in a reference
            # cycle; collected here, or vLLM cannot unmap its region
            gc.collect()

    def _release_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    # ------------------------------------------------------------------ the IO thread

    def _run(self) -> None:
        """The IO thread: runs queued touches, loads (first) and stores in order, then polls the transfers in
        flight; ends once asked to stop and nothing is left."""
        while True:
            with self._lock:
                while not (self._touches or self._loads or self._stores or self._in_flight or self._stopping):
                    self._lock.wait()
                if self._stopping and not (self._loads or self._stores or self._in_flight):
                    return
                touches, self._touches = self._touches, []
                queued = self._loads.popleft() if self._loads else self._stores.popleft() if self._stores else None
                self._busy = queued is not None
            for hashes in touches:
                try:
                    self.store.touch(hashes)
                except Exception:  # an order of eviction, not data: the tier goes on
                    logger.exception("kvcopy disk tier: a touch failed")
            if queued is not None:
                self._post(queued)
            self._poll()
            with self._lock:
                self._busy = False
                if self._in_flight and not (self._loads or self._stores or self._touches):
                    self._lock.wait(POLL_S)  # (stopping too: the IO in flight ends without a spinning core)

    def _post(self, queued: _Job) -> None:
        """Posts the job's put or get; a job the store refuses (or with nothing to move) ends at once."""
        queued.posted = time.monotonic()
        pool = self._pool
        assert pool is not None  # (released only once the IO thread has ended)
        try:
            if queued.job.is_promotion:
                slots = self.store.match(queued.hashes)  # the prefix still held (one evicted since: not loaded)
                queued.slots = tuple(slots)
                if slots:
                    queued.transfer = self.store.get(slots, pool, queued.rows[: len(slots)])
            else:
                queued.new = sum(not self.store.contains(h) for h in queued.hashes)
                self._make_room(queued.new)
                queued.transfer = self.store.put(queued.hashes, pool, queued.rows)
        except Exception as err:  # (a store with no room for the job, say): the job failed, the tier goes on
            err.__traceback__ = None  # (a log record keeps the error: its frames would keep the pool alive)
            logger.warning("kvcopy disk tier: job %d refused: %s", queued.job.job_id, err)
            self._finish(queued, None, err)
            return
        if queued.transfer is None:
            self._finish(queued, None, None)
        else:
            with self._lock:
                self._in_flight.append(queued)

    def _make_room(self, new: int) -> None:
        """Grows the store for a cascade of ``new`` chunks it does not hold, as the budget allows (or gives back
        room another engine asks for): kvcopy.integrations.vllm.tiers.stores. On an error the cascade goes on
        within the store's room."""
        try:
            self._tier_store.room_for(new)
        except Exception:
            logger.exception("kvcopy disk tier: making room for a cascade failed; it evicts within the store's room")

    def _poll(self) -> None:
        for queued in list(self._in_flight):
            transfer = queued.transfer
            assert transfer is not None
            try:
                if not transfer.done():
                    continue
            except Exception as err:  # its own failure (a corrupt block, a failed read or write)
                self._finish(queued, transfer, err)
                err.__traceback__ = None  # (the transfer keeps its error: its frames would keep the pool alive)
            else:
                self._finish(queued, transfer, None)
            queued.transfer = None
            with self._lock:
                self._in_flight.remove(queued)

    def _finish(self, queued: _Job, transfer: DiskTransfer | None, error: Exception | None) -> None:
        """The job's result, its metrics, and (a corrupt block) the block dropped from the store."""
        job, now = queued.job, time.monotonic()
        row_bytes = self.block_size_bytes
        if job.is_promotion:
            held = len(queued.slots)
            ok = [True] * held + [False] * (len(queued.keys) - held)
            if isinstance(error, CorruptBlockError):
                bad_slots = set(error.slots)
                bad = {i for i, slot in enumerate(queued.slots) if slot in bad_slots}
                try:
                    dropped = self.store.discard([queued.hashes[i] for i in sorted(bad)])
                except Exception:  # not loaded either way; a later promotion finds it corrupt again
                    logger.exception("kvcopy disk tier: corrupt chunks could not be dropped")
                    dropped = 0
                logger.warning("kvcopy disk tier: %d chunk(s) failed their checksum; dropped, recomputed", dropped)
                ok = [good and i not in bad for i, good in enumerate(ok)]
                corrupt = len(bad)
            elif error is not None:
                ok, corrupt = [False] * len(ok), 0
                logger.warning("kvcopy disk tier: promotion job %d failed: %s", job.job_id, error)
            else:
                corrupt = 0
            loaded = [key for key, good in zip(queued.keys, ok, strict=True) if good]
            result = JobResult(
                job.job_id,
                success=len(loaded) == len(queued.keys),
                successful_keys=loaded if 0 < len(loaded) < len(queued.keys) else None,
                transfer_time=now - queued.posted,
                transfer_bytes=len(loaded) * row_bytes,
            )
            with self._lock:
                self._count("loaded_blocks", len(loaded))
                self._count("loaded_bytes", len(loaded) * row_bytes)
                self._count("corrupt_blocks", corrupt)
                self._stats.observe_histogram(PROMOTION_LATENCY, now - job.submit_time, self._labels)
        else:
            stored = queued.new if error is None else 0
            if error is not None and transfer is not None:
                logger.warning("kvcopy disk tier: cascade job %d failed: %s", job.job_id, error)
            result = JobResult(
                job.job_id, success=error is None, transfer_time=now - queued.posted, transfer_bytes=stored * row_bytes
            )
            with self._lock:
                self._count("stored_blocks", stored)
                self._count("stored_bytes", stored * row_bytes)
        with self._lock:
            self._finished.append(result)
            self._lock.notify_all()


def _tier_label(offloading_spec: Any, tier_type: str, path: object) -> str:
    """The tier's metric label as vLLM's tiering metrics name a tier, ``"<index + 1>:<type>"``: its place in the
    spec's ``secondary_tiers``, found by its type and ``path``; the type alone where the spec has no such list
    (a tier built outside vLLM's tiering spec)."""
    configs = getattr(offloading_spec, "secondary_tier_configs", None)
    for index, config in enumerate(configs if isinstance(configs, list) else []):
        if isinstance(config, Mapping) and config.get("type") == tier_type and config.get("path") == path:
            return f"{index + 1}:{tier_type}"
    return tier_type


def _warn_if_hashes_change_per_process() -> None:
    """Logs once when vLLM's block hashes are seeded at random in each process (xxhash without
    PYTHONHASHSEED): nothing stored is then found after a restart."""
    vllm_config = engine_vllm_config()
    algorithm = str(getattr(getattr(vllm_config, "cache_config", None), "prefix_caching_hash_algo", ""))
    if algorithm.startswith("xxhash") and not os.environ.get("PYTHONHASHSEED"):
        logger.warning(
            "kvcopy disk tier: prefix_caching_hash_algo %r without PYTHONHASHSEED seeds vLLM's block hashes at "
            "random in each process, so the tier cannot hit across restarts (set PYTHONHASHSEED, or use sha256)",
            algorithm,
        )
