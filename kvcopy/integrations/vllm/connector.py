"""KVCopyOffloadingConnector: vLLM's OffloadingConnector with kvcopy's spec, learning from the engine, and
failed copies turned into recomputation instead of a crash.

What it adds to vLLM's connector (docs/engines.md, "vLLM"):

- learning (``kvcopy_learn``): the worker side sends each finished copy (direction, method, bytes, blocks,
  turnaround) with the step's worker metadata; the scheduler side times each step from the moment its
  metadata is built to the moment its output arrives, with the tokens every request computed and the tokens
  it had cached. Both feed the spec's OnlineProfile, the one the manager's Planner judges hits with. A step
  whose forward waited for a synchronous load is not taken as a forward.
- failures: vLLM's connector asserts that every transfer succeeded. Here a failed load is reported to vLLM's
  scheduler as a failed receive (vLLM recomputes the request, its ``kv_load_failure_policy`` permitting), a
  failed expedited load as invalid blocks (recomputed), and a failed store drops its chunks
  (``complete_store(success=False)``): they never read as stored.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from kvcopy.integrations.vllm.manager import KVCopyOffloadingManager
from kvcopy.integrations.vllm.worker import CopyObservation, KVCopyOffloadingWorker

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker

__all__ = ["KVCopyOffloadingConnector", "KVCopyWorkerMetadata"]

SPEC_NAME = "KVCopyOffloadingSpec"
SPEC_MODULE = "kvcopy.integrations.vllm"


@dataclass
class KVCopyWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker metadata, plus the step's finished copies and the store jobs that failed."""

    copies: list[CopyObservation] = field(default_factory=list)
    failed_stores: set[int] = field(default_factory=set)

    def aggregate(self, other: Any) -> KVCopyWorkerMetadata:
        merged = super().aggregate(other)
        assert isinstance(merged, OffloadingWorkerMetadata)  # what vLLM's OffloadingWorkerMetadata.aggregate makes
        return KVCopyWorkerMetadata(
            completed_jobs=merged.completed_jobs,
            transfer_stats=merged.transfer_stats,
            copies=self.copies + list(getattr(other, "copies", [])),
            failed_stores=self.failed_stores | set(getattr(other, "failed_stores", set())),
        )


@dataclass
class _Step:
    started: float
    tokens: list[int]
    cached: list[int]
    waited_for_load: bool


class KVCopyOffloadingConnector(OffloadingConnector):
    """Name it with ``"kv_connector": "KVCopyOffloadingConnector", "kv_connector_module_path":
    "kvcopy.integrations.vllm"``; ``spec_name`` and ``spec_module_path`` default to kvcopy's spec, and another
    spec is a ValueError."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        extra.setdefault("spec_name", SPEC_NAME)
        extra.setdefault("spec_module_path", SPEC_MODULE)
        if (extra["spec_name"], extra["spec_module_path"]) != (SPEC_NAME, SPEC_MODULE):
            raise ValueError(
                f"spec_name: KVCopyOffloadingConnector runs {SPEC_NAME} from {SPEC_MODULE}, got "
                f"{extra['spec_name']} from {extra['spec_module_path']}"
            )
        super().__init__(vllm_config, role, kv_cache_config)
        self._steps: deque[_Step] = deque()
        self._failed_sync_blocks: set[int] = set()

    # ------------------------------------------------------------------ worker side

    @property
    def _worker_side(self) -> OffloadingConnectorWorker:
        """vLLM's worker side of the connector: the worker role's connector has one."""
        connector = self.connector_worker
        assert connector is not None, "a worker-side call on the scheduler's connector"
        return connector

    def _kv_worker(self) -> KVCopyOffloadingWorker | None:
        worker = self.connector_worker.worker if self.connector_worker is not None else None
        if isinstance(worker, KVCopyOffloadingWorker):
            worker.hold_failures = True
            return worker
        return None

    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        self._kv_worker()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        results = super().get_transfer_results(finished_req_ids)
        worker = self._kv_worker()
        if worker is None:
            return results
        connector = self._worker_side
        meta = connector._connector_worker_meta  # vLLM's per-step metadata, sent with the step's output
        for job_id, device_ids in worker.failures:
            meta.mark_completed(job_id)  # a failed job is over: vLLM must stop waiting for it
            if job_id not in connector._load_jobs:
                self._failed_stores().add(job_id)
                continue
            request_id = connector._load_jobs.pop(job_id)
            if request_id is None:  # an expedited load, waited for inside the step: its blocks are invalid
                self._failed_sync_blocks.update(device_ids)
            else:
                results.failed_recving.add(request_id)
                results.finished_recving.add(request_id)
        worker.failures.clear()
        return results

    def _failed_stores(self) -> set[int]:
        return self._step_meta().failed_stores

    def _step_meta(self) -> KVCopyWorkerMetadata:
        """The step's worker metadata, made a KVCopyWorkerMetadata (with what vLLM's held) if it is not one yet."""
        connector = self._worker_side
        meta = connector._connector_worker_meta
        if not isinstance(meta, KVCopyWorkerMetadata):
            meta = KVCopyWorkerMetadata(completed_jobs=meta.completed_jobs, transfer_stats=meta.transfer_stats)
            connector._connector_worker_meta = meta
        return meta

    def get_block_ids_with_load_errors(self) -> set[int]:
        blocks, self._failed_sync_blocks = self._failed_sync_blocks, set()
        return blocks

    def build_connector_worker_meta(self) -> OffloadingWorkerMetadata | None:
        worker = self._kv_worker()
        if worker is not None and worker.copies:
            meta = self._step_meta()
            while worker.copies:
                meta.copies.append(worker.copies.popleft())
            if not meta.completed_jobs:  # vLLM's own sends nothing without a completed job: send the copies
                self._worker_side._connector_worker_meta = OffloadingWorkerMetadata()
                return meta
        return super().build_connector_worker_meta()

    # ------------------------------------------------------------------ scheduler side

    @property
    def _scheduler_side(self) -> OffloadingConnectorScheduler:
        """vLLM's scheduler side of the connector: the scheduler role's connector has one."""
        connector = self.connector_scheduler
        assert connector is not None, "a scheduler-side call on a worker's connector"
        return connector

    @property
    def _manager(self) -> KVCopyOffloadingManager:
        manager = self._scheduler_side.manager
        assert isinstance(manager, KVCopyOffloadingManager)  # kvcopy's spec makes it (checked in __init__)
        return manager

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        tokens, cached = [], []
        for new in scheduler_output.scheduled_new_reqs:
            tokens.append(scheduler_output.num_scheduled_tokens[new.req_id])
            cached.append(new.num_computed_tokens)
        running = scheduler_output.scheduled_cached_reqs
        for request_id, computed in zip(running.req_ids, running.num_computed_tokens, strict=True):
            tokens.append(scheduler_output.num_scheduled_tokens[request_id])
            cached.append(computed)
        waited = any(job.sync for job in getattr(meta, "load_jobs", {}).values())
        self._steps.append(_Step(time.perf_counter(), tokens, cached, waited))
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' step report (vLLM calls this only when there is one): the copies they finished, to
        learn from; the stores that failed, whose chunks must not read as stored; the requests whose load
        failed, which are not loaded again."""
        session = self._manager.session
        meta = connector_output.kv_connector_worker_meta
        if session is not None and isinstance(meta, KVCopyWorkerMetadata):
            for copy in meta.copies:
                session.live.observe_copy(
                    copy.profile_direction, copy.method, copy.nbytes, copy.seconds, copy.num_blocks
                )
            jobs = self._scheduler_side._jobs  # vLLM's jobs in flight: the keys each store writes
            for job_id in meta.failed_stores:
                if job_id in jobs:
                    self._manager.fail_store(jobs[job_id].keys)
        for request_id in connector_output.failed_recving or ():
            self._manager.fail_load(request_id)
        super().update_connector_output(connector_output)

    def get_kv_connector_stats(self) -> Any:
        """vLLM's stats; on the scheduler side also the end of a step (vLLM's scheduler asks once per step's
        output), which times that step's forward."""
        ended = time.perf_counter()
        if self.connector_scheduler is not None and self._steps:
            step = self._steps.popleft()
            session = self._manager.session
            if session is not None and step.tokens and not step.waited_for_load:
                session.live.observe_forward(step.tokens, step.cached, ended - step.started)
        return super().get_kv_connector_stats()
