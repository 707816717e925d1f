"""The worker half of kvcopy's vLLM offloading: every job one TransferEngine submission.

vLLM's worker-side connector calls ``submit_store`` / ``submit_load`` with a
job id and the job's specs, ``get_finished`` once per step and ``wait`` for the
loads a step must have (docs/engines.md, "vLLM"). Here:

- the device side is one :class:`~kvcopy.PagedKV` whose planes are vLLM's
  canonical KV tensors (each ``(num_blocks, page_bytes)`` int8: vLLM has already
  reduced FlashAttention's, FlashInfer's and MLA's layouts, scale tensors
  included, to these pages);
- the host side is one page-first :class:`~kvcopy.HostKVPool` of
  ``num_chunks * blocks_per_chunk`` blocks, one per device block of a chunk
  (kvcopy.integrations.vllm._chunks); under tiered offloading, vLLM's shared
  primary region in vLLM's own layout instead (kvcopy.integrations.vllm.primary_region:
  one engine per sub-block position of a chunk, a job split among them);
- order comes from the TransferEngine: a load of chunks a store is still
  writing starts after it, a store reads device blocks only after the work
  already queued on the caller's stream (the forward that wrote them), and
  jobs that share no block overlap. Prefetch loads run on the reload stream and
  expedited ones (a step waits for them) on the expedited stream of the
  greatest priority (kvcopy.engine.streams), so no load queues behind a store,
  nor an expedited load behind a prefetch.

A copy that fails is logged and reported ``success=False``, never as done.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvcopy.engine.engine import TransferEngine
from kvcopy.engine.transfer import Transfer
from kvcopy.host.pool import HostKVPool
from kvcopy.integrations.common.offload_session import OffloadSession
from kvcopy.integrations.vllm._chunks import job_block_ids
from kvcopy.integrations.vllm.primary_region import RegionHost
from kvcopy.layout import PagedKV
from kvcopy.profile import Profile

__all__ = ["CopyObservation", "KVCopyOffloadingWorker", "paged_kv_of"]

logger = logging.getLogger("kvcopy.integrations.vllm")

# Finished copies kept for the scheduler until a connector collects them (KVCopyOffloadingConnector does, every
# step); vLLM's stock connector never does, so the oldest are dropped past this many: about a minute of copies.
MAX_UNCOLLECTED_COPIES = 4096


def paged_kv_of(kv_caches: CanonicalKVCaches) -> PagedKV:
    """The PagedKV over vLLM's canonical KV tensors: one plane per tensor, a block its page of bytes."""
    planes = []
    for i, entry in enumerate(kv_caches.tensors):
        tensor = entry.tensor
        if tensor.dim() != 2 or tensor.dtype != torch.int8 or tensor.shape[1] != entry.page_size_bytes:
            raise ValueError(
                f"kv_caches.tensors[{i}]: expected an int8 (num_blocks, {entry.page_size_bytes}) page tensor, got "
                f"{tensor.dtype} {tuple(tensor.shape)}"
            )
        planes.append(tensor)
    return PagedKV(planes)


@dataclass(frozen=True)
class CopyObservation:
    """One finished copy as OnlineProfile.observe_copy takes it: Profile direction, method, bytes, blocks, and
    its turnaround in seconds."""

    profile_direction: str
    method: str
    nbytes: int
    num_blocks: int
    seconds: float


@dataclass
class _Job:
    transfers: list[Transfer] | None  # one per engine it went to; None: it failed before it was submitted
    nbytes: int
    device_ids: list[int]

    def done(self) -> bool:
        return self.transfers is None or all(transfer.done() for transfer in self.transfers)


class KVCopyOffloadingWorker(OffloadingWorker):
    """Stores (device -> host) and loads (host -> device) of vLLM's jobs on one kvcopy TransferEngine.

    ``kv``: vLLM's canonical KV tensors as a PagedKV (:func:`paged_kv_of`).
    ``session`` owns the host pool (``num_chunks * blocks_per_chunk`` blocks), unless ``region`` (the worker's
    ``SharedOffloadRegion`` of vLLM's tiered offloading) is the host side; ``method`` and ``profile`` are
    the engine's copy method and the profile its ``"auto"`` reads. ``get_finished`` reports each job once,
    with its bytes and its turnaround (seconds from submission until done, time behind other copies
    included). Each finished copy also lands in :attr:`copies`, for the scheduler's planner to learn from.
    """

    def __init__(
        self,
        kv: PagedKV,
        *,
        blocks_per_chunk: int,
        num_chunks: int,
        session: OffloadSession,
        method: str = "auto",
        profile: Profile | None = None,
        region: Any = None,
    ) -> None:
        self.kv = kv
        self.blocks_per_chunk = blocks_per_chunk
        self.num_chunks = num_chunks
        self.session = session
        engine: dict[str, Any] = {"method": method, "profile": profile, "observer": self._observe}
        self.region: RegionHost | None = None
        self.host: HostKVPool
        if region is not None:
            self.region = RegionHost(region, kv, blocks_per_chunk, num_chunks, pin=None, **engine)
            self.engine, self.host = self.region.engines[0], self.region.pools[0]  # (the first sub-block's)
        else:
            host = session.pools_for({"kv": self.kv})["kv"]
            if host is None or host.num_blocks < num_chunks * blocks_per_chunk:
                raise ValueError(f"cpu_bytes_to_use: holds no {num_chunks} chunks of {blocks_per_chunk} blocks")
            self.host = host
            self.engine = TransferEngine(self.kv, host, **engine)
        self.copies: deque[CopyObservation] = deque(maxlen=MAX_UNCOLLECTED_COPIES)  # for the scheduler to learn
        self.hold_failures = False  # KVCopyOffloadingConnector: failed jobs go to `failures`, not get_finished
        self.failures: list[tuple[int, list[int]]] = []  # (job id, device blocks) of failed jobs held back
        self._jobs: dict[int, _Job] = {}  # in flight or not yet reported, in submission order
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ submission

    def _ids(self, gpu: LoadStoreSpec, host: LoadStoreSpec, name: str) -> tuple[list[int], list[int]]:
        if not isinstance(gpu, GPULoadStoreSpec):
            raise TypeError(f"{name}: expected a GPULoadStoreSpec, got {type(gpu).__name__}")
        if not isinstance(host, BlockIDsLoadStoreSpec):
            raise TypeError(f"{name}: expected the host chunks as a BlockIDsLoadStoreSpec, got {type(host).__name__}")
        return job_block_ids(gpu.block_ids, gpu.group_sizes, gpu.block_indices, host.block_ids, self.blocks_per_chunk)

    def _submit(
        self, job_id: int, direction: str, device_ids: list[int], host_ids: list[int], expedited: bool = False
    ) -> bool:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"submit_{direction}: this worker is shut down")
            if job_id in self._jobs:
                raise ValueError(f"job_id: {job_id} is already in flight")
            started: list[Transfer] = []
            try:
                for engine, devices, hosts in self._routes(device_ids, host_ids):
                    if direction == "store":
                        started.append(engine.offload(devices, hosts))
                    else:
                        started.append(engine.reload(hosts, devices, expedited=expedited))
                transfers: list[Transfer] | None = started
            except Exception:  # vLLM hears of it as a failed job, never as a done one
                logger.exception("kvcopy: %s job %d failed to start", direction, job_id)
                for part in started:  # (a job split among engines: the parts started are waited for)
                    with contextlib.suppress(Exception):
                        part.wait()
                transfers = None
            self._jobs[job_id] = _Job(transfers, len(device_ids) * self.kv.nbytes_per_block, device_ids)
        return True

    def _routes(self, device_ids: list[int], host_ids: list[int]) -> list[tuple[TransferEngine, list[int], list[int]]]:
        """The engines a job's blocks go to: the one engine, or the region's per sub-block position."""
        if self.region is not None:
            return self.region.route(device_ids, host_ids)
        return [(self.engine, device_ids, host_ids)]

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Device blocks -> host chunks, after the work already queued on the current stream."""
        device_ids, host_ids = self._ids(src_spec, dst_spec, "src_spec")
        return self._submit(job_id, "store", device_ids, host_ids)

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        """Host chunks -> device blocks, after any unfinished store of those chunks. ``expedited`` loads (a step
        waits for them) run on the engine's expedited queue, never behind prefetch loads."""
        device_ids, host_ids = self._ids(dst_spec, src_spec, "dst_spec")
        return self._submit(job_id, "load", device_ids, host_ids, expedited=bool(expedited))

    # ------------------------------------------------------------------ completion

    def _observe(self, transfer: Transfer) -> None:
        """The engine's observer: every copy that finished without error, with its turnaround."""
        if transfer.turnaround is not None:
            self.copies.append(
                CopyObservation(
                    transfer.profile_direction,
                    transfer.method,
                    transfer.nbytes,
                    transfer.num_blocks,
                    transfer.turnaround,
                )
            )

    @staticmethod
    def _result(job_id: int, job: _Job) -> TransferResult:
        if job.transfers is None:
            return TransferResult(job_id=job_id, success=False)
        try:
            for transfer in job.transfers:
                transfer.wait()  # done already: re-raises the copy's error, if it had one
        except Exception:  # reported, not raised: vLLM decides what a failed job means
            logger.exception("kvcopy: job %d failed; its blocks are not valid", job_id)
            return TransferResult(job_id=job_id, success=False)
        turnarounds = [t.turnaround for t in job.transfers if t.turnaround is not None]
        seconds = max(turnarounds) if turnarounds else None
        return TransferResult(job_id=job_id, success=True, transfer_size=job.nbytes, transfer_time=seconds)

    def get_finished(self) -> list[TransferResult]:
        """The jobs finished since the last call, each reported once (with ``hold_failures``, the failed ones go
        to :attr:`failures` instead)."""
        with self._lock:
            done = [(job_id, job) for job_id, job in self._jobs.items() if job.done()]
            for job_id, _ in done:
                del self._jobs[job_id]
        results = []
        for job_id, job in done:
            result = self._result(job_id, job)
            if not result.success and self.hold_failures:
                self.failures.append((job_id, job.device_ids))
            else:
                results.append(result)
        return results

    @property
    def job_ids_in_flight(self) -> set[int]:
        """The jobs submitted and not yet reported by :meth:`get_finished`."""
        with self._lock:
            return set(self._jobs)

    def wait(self, job_ids: set[int]) -> None:
        """Blocks until those jobs (the ones still unreported) are done; errors wait for get_finished."""
        with self._lock:
            transfers = [t for j in job_ids if j in self._jobs for t in (self._jobs[j].transfers or [])]
        for transfer in transfers:
            with contextlib.suppress(Exception):
                transfer.wait()

    def shutdown(self) -> None:
        """Waits for every copy in flight, then frees the host pool (or lets go of vLLM's region); later
        submissions are a RuntimeError."""
        with self._lock:
            self._closed = True
        if self.region is not None:
            del self.engine, self.host  # (the region's: nothing of the worker may hold it when it is unmapped)
            self.region.close()  # its engines first, then the region (vLLM's cleanup unmaps it)
        else:
            self.engine.close()
        with self._lock:
            self._jobs.clear()
        self.session.close()
