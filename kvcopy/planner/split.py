"""The split's search: compute the front of a prefix while the rest loads, at the best split point.

Computing x tokens takes longer as x grows, and loading the rest no longer, so the best x is where the two
cross. On sliding-window layers only the last W tokens are cached, so computing tokens before them saves no
load. Used by the Planner (kvcopy.planner.planner) for every way a prefix arrives: a reload, a fetch from a
peer, a read from the disk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcopy.planner.planner import Planner

__all__ = ["best_split", "cached_bytes_after", "split_seconds"]


def cached_bytes_after(planner: Planner, prefix: int, computed: int) -> int:
    """KV bytes of a prefix of ``prefix`` tokens that computing its first ``computed`` does not produce.

    Full layers: the tokens after the computed ones. Sliding layers keep only the last W
    tokens of the prefix, so computed tokens before those save nothing there.
    """
    spec = planner.spec
    per_layer = spec.kv_bytes_per_token() // spec.num_layers
    sliding = spec.num_sliding_layers
    full = (spec.num_layers - sliding) * (prefix - computed)
    if sliding:
        assert spec.sliding_window is not None  # a spec with sliding layers has a window (ModelSpec checks it)
        window = min(prefix, spec.sliding_window)
        full += sliding * (window - max(0, computed - (prefix - window)))
    return full * per_layer


def split_seconds(planner: Planner, prefix: int, computed: int, load: Callable[[float], float]) -> float:
    """Compute the first ``computed`` tokens while the rest of the prefix loads (in ``load`` seconds)."""
    return max(planner.t_prefill(computed), load(cached_bytes_after(planner, prefix, computed)))


def best_split(planner: Planner, prefix: int, load: Callable[[float], float]) -> tuple[int, float] | None:
    """The x in [1, prefix - 1] minimising the split time, and that time: the first x at which computing is no
    faster than loading the rest, or the one before it (found by bisection)."""
    if prefix < 2:
        return None
    lo, hi = 1, prefix - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if planner.t_prefill(mid) >= load(cached_bytes_after(planner, prefix, mid)):
            hi = mid
        else:
            lo = mid + 1
    best = min({max(1, lo - 1), lo}, key=lambda x: split_seconds(planner, prefix, x, load))
    return best, split_seconds(planner, prefix, best, load)
