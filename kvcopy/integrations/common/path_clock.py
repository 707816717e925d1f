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

Its own part of a forward is the forward's seconds times the law's forward of the request alone over the law's
forward of the whole batch (:func:`~._live_planner.own_share`, with the OnlinePlanner's Planner of the moment):
the other requests' work in it (another request's prefill chunk the scheduler put beside it) is not its cost.
A forward it rides alone counts whole.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from kvcopy.engine.transfer import Transfer
from kvcopy.integrations.common.offload_stats import OffloadDecision
from kvcopy.integrations.common.online_planner import OnlinePlanner, own_share

__all__ = ["ForwardRequest", "PathClock"]


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
    started: float
    requests: tuple[ForwardRequest, ...]
    reloads: list[Transfer]  # the reloads this forward waits for


class PathClock:
    """Times forwards and resumed requests' paths. ``waits_inside_forward``: the forward's own stream waits
    for its reloads (CUDA), so that wait is inside its measured seconds and is taken out of them; on a CPU
    the thread waited before :meth:`start`."""

    def __init__(self, live: OnlinePlanner, *, waits_inside_forward: bool) -> None:
        self.live = live
        self.waits_inside_forward = waits_inside_forward
        self._paths: dict[str, _Path] = {}
        self._caught_up: list[_Path] = []  # up to date; measured once their reloads' ends are known
        self._forward: _Forward | None = None
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
        """A forward of ``requests`` starts now."""
        self._forward = _Forward(time.perf_counter(), tuple(requests), self._reloads)
        self._reloads = []

    def stop(self) -> None:
        """The forward started last has ended (if any): report it, charge it to the paths it carried, and
        record the paths now complete."""
        forward, self._forward = self._forward, None
        if forward is not None:
            seconds = time.perf_counter() - forward.started
            waited = _reload_wait(forward.reloads) if self.waits_inside_forward and forward.reloads else None
            if waited is not None:  # (None: a reload failed; its wait is not known, nor its path measured)
                seconds = max(0.0, seconds - waited)
            new = [r.new_tokens for r in forward.requests]
            cached = [r.cached_tokens for r in forward.requests]
            self.live.observe_forward(new, cached, seconds)
            for index, request in enumerate(forward.requests):
                path = self._paths.get(request.request_id)
                if path is not None:
                    path.forward_s += seconds * own_share(self.live.planner, new, cached, index)
                    crowding = sum(r.new_tokens for r in forward.requests if r is not request and r.new_tokens > 1)
                    path.crowding_tokens = max(path.crowding_tokens, crowding)
                    if request.completes:
                        self._caught_up.append(self._paths.pop(request.request_id))
        self.settle()

    def drop_forward(self) -> None:
        """The engine starts over (a new run): the forward in flight is not charged (its end is not seen)."""
        self._forward = None
        self._reloads = []

    def settle(self, *, wait: bool = False) -> None:
        """Records the measured seconds of caught-up paths whose reloads are done (all of them, waiting for the
        reloads, with ``wait``; a failed reload's path is not measured)."""
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
        self.drop_forward()


def _reload_wait(reloads: list[Transfer]) -> float | None:
    """Seconds a forward waited for its reloads: the longest turnaround (they were submitted together, just
    before it); None if one failed or has no timing."""
    seconds = [transfer.turnaround for transfer in reloads]
    known = [s for s in seconds if s is not None]
    return max(known) if len(known) == len(seconds) else None
