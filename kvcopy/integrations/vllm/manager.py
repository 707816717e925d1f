"""The scheduler half of kvcopy's vLLM offloading: vLLM's own CPU manager, plus the load-or-recompute judgment.

vLLM's scheduler asks the manager about a waiting request's offloaded chunks
one key at a time, in prefix order, and stops at the first MISS; a MISS on the
first key means no load and vLLM computes every token (docs/engines.md,
"vLLM"). So the judgment is made once per request and scheduler step, at the
first hit of a full-attention group: the manager reads the request's whole hit
(the run of stored chunks from that key on, from the request's key positions),
asks the Planner whether loading it beats recomputing it, and if not answers
MISS for every key of the request until the step ends. Everything else (LRU or
ARC eviction, chunk allocation, events) is vLLM's ``CPUOffloadingManager``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext, ScheduleEndContext, get_offload_group_idx
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from kvcopy.integrations.common.offload_session import OffloadSession
from kvcopy.integrations.common.offload_stats import OffloadDecision
from kvcopy.integrations.vllm._config import SpecConfig

if TYPE_CHECKING:
    from kvcopy.integrations.vllm.agents.pauses import AgentPauses

__all__ = ["COUNTERS", "HitGeometry", "KVCopyOffloadingManager", "request_hit"]

_FOUND = (LookupResult.HIT, LookupResult.HIT_PENDING)
# vLLM metrics (get_kv_connector_stats, Prometheus) the judgment adds, with their documentation.
HITS_LOADED = "vllm:kv_offload_kvcopy_hits_loaded"
HITS_RECOMPUTED = "vllm:kv_offload_kvcopy_hits_recomputed"
TOKENS_RECOMPUTED = "vllm:kv_offload_kvcopy_tokens_recomputed"
COUNTERS = {
    HITS_LOADED: "Offloaded hits kvcopy's planner judged faster to load than to recompute (or policy 'offload').",
    HITS_RECOMPUTED: "Offloaded hits kvcopy's planner judged faster to recompute: not loaded.",
    TOKENS_RECOMPUTED: "Tokens of the offloaded hits kvcopy's planner chose to recompute.",
}


@dataclass(frozen=True)
class HitGeometry:
    """What the judgment needs of vLLM's cache: tokens per offload chunk per group, the full-attention groups
    (the ones looked up as a prefix), tokens and bytes per device block, and the batch token budget."""

    tokens_per_chunk: dict[int, int]
    full_groups: frozenset[int]
    tokens_per_block: int
    bytes_per_block: int
    max_forward_tokens: int | None = None


def request_hit(
    key: OffloadKey, req_context: ReqContext, stored: Callable[[OffloadKey], bool], tokens_per_chunk: int
) -> tuple[int, int, int]:
    """(computed, hit_end, known_end) in tokens for the request whose lookup reached ``key``: where its lookup
    started (the tokens vLLM's prefix cache already holds), the end of the run of stored chunks from ``key``
    on, and the end of its last complete chunk (its length, to within a chunk)."""
    group = get_offload_group_idx(key)
    # vLLM 0.33 records every key of the request with its end position before it looks any up; ReqContext has no
    # public way to list them (kvcopy.integrations.vllm._compat checks this attribute exists).
    positions = sorted(
        (position, k) for k, position in req_context._offload_key_positions.items() if get_offload_group_idx(k) == group
    )
    start = req_context.get_offload_key_position(key)
    assert start is not None, "vLLM looked up a key it did not place"
    hit_end = start
    for position, k in positions:
        if position <= start:
            continue
        if position != hit_end + tokens_per_chunk or not stored(k):
            break
        hit_end = position
    known_end = positions[-1][0] if positions else start
    return start - tokens_per_chunk, hit_end, known_end


class KVCopyOffloadingManager(CPUOffloadingManager):
    """vLLM's CPU offloading manager whose lookups refuse a hit the Planner says to recompute.

    ``session`` decides (kvcopy's policy and live Planner) and keeps the decisions; ``geometry`` maps keys to
    tokens and bytes. The other keyword arguments are ``CPUOffloadingManager``'s.
    """

    def __init__(
        self,
        *,
        session: OffloadSession,
        geometry: HitGeometry,
        chunk_bytes: int = 0,
        row_bytes: int = 0,
        settings: SpecConfig | None = None,
        **cpu_manager: Any,
    ) -> None:
        super().__init__(**cpu_manager)
        self.session = session
        self.geometry = geometry
        self.chunk_bytes = chunk_bytes  # what one worker loads of a chunk to its GPU
        self.row_bytes = row_bytes  # what a chunk holds of host RAM (every worker's part)
        self.secondary_tiers: list[Any] = []  # (none: the agents' pauses keep or drop, never demote)
        # the decisions at agents' pauses, leases only (kvcopy_agents "auto"; None when "off")
        self.pauses: AgentPauses | None = None
        if settings is not None and settings.agents == "auto":
            from kvcopy.integrations.vllm.agents.pauses import AgentPauses  # (it imports this module's HitGeometry)

            self.pauses = AgentPauses(self, settings, host=self)
        self._verdicts: dict[str, bool] = {}  # this step's judgment per request: load its hit or not
        self._failed: set[OffloadKey] = set()  # keys whose store failed (KVCopyOffloadingConnector says which)
        self._recompute: set[str] = set()  # requests whose load failed: computed from now on
        self._unreported = dict.fromkeys(COUNTERS, 0)  # the counters' increase since vLLM last asked

    def fail_load(self, request_id: str) -> None:
        """A load for ``request_id`` failed: its hits are not loaded again (vLLM recomputes it, or fails it)."""
        self._recompute.add(request_id)

    def on_new_request(self, req_context: ReqContext) -> Any:
        if self.pauses is not None:
            self.pauses.arrived(req_context)
        return super().on_new_request(req_context)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._recompute.discard(req_context.req_id)
        super().on_request_finished(req_context)
        if self.pauses is not None:  # (after the policy took the request's recency: the plan acts on it)
            self.pauses.finished(req_context)

    def prepare_store(self, keys: Any, req_context: ReqContext) -> Any:
        if self.pauses is not None:
            self.pauses.seen(req_context)
        return super().prepare_store(keys, req_context)

    def shutdown(self) -> None:
        if self.pauses is not None:
            self.pauses.shutdown()
        super().shutdown()

    def fail_store(self, keys: Collection[OffloadKey]) -> None:
        """The store of ``keys`` failed: its completion drops them instead of making them loadable."""
        self._failed.update(keys)

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        failed = self._failed.intersection(keys)
        self._failed.difference_update(failed)
        super().complete_store(keys, req_context, success=success and not failed)

    def _stored(self, key: OffloadKey) -> bool:
        chunk = self._policy.get(key)  # CPUOffloadingManager's eviction policy: side-effect free
        return chunk is not None

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self.pauses is not None:
            self.pauses.seen(req_context)  # (a resume ends its session's lease before the hit is judged)
        result = super().lookup(key, req_context)
        if result not in _FOUND:
            return result
        if req_context.req_id in self._recompute:
            return LookupResult.MISS
        verdict = self._verdicts.get(req_context.req_id)
        if verdict is None:
            group = get_offload_group_idx(key)
            if group not in self.geometry.full_groups:
                return result  # a sliding-window group's suffix: judged with its full-attention groups
            verdict = self._judge(key, req_context, group).action == "reload"
            self._verdicts[req_context.req_id] = verdict
        return result if verdict else LookupResult.MISS

    def _judge(self, key: OffloadKey, req_context: ReqContext, group: int) -> OffloadDecision:
        geometry = self.geometry
        computed, hit_end, known_end = request_hit(key, req_context, self._stored, geometry.tokens_per_chunk[group])
        prefix = hit_end - computed
        blocks = -(-prefix // geometry.tokens_per_block)
        decision = self.session.decide(
            req_context.req_id,
            prefix_tokens=prefix,
            new_tokens=max(known_end - hit_end, 1),  # at least the token vLLM always computes
            reload_blocks=blocks,
            reload_nbytes=blocks * geometry.bytes_per_block,
            max_forward_tokens=geometry.max_forward_tokens,
            cached_tokens=computed,
        )
        self.session.record(decision)
        if decision.action == "reload":
            self.session.count_reloaded(1)
            self._unreported[HITS_LOADED] += 1
        else:
            self._unreported[HITS_RECOMPUTED] += 1
            self._unreported[TOKENS_RECOMPUTED] += prefix
        return decision

    def get_stats(self) -> OffloadingConnectorStats | None:
        """vLLM's CPU-tier metrics, plus the judgment's counters (:data:`COUNTERS`) since the last call."""
        stats = super().get_stats()
        if stats is None:
            stats = OffloadingConnectorStats()
        for name, value in self._unreported.items():
            if value:
                stats.increase_counter(name, value)
        self._unreported = dict.fromkeys(COUNTERS, 0)
        if self.pauses is not None:
            stats.aggregate(self.pauses.take_stats())
        return stats

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._verdicts.clear()  # the next step judges again, on what is stored and learned by then
        if self.pauses is not None:
            self.pauses.start_due()  # (the pauses that have waited their delay are planned)
        super().on_schedule_end(context)

    def has_pending_work(self) -> bool:
        """vLLM's, or a pause's plan due now (an idle engine evicts nothing, so one not due waits for a step)."""
        return super().has_pending_work() or (self.pauses is not None and self.pauses.due_now())
