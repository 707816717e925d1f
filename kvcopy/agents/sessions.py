"""Which session a request belongs to, when it paused, and when it came back.

An engine tells :class:`PauseTracker` two things: a request finished (:meth:`PauseTracker.paused`, with the
request's hint, if any, and the last chunk it stored), and a request arrived (:meth:`PauseTracker.resumed`,
with its hint's session, if any, and the chunk keys of its prompt). The tracker finds the pause that the
arrival ends and teaches the gap to a :class:`~kvcopy.agents.GapForecaster`:

- a hinted session is found by name: the arrival's hint names the session, and the pause is that session's;
- a session without hints is *learned* from prefix continuation: an arrival whose prompt holds a paused
  request's last stored chunk continues that request (an agent's next turn carries the whole conversation
  before it), so it resumes that pause, and the session is named after the request that began it.

A session's next request can arrive before the engine reports its previous one finished (an agent's
back-to-back turn, while the engine still stores the last chunks): that request resumes nothing yet, so the
tracker holds it as *ahead* until its session pauses, and then the pause ends as it begins (a gap of 0, the
Pause's ``resumed_by``), instead of waiting for a resume that has already come.

Keys are whatever the engine names chunks by (vLLM's ``OffloadKey`` bytes); the clock is ``time.monotonic``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from kvcopy.agents.hint import PauseHint

__all__ = ["LEARNED_PREFIX", "MAX_PAUSED", "Pause", "PauseTracker"]

# A session named by the tracker (no hint) starts so, so that it never takes a client's session name.
LEARNED_PREFIX = "~"
# Paused sessions remembered at once, the oldest forgotten first: 65,536 at a few hundred bytes each is a few
# MiB, and an engine serves far fewer sessions than that between two turns of one (TraceLab's busiest user
# ran a few hundred sessions in a day).
MAX_PAUSED = 65536


@dataclass(frozen=True)
class Pause:
    """A session waiting between two of its requests: since ``since`` (the clock's seconds), after
    ``request_id`` stored ``last_key`` (None: it stored nothing); ``tool`` and ``resume_in_s`` as its hint said
    (None without one); ``learned``: found by prefix continuation rather than named by a hint; ``resumed_by``:
    the request that had already resumed it when it began (None: it waits)."""

    session: str
    request_id: str
    since: float
    last_key: Hashable | None
    tool: str | None = None
    resume_in_s: float | None = None
    learned: bool = False
    resumed_by: str | None = None


class PauseTracker:
    """The sessions paused now, found again when they resume (see the module). ``forecaster``: what learns
    from each gap (an object with ``observe(gap_s, *, session, tool, resume_in_s)``; None: nothing learns)."""

    def __init__(self, forecaster: object | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.forecaster = forecaster
        self.clock = clock
        self._paused: OrderedDict[str, Pause] = OrderedDict()  # by session, the oldest first
        self._by_last_key: dict[Hashable, str] = {}  # a learned pause's last key -> its session
        self._session_of: dict[str, str] = {}  # a live request -> its learned session
        # live requests that resumed no pause, oldest first: -> (their hint's session, or their keys without one)
        self._ahead: OrderedDict[str, tuple[str | None, frozenset[Hashable]]] = OrderedDict()

    def paused(self, request_id: str, hint: PauseHint | None, last_key: Hashable | None) -> Pause | None:
        """``request_id`` finished: its session pauses (None when its hint said ``done``: nothing waits)."""
        learned = self._session_of.pop(request_id, None)
        self._ahead.pop(request_id, None)
        if hint is not None and hint.done:
            self._forget(hint.session)
            return None
        session = hint.session if hint is not None else (learned or LEARNED_PREFIX + request_id)
        ahead = self._ahead_of(session if hint is not None else None, last_key)
        pause = Pause(
            session=session,
            request_id=request_id,
            since=self.clock(),
            last_key=last_key,
            tool=None if hint is None else hint.tool,
            resume_in_s=None if hint is None else hint.resume_in_s,
            learned=hint is None,
            resumed_by=ahead,
        )
        self._forget(session)
        if ahead is not None:  # resumed already: a pause of no length, learned as such
            del self._ahead[ahead]
            if pause.learned:
                self._session_of[ahead] = session
            self._observe(pause, 0.0)
            return pause
        self._paused[session] = pause
        if pause.learned and last_key is not None:
            self._by_last_key[last_key] = session
        while len(self._paused) > MAX_PAUSED:
            self._forget(next(iter(self._paused)))
        return pause

    def resumed(
        self, request_id: str, session: str | None, keys: Iterable[Hashable], *, at: float | None = None
    ) -> tuple[Pause, float] | None:
        """``request_id`` arrived (with its hint's ``session``, None without a hint; ``keys``: its prompt's
        chunks; ``at``: when it arrived, the clock's seconds, if not now). Returns the pause it ends and the gap
        in seconds (which the forecaster has learned), or None when it resumes no pause."""
        pause = None
        if session is not None:
            pause = self._paused.get(session)
        else:
            for key in keys:
                found = self._by_last_key.get(key)
                if found is not None:
                    pause = self._paused.get(found)
                    break
        if pause is None:
            self._ahead[request_id] = (session, frozenset() if session is not None else frozenset(keys))
            while len(self._ahead) > MAX_PAUSED:  # (requests that never finished: the oldest forgotten)
                self._ahead.popitem(last=False)
            return None
        self._forget(pause.session)
        if pause.learned:
            self._session_of[request_id] = pause.session
        gap = max(0.0, (self.clock() if at is None else at) - pause.since)
        self._observe(pause, gap)
        return pause, gap

    def _ahead_of(self, session: str | None, last_key: Hashable | None) -> str | None:
        """A live request that already continues a request finishing now: one hinted with ``session``, or (for
        a request without a hint, ``session`` None) one whose prompt holds its ``last_key``."""
        for request_id, (named, keys) in self._ahead.items():
            if (session is not None and named == session) or (
                session is None and named is None and last_key is not None and last_key in keys
            ):
                return request_id
        return None

    def _observe(self, pause: Pause, gap: float) -> None:
        if self.forecaster is not None:
            self.forecaster.observe(  # type: ignore[attr-defined]
                gap, session=pause.session, tool=pause.tool, resume_in_s=pause.resume_in_s
            )

    def pause_of(self, session: str) -> Pause | None:
        """The session's pause, None when it is not paused."""
        return self._paused.get(session)

    def __len__(self) -> int:
        return len(self._paused)

    def _forget(self, session: str) -> None:
        pause = self._paused.pop(session, None)
        if pause is not None and pause.learned and pause.last_key is not None:
            self._by_last_key.pop(pause.last_key, None)
