"""KVCopyOffloadingSpec: vLLM's offloading spec whose copies run on kvcopy and whose loads its Planner judges.

vLLM builds the spec in each role: the scheduler asks it for the manager
(:mod:`.manager`), the worker for the worker (:mod:`.worker`). Both read the
same extra-config keys (:mod:`._config`) and size the host tier alike. As in vLLM's
own CPU spec, ``cpu_bytes_to_use`` is the total of every worker of the engine
(``parallel.world_size``: TP x PP x PCP), and each worker pins its share:
``num_chunks`` = ``cpu_bytes_to_use`` // (one worker's bytes per block x
``blocks_per_chunk`` x ``world_size``) chunks on the scheduler, and
``num_chunks`` x ``blocks_per_chunk`` of its own blocks on each worker.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingCounterMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvcopy.integrations.common.offload_session import OffloadSession
from kvcopy.integrations.common.offload_stats import OffloadStats
from kvcopy.integrations.vllm._compat import check_vllm
from kvcopy.integrations.vllm._config import SpecConfig, read_config
from kvcopy.integrations.vllm.agents.pauses import agent_metric_definitions
from kvcopy.integrations.vllm.manager import COUNTERS, KVCopyOffloadingManager
from kvcopy.integrations.vllm.session import hit_geometry, model_spec_of, new_session
from kvcopy.integrations.vllm.worker import KVCopyOffloadingWorker, paged_kv_of
from kvcopy.model.spec import ModelSpec
from kvcopy.profile import Profile, default_profile

__all__ = ["KVCopyOffloadingSpec"]

logger = logging.getLogger("kvcopy.integrations.vllm")


class KVCopyOffloadingSpec(OffloadingSpec):
    """vLLM's ``OffloadingSpec`` for host-memory offloading through kvcopy (docs/engines.md, "vLLM").

    Extra-config keys (``kv_connector_extra_config``): ``cpu_bytes_to_use`` (required; the host memory of
    all the engine's workers together, as vLLM's CPU spec reads it: each pins its share), vLLM's
    ``blocks_per_chunk``, ``kvcopy_policy`` ("auto": load a hit only when the Planner predicts it faster than
    recomputing it; "offload": load every hit), ``kvcopy_profile`` (a Profile's path; default: kvcopy's
    default profile), ``kvcopy_method`` (the copy method, "auto"), ``kvcopy_learn`` (refine the profile from
    the engine's transfers and steps, with :class:`~kvcopy.integrations.vllm.KVCopyOffloadingConnector`) and
    ``kvcopy_decode_share`` (the share of the link decode traffic keeps, 0 by default).

    A vLLM outside the tested range is a RuntimeError, and a bad key a ValueError or TypeError, here, before
    any transfer. :attr:`stats` has the scheduler's decisions (one per judged hit).

    With ``secondary_tiers`` (vLLM's tiering: ``fs``, ``obj``, ``p2p``, or kvcopy's
    :class:`~kvcopy.integrations.vllm.KVCopyDiskTier`), ``KVCopyOffloadingSpec(config)`` is a
    :class:`~kvcopy.integrations.vllm.tiering.KVCopyTieringSpec`: vLLM's tiered offloading with kvcopy's worker
    and a judgment that covers every tier.
    """

    def __new__(cls, config: OffloadingConfig, *args: Any, **kwargs: Any) -> Any:
        tiered = _tiered_spec(cls, config.extra_config)
        if tiered is not None:
            return tiered(config)  # (not a KVCopyOffloadingSpec: Python does not run __init__ again)
        return super().__new__(cls)

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        """vLLM's CPU-tier metrics (the manager is vLLM's CPU manager), the judgment's counters and the agents'
        pauses' (kvcopy.integrations.vllm.agents); with
        ``secondary_tiers``, the tiered spec's (vLLM's metrics logger asks the class the config names, which
        it never builds)."""
        tiered = _tiered_spec(cls, extra_config)
        if tiered is not None:
            return tiered.build_metric_definitions(extra_config)
        definitions = CPUOffloadingSpec.build_metric_definitions(extra_config)
        definitions.update({name: OffloadingCounterMetadata(documentation=doc) for name, doc in COUNTERS.items()})
        definitions.update(agent_metric_definitions())
        return definitions

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """The info metric's label names: vLLM's CPU tier's (the manager fills a ``CPUOffloadingInfo``); with
        ``secondary_tiers``, the tiered spec's."""
        tiered = _tiered_spec(cls, extra_config)
        return (CPUOffloadingSpec if tiered is None else tiered).config_info_keys(extra_config)

    def __init__(self, config: OffloadingConfig) -> None:
        check_vllm()
        self.settings: SpecConfig = read_config(config.extra_config)
        super().__init__(config)
        blocks_per_chunk = self.blocks_per_chunk
        # Every worker pins its own copy of each chunk (no shared region, so no replicated layout): a chunk
        # costs world_size times one worker's bytes, as in vLLM's CPU spec.
        self.world_size = world_size = max(1, config.parallel.world_size)
        self._chunk_bytes = chunk_bytes = config.worker_kv_bytes_per_block * blocks_per_chunk * world_size
        self.num_chunks = self.settings.cpu_bytes_to_use // chunk_bytes if chunk_bytes > 0 else 0
        if chunk_bytes > 0 and self.num_chunks < 1:
            raise ValueError(
                f"cpu_bytes_to_use: {self.settings.cpu_bytes_to_use} bytes (the total of {world_size} workers) "
                f"hold no chunk of {blocks_per_chunk} blocks ({chunk_bytes} bytes over the workers)"
            )
        path = self.settings.profile_path
        self.profile: Profile | None = Profile.load(path) if path is not None else default_profile()
        self._manager: KVCopyOffloadingManager | None = None
        self._worker: KVCopyOffloadingWorker | None = None
        self._session: OffloadSession | None = None

    def _new_session(self, spec: ModelSpec | None, host_bytes: int) -> OffloadSession:
        return new_session(self.settings, self.profile, spec, host_bytes, self.tokens_per_block)

    @property
    def session(self) -> OffloadSession | None:
        """The scheduler's session (its policy, live Planner and decisions), once the manager is built."""
        return self._session

    @property
    def stats(self) -> OffloadStats | None:
        """The scheduler's decisions: ``decisions`` (one per judged hit, with both predictions), loaded hits
        (``reloaded_requests``), refused ones (``recomputed_requests``), and ``profile``."""
        return None if self._session is None else self._session.stats

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            config = self.config
            # planned under "offload" too: its decisions then still carry both predictions
            self._session = self._new_session(model_spec_of(config), host_bytes=0)
            geometry = hit_geometry(self)
            self._manager = KVCopyOffloadingManager(
                session=self._session,
                geometry=geometry,
                chunk_bytes=config.worker_kv_bytes_per_block * self.blocks_per_chunk,
                row_bytes=self._chunk_bytes,
                settings=self.settings,
                num_chunks=self.num_chunks,
                cache_policy=self.extra_config.get("eviction_policy", "lru"),
                cache_policy_module_path=self.extra_config.get("cache_policy_module_path"),
                enable_events=self.kv_events_config.enable_kv_cache_events,
                # vLLM's CPU spec's keys and defaults, passed on as it does
                store_threshold=int(self.extra_config.get("store_threshold", 0)),
                max_tracker_size=int(self.extra_config.get("max_tracker_size", 64_000)),
                info=CPUOffloadingInfo.from_config(config, self.num_chunks, self._chunk_bytes),
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            kv = paged_kv_of(kv_caches)
            host_bytes = self.num_chunks * self.blocks_per_chunk * kv.nbytes_per_block
            session = self._new_session(None, host_bytes)
            self._worker = KVCopyOffloadingWorker(
                kv,
                blocks_per_chunk=self.blocks_per_chunk,
                num_chunks=self.num_chunks,
                session=session,
                method=self.settings.method,
                profile=self.profile,
            )
        return self._worker


def _tiered_spec(cls: type, extra_config: Any) -> type[OffloadingSpec] | None:
    """KVCopyTieringSpec where ``KVCopyOffloadingSpec`` itself is given ``secondary_tiers``, else None."""
    if cls is not KVCopyOffloadingSpec or "secondary_tiers" not in extra_config:
        return None
    from kvcopy.integrations.vllm.tiering import KVCopyTieringSpec  # (it imports this module)

    return KVCopyTieringSpec
