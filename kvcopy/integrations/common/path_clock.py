"""Timing an engine's forwards and the path each resumed request takes, in the terms the Planner predicts.

Engine-independent: an adapter calls :meth:`PathClock.resumed` when a preempted request is scheduled again,
:meth:`PathClock.reloaded` with the transfers that bring its blocks back, :meth:`PathClock.start` just
before a forward and :meth:`PathClock.stop` once it has ended. Each forward is reported to the OnlinePlanner
(its requests' new and cached tokens, and its seconds); each resumed request's path is measured as
docs/decisions.md defines it ("Predicted and measured in a batching engine"):

- a reload: the seconds the forward waited for the request's blocks (the turnaround of that batch's reload
  transfers: from their submission, just before the forward, until done), plus its own part of the forwards
  that carry its new tokens, until it has caught up;
- a recompute: its own part of the forwards that carry its re-prefilled tokens, until it has caught up.

A forward's seconds are the host's clock, or, on a GPU, CUDA events recorded on the stream the forward runs on
(:class:`StreamTimer`), read once the stream has passed them: an engine that prepares batch N+1 while batch N
still runs (transformers' asynchronous batching) stops the host's clock too early. The start is marked after the
stream was made to wait for the forward's reloads, so the forward's seconds never hold that wait; the reloads'
own turnaround is the path's wait.

Its own part of a forward is the forward's seconds times the law's forward of the request alone over the law's
forward of the whole batch (:func:`~.online_planner.own_share`, with the OnlinePlanner's Planner of the moment):
the other requests' work in it (another request's prefill chunk the scheduler put beside it) is not its cost.
A forward it rides alone counts whole.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvcopy.engine.transfer import Transfer
from kvcopy.integrations.common.offload_stats import OffloadDecision
from kvcopy.integrations.common.online_planner import OnlinePlanner, own_share

__all__ = ["ForwardRequest", "ForwardTimer", "HostTimer", "PathClock", "StreamTimer"]


@dataclass(frozen=True)
class ForwardRequest:
    """One request's part of a forward: its id, the tokens it computes and the cached tokens before them, and
    whether the forward brings it up to date (nothing left to prefill after it)."""

    request_id: str
    new_tokens: int
    cached_tokens: int
    completes: bool


@dataclass
class _Path:
    """A resumed request and the seconds its path has taken so far."""

    decision: OffloadDecision
    reloads: list[Transfer] = field(default_factory=list)
    forward_s: float = 0.0
    crowding_tokens: int = 0  # the most tokens of other requests' prefill chunks in one of its forwards


@dataclass
class _Forward:
    started: Any  # the timer's mark
    requests: tuple[ForwardRequest, ...]
    paths: tuple[_Path | None, ...]  # each request's path when the forward started (None: not resumed)
    reloads: list[Transfer]  # the reloads this forward waits for
    ended: Any = None  # the timer's mark, once stopped


class ForwardTimer(Protocol):
    """How PathClock times a forward: a mark at its start and at its end, and the seconds between two marks."""

    def mark(self) -> Any:
        """A mark of now (in the forward's own order of work)."""
        ...

    def seconds(self, start: Any, end: Any, *, wait: bool) -> float | None:
        """Seconds from ``start`` to ``end``; None while ``end`` has not been reached (``wait``: wait for it)."""
        ...


class HostTimer:
    """The host's clock: a forward has ended when the engine says so."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float, *, wait: bool) -> float:
        del wait
        return end - start


class StreamTimer:
    """CUDA events recorded on ``stream`` (the current stream when None), read once the stream has passed them:
    the seconds the device spent from one mark to the other, whatever the host did meanwhile. ``event_type`` is
    ``torch.cuda.Event`` unless given (a stand-in with its ``record``, ``query``, ``synchronize`` and
    ``elapsed_time``)."""

    def __init__(self, stream: Any = None, *, event_type: Any = None) -> None:
        if event_type is None:
            import torch

            event_type = torch.cuda.Event
        self._stream = stream
        self._event_type = event_type

    def mark(self) -> Any:
        event = self._event_type(enable_timing=True)
        event.record(self._stream)
        return event

    def seconds(self, start: Any, end: Any, *, wait: bool) -> float | None:
        if wait:
            end.synchronize()
        elif not end.query():
            return None
        return start.elapsed_time(end) / 1e3  # milliseconds


class PathClock:
    """Times forwards (with ``timer``, the host's clock by default) and resumed requests' paths. A forward
    whose end the timer cannot read yet is reported, in order, at a later :meth:`stop` or :meth:`settle`."""

    def __init__(self, live: OnlinePlanner, *, timer: ForwardTimer | None = None) -> None:
        self.live = live
        self.timer: ForwardTimer = HostTimer() if timer is None else timer
        self._paths: dict[str, _Path] = {}
        self._caught_up: list[_Path] = []  # up to date; measured once their reloads' ends are known
        self._forward: _Forward | None = None
        self._ended: deque[_Forward] = deque()  # stopped, not yet read (oldest first)
        self._reloads: list[Transfer] = []  # submitted for the forward about to start

    def resumed(self, request_id: str, decision: OffloadDecision) -> None:
        """A preempted request is scheduled again: its path starts."""
        self._paths[request_id] = _Path(decision)

    def forget(self, request_id: str) -> None:
        """Preempted again before catching up, or cancelled: that path is not measured."""
        self._paths.pop(request_id, None)

    def reloaded(self, request_ids: list[str], transfers: list[Transfer]) -> None:
        """These requests' blocks come back with ``transfers``, which the next forward waits for."""
        self._reloads.extend(transfers)
        for request_id in request_ids:
            path = self._paths.get(request_id)
            if path is not None:
                path.reloads = list(transfers)

    def start(self, requests: list[ForwardRequest]) -> None:
        """A forward of ``requests`` starts now (after its stream was made to wait for its reloads)."""
        paths = tuple(self._paths.get(r.request_id) for r in requests)
        self._forward = _Forward(self.timer.mark(), tuple(requests), paths, self._reloads)
        self._reloads = []

    def stop(self) -> None:
        """The forward started last has ended (if any): once its seconds are known, report it, charge it to the
        paths it carried, and record the paths now complete."""
        forward, self._forward = self._forward, None
        if forward is not None:
            forward.ended = self.timer.mark()
            self._ended.append(forward)
        self.settle()

    def _report(self, forward: _Forward, seconds: float) -> None:
        new = [r.new_tokens for r in forward.requests]
        cached = [r.cached_tokens for r in forward.requests]
        self.live.observe_forward(new, cached, seconds)
        for index, (request, path) in enumerate(zip(forward.requests, forward.paths, strict=True)):
            if path is None:
                continue
            path.forward_s += seconds * own_share(self.live.planner, new, cached, index)
            crowding = sum(r.new_tokens for r in forward.requests if r is not request and r.new_tokens > 1)
            path.crowding_tokens = max(path.crowding_tokens, crowding)
            if request.completes and self._paths.get(request.request_id) is path:  # (not forgotten since)
                self._caught_up.append(self._paths.pop(request.request_id))

    def drop_forward(self) -> None:
        """The engine starts over (a new run): the forward in flight is not charged (its end is not seen)."""
        self._forward = None
        self._reloads = []

    def settle(self, *, wait: bool = False) -> None:
        """Reports the ended forwards whose seconds are known, oldest first, then records the measured seconds
        of caught-up paths whose reloads are done (all of them, waiting for the forwards' ends and the reloads,
        with ``wait``; a failed reload's path is not measured)."""
        while self._ended:
            forward = self._ended[0]
            seconds = self.timer.seconds(forward.started, forward.ended, wait=wait)
            if seconds is None:
                break
            self._ended.popleft()
            self._report(forward, max(0.0, seconds))
        still = []
        for path in self._caught_up:
            if wait:
                for transfer in path.reloads:
                    with contextlib.suppress(Exception):  # a failed reload: its error went to generation
                        transfer.wait()
            if all(transfer.done() for transfer in path.reloads):
                wait_s = _reload_wait(path.reloads) if path.reloads else 0.0
                if wait_s is not None:
                    path.decision.measured_s = wait_s + path.forward_s
                    path.decision.crowding_tokens = path.crowding_tokens
            else:
                still.append(path)
        self._caught_up = still

    def clear(self) -> None:
        self._paths.clear()
        self._ended.clear()
        self.drop_forward()


def _reload_wait(reloads: list[Transfer]) -> float | None:
    """Seconds a forward waited for its reloads: the longest turnaround (they were submitted together, just
    before it); None if one failed or has no timing."""
    seconds = [transfer.turnaround for transfer in reloads]
    known = [s for s in seconds if s is not None]
    return max(known) if len(known) == len(seconds) else None
