"""What an engine adapter reports about its offloads: counters and one record per preempted request."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from kvcopy.profile import Profile

__all__ = ["OffloadAction", "OffloadDecision", "OffloadStats"]

OffloadAction = Literal["reload", "recompute"]


@dataclass
class OffloadDecision:
    """One preempted request: what was decided, what was predicted, and (once it resumed) what it took.

    ``prefix_tokens``: tokens whose KV was in the cache when the request was
    preempted. ``new_tokens``: tokens it still had to process on top of them
    (usually the one token just generated). A reload moves ``reload_blocks``
    blocks (``reload_nbytes`` bytes) and then processes ``new_tokens``; a
    recompute re-prefills ``prefix_tokens + new_tokens``.

    ``predicted_reload_s`` / ``predicted_recompute_s``: the Planner's seconds
    for each path at decision time (None without a profile), in the terms of
    ``measured_s`` (docs/decisions.md, "Predicted and measured in a batching
    engine"): the time the request takes to catch up once it runs again, in
    forwards of its own. A reload: the seconds the forward waited for its
    blocks, plus the forwards that carry its ``new_tokens``; a recompute: the
    forwards that carry its ``prefix_tokens + new_tokens``; forwards of at
    most the engine's batch token budget each. Predicted, each forward is the
    request's alone; measured, each is the part of the batched forward that
    the law gives the request alone. ``observations``: how many of the
    engine's own measurements the Planner's profile held (0: the calibration
    alone). ``measured_s``: the path taken, measured after the request resumed;
    None until then, if it was preempted again before catching up, or if it
    caught up in the engine's last forward (whose end is not observed).
    ``crowding_tokens``: once measured, the most tokens other requests'
    prefill chunks took in one forward of its path (0: those forwards carried
    only decode steps of others): work it waited beside, which no prediction
    made at decision time can see, and which its measured part leaves out.
    """

    request_id: str
    prefix_tokens: int
    new_tokens: int
    reload_blocks: int
    reload_nbytes: int
    action: OffloadAction
    reason: str
    predicted_reload_s: float | None
    predicted_recompute_s: float | None
    measured_s: float | None = None
    observations: int = 0
    crowding_tokens: int = 0

    @property
    def predicted_s(self) -> float | None:
        """The prediction for the path taken."""
        return self.predicted_reload_s if self.action == "reload" else self.predicted_recompute_s

    @property
    def prediction_error(self) -> float | None:
        """``|predicted for the path taken / measured - 1|``; None until measured, or without a prediction."""
        if not self.measured_s or self.predicted_s is None:
            return None
        return abs(self.predicted_s / self.measured_s - 1)


@dataclass
class OffloadStats:
    """Counters of one offloading context, updated live while the engine runs.

    ``offloaded_requests``: preempted requests whose KV went to the host pool;
    ``reloaded_requests``: of those, the ones brought back; ``recomputed_requests``:
    preempted requests whose KV was dropped (by decision, or because the host
    pool was full) and re-prefilled; ``offloaded_blocks``: blocks copied to the
    host; ``host_blocks_in_use``: host blocks holding KV now (0 once nothing
    is offloaded and every copy has finished; reading it queries the copies'
    events, so do not read it while another thread captures a CUDA graph in
    global mode); ``decisions``: one record per preempted request, in order;
    ``profile``: the Profile decisions are made from now: learned from the
    engine's transfers and forwards (``learn=True``), else the calibrated one
    (None without any).
    """

    offloaded_requests: int = 0
    reloaded_requests: int = 0
    recomputed_requests: int = 0
    offloaded_blocks: int = 0
    decisions: list[OffloadDecision] = field(default_factory=list)
    _blocks_in_use: Callable[[], int] = field(default=lambda: 0, repr=False, compare=False)
    _profile: Callable[[], Profile | None] = field(default=lambda: None, repr=False, compare=False)

    @property
    def host_blocks_in_use(self) -> int:
        return self._blocks_in_use()

    @property
    def profile(self) -> Profile | None:
        return self._profile()

    def prediction_errors(self, skip: int = 0) -> list[float]:
        """``|predicted for the path taken / measured - 1|`` of each measured decision after the first ``skip``
        (the ones made before the engine had been observed for long)."""
        return [d.prediction_error for d in self.decisions[skip:] if d.prediction_error is not None]
