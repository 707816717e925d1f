"""kvcopy's vLLM spec with ``secondary_tiers``: vLLM's tiered offloading, with kvcopy's copies and judgment.

``KVCopyOffloadingSpec`` with ``secondary_tiers`` in its extra config is a :class:`KVCopyTieringSpec`: vLLM's
``TieringOffloadingSpec`` (its primary tier in a shared region, its secondary tiers: ``fs``, ``obj``,
``p2p`` or an out-of-tree one such as :class:`~kvcopy.integrations.vllm.KVCopyDiskTier`, its cascades and
promotions), where

- the worker is kvcopy's: it copies GPU blocks into and out of the shared region on its TransferEngine, in
  vLLM's byte layout (kvcopy.integrations.vllm.primary_region), so every tier reads what vLLM's worker would
  have written;
- the manager is vLLM's ``TieringOffloadingManager`` whose ``lookup`` first judges the request's whole hit,
  wherever its chunks are (:class:`KVCopyTieringManager`).

The judgment. vLLM's manager promotes a chunk at the first secondary tier that holds it, evicting primary
chunks for it, at the first key of the request that misses in the primary tier. kvcopy's manager judges
before that: at the request's first lookup in a step (of a full-attention group), it looks every chunk of the
request's hit up (the primary tier, then each secondary tier the request may load from; a tier whose lookup
is not resolved yet makes it RETRY, so the decision waits until the whole hit is known), and asks the Planner
which prefix to load:

- all of it: the tiers' chunks read into the primary tier (the profile's disk line, ``kvcopy calibrate
  --disk``, or what the tiers' own promotions measured, learned as the engine runs), then every chunk loaded
  to the GPU, then the tokens after the hit computed;
- the part in host RAM (the leading run of chunks in the primary tier), the rest computed;
- nothing: every token computed.

Keys past the chosen prefix answer MISS, so no primary slot is evicted for a chunk not worth its promotion,
and vLLM computes those tokens. ``kvcopy_policy: "offload"`` loads every hit, as vLLM does. vLLM's own
per-request controls (``max_load_tokens``, ``kv_load_tiers``, ``kv_store_tiers``) keep working: the
judgment looks only at the tiers a request may load from, and no further than its ``max_load_tokens``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingHistogramMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingWorker,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.base import TIER_LABEL, JobResult
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvcopy.integrations.common.offload_session import OffloadSession
from kvcopy.integrations.common.offload_stats import OffloadDecision
from kvcopy.integrations.common.online_planner import OnlinePlanner, forward_seconds
from kvcopy.integrations.vllm._compat import check_vllm
from kvcopy.integrations.vllm._config import SpecConfig, read_config
from kvcopy.integrations.vllm.agents.pauses import AgentPauses, agent_metric_definitions
from kvcopy.integrations.vllm.manager import HitGeometry
from kvcopy.integrations.vllm.session import hit_geometry, model_spec_of, new_session
from kvcopy.integrations.vllm.tiers.disk import KVCopyDiskTier, check_tier_config
from kvcopy.integrations.vllm.worker import KVCopyOffloadingWorker, paged_kv_of
from kvcopy.planner.planner import Planner
from kvcopy.profile import DISK_METHOD, DISK_READ_DIRECTION, Profile, default_profile

__all__ = [
    "TIER_METRICS",
    "KVCopyTieringManager",
    "KVCopyTieringSpec",
    "TierVerdict",
    "observe_promotion",
    "predicted_read_s",
    "prediction_error",
]

logger = logging.getLogger("kvcopy.integrations.vllm")

_FOUND = (LookupResult.HIT, LookupResult.HIT_PENDING)
_PREFIX = "vllm:kv_offload_kvcopy_"
HITS_LOADED = f"{_PREFIX}tier_hits_loaded"
HITS_RECOMPUTED = f"{_PREFIX}tier_hits_recomputed"
TOKENS_RECOMPUTED = f"{_PREFIX}tier_tokens_recomputed"
PREDICTION_ERROR = f"{_PREFIX}tier_prediction_error"
TIER_METRICS = {
    HITS_LOADED: "Hits kvcopy's planner loaded, by the tier their furthest chunk was in.",
    HITS_RECOMPUTED: "Hits kvcopy's planner recomputed (in whole or from the end of their part in host RAM), by tier.",
    TOKENS_RECOMPUTED: "Tokens of hits kvcopy's planner chose to recompute, by tier.",
}
# |predicted / measured - 1| of a promotion's read: from a close prediction to one off by 10x.
PREDICTION_ERROR_BUCKETS = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
# Where a chunk is: the primary tier (host RAM), a secondary tier (its index), or not known yet (a tier's lookup
# not resolved).
HOST, PENDING = -1, -2


@dataclass(frozen=True)
class TierVerdict:
    """What a request loads this step: the chunks up to token ``load_end`` (keys past it answer MISS), and the
    decision that said so."""

    load_end: int
    decision: OffloadDecision


@dataclass(frozen=True)
class _Hit:
    start: int  # the first token of the hit (what vLLM's prefix cache holds before it)
    chunk_ends: tuple[int, ...]  # each chunk's end token, in order
    places: tuple[int, ...]  # where each chunk is: HOST or a secondary tier's index
    known_end: int  # the end of the request's last complete chunk


class KVCopyTieringManager(TieringOffloadingManager):
    """vLLM's tiering manager whose lookups load only the prefix of a hit the Planner judges worth it (see the
    module). ``session`` decides and keeps the decisions; ``geometry`` maps keys to tokens and bytes (a chunk:
    ``tokens_per_chunk`` tokens; ``chunk_bytes``, what one worker loads of it to its GPU; ``row_bytes``, what a
    secondary tier reads of it: the region's row, every worker's slot and the padding). The other keywords are
    ``TieringOffloadingManager``'s."""

    def __init__(
        self,
        *,
        session: OffloadSession,
        geometry: HitGeometry,
        chunk_bytes: int,
        row_bytes: int,
        settings: SpecConfig | None = None,
        **tiering: Any,
    ) -> None:
        super().__init__(**tiering)
        self.session = session
        self.geometry = geometry
        self.chunk_bytes = chunk_bytes
        self.row_bytes = row_bytes
        self._verdicts: dict[str, TierVerdict] = {}  # this step's, per request
        self._recorded: dict[str, int] = {}  # the load end last recorded and counted, per request
        self._stats = OffloadingConnectorStats()
        # the decisions at agents' pauses (kvcopy_agents "auto"; None when "off")
        self.pauses = None
        if settings is not None and settings.agents == "auto":
            self.pauses = AgentPauses(self, settings, host=self.primary_tier)

    # ------------------------------------------------------------------ the hit

    def _place(self, key: OffloadKey, req_context: ReqContext, exclude_tier_idx: int | None) -> int | None:
        """Where ``key``'s chunk is (HOST, a tier's index; PENDING while a tier's lookup is not resolved), None
        when nowhere."""
        if self.primary_tier.lookup(key, req_context) in _FOUND:
            return HOST
        if self._promotions_held:
            return None
        pending = False
        for i, tier in enumerate(self.secondary_tiers):
            if i == exclude_tier_idx or not req_context.load_tier_filter.allows(tier.medium, tier.locality):
                continue
            result = tier.lookup(key, req_context)
            if result is LookupResult.HIT:
                return i
            pending = pending or result is LookupResult.RETRY
        return PENDING if pending else None

    def _hit(self, key: OffloadKey, req_context: ReqContext, exclude_tier_idx: int | None) -> _Hit | None:
        """The request's hit from ``key`` on (its group's chunks, contiguous, each somewhere), within its
        ``max_load_tokens``; None while a tier's lookup is not resolved."""
        group = get_offload_group_idx(key)
        per_chunk = self.geometry.tokens_per_chunk[group]
        # vLLM 0.33 records every key of the request with its end position before it looks any up (the same
        # internal the untiered manager reads; kvcopy.integrations.vllm._compat pins the version).
        positions = sorted(
            (p, k) for k, p in req_context._offload_key_positions.items() if get_offload_group_idx(k) == group
        )
        first = req_context.get_offload_key_position(key)
        assert first is not None, "lookup judges only keys vLLM's scheduler placed"
        start = first - per_chunk
        cap = _max_load_tokens(req_context)
        ends: list[int] = []
        places: list[int] = []
        for position, k in positions:
            if position < first or position % per_chunk:  # (before the key; a partial tail's boundary)
                continue
            if position != first + len(ends) * per_chunk or (cap is not None and position - start > cap):
                break
            place = self._place(k, req_context, exclude_tier_idx)
            if place == PENDING:
                return None
            if place is None:
                break
            ends.append(position)
            places.append(place)
        known_end = positions[-1][0] if positions else first
        return _Hit(start, tuple(ends), tuple(places), known_end)

    # ------------------------------------------------------------------ the judgment

    def _judge(self, hit: _Hit, req_context: ReqContext) -> TierVerdict:
        geometry, chunk_bytes = self.geometry, self.chunk_bytes
        end = hit.chunk_ends[-1]
        host_run = next((i for i, place in enumerate(hit.places) if place != HOST), len(hit.places))
        host_end = hit.start if host_run == 0 else hit.chunk_ends[host_run - 1]
        tier_chunks = sum(place != HOST for place in hit.places)
        new = max(hit.known_end - end, 1)
        planner, observations = self.session.live.current()
        forward = geometry.max_forward_tokens

        def compute(tokens: int, cached: int) -> float:
            assert planner is not None
            return forward_seconds(planner, tokens, cached, forward)

        options: dict[str, tuple[int, float | None]] = {}  # name -> (load_end, predicted seconds)
        if planner is not None:
            # a tier reads whole rows (every worker's slot); each worker then loads its own slot, all at once
            rows = tier_chunks * self.row_bytes
            read = (predicted_read_s(planner, rows) or 0.0) if tier_chunks else 0.0
            options["all"] = (end, read + planner.t_load_nbytes(len(hit.places) * chunk_bytes) + compute(new, end))
            if 0 < host_run < len(hit.places):
                load = planner.t_load_nbytes(host_run * chunk_bytes)
                options["host"] = (host_end, load + compute(end - host_end + new, host_end))
            options["none"] = (hit.start, compute(end - hit.start + new, hit.start))
        policy = self.session.policy
        if policy == "offload" or planner is None:
            choice, reason = "all", f"policy '{policy}'" + ("" if planner else " (no profile)")
        elif tier_chunks and planner.disk is None:
            choice, reason = "all", "no disk line in the profile yet (kvcopy calibrate --disk): loaded"
        else:
            choice = min(options, key=lambda name: options[name][1] or 0.0)
            source = f"learned from {observations} observations" if observations else "calibrated"
            said = ", ".join(f"{name} {options[name][1]:.4g} s" for name in options)
            reason = f"planner ({source}): {said} ({tier_chunks} of {len(hit.places)} chunks in a secondary tier)"
        load_end = options[choice][0] if choice in options else end
        loaded = load_end - hit.start
        decision = OffloadDecision(
            request_id=req_context.req_id,
            prefix_tokens=loaded,
            new_tokens=end - load_end + new,
            reload_blocks=loaded // geometry.tokens_per_block,
            reload_nbytes=(loaded // geometry.tokens_per_block) * geometry.bytes_per_block,
            action="reload" if loaded else "recompute",
            reason=f"{choice}: {reason}",
            predicted_reload_s=options[choice][1] if choice in options else None,
            predicted_recompute_s=options["none"][1] if "none" in options else None,
            observations=observations,
        )
        if self._recorded.get(req_context.req_id) == load_end:
            return TierVerdict(load_end, decision)  # judged alike at an earlier step (a promotion takes several)
        self._recorded[req_context.req_id] = load_end
        self.session.record(decision)
        furthest = next((place for place in reversed(hit.places) if place != HOST), HOST)
        labels = self._metrics.primary_tier_label if furthest == HOST else self._metrics.tier_label(furthest)
        if load_end == end:
            self._stats.increase_counter(HITS_LOADED, 1, labels)
            self.session.count_reloaded(1)
        else:
            self._stats.increase_counter(HITS_RECOMPUTED, 1, labels)
            self._stats.increase_counter(TOKENS_RECOMPUTED, end - load_end, labels)
        return TierVerdict(load_end, decision)

    def lookup(self, key: OffloadKey, req_context: ReqContext, *, exclude_tier_idx: int | None = None) -> LookupResult:
        """vLLM's lookup, within this step's verdict for the request (judged at its first key of a
        full-attention group, once the tiers' lookups of its whole hit are resolved)."""
        position = req_context.get_offload_key_position(key)
        if position is None:  # not the scheduler's request (a p2p peer's lookup, served by vLLM): nothing to judge
            return super().lookup(key, req_context, exclude_tier_idx=exclude_tier_idx)
        if not _ends_a_chunk(position, self.geometry, key):
            return LookupResult.MISS  # a partial recurrent tail's boundary: never judged, computed (docs/engines.md)
        request = req_context.req_id
        if self.pauses is not None:
            self.pauses.seen(req_context)  # (a resume ends its session's lease before the hit is judged)
        verdict = self._verdicts.get(request)
        if verdict is None and get_offload_group_idx(key) in self.geometry.full_groups:
            self._maybe_process_finished_jobs()  # (as vLLM's lookup: promotions finished since count as host)
            hit = self._hit(key, req_context, exclude_tier_idx)
            if hit is None:
                return LookupResult.RETRY  # a tier is still looking: decide once the whole hit is known
            if not hit.chunk_ends:
                return LookupResult.MISS
            verdict = self._verdicts[request] = self._judge(hit, req_context)
        if verdict is not None and position > verdict.load_end:
            return LookupResult.MISS  # past the prefix worth loading: never promoted, computed
        return super().lookup(key, req_context, exclude_tier_idx=exclude_tier_idx)

    def on_request_finished(self, req_context: ReqContext, *, exclude_tier_idx: int | None = None) -> None:
        self._recorded.pop(req_context.req_id, None)
        super().on_request_finished(req_context, exclude_tier_idx=exclude_tier_idx)
        if self.pauses is not None:  # (after the host tier took the request's recency: the plan acts on it)
            self.pauses.finished(req_context)

    def on_new_request(self, req_context: ReqContext, *, exclude_tier_idx: int | None = None) -> Any:
        if self.pauses is not None:
            self.pauses.arrived(req_context)
        return super().on_new_request(req_context, exclude_tier_idx=exclude_tier_idx)

    def prepare_store(self, keys: Any, req_context: ReqContext) -> Any:
        if self.pauses is not None:
            self.pauses.seen(req_context)
        return super().prepare_store(keys, req_context)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._verdicts.clear()  # the next step judges again, on what is where and learned by then
        if self.pauses is not None:
            self.pauses.start_due()  # (their promotions are submitted with the step's, just below)
        super().on_schedule_end(context)

    def has_pending_work(self) -> bool:
        """vLLM's (jobs in flight, cascades parked), or a prefetch due now."""
        return super().has_pending_work() or (self.pauses is not None and self.pauses.due_now())

    def shutdown(self) -> None:
        if self.pauses is not None:
            self.pauses.shutdown()
        super().shutdown()

    # ------------------------------------------------------------------ learning and metrics

    def _complete_promotion(self, job_metadata: Any, completed_job: JobResult) -> None:
        super()._complete_promotion(job_metadata, completed_job)
        if self.pauses is not None and completed_job.success:
            self.pauses.landed(job_metadata.transfer_job.keys)
        seconds, nbytes = completed_job.transfer_time, completed_job.transfer_bytes
        if not (completed_job.success and seconds and nbytes):
            return
        if self.secondary_tiers[job_metadata.tier_idx].medium is not Medium.STORAGE:
            return  # (another engine's memory, say: not the disk's line, which is the one the Planner holds)
        error = observe_promotion(self.session.live, nbytes, seconds)
        if error is not None:
            self._stats.observe_histogram(PREDICTION_ERROR, error, self._metrics.tier_label(job_metadata.tier_idx))

    def get_stats(self) -> OffloadingConnectorStats | None:
        """vLLM's tiering metrics, plus the judgment's counters and prediction errors since the last call."""
        stats = super().get_stats()
        mine, self._stats = self._stats, OffloadingConnectorStats()
        if self.pauses is not None:
            mine.aggregate(self.pauses.take_stats())
        if mine.is_empty():
            return stats
        if stats is None:
            return mine
        stats.aggregate(mine)
        return stats


def predicted_read_s(planner: Planner | None, nbytes: int) -> float | None:
    """Seconds the judgment costs a secondary tier's read of ``nbytes`` (a promotion's rows) at: ``planner``'s disk
    line; None without one."""
    if planner is None or planner.disk is None:
        return None
    return planner.disk.predict(nbytes)


def prediction_error(planner: Planner | None, nbytes: int, seconds: float) -> float | None:
    """|predicted / measured - 1| of a promotion that read ``nbytes`` in ``seconds`` (above 0): the read as the
    judgment costed it (:func:`predicted_read_s`) against the read; None without a disk line. What the
    ``tier_prediction_error`` histogram records."""
    predicted = predicted_read_s(planner, nbytes)
    return None if predicted is None else abs(predicted / seconds - 1.0)


def observe_promotion(live: OnlinePlanner, nbytes: int, seconds: float) -> float | None:
    """A storage tier's finished promotion, which read ``nbytes`` in ``seconds`` (above 0), taken as the manager
    takes each: scored against the Planner of the moment (:func:`prediction_error`, None without a disk line),
    then learned as a read of the disk (the line the judgment costs a tier's read with). Returns the score."""
    planner, _ = live.current()
    error = prediction_error(planner, nbytes, seconds)
    try:
        live.observe_copy(DISK_READ_DIRECTION, DISK_METHOD, nbytes, seconds)
    except ValueError as err:  # a profile whose disk line is another method's: not learned, said once
        logger.warning("kvcopy: a promotion's read is not learned (%s)", err)
    return error


def _ends_a_chunk(position: int, geometry: HitGeometry, key: OffloadKey) -> bool:
    """Whether ``position`` ends one of its group's chunks: vLLM places a chunk's key at its end; only a partial
    recurrent tail's boundary key (hybrid models) lies between chunk ends."""
    per_chunk = geometry.tokens_per_chunk.get(get_offload_group_idx(key))
    return per_chunk is None or position % per_chunk == 0


def _max_load_tokens(req_context: ReqContext) -> int | None:
    """The request's ``max_load_tokens`` (vLLM's per-request cap on loaded tokens), or None."""
    params = req_context.kv_transfer_params or {}
    cap = params.get("max_load_tokens")
    return cap if isinstance(cap, int) and not isinstance(cap, bool) and cap >= 0 else None


class KVCopyTieringSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` with kvcopy's worker and judgment (see the module); what
    ``KVCopyOffloadingSpec(config)`` gives when the extra config has ``secondary_tiers``. Its keys are
    KVCopyOffloadingSpec's and vLLM's tiering ones; each is checked (and the tiers built by the manager) before
    any transfer, in both roles."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        definitions = super().build_metric_definitions(extra_config)
        definitions.update(
            {
                name: OffloadingCounterMetadata(documentation=doc, labelnames=(TIER_LABEL,))
                for name, doc in TIER_METRICS.items()
            }
        )
        definitions[PREDICTION_ERROR] = OffloadingHistogramMetadata(
            documentation="|predicted / measured - 1| of the secondary tiers' promotion reads, by tier.",
            labelnames=(TIER_LABEL,),
            buckets=PREDICTION_ERROR_BUCKETS,
        )
        definitions.update(agent_metric_definitions())
        return definitions

    def __init__(self, config: OffloadingConfig) -> None:
        check_vllm()
        extra = config.extra_config
        self.settings: SpecConfig = read_config(extra)  # before vLLM's CPU spec reads cpu_bytes_to_use
        tiers = extra.get("secondary_tiers")
        if not isinstance(tiers, list) or not all(isinstance(t, dict) for t in tiers):
            raise TypeError(f"secondary_tiers: expected a list of tier configurations (dicts), got {tiers!r:.80}")
        threshold = extra.get("store_threshold", 0)
        if not isinstance(threshold, int) or isinstance(threshold, bool):
            raise TypeError(f"store_threshold: expected an int, got {type(threshold).__name__}")
        if threshold >= 2:
            raise ValueError(f"store_threshold: {threshold} is not supported with secondary_tiers (vLLM's tiering)")
        if extra.get("canonical_layout"):
            raise ValueError("canonical_layout: kvcopy's worker writes vLLM's direct layout; remove the key")
        for tier in tiers:  # an unknown tier type, or a bad key of kvcopy's tier, fails here, in both roles
            if issubclass(SecondaryTierFactory.get_tier_class(tier), KVCopyDiskTier):
                check_tier_config(tier)
        super().__init__(config)
        path = self.settings.profile_path
        self.profile: Profile | None = Profile.load(path) if path is not None else default_profile()
        self._session: OffloadSession | None = None
        self._kvcopy_worker: KVCopyOffloadingWorker | None = None

    def _new_session(self, spec: Any, host_bytes: int) -> OffloadSession:
        return new_session(self.settings, self.profile, spec, host_bytes, self.tokens_per_block)

    @property
    def session(self) -> OffloadSession | None:
        """The scheduler's session (its policy, live Planner and decisions), once the manager is built."""
        return self._session

    @property
    def stats(self) -> Any:
        """The scheduler's decisions (one per judged hit), as KVCopyOffloadingSpec's."""
        return None if self._session is None else self._session.stats

    def get_manager(self) -> OffloadingManager:
        """vLLM's tiering manager, built as TieringOffloadingSpec.get_manager builds it (its primary tier over
        the shared region, the secondary tiers from their configurations), as a KVCopyTieringManager: vLLM
        names its manager class in that method, so the assembly is repeated here with vLLM's own parts."""
        if self._manager is not None:
            return self._manager
        config = self.config
        self._session = self._new_session(model_spec_of(config), host_bytes=0)
        region: SharedOffloadRegion | None = None
        primary: CPUPrimaryTierOffloadingManager | None = None
        tiers: list[Any] = []
        try:
            region = self._region(rank=None)
            self._scheduler_mmap = region
            primary = CPUPrimaryTierOffloadingManager(
                num_chunks=self.num_chunks,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                mmap_region=region,
                info=self.cpu_info,
            )
            view = primary.get_kv_memoryview()
            for tier_config in self.secondary_tier_configs:
                tiers.append(SecondaryTierFactory.create_secondary_tier(tier_config, view, self))
            self._manager = KVCopyTieringManager(
                session=self._session,
                geometry=hit_geometry(self),
                chunk_bytes=config.worker_kv_bytes_per_block * self.blocks_per_chunk,
                row_bytes=self.kv_bytes_per_chunk,
                settings=self.settings,
                primary_tier=primary,
                secondary_tiers=tiers,
                tier_poll_interval_s=self.tier_poll_interval_s,
            )
        except BaseException:
            for tier in reversed(tiers):
                try:
                    tier.shutdown()
                except Exception:
                    logger.exception("kvcopy: a secondary tier failed to shut down after a failed start")
            if primary is not None:
                primary.shutdown()
            elif region is not None:
                region.cleanup()
            self._scheduler_mmap = None
            raise
        return self._manager

    def _region(self, *, rank: int | None) -> SharedOffloadRegion:
        """vLLM's shared primary region, as vLLM's tiering spec maps it: the scheduler's view of every row (rank
        None), or one worker's slot."""
        return SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """kvcopy's worker over this worker's slot of vLLM's shared region (kvcopy.integrations.vllm.primary_region)."""
        if self._kvcopy_worker is None:
            region = self._region(rank=0 if self.replicated_layout else self.config.parallel.rank)
            try:
                self._kvcopy_worker = KVCopyOffloadingWorker(
                    paged_kv_of(kv_caches),
                    blocks_per_chunk=self.blocks_per_chunk,
                    num_chunks=self.num_chunks,
                    session=self._new_session(None, 0),
                    method=self.settings.method,
                    profile=self.profile,
                    region=region,
                )
            except BaseException:
                region.cleanup()
                raise
        return self._kvcopy_worker
