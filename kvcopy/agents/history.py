"""What the gap forecaster remembers, and how much: per level, bounded windows of recent log-gaps and of
log-ratios to the client's estimates; how many levels it keeps; the range a gap is clamped to.

Gaps are kept as natural logs of seconds: pause lengths span six orders of magnitude (a 0.1 s file read, a
lunch break), and every law the forecaster uses (the priors, the smoothing kernel, the estimates' error) is
shaped in log-space.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

__all__ = [
    "LOG_GAP_RANGE",
    "LOG_RATIO_RANGE",
    "MAX_GAP_S",
    "MAX_SESSION_LEVELS",
    "MAX_TOOLS",
    "MIN_GAP_S",
    "SESSION_WINDOW",
    "WINDOW",
    "LevelHistory",
    "Window",
    "log_gap",
]

# The pauses a tool or a root level keeps: the most recent 512. Enough that a quantile's sampling error is
# small (the median's about 0.06 in log-space, 6%, for a log-normal of sigma 1), few enough that the
# forecaster forgets as a tool's or a deployment's behaviour drifts (a tool called once a second is
# relearned in minutes), and bounded memory: 4 KiB of float64 per window.
WINDOW = 512
# A session level keeps fewer: one session is one task, whose own pauses matter only while it lives (TraceLab
# per session: p50 15, p90 135 tool-initiated steps), and there are many sessions (at most MAX_SESSION_LEVELS).
SESSION_WINDOW = 128
# Tool levels kept, least recently used forgotten first: a tool name is a client's string, so the count is
# bounded; an agent framework has tens of tools, a deployment a few hundred.
MAX_TOOLS = 1024
# Session levels kept (a session's pauses under one tool, or its pauses with no tool), least recently used
# forgotten first. 4096 holds the live sessions of a deployment (hundreds to a few thousand at once, each
# with a few tools) in at most 4096 x 2 windows x SESSION_WINDOW x 8 bytes = 8 MiB.
MAX_SESSION_LEVELS = 4096
# Gaps are clamped to [MIN_GAP_S, MAX_GAP_S] before their log is kept. Below 1 ms a pause is immediate (an
# engine step takes longer), and a gap of 0 has no log; past 30 days a session is gone whatever the number.
MIN_GAP_S = 1e-3
MAX_GAP_S = 30 * 86400.0
# The ranges a kept log-gap and log-ratio (ln gap - ln estimate, both clamped) lie in.
LOG_GAP_RANGE = (math.log(MIN_GAP_S), math.log(MAX_GAP_S))
LOG_RATIO_RANGE = (LOG_GAP_RANGE[0] - LOG_GAP_RANGE[1], LOG_GAP_RANGE[1] - LOG_GAP_RANGE[0])
# A window's first allocation: most session levels see a handful of pauses; it doubles up to its capacity.
_FIRST_ALLOCATION = 8


def log_gap(seconds: float) -> float:
    """ln(seconds) with ``seconds`` (>= 0, finite) clamped to [MIN_GAP_S, MAX_GAP_S]."""
    return math.log(min(max(seconds, MIN_GAP_S), MAX_GAP_S))


class Window:
    """The most recent ``capacity`` values added, in a float64 ring: adding is O(1), and :meth:`values`
    shows them without a copy (in storage order, which a distribution does not care about)."""

    __slots__ = ("_next", "_size", "_store", "capacity")

    def __init__(self, capacity: int, values: Iterable[float] = ()) -> None:
        self.capacity = capacity
        self._store = np.empty(min(_FIRST_ALLOCATION, capacity))
        self._size = 0
        self._next = 0  # once full: the slot of the oldest value, the next one overwritten
        for value in values:
            self.add(value)

    def __len__(self) -> int:
        return self._size

    def add(self, value: float) -> None:
        if self._size < self.capacity:
            if self._size == len(self._store):
                grown = np.empty(min(2 * len(self._store), self.capacity))
                grown[: self._size] = self._store
                self._store = grown
            self._store[self._size] = value
            self._size += 1
        else:
            self._store[self._next] = value
            self._next = (self._next + 1) % self.capacity

    def values(self) -> np.ndarray:
        """The values kept (a view: read it before the next :meth:`add`)."""
        return self._store[: self._size]

    def oldest_first(self) -> list[float]:
        """The values kept, oldest first: the order that rebuilds this window value by value."""
        kept = self._store[: self._size]
        return [float(v) for v in np.concatenate((kept[self._next :], kept[: self._next]))]

    def mean_and_variance(self) -> tuple[float, float]:
        """The values' mean and (population) variance; (0, 0) for none."""
        if not self._size:
            return 0.0, 0.0
        kept = self.values()
        mean = float(kept.mean())
        return mean, float(np.mean(np.square(kept - mean)))


class LevelHistory:
    """One level's memory: the log-gaps of its recent pauses, and the log-ratios ln(gap) - ln(resume_in_s) of
    those that came with a client's estimate, each in a window of ``capacity``."""

    __slots__ = ("log_gaps", "log_ratios")

    def __init__(self, capacity: int, log_gaps: Iterable[float] = (), log_ratios: Iterable[float] = ()) -> None:
        self.log_gaps = Window(capacity, log_gaps)
        self.log_ratios = Window(capacity, log_ratios)

    def observe(self, log_gap_value: float, log_ratio: float | None) -> None:
        self.log_gaps.add(log_gap_value)
        if log_ratio is not None:
            self.log_ratios.add(log_ratio)
