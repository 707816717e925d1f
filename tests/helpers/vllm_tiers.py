"""vLLM's stock multi-tier offloading on the CPU: its real Scheduler and OffloadingConnector (both roles) with
its own ``TieringOffloadingSpec`` (a CPU primary tier in a shared region of /dev/shm, and secondary tiers from
``secondary_tiers``), around CPU tensors standing in for the GPU's KV cache (tests/helpers/vllm.py).

vLLM's worker cannot run on a CPU (``CPUOffloadingSpec.get_worker`` raises, its handlers assert CUDA tensors),
so ``CPUTieringSpec`` overrides ``get_worker`` only, with ``CPUStandInWorker``: it maps the same region and
views it per canonical tensor as vLLM's ``CPUOffloadingWorker`` does, builds the same copy descriptors with
vLLM's own ``compute_sub_block_ptrs``, and runs them synchronously on the CPU. The rows it writes are the
bytes vLLM's worker writes on a GPU: a row holds every worker's slot plus padding to the page; inside a slot
the bytes are tensor-major, ``[t0: j0 j1 ... | t1: j0 j1 ...]`` for the chunk's blocks j.

Usage (``tests/integrations/test_vllm_tiering_rig.py``)::

    rig = make_tiering_rig(tmp_path, secondary_tiers=[{"type": "fs", "root_dir": str(tmp_path / "fs")}])
    try:
        tokens, hit = rig.reload_from_tiers(PROMPT)  # stored, cascaded, evicted, reset, zeroed, requested again
        assert_blocks_hold(rig, "again", tokens, range(hit // BLOCK_TOKENS))
    finally:
        rig.close()
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import glob
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs it)")

import torch
from vllm import SamplingParams
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingWorker,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.request import Request

from helpers import HANG_TIMEOUT_S
from helpers.vllm import BLOCK_TOKENS, HEAD_DIM, HEADS, MAX_MODEL_LEN, Rig, make_rig

# The spec as vLLM's OffloadingSpecFactory loads it (pytest puts tests/ on sys.path: pyproject's pythonpath).
TIERING_SPEC_PATH = {"spec_name": "CPUTieringSpec", "spec_module_path": "helpers.vllm_tiers"}
# The primary tier's bytes: 512 chunks of 2 layers' 16-token blocks (8 KiB each), room for every prompt a
# test stores; a test that wants the primary to evict passes less.
PRIMARY_BYTES = 1 << 22
# After a step that computed nothing, the rig pauses this long so the tiers' threads (the fs tier's lookups
# and copies) can move; short against a step, so a waiting request costs little time.
IDLE_PAUSE_S = 0.002
# /dev/shm/vllm_offload_<engine_id>.mmap (and .1, .2 ... when vLLM splits a large region into segments)
REGION_PATH = "/dev/shm/vllm_offload_{engine_id}.mmap"


@dataclass(frozen=True)
class StandInJob:
    """One transfer the stand-in ran: its direction, the GPU blocks and the primary chunks it touched."""

    job_id: int
    store: bool  # GPU -> primary (a store); False: primary -> GPU (a load)
    gpu_block_ids: tuple[int, ...]
    chunk_ids: tuple[int, ...]
    num_bytes: int


class CPUStandInWorker(OffloadingWorker):
    """vLLM's ``CPUOffloadingWorker`` on CPU tensors: the same region, the same views, the same descriptors,
    copied with memmove at submission (so every job is finished when ``get_finished`` is next asked)."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion) -> None:
        self.region = region
        self.blocks_per_chunk = blocks_per_chunk
        self.refs_per_group = kv_caches.group_data_refs
        self.gpu_tensors: list[torch.Tensor] = []
        self.cpu_tensors: list[torch.Tensor] = []
        for cache in kv_caches.tensors:  # as CPUOffloadingWorker.__init__, direct (non-canonical) layout
            page = cache.page_size_bytes
            self.gpu_tensors.append(cache.tensor.view(torch.int8).view((-1, page)))
            self.cpu_tensors.append(region.create_next_worker_view(page * blocks_per_chunk))
        self.jobs: list[StandInJob] = []  # every job run, in order
        self._finished: list[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._run(job_id, src_spec, dst_spec, gpu_to_cpu=True)

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        return self._run(job_id, src_spec, dst_spec, gpu_to_cpu=False)

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return  # every job ran at submission

    def shutdown(self) -> None:
        self.gpu_tensors.clear()
        self.cpu_tensors.clear()  # the region's own views go with cleanup()
        self.region.cleanup()

    def _run(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec, *, gpu_to_cpu: bool) -> bool:
        start = time.perf_counter()
        num_bytes = self._copy(src_spec, dst_spec, gpu_to_cpu)
        self._finished.append(TransferResult(job_id, True, num_bytes, time.perf_counter() - start))
        gpu, cpu = (src_spec, dst_spec) if gpu_to_cpu else (dst_spec, src_spec)
        assert isinstance(gpu, BlockIDsLoadStoreSpec) and isinstance(cpu, BlockIDsLoadStoreSpec)
        self.jobs.append(
            StandInJob(job_id, gpu_to_cpu, tuple(map(int, gpu.block_ids)), tuple(map(int, cpu.block_ids)), num_bytes)
        )
        return True

    def _copy(self, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec, gpu_to_cpu: bool) -> int:
        """``SingleDirectionOffloadingHandler.transfer_async`` with ``_fill_direct_ops``, line for line, each
        descriptor (src pointer, dst pointer, the layer's unpadded page) run by memmove."""
        assert isinstance(src_spec, BlockIDsLoadStoreSpec) and isinstance(dst_spec, BlockIDsLoadStoreSpec)
        gpu_spec = src_spec if gpu_to_cpu else dst_spec
        assert isinstance(gpu_spec, GPULoadStoreSpec)
        assert len(gpu_spec.group_sizes) == len(gpu_spec.block_indices) == len(self.refs_per_group)
        src_tensors, dst_tensors = (
            (self.gpu_tensors, self.cpu_tensors) if gpu_to_cpu else (self.cpu_tensors, self.gpu_tensors)
        )
        src_bpc = 1 if gpu_to_cpu else self.blocks_per_chunk  # GPU blocks are one per row; chunks hold bpc
        dst_bpc = self.blocks_per_chunk if gpu_to_cpu else 1
        src_blocks, dst_blocks = src_spec.block_ids, dst_spec.block_ids
        src_at = dst_at = 0
        num_bytes = 0
        groups = zip(gpu_spec.group_sizes, gpu_spec.block_indices, strict=True)
        for group, (group_size, block_index) in enumerate(groups):
            if group_size == 0:
                continue
            src_skip, dst_skip = block_index % src_bpc, block_index % dst_bpc
            src_end = src_at + cdiv(group_size + src_skip, src_bpc)
            dst_end = dst_at + cdiv(group_size + dst_skip, dst_bpc)
            assert src_end <= len(src_blocks) and dst_end <= len(dst_blocks)
            for ref in self.refs_per_group[group]:
                src_ptrs = np.empty(group_size, dtype=np.int64)
                dst_ptrs = np.empty(group_size, dtype=np.int64)
                src, dst = src_tensors[ref.tensor_idx], dst_tensors[ref.tensor_idx]
                compute_sub_block_ptrs(src_blocks[src_at:src_end], src_bpc, src_ptrs, src, skip_count=src_skip)
                compute_sub_block_ptrs(dst_blocks[dst_at:dst_end], dst_bpc, dst_ptrs, dst, skip_count=dst_skip)
                _check_inside(src, src_ptrs, ref.page_size_bytes)
                _check_inside(dst, dst_ptrs, ref.page_size_bytes)
                for s, d in zip(src_ptrs.tolist(), dst_ptrs.tolist(), strict=True):
                    ctypes.memmove(d, s, ref.page_size_bytes)
                num_bytes += group_size * ref.page_size_bytes
            src_at, dst_at = src_end, dst_end
        assert (src_at, dst_at) == (len(src_blocks), len(dst_blocks)), "the job's blocks were not all used"
        return num_bytes


def _check_inside(tensor: torch.Tensor, pointers: np.ndarray, size: int) -> None:
    """Every ``size`` bytes from ``pointers`` lie inside the 2-D int8 ``tensor`` (a bad descriptor fails here
    instead of writing outside it)."""
    if not len(pointers):
        return
    low = tensor.data_ptr()
    high = low + (tensor.shape[0] - 1) * tensor.stride(0) + tensor.shape[1]
    assert low <= int(pointers.min()) and int(pointers.max()) + size <= high, "a descriptor leaves its tensor"


class CPUTieringSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` with ``CPUStandInWorker`` as its worker; nothing else changes."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if getattr(self, "_stand_in", None) is None:
            if self.config.canonical_layout:
                raise NotImplementedError("CPUStandInWorker copies vLLM's direct layout only, not canonical_layout")
            # as TieringOffloadingSpec.create_worker
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=0 if self.replicated_layout else self.config.parallel.rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                self._stand_in = CPUStandInWorker(kv_caches, self.blocks_per_chunk, region)
            except BaseException:
                region.cleanup()
                raise
        return self._stand_in


class TieringRig(Rig):
    """A Rig (tests/helpers/vllm.py) whose connector runs vLLM's tiering manager: its idle steps let the tiers'
    threads move, its step loops are bounded by HANG_TIMEOUT_S instead of a count of steps (a busy machine
    takes more idle steps for the same thread work), and ``drain`` also waits for the cascades."""

    closed = False
    region_left_behind = False  # set by close(): a region file was still in /dev/shm after the shutdown

    @property
    def manager(self) -> TieringOffloadingManager:
        """vLLM's TieringOffloadingManager, as the scheduler-side connector holds it."""
        return self.scheduler.connector.connector_scheduler.manager

    @property
    def tiers(self) -> list[Any]:
        """The secondary tiers, in configuration order."""
        return self.manager.secondary_tiers

    @property
    def engine_id(self) -> str:
        return self.vllm_config.kv_transfer_config.engine_id

    @property
    def region_path(self) -> str:
        return REGION_PATH.format(engine_id=self.engine_id)

    @property
    def region(self) -> torch.Tensor:
        """The primary tier's rows, (num_chunks, row_stride) int8, over the memoryview the tiers are given
        (zero-copy: valid until ``close()`` unmaps it)."""
        view = self.manager.primary_tier.get_kv_memoryview()
        return torch.frombuffer(view, dtype=torch.int8).view(view.shape)

    def _on_idle_step(self) -> None:
        time.sleep(IDLE_PAUSE_S)

    def _step_until(self, done: Callable[[], bool], max_steps: int, what: str) -> None:
        deadline = time.monotonic() + HANG_TIMEOUT_S
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} in {HANG_TIMEOUT_S} s")
            self.step()

    def _transfers_pending(self) -> bool:
        """The connector's jobs, a reset's fence, or the manager's cascades and promotions (vLLM's own test of
        whether the engine must keep stepping)."""
        return self.scheduler.connector.has_pending_push_work()

    def evict_primary(self) -> None:
        """Empties the primary tier (vLLM's connector reset: the tiers drain their jobs, the primary drops every
        chunk, the secondary tiers keep theirs) and zeroes its rows, so whatever is loaded next came from a
        secondary tier. Call it with nothing in flight (after ``drain``)."""
        assert not self._transfers_pending(), "evict_primary with transfers in flight: drain() first"
        assert self.scheduler.reset_connector_cache()
        self.region.zero_()

    def reset_prefix_cache(self, *, zero: bool = True) -> None:
        """Drops vLLM's prefix cache (and with ``zero``, the KV cache's bytes)."""
        assert self.scheduler.reset_prefix_cache()
        if zero:
            for cache in self.caches.values():
                cache.zero_()

    def store_cascade_evict(self, tokens: Sequence[int], request_id: str = "first") -> None:
        """Runs ``request_id`` over ``tokens`` until its stores and their cascades are done, then empties the
        primary tier, vLLM's prefix cache and the KV cache: what is left of the prompt is in the secondary
        tiers."""
        self.add(request_id, list(tokens))
        self.run()
        self.drain()
        self.evict_primary()
        self.reset_prefix_cache(zero=True)

    def reload_from_tiers(self, prompt: Sequence[int]) -> tuple[list[int], int]:
        """``store_cascade_evict(prompt)``, then request "again" over it with 3 more tokens until its prompt is
        in: (those tokens, the tokens loaded, every complete chunk), asserting the rest was computed."""
        self.store_cascade_evict(prompt)
        tokens = [*prompt, 5, 6, 7]
        chunk_tokens = BLOCK_TOKENS * self.blocks_per_chunk
        hit = len(prompt) // chunk_tokens * chunk_tokens
        assert len(tokens) - hit in self.rerun(tokens, keep_blocks=True)
        return tokens, hit

    @property
    def blocks_per_chunk(self) -> int:
        return self.scheduler.connector.connector_scheduler.config.blocks_per_chunk

    def offload_keys(self, tokens: Sequence[int], group: int = 0) -> list[OffloadKey]:
        """The OffloadKeys of ``tokens``' complete chunks in ``group``, in order: the hash of each chunk's last
        block (chained over the whole prefix) and the group, 4 bytes big-endian."""
        request = Request(
            request_id="keys", prompt_token_ids=list(tokens), sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=self._hasher,
        )  # fmt: skip
        hashes = request.block_hashes[self.blocks_per_chunk - 1 :: self.blocks_per_chunk]
        return [make_offload_key(h, group) for h in hashes]

    def primary_chunk_ids(self, keys: Sequence[OffloadKey]) -> list[int]:
        """Where the primary tier holds ``keys`` (each must be a HIT there), asked through the reads a cascade
        takes (prepare_read/complete_read, which leave the eviction order alone) under the manager's lock."""
        context = ReqContext(req_id="rig-probe")
        with self.manager.lock:
            spec = self.manager.primary_tier.prepare_read(keys, context)
            self.manager.primary_tier.complete_read(keys, context)
        assert isinstance(spec, BlockIDsLoadStoreSpec)
        return [int(c) for c in spec.block_ids]

    def close(self) -> None:
        """Shuts both roles down (the worker unmaps the region, the scheduler's manager shuts the tiers down and
        removes the region), then removes a region file still there; ``region_left_behind`` says whether one
        was."""
        if self.closed:
            return
        self.closed = True
        try:
            super().close()
        finally:
            path = glob.escape(self.region_path)
            leftovers = glob.glob(path) + glob.glob(path + ".*")  # the region and its segments
            self.region_left_behind = bool(leftovers)
            for path in leftovers:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)


def make_tiering_rig(
    tmp_path,
    *,
    secondary_tiers: list[dict[str, Any]],
    blocks_per_chunk: int = 1,
    num_layers: int = 2,
    cpu_bytes_to_use: int = PRIMARY_BYTES,
    extra: dict[str, Any] | None = None,
    engine_id: str | None = None,
    num_blocks: int = 160,
    max_batch_tokens: int = 512,
    hf_overrides: dict | None = None,
    cache_dtype: str = "auto",
    spec: dict[str, str] | None = None,
    kv_events: bool = False,
    device: str = "cpu",
    kv_heads: int = HEADS,
    head_dim: int = HEAD_DIM,
    max_model_len: int = MAX_MODEL_LEN,
) -> TieringRig:
    """A CPU engine with vLLM's stock TieringOffloadingSpec (CPUTieringSpec) over ``secondary_tiers`` (copied:
    vLLM's spec writes into them); ``extra`` adds or overrides keys of kv_connector_extra_config. The engine id
    is unique (so is the region in /dev/shm) unless given; ``hf_overrides``, ``cache_dtype``, ``kv_events``,
    ``device``, ``kv_heads``, ``head_dim`` and ``max_model_len`` are make_rig's; ``spec`` names another spec (spec_name,
    spec_module_path). Close it with ``close()``."""
    extra_config = {
        **(spec or TIERING_SPEC_PATH),
        "cpu_bytes_to_use": cpu_bytes_to_use,
        "blocks_per_chunk": blocks_per_chunk,
        "secondary_tiers": copy.deepcopy(secondary_tiers),
        **(extra or {}),
    }
    rig = make_rig(
        tmp_path,
        num_layers=num_layers,
        num_blocks=num_blocks,
        max_batch_tokens=max_batch_tokens,
        extra=extra_config,
        engine_id=engine_id or f"kvcopy-test-{uuid.uuid4().hex[:12]}",
        rig_cls=TieringRig,
        hf_overrides=hf_overrides,
        cache_dtype=cache_dtype,
        kv_events=kv_events,
        device=device,
        kv_heads=kv_heads,
        head_dim=head_dim,
        max_model_len=max_model_len,
    )
    assert isinstance(rig, TieringRig)
    return rig


class MemoryRowTier(SecondaryTierManager):
    """A secondary tier in this process's memory that really copies rows (vLLM's ``example`` tier only records
    keys): configured as ``{"type": "MemoryRowTier", "module_path": "helpers.vllm_tiers"}``. Its lookups answer
    at once; a job's copies run at submission and it is reported at the next ``get_finished_jobs``. ``corrupt``
    makes a key's promotion fail: the chunks before it in the job are loaded and reported in
    ``successful_keys``, and the key is dropped (unless ``drop_failed`` is False), so later lookups of it miss.
    A promotion reports its bytes and seconds; ``medium`` ("STORAGE" by default) is vLLM's ``Medium``."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        drop_failed: bool = True,
        medium: str = "STORAGE",
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.medium = Medium(medium)  # type: ignore[misc]  # (an instance's, not the class's)
        self.drop_failed = drop_failed  # False: a key whose promotion failed still answers HIT
        # memoryview cannot index a 2-D view by row (NotImplementedError); numpy's view of it can, zero-copy
        self._primary: np.ndarray | None = np.asarray(primary_kv_view)
        self.rows: dict[OffloadKey, bytes] = {}
        self.corrupted: set[OffloadKey] = set()
        self._done: list[JobResult] = []

    def corrupt(self, key: OffloadKey) -> None:
        self.corrupted.add(key)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if key in self.rows else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        for key, chunk in zip(list(job_metadata.keys), job_metadata.chunk_ids.tolist(), strict=True):
            self.rows[key] = self._primary_rows()[chunk].tobytes()
        self._done.append(JobResult(job_metadata.job_id, True))

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        started = time.perf_counter()
        for done, (key, chunk) in enumerate(zip(keys, job_metadata.chunk_ids.tolist(), strict=True)):
            if key in self.corrupted or key not in self.rows:
                if self.drop_failed:
                    self.rows.pop(key, None)
                self._done.append(JobResult(job_metadata.job_id, False, successful_keys=keys[:done] or None))
                return
            self._primary_rows()[chunk] = np.frombuffer(self.rows[key], dtype=np.int8)
        seconds, nbytes = time.perf_counter() - started, len(keys) * self._primary_rows().shape[1]
        self._done.append(JobResult(job_metadata.job_id, True, transfer_time=seconds, transfer_bytes=nbytes))

    def get_finished_jobs(self) -> list[JobResult]:
        done, self._done = self._done, []
        return done

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        return  # every job ran at submission

    def shutdown(self) -> None:
        self._primary = None  # an export of the primary's memoryview left here would keep the region mapped

    def _primary_rows(self) -> np.ndarray:
        assert self._primary is not None, "the tier was shut down"
        return self._primary


def record_calls(obj: object, name: str) -> list[tuple[Any, ...]]:
    """Wraps ``obj.name`` so each call's positional arguments are appended to the returned list (a spy: the
    method still runs)."""
    method = getattr(obj, name)
    calls: list[tuple[Any, ...]] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return method(*args, **kwargs)

    setattr(obj, name, spy)
    return calls
