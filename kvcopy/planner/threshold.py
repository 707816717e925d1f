"""The planner's threshold search: the prefix lengths it evaluates, and the bisection after them."""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["first_winning", "scan_grid"]

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


def first_winning(wins: Callable[[int], bool], limit: int) -> int | None:
    """The smallest P from which ``wins(P')`` holds for every P' up to ``limit`` (on the scan grid, then
    bisected between its last losing and first winning lengths); None when ``wins(limit)`` does not hold."""
    if not wins(limit):
        return None
    grid = scan_grid(limit)
    last_loss = next((p for p in reversed(grid) if not wins(p)), None)
    if last_loss is None:
        return 1
    lo, hi = last_loss, grid[grid.index(last_loss) + 1]  # loses at lo, wins at hi (and at every grid point above)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if wins(mid) else (mid, hi)
    return hi
