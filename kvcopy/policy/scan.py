"""The prefix lengths the planner's threshold search evaluates before it bisects."""

from __future__ import annotations

import math

__all__ = ["scan_grid"]

# Prefix lengths the threshold scan evaluates before bisecting the last sign change: every length up to
# the first, then geometric steps (a relative step of 1/_SCAN_PER_DOUBLING of a doubling).
_SCAN_DENSE_UP_TO = 4096
_SCAN_PER_DOUBLING = 64


def scan_grid(limit: int) -> list[int]:
    """Prefix lengths for the threshold scan: every length up to _SCAN_DENSE_UP_TO, then geometric, and limit."""
    grid = list(range(1, min(limit, _SCAN_DENSE_UP_TO) + 1))
    step = 2 ** (1 / _SCAN_PER_DOUBLING)
    value = float(grid[-1])
    while value < limit:
        value = max(value * step, value + 1)
        grid.append(min(limit, math.ceil(value)))
    return sorted(set(grid))
