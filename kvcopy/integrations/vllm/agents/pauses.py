"""The pause of an agent session, acted on in kvcopy's tiered vLLM spec: leases, demotions and prefetches.

:class:`AgentPauses` is the part of :class:`~kvcopy.integrations.vllm.tiering.KVCopyTieringManager` that
looks ahead. At a request's finish (the pause edge) it reads the request's pause hint (``kv_transfer_params``'
``"kvcopy"`` or a ``kvcopy.pause`` action of vLLM's ``kv_hints``) and finds its session (named by the hint, or
learned by prefix continuation: kvcopy.agents.sessions). Once the pause has lasted PLAN_DELAY_S (shorter ones,
back-to-back turns, are left to LRU unplanned), it forecasts the pause (kvcopy.agents.GapForecaster) and plans
it (kvcopy.agents.plan_pause) over the chunks the request left in host RAM:

- **keep**: the host tier's eviction policy leases them until the plan's lease end (kvcopy.integrations.vllm
  .leases: bounded, displaced before they keep a request from room, LRU's again once expired); the chunks a
  lease cannot hold (past the session's share, or all when the leases are full) stay LRU's, and so do all of
  them when the lease would end before LRU would let them go anyway (``LeasedPolicy.lru_s``: a pause shorter
  than the tier's memory, as an agent's back-to-back turn, holds nothing from the others);
- **demote**: they go first when room is needed (vLLM's tiering has already cascaded them to the secondary
  tiers); with a prefetch, a promotion job reads them back from the plan's prefetch time, started at the step
  that reaches it (``on_schedule_end``, while ``has_pending_work``) or, while the engine is idle, by a timer
  under the manager's lock, then leased until the plan's lease end;
- **drop**: they go first; the resume recomputes what the resume's own judgment will not load.

At the next request of the session (its arrival, vLLM's ``on_new_request``, for a hinted session; the first
time its keys are seen, for a learned one: the resume edge) the lease ends and an unstarted prefetch
is cancelled; a prefetch still in flight makes the lookups answer HIT_PENDING (vLLM's own answer for a chunk
being written), so the request waits on it and no second read starts. A session with no hint and not yet
learned is left to LRU: with no pauses, every decision is as it was.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingCounterMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from kvcopy.agents import GapForecast, GapForecaster, PauseHint, read_pause_hint
from kvcopy.agents.plan import PauseCosts, PausePlan, hold_price, plan_pause
from kvcopy.agents.sessions import MAX_PAUSED, Pause, PauseTracker
from kvcopy.integrations.common.offload_session import OffloadSession
from kvcopy.integrations.common.online_planner import forward_seconds
from kvcopy.integrations.vllm._config import SpecConfig
from kvcopy.integrations.vllm.agents.leases import LeasedPolicy, RecentEvents
from kvcopy.integrations.vllm.manager import HitGeometry

if TYPE_CHECKING:
    from kvcopy.integrations.vllm.tiering import KVCopyTieringManager

__all__ = ["AGENT_METRICS", "AgentPauses", "agent_metric_definitions"]

logger = logging.getLogger("kvcopy.integrations.vllm")

_PREFIX = "vllm:kv_offload_kvcopy_agent_"
PAUSES = f"{_PREFIX}pauses"
RESUMES = f"{_PREFIX}resumes"
PREFETCHES = f"{_PREFIX}prefetches"
LEASED_BYTES = f"{_PREFIX}leased_bytes"
HINT_FAULTS = f"{_PREFIX}hint_faults"
FORECAST_ERROR = f"{_PREFIX}forecast_error"
RESUMES_IN_BAND = f"{_PREFIX}resumes_in_band"
AGENT_METRICS: dict[str, tuple[str, str]] = {  # name -> (documentation, label)
    PAUSES: ("Pauses of agent sessions, by the decision kvcopy took for their chunks.", "decision"),
    RESUMES: ("Resumes of paused sessions, by where their chunks were (host, prefetch, tier, none).", "where"),
    PREFETCHES: ("Prefetches of demoted chunks, by outcome (started, in_time, late, unused).", "outcome"),
    LEASED_BYTES: ("Host bytes leased to paused sessions (each lease counted once, when made).", "decision"),
    HINT_FAULTS: ("Malformed pause hints (served, the hint ignored), by kind of fault.", "kind"),
    RESUMES_IN_BAND: ("Resumes inside (yes) or outside (no) the forecast's 10-90% band.", "inside"),
}
# |forecast median / actual gap - 1|: from a close forecast to one off by 100x.
FORECAST_ERROR_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 100.0)
# The host tier's reuse after eviction (what prices a lease) is taken over the last minute: long enough to span a
# few agent turns (TraceLab's median LLM step is 5.7 s), short enough to follow a burst.
REUSE_WINDOW_S = 60.0
# A prefetch is timed for a read this much longer than the disk line predicts: bench_vllm_tiers.py measured every
# promotion slower than predicted, |predicted / measured - 1| p90 0.37-0.49 (the tier's one IO thread also
# writes other sessions' cascades), and a read that lands late forfeits the gain while one early costs only
# residency (bench_agents.py: timed at the prediction, 16 of 81 exactly-timed prefetches landed late).
PREFETCH_READ_MARGIN = 0.5
# A pause is planned once it has lasted this long (or half what LRU keeps the chunks, when that is less): one
# shorter, an agent's back-to-back turn (about a millisecond on the agent bench), ends before it and is left to
# LRU unplanned, which keeps the chunks meanwhile anyway. Planned at every finish, such turns cost the
# scheduler thread a plan each (~3 ms): on the bench's back-to-back trace, computing every plan and acting on
# none took 1.14x the makespan of computing none. 50 ms is under a sixth of TraceLab's median tool call (0.3 s).
PLAN_DELAY_S = 0.05
# A learned session's resume is known only when vLLM first looks its request up (by its keys), which a busy
# engine may do some steps after it arrived: its pause's plan waits for the requests that arrived since to be
# looked up, but no longer than this, nor than half what LRU keeps its chunks (LRU keeps them meanwhile).
MAX_PLAN_WAIT_S = 1.0
# A timer that wakes for a prefetch sleeps at most this long, so that a shutdown or an earlier prefetch planned
# meanwhile is seen within it.
_TIMER_MAX_SLEEP_S = 0.5


def agent_metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The agents' metrics, declared as vLLM's frontend declares a spec's (build_metric_definitions)."""
    definitions: dict[str, OffloadingMetricMetadata] = {
        name: OffloadingCounterMetadata(documentation=doc, labelnames=(label,))
        for name, (doc, label) in AGENT_METRICS.items()
    }
    definitions[FORECAST_ERROR] = OffloadingHistogramMetadata(
        documentation="|forecast median / actual gap - 1| of resumed sessions.",
        labelnames=(),
        buckets=FORECAST_ERROR_BUCKETS,
    )
    return definitions


@dataclass
class _Prefetch:
    """A demoted session's read back: due at ``due`` (the clock's seconds), then held until ``until``, under a
    lease when ``leased`` (else LRU's, which keeps it as long: PausePlan.leased)."""

    session: str
    keys: tuple[OffloadKey, ...]
    context: ReqContext
    due: float
    until: float
    leased: bool
    waiting: set[OffloadKey] = field(default_factory=set)  # promoted, not landed yet
    read: list[OffloadKey] = field(default_factory=list)  # every chunk it promoted (landed or not)
    started: bool = False


@dataclass(frozen=True)
class _Waiting:
    """A pause not planned yet, over the ``chunks`` its request left in host RAM: planned at ``due`` (the
    clock's seconds) unless its session is back first; a learned one, while a request that arrived since is
    not looked up yet (it may be the resume, known only by its keys), at the latest at ``latest``."""

    pause: Pause
    hint: PauseHint | None
    chunks: list[OffloadKey]
    context: ReqContext
    due: float
    latest: float


@dataclass(frozen=True)
class _Planned:
    """What a pause's forecast said, kept to score it at the resume: its median and its 10-90% band."""

    median: float
    band: tuple[float, float]


class PausingManager(Protocol):
    """What AgentPauses reads of the manager it serves: kvcopy's tiered one, or its untiered one (no tiers)."""

    session: OffloadSession
    geometry: HitGeometry
    chunk_bytes: int  # what one worker loads of a chunk to its GPU
    row_bytes: int  # what a chunk holds of host RAM

    @property
    def secondary_tiers(self) -> Sequence[Any]: ...


class AgentPauses:
    """The pauses of one manager's sessions (see the module): ``host``, the CPU manager whose eviction policy
    leases (the tiered manager's primary tier, or the untiered manager itself: then there is no tier, so no
    demotion to one nor prefetch, only leases and drops). ``settings``: the spec's (its ``kvcopy_agent_*``
    keys); ``clock``: ``time.monotonic``, as the leases'."""

    def __init__(
        self,
        manager: PausingManager,
        settings: SpecConfig,
        *,
        host: CPUOffloadingManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.manager = manager
        self.host = host
        self.clock = clock
        primary = host
        # (vLLM 0.33's CPUOffloadingManager keeps its policy here; kvcopy.integrations.vllm._compat pins it)
        self.policy = LeasedPolicy(
            primary._policy,
            max_leased_fraction=settings.max_leased_fraction,
            max_session_fraction=settings.max_session_fraction,
            clock=clock,
            on_reuse=self.reused,
        )
        primary._policy = self.policy
        self.forecast_path = settings.forecast_path
        if self.forecast_path is not None and os.path.exists(self.forecast_path):
            self.forecaster = GapForecaster.load(self.forecast_path)
        else:
            self.forecaster = GapForecaster()
        self.tracker = PauseTracker(self.forecaster, clock=clock)
        self.stats = OffloadingConnectorStats()
        self._hints: dict[str, PauseHint | None] = {}  # by live request, parsed at its first sight
        self._arrivals: dict[str, float] = {}  # live requests whose resume is not looked for yet: when they came
        self.plan_delay_s = PLAN_DELAY_S  # (0: every pause planned as it begins)
        self._waiting: dict[str, _Waiting] = {}  # by paused session, not planned yet
        self._planned: dict[str, _Planned] = {}  # by paused session
        self._prefetches: dict[str, _Prefetch] = {}  # by paused session
        self._warned: set[str] = set()  # the kinds of hint fault already logged
        self._reuses = RecentEvents(REUSE_WINDOW_S)  # when lately evicted chunks came back
        self._wake = threading.Condition()
        self._stopping = False
        self._timer: threading.Thread | None = None
        if manager.secondary_tiers:  # (prefetches read from a tier: without one, nothing to wake for)
            self._timer = threading.Thread(target=self._timer_loop, name="kvcopy-agent-prefetch", daemon=True)
            self._timer.start()

    # ------------------------------------------------------------------ the edges

    def hint_of(self, context: ReqContext) -> PauseHint | None:
        """The request's pause hint, parsed once; a malformed one is counted, warned of once per kind of fault
        and ignored (the request is served)."""
        if context.req_id in self._hints:
            return self._hints[context.req_id]
        reading = read_pause_hint(context.kv_transfer_params, context.kv_hints)
        if reading.fault is not None:
            self.stats.increase_counter(HINT_FAULTS, 1, (reading.fault,))
            if reading.fault not in self._warned:
                self._warned.add(reading.fault)
                logger.warning(
                    "kvcopy: a pause hint ignored (%s); the request is served, later faults of this kind counted",
                    reading.message,
                )
        self._hints[context.req_id] = reading.hint
        return reading.hint

    def arrived(self, context: ReqContext) -> None:
        """A request arrived (vLLM's ``on_new_request``): when it resumes a session its hint names, that
        session's pause ends now; without a hint, the pause it may continue is found once its keys are known
        (:meth:`seen`), with this arrival's time."""
        self._arrivals[context.req_id] = self.clock()
        hint = self.hint_of(context)
        if hint is not None:
            self._resume(context, self.tracker.resumed(context.req_id, hint.session, ()))

    def seen(self, context: ReqContext) -> None:
        """The manager sees the request with its keys (a lookup, a store, its finish): a request without a hint
        that continues a paused request's prompt resumes that request's session."""
        at = self._arrivals.pop(context.req_id, None)
        if at is None or self._hints.get(context.req_id) is not None:
            return
        keys = [key for _, key in _ordered_keys(context)]
        self._resume(context, self.tracker.resumed(context.req_id, None, keys, at=at))

    def _resume(self, context: ReqContext, found: tuple[Pause, float] | None) -> None:
        """A paused session resumed: its lease ends, an unstarted prefetch is cancelled, and the pause is scored
        (where the chunks were, the forecast's error)."""
        if found is None:
            return
        pause, gap = found
        session = pause.session
        held = self.policy.keys_of(session)
        self._waiting.pop(session, None)  # (back before its plan: LRU kept its chunks)
        self.policy.release(session)
        prefetch = self._prefetches.pop(session, None)
        planned = self._planned.pop(session, None)
        where = "none"
        if prefetch is not None and prefetch.started:
            outcome = "late" if prefetch.waiting else "in_time"
            self.stats.increase_counter(PREFETCHES, 1, (outcome,))
            where = "prefetch"
        elif held and all(self._in_host(key) for key in held):
            where = "host"
        elif not held and pause.last_key is not None and self._in_host(cast(OffloadKey, pause.last_key)):
            where = "host"  # (left to LRU, unleased, and LRU kept them: its last chunk is the newest)
        elif pause.last_key is not None and self._in_a_tier(pause.last_key, context):
            where = "tier"
        self.stats.increase_counter(RESUMES, 1, (where,))
        if planned is not None and gap > 0:
            self.stats.observe_histogram(FORECAST_ERROR, abs(planned.median / gap - 1.0))
            low, high = planned.band
            self.stats.increase_counter(RESUMES_IN_BAND, 1, ("yes" if low <= gap <= high else "no",))

    def finished(self, context: ReqContext) -> PausePlan | None:
        """The request finished: its session pauses. The plan for its chunks in host RAM is made and acted on
        once the pause has lasted ``plan_delay_s`` (at the step, or the timer's wake, that reaches it; at once
        when that is 0), unless the session is back first. Returns the plan when it was made now; None
        otherwise (no session, nothing in host RAM, or planned later)."""
        self.seen(context)
        hint = self.hint_of(context)
        self._hints.pop(context.req_id, None)
        chunks = [key for _, key in _ordered_keys(context) if self.policy.get(key) is not None]
        learned_before = context.req_id in self.tracker._session_of  # (a learned session's later turn)
        pause = self.tracker.paused(context.req_id, hint, chunks[-1] if chunks else None)
        if pause is None:  # done: nothing of it is needed again
            assert hint is not None
            self._end(hint.session)
            self.forecaster.end_session(hint.session)
            self.policy.demote(chunks)
            self.stats.increase_counter(PAUSES, 1, ("done",))
            return PausePlan.released("the client said done")
        if pause.resumed_by is not None:  # its next request came before this one was done: nothing waits
            self._end(pause.session)
            if hint is not None or learned_before:
                self.stats.increase_counter(RESUMES, 1, ("host",))
            return None
        if (hint is None and not learned_before) or not chunks:
            return None  # a session not hinted and not learned yet: LRU's, as without agents
        self._end(pause.session)
        half_lru = 0.5 * self.policy.lru_s()  # (LRU keeps the chunks meanwhile)
        delay = min(self.plan_delay_s, half_lru)
        if delay > 0:
            latest = pause.since + max(delay, min(half_lru, MAX_PLAN_WAIT_S))
            self._waiting[pause.session] = _Waiting(pause, hint, chunks, context, pause.since + delay, latest)
            self._notify()
            return None
        return self._act(pause, hint, chunks, context)

    def _plan_dues(self) -> list[tuple[str, float]]:
        """Each waiting pause's session and when it is planned: at its delay, or for a learned one while a
        request that arrived since is not looked up yet, at its latest (the step that looks the request up
        plans it, if it is not the resume)."""
        waiting = list(self._waiting.items())  # (copied whole first: the timer's thread asks too)
        if not waiting:
            return []
        newest = max(list(self._arrivals.values()), default=-math.inf)  # (the newest not looked up yet)
        return [(s, w.latest if w.hint is None and newest >= w.pause.since else w.due) for s, w in waiting]

    def _act(
        self, pause: Pause, hint: PauseHint | None, chunks: list[OffloadKey], context: ReqContext
    ) -> PausePlan | None:
        """Plans the pause over its ``chunks`` still in host RAM and acts on the plan (None, nothing planned,
        when LRU let them all go meanwhile); the plan's times count from the pause's beginning (a prefetch due
        by now starts at once)."""
        chunks = [key for key in chunks if self.policy.get(key) is not None]
        if not chunks:
            return None
        held = chunks[: self.policy.room(pause.session)]  # (a session holds its leading chunks, to its share)
        forecast = self._forecast(pause.session, hint)
        plan = self._plan(forecast, held or chunks, room=bool(held))
        since = pause.since
        # A plan made with room to hold that holds nothing frees the chunks; the chunks a lease cannot hold (past
        # the session's share, or all of them when the leases are full) stay LRU's, as recent as they are: a
        # session back at once still finds them (demoted, they would go before any other request's).
        if held and plan.choice != "keep":
            self.policy.demote(chunks)
        if plan.choice == "keep" and plan.leased:
            assert plan.lease_end_s is not None
            leased = self.policy.lease(pause.session, held, since + plan.lease_end_s)
            self.stats.increase_counter(LEASED_BYTES, leased * self.manager.row_bytes, ("keep",))
        elif plan.prefetch_at_s is not None and plan.lease_end_s is not None:
            self._prefetches[pause.session] = _Prefetch(
                pause.session, tuple(held), context, since + plan.prefetch_at_s, since + plan.lease_end_s, plan.leased
            )
            self._notify()
        self.stats.increase_counter(PAUSES, 1, (plan.choice,))
        p10, p50, p90 = (float(q) for q in forecast.quantiles((0.1, 0.5, 0.9)))
        self._planned[pause.session] = _Planned(p50, (p10, p90))
        while len(self._planned) > MAX_PAUSED:  # (sessions that never came back: the oldest forgotten)
            self._planned.pop(next(iter(self._planned)))
        logger.debug("kvcopy: session %s paused over %d chunks: %s", pause.session, len(chunks), plan.explanation)
        return plan

    # ------------------------------------------------------------------ prefetches

    def start_due(self) -> int:
        """Plans the pauses that have waited their delay, starts the prefetches due by now (the caller holds
        the manager's lock), and ends those whose session did not come back by their lease's end (counted
        unused); returns how many prefetches started."""
        now = self.clock()
        for session in [s for s, due in self._plan_dues() if due <= now]:
            waiting = self._waiting.pop(session)
            self._act(waiting.pause, waiting.hint, waiting.chunks, waiting.context)
        for session in [s for s, p in self._prefetches.items() if p.until <= now]:
            self._end(session)
        started = 0
        for prefetch in list(self._prefetches.values()):
            if prefetch.started or prefetch.due > now:
                continue
            prefetch.started = True
            started += 1
            self.stats.increase_counter(PREFETCHES, 1, ("started",))
            for key in prefetch.keys:
                if self.policy.get(key) is not None:
                    continue  # still (or already again) in host RAM
                tier = self._tier_holding(key, prefetch.context)
                if tier is None:
                    break  # (its chunks past this one would not be a prefix: left to the resume)
                prefetch.waiting.add(key)  # (before the promotion takes a row: its read back is not a reuse)
                if not self._tiered._initiate_promotion(tier, key, prefetch.context):
                    prefetch.waiting.discard(key)
                    break  # the host tier is full: the rest waits for the resume
                prefetch.read.append(key)
            if not prefetch.waiting:
                self._lease_prefetched(prefetch)
        return started

    def due_now(self) -> bool:
        """Whether a plan or a prefetch is due and not started: the engine should step (``has_pending_work``)."""
        now = self.clock()
        return any(due <= now for _, due in self._plan_dues()) or any(
            not p.started and p.due <= now for p in self._prefetches.values()
        )

    def landed(self, keys: Sequence[OffloadKey]) -> None:
        """A promotion landed ``keys``: a prefetch whose every chunk is in leases its chunks until its end."""
        for prefetch in list(self._prefetches.values()):
            if prefetch.waiting:
                prefetch.waiting.difference_update(keys)
                if not prefetch.waiting:
                    self._lease_prefetched(prefetch)

    def _lease_prefetched(self, prefetch: _Prefetch) -> None:
        if not prefetch.leased:
            return  # (LRU keeps what it read back until the plan's end)
        leased = self.policy.lease(prefetch.session, prefetch.keys, prefetch.until)
        self.stats.increase_counter(LEASED_BYTES, leased * self.manager.row_bytes, ("prefetch",))

    def _end(self, session: str) -> None:
        """Ends what a session's earlier pause left: its plan not made yet, its lease, its prefetch (counted
        unused if it landed)."""
        self._waiting.pop(session, None)
        self.policy.release(session)
        prefetch = self._prefetches.pop(session, None)
        if prefetch is not None and prefetch.started and not prefetch.waiting:
            self.stats.increase_counter(PREFETCHES, 1, ("unused",))
        self._planned.pop(session, None)

    def _timer_loop(self) -> None:
        """While the engine is idle nothing steps: this plans the pauses and starts the prefetches due, under
        the manager's lock, and submits them (vLLM's flush of pending promotions)."""
        while True:
            with self._wake:
                if self._stopping:
                    return
                now = self.clock()
                prefetches = list(self._prefetches.values())  # (copied whole first: the scheduler's thread adds)
                due = min(
                    [p.due for p in prefetches if not p.started] + [due for _, due in self._plan_dues()],
                    default=math.inf,
                )
                if due > now:
                    self._wake.wait(min(_TIMER_MAX_SLEEP_S, due - now))
                    continue
            with self._tiered.lock:
                if self.start_due():
                    self._tiered._flush_pending_promotions()

    @property
    def _tiered(self) -> KVCopyTieringManager:
        """The manager, as the tiered one it is wherever a prefetch was planned (only a tier's chunks are read
        back)."""
        return cast("KVCopyTieringManager", self.manager)

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify_all()

    # ------------------------------------------------------------------ costs

    def _plan(self, forecast: GapForecast, chunks: list[OffloadKey], *, room: bool) -> PausePlan:
        """The plan for ``chunks`` (the session's leading chunks in host RAM, within its share) over the pause's
        ``forecast``; ``room``: False when the session may lease nothing now (it is then demoted or dropped)."""
        manager = self.manager
        lru = self.policy.lru_s()  # (what a lease buys is the time past this)
        planner, _ = manager.session.live.current()
        n = len(chunks)
        rows = n * manager.row_bytes
        if planner is None:  # no profile: keep while the leases allow, as LRU would have kept them at best
            costs = PauseCosts(host_s=0.0, recompute_s=1.0, nbytes=rows)
            return plan_pause(forecast, costs, hold_price=0.0, room_bytes=None if room else 0, lru_s=lru)
        group = get_offload_group_idx(chunks[0])
        tokens = n * manager.geometry.tokens_per_chunk[group]
        host = planner.t_load_nbytes(n * manager.chunk_bytes)
        recompute = forward_seconds(planner, tokens, 0, manager.geometry.max_forward_tokens)
        read = planner.disk.predict(rows) if planner.disk is not None and manager.secondary_tiers else None
        costs = PauseCosts(
            host_s=host,
            recompute_s=recompute,
            nbytes=rows,
            tier_s=None if read is None else read + host,
            read_s=None if read is None else read * (1 + PREFETCH_READ_MARGIN),  # (a prefetch's: with margin)
        )
        price = hold_price(reuse_per_s=self._reuse_rate(), miss_s_per_byte=costs.fallback_s / max(rows, 1))
        return plan_pause(forecast, costs, hold_price=price, room_bytes=None if room else 0, lru_s=lru)

    def _forecast(self, session: str, hint: PauseHint | None) -> GapForecast:
        """The pause's forecast: its session's, under its tool, with its client's estimate."""
        if hint is None:
            return self.forecaster.forecast(session=session)
        return self.forecaster.forecast(session=session, tool=hint.tool, resume_in_s=hint.resume_in_s)

    def reused(self, key: OffloadKey) -> None:
        """A chunk the host tier evicted lately came back: traffic needed the room it had (what prices a lease:
        kvcopy.agents.hold_price). A prefetch's own read back is not counted: it is the plan, not the others."""
        if not any(key in prefetch.waiting for prefetch in self._prefetches.values()):
            self._reuses.add(self.clock())

    def _reuse_rate(self) -> float:
        """The fraction of the host tier's capacity that came back within a capacity's worth of evictions, per
        second, over the last REUSE_WINDOW_S.

        Until the tier has evicted a capacity's worth of chunks, that is not measured yet (a chunk counts as
        reused only while it is among the last capacity's worth evicted), and the rate is taken at the most it
        can be: the tier's store rate (once full, each chunk stored evicts one, and each is taken to come
        back). An engine starts from what LRU does, then, and leases for longer as it sees the others' traffic
        leave it room. (Priced at nothing until a reuse was seen, the first pauses leased to their cap while
        the tier filled, a session's last turn to the end of its forecast: a fifth of the agent bench's time on
        back-to-back turns.)
        """
        capacity = max(self.policy.cache_capacity, 1)
        if self.policy.evicted < capacity:
            return self.policy.stored_per_s() / capacity
        return self._reuses.per_s(self.clock()) / capacity

    def _in_host(self, key: OffloadKey) -> bool:
        """Whether ``key``'s chunk is in host RAM, ready (asked of the policy: a lookup would judge)."""
        chunk = self.policy.get(key)
        return chunk is not None and chunk.is_ready

    def _tier_holding(self, key: OffloadKey, context: ReqContext) -> int | None:
        for i, tier in enumerate(self.manager.secondary_tiers):
            if tier.lookup(key, context) is LookupResult.HIT:
                return i
        return None

    def _in_a_tier(self, key: Hashable, context: ReqContext) -> bool:
        return self._tier_holding(cast(OffloadKey, key), context) is not None  # (the tracker keeps vLLM's keys)

    def take_stats(self) -> OffloadingConnectorStats:
        stats, self.stats = self.stats, OffloadingConnectorStats()
        return stats

    def shutdown(self) -> None:
        """Stops the timer and saves the forecaster (where ``kvcopy_agent_forecast`` names a file)."""
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._timer is not None:
            self._timer.join(timeout=5.0)
        if self.forecast_path is not None:
            try:
                self.forecaster.save(self.forecast_path)
            except OSError as err:
                logger.warning("kvcopy: the gap forecaster could not be saved to %s (%s)", self.forecast_path, err)


def _ordered_keys(context: ReqContext) -> list[tuple[int, OffloadKey]]:
    """The request's keys with their end positions, head first (vLLM 0.33 records them before any lookup)."""
    return sorted((position, key) for key, position in context._offload_key_positions.items())
