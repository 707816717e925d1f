"""What an OnlineProfile is told, checked before anything is kept, and kept in streams that need no lock."""

from __future__ import annotations

import itertools
import math
import numbers
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvcopy._checks import positive_int

__all__ = ["MIN_SECONDS", "Stream", "age_weights", "checked_seconds", "count", "token_counts"]

# A measured 0 s (below the clock's resolution) is taken as this, so that its logarithm exists.
MIN_SECONDS = 1e-9


def checked_seconds(value: object) -> float:
    """A measured duration: TypeError unless a real number (not a bool), ValueError unless finite and >= 0; a
    measured 0 s is accepted, as MIN_SECONDS."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"seconds: expected a number of seconds, got {type(value).__name__}")
    value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"seconds: expected finite seconds >= 0, got {value}")
    return max(value, MIN_SECONDS)


def _plain_counts(values: object, least: int) -> tuple[int, ...] | None:
    """``values`` as a tuple when it is a list or tuple of plain ints >= ``least`` (an engine's common case,
    checked without the ABC machinery); else None, for the full checks."""
    if (
        (type(values) is list or type(values) is tuple)
        and values
        and all(type(v) is int for v in values)
        and min(values) >= least
    ):
        return tuple(values)
    return None


def token_counts(tokens: object, cached_tokens: object) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(new, cached) per request of a forward: ints for one sequence, or one entry per request of a batch."""
    new_fast, cached_fast = _plain_counts(tokens, 1), _plain_counts(cached_tokens, 0)
    if new_fast is not None and cached_fast is not None and len(new_fast) == len(cached_fast):
        return new_fast, cached_fast
    if isinstance(tokens, Sequence) and not isinstance(tokens, (str, bytes)):
        if not tokens:
            raise ValueError("tokens: expected at least one request's token count, got an empty sequence")
        new = tuple(positive_int("tokens", n) for n in tokens)
        if isinstance(cached_tokens, Sequence) and not isinstance(cached_tokens, (str, bytes)):
            cached_list = list(cached_tokens)
        elif isinstance(cached_tokens, numbers.Integral) and not isinstance(cached_tokens, bool) and cached_tokens == 0:
            cached_list = [0] * len(new)
        else:
            raise TypeError(
                f"cached_tokens: expected a sequence of {len(new)} counts (one per request in tokens), got "
                f"{type(cached_tokens).__name__}"
            )
        if len(cached_list) != len(new):
            raise ValueError(f"cached_tokens: expected {len(new)} counts (one per request), got {len(cached_list)}")
    else:
        new = (positive_int("tokens", tokens),)
        cached_list = [cached_tokens]
    cached = []
    for value in cached_list:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"cached_tokens: expected an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"cached_tokens: expected an int >= 0, got {value}")
        cached.append(int(value))
    return new, tuple(cached)


class Stream:
    """One stream of observations (a copy link, or forwards), newest last, with an observation counter.

    ``append`` is one ``next`` on a counter and one ``deque.append``, each atomic under the GIL: copy workers
    observe from their own threads without a lock."""

    def __init__(self, maxlen: int) -> None:
        self._counter = itertools.count()
        self.items: deque[tuple[Any, ...]] = deque(maxlen=maxlen)

    def append(self, *values: Any) -> None:
        self.items.append((next(self._counter), *values))

    def snapshot(self) -> tuple[tuple[Any, ...], ...]:
        while True:
            try:
                return tuple(self.items)
            except RuntimeError:  # mutated while copied (only on an interpreter without the GIL): again
                continue


def age_weights(seqs: np.ndarray, half_life: int) -> np.ndarray:
    """Each observation's weight: it halves every ``half_life`` observations after it."""
    return 0.5 ** ((seqs.max() - seqs) / half_life)


def count(items: tuple[tuple[Any, ...], ...]) -> int:
    """Observations a stream has had (its newest sequence number + 1), from a snapshot of it."""
    return max((item[0] for item in items), default=-1) + 1
