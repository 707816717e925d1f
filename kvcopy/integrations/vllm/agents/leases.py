"""Leases on vLLM's host tier: a paused session's chunks kept from eviction until a time, within bounds.

:class:`LeasedPolicy` wraps the eviction policy vLLM's CPU (primary) tier was built with (``lru``, ``arc`` or
an out-of-tree one) and answers every call as it does, except ``evict``:

- chunks a pause *demoted* go first (their session waits for them in a secondary tier, or not at all);
- then the inner policy's choice, with every leased chunk protected;
- when that cannot free enough, leases are *displaced*, the one nearest its end first, until it can. A lease
  never keeps a new request from host room, so nothing waits on a lease and nothing deadlocks (vLLM's resumable
  sessions did: #49439; SGLang's pinned sessions: #27024);
- an expired lease protects nothing: its chunks are LRU's again.

Bounds: all leases together hold at most ``max_leased_fraction`` of the tier's chunks, and one session at most
``max_session_fraction`` (:meth:`LeasedPolicy.room`); a lease asked beyond its room is cut to it. Clock:
``time.monotonic`` seconds, as the tiering manager's own.

What a lease costs the others is the room it takes from LRU: the chunks LRU evicts that traffic asks for again
soon after. The policy remembers the keys of the last ``cache_capacity`` chunks it evicted (the chunks one more
capacity's worth of room would have kept); ``on_reuse``, when given, is told each such key when it comes back
(stored or promoted again), which is what prices a lease (kvcopy.agents.hold_price). What a lease buys is the
time past what LRU would have kept the chunks anyway: :meth:`LeasedPolicy.lru_s`, from the rate the tier stores
chunks at.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus

from kvcopy._checks import non_negative_number
from kvcopy.agents.plan import DEFAULT_MAX_LEASED_FRACTION, DEFAULT_MAX_SESSION_FRACTION

__all__ = ["STORE_WINDOW_S", "LeasedPolicy", "RecentEvents"]

# The window over which the tier's store rate is measured (lru_s): a minute, as the reuses that price a lease
# (kvcopy.integrations.vllm.agents.pauses.REUSE_WINDOW_S): long beside a turn, short beside a shift in traffic.
STORE_WINDOW_S = 60.0


class RecentEvents:
    """When events happened over the last ``window_s`` seconds (a clock's), and how often: the tier's stores
    (:meth:`LeasedPolicy.lru_s`) and its evicted chunks coming back (what prices a lease)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._times: deque[float] = deque()  # oldest first

    def add(self, now: float) -> None:
        self._times.append(now)
        self._forget(now)  # (trimmed as they come: with nobody asking for the rate, nothing else would)

    def per_s(self, now: float) -> float:
        """Events a second over the window (0.0 with none in it; a burst is counted over 1 s)."""
        self._forget(now)
        return len(self._times) / max(now - self._times[0], 1.0) if self._times else 0.0

    def __len__(self) -> int:
        return len(self._times)

    def _forget(self, now: float) -> None:
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()


@dataclass
class _Lease:
    keys: tuple[OffloadKey, ...]
    until: float


class LeasedPolicy(CachePolicy):
    """``inner`` (the tier's eviction policy) with leases and demotions (see the module)."""

    def __init__(
        self,
        inner: CachePolicy,
        *,
        max_leased_fraction: float = DEFAULT_MAX_LEASED_FRACTION,
        max_session_fraction: float = DEFAULT_MAX_SESSION_FRACTION,
        clock: Callable[[], float] = time.monotonic,
        on_reuse: Callable[[OffloadKey], None] | None = None,
    ) -> None:
        super().__init__(inner.cache_capacity)
        for name, fraction in (
            ("max_leased_fraction", max_leased_fraction),
            ("max_session_fraction", max_session_fraction),
        ):
            if not non_negative_number(name, fraction) <= 1:
                raise ValueError(f"{name}: expected a fraction in [0, 1], got {fraction}")
        self.inner = inner
        self.max_leased = int(inner.cache_capacity * max_leased_fraction)
        self.max_per_session = int(inner.cache_capacity * max_session_fraction)
        self.clock = clock
        self.on_reuse = on_reuse  # told each recently evicted key that comes back (what prices a lease)
        self._evicted: OrderedDict[OffloadKey, None] = OrderedDict()  # the last cache_capacity evicted, oldest first
        self._leases: dict[str, _Lease] = {}
        self._demoted: dict[OffloadKey, None] = {}  # (insertion-ordered: the first demoted go first)
        self._stores = RecentEvents(STORE_WINDOW_S)  # when each chunk was stored
        self.evicted = 0  # chunks evicted in all
        self.displaced = 0  # leases ended early to give a request room
        self.expired = 0  # leases that ran to their end

    # ------------------------------------------------------------------ leases

    def lease(self, session: str, keys: Sequence[OffloadKey], until: float) -> int:
        """Keep ``keys`` (a paused session's chunks, head first) from eviction until ``until`` (the clock's
        seconds), replacing the session's earlier lease; only the leading chunks that fit its room are leased.
        Returns how many were."""
        self.release(session)
        held = [key for key in keys if self.inner.get(key) is not None][: self.room(session)]
        if held:
            self._leases[session] = _Lease(tuple(held), until)
            for key in held:
                self._demoted.pop(key, None)
        return len(held)

    def release(self, session: str) -> tuple[OffloadKey, ...]:
        """End ``session``'s lease (its client is done, or it resumed); returns the keys it held."""
        lease = self._leases.pop(session, None)
        return () if lease is None else lease.keys

    def demote(self, keys: Iterable[OffloadKey]) -> None:
        """Make ``keys`` the first to go when room is needed (their session waits for them elsewhere); a key
        another session leases stays leased."""
        leased = {key for lease in self._leases.values() for key in lease.keys}
        for key in keys:
            if self.inner.get(key) is not None and key not in leased:
                self._demoted[key] = None

    def room(self, session: str) -> int:
        """The chunks ``session`` may lease now: its share, within what all leases may hold beside the others'."""
        self._expire()
        others = sum(len(lease.keys) for name, lease in self._leases.items() if name != session)
        return max(0, min(self.max_per_session, self.max_leased - others))

    def leased(self, session: str | None = None) -> int:
        """How many chunks are leased (to ``session``, or to all)."""
        self._expire()
        if session is not None:
            lease = self._leases.get(session)
            return 0 if lease is None else len(lease.keys)
        return sum(len(lease.keys) for lease in self._leases.values())

    def lease_end(self, session: str) -> float | None:
        """When ``session``'s lease ends (the clock's seconds), None when it holds none."""
        self._expire()
        lease = self._leases.get(session)
        return None if lease is None else lease.until

    def lru_s(self) -> float:
        """How long LRU keeps a chunk stored now without a lease: it goes once the tier has stored as many
        chunks after it as it holds outside the leases (each new one takes free room or evicts the least
        recently used), so the seconds that takes at the rate it stored chunks over the last STORE_WINDOW_S
        (``math.inf`` when it stored none: then nothing needs a lease)."""
        rate = self.stored_per_s()
        return max(self.cache_capacity - self.leased(), 0) / rate if rate else math.inf

    def stored_per_s(self) -> float:
        """Chunks the tier stored a second, over the last STORE_WINDOW_S."""
        return self._stores.per_s(self.clock())

    def _expire(self) -> None:
        now = self.clock()
        for name in [name for name, lease in self._leases.items() if lease.until <= now]:
            del self._leases[name]
            self.expired += 1

    # ------------------------------------------------------------------ eviction

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus]] | None:
        """``n`` chunks out (see the module): demoted ones first, then the inner policy's choice with leased
        chunks protected, displacing leases (nearest their end first) only when nothing else frees enough.
        None, changing nothing, when even that cannot."""
        if n == 0:
            return []
        self._expire()
        first: list[tuple[OffloadKey, ChunkStatus]] = []
        for key in self._demoted:
            chunk = self.inner.get(key)
            if len(first) < n and chunk is not None and chunk.ref_cnt == 0 and key not in protected:
                first.append((key, chunk))
        taken = {key for key, _ in first}
        rest: list[tuple[OffloadKey, ChunkStatus]] | None = []
        if len(first) < n:
            leases = sorted(self._leases.items(), key=lambda item: item[1].until, reverse=True)
            gone: list[str] = []
            while True:
                shielded = {key for _, lease in leases for key in lease.keys}
                rest = self.inner.evict(n - len(first), protected | taken | shielded)
                if rest is not None or not leases:
                    break
                gone.append(leases.pop()[0])  # the lease nearest its end gives way
            if rest is None:
                return None  # (nothing changed: the inner policy's evict is atomic, the leases untouched)
            for name in gone:
                del self._leases[name]
            self.displaced += len(gone)
        for key, _ in first:
            self.inner.remove(key)
        for key in taken:
            del self._demoted[key]
        for key, _ in rest or ():
            self._demoted.pop(key, None)
        out = first + (rest or [])
        for key, _ in out:
            self._evicted[key] = None
            self._evicted.move_to_end(key)
        while len(self._evicted) > self.cache_capacity:
            self._evicted.popitem(last=False)
        self.evicted += len(out)
        return out

    # ------------------------------------------------------------------ the rest, as the inner policy

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.inner.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        if self._evicted.pop(key, 0) is None and self.on_reuse is not None:  # (evicted lately, needed again)
            self.on_reuse(key)
        self._stores.add(self.clock())
        self.inner.insert(key, chunk, req_context)

    def remove(self, key: OffloadKey) -> None:
        self._demoted.pop(key, None)
        self.inner.remove(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self.inner.touch(keys, req_context)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self.inner.on_store_miss(keys, req_context)

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self.inner.on_request_access(keys, req_context)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: set[OffloadKey],
        reused_keys: set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        self.inner.on_request_finished(key_groups, insertion_only_keys, reused_keys, req_context)

    def clear(self) -> None:
        self._leases.clear()
        self._demoted.clear()
        self.inner.clear()

    def mark_evictable(self, key: OffloadKey) -> None:
        self.inner.mark_evictable(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self.inner.mark_non_evictable(key)

    def keys_of(self, session: str) -> Collection[OffloadKey]:
        """The keys ``session``'s lease holds (empty when none)."""
        lease = self._leases.get(session)
        return () if lease is None else lease.keys
