"""Argument checks shared by every room, one per kind of mistake: TypeError for a wrong type, ValueError for
a wrong value, each naming the argument, what was expected and what was given."""

from __future__ import annotations

import numbers

__all__ = ["non_negative_int", "positive_int"]


def _integral(name: str, value: object, expected: str) -> int:
    # bool is an int to Python, never a count to a caller; numpy's integers are counts
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__} {value!r}")
    return int(value)


def positive_int(name: str, value: object) -> int:
    """``value`` as an int >= 1: TypeError unless it is an integer (not a bool), ValueError below 1."""
    number = _integral(name, value, "a positive int")
    if number < 1:
        raise ValueError(f"{name}: expected a positive int, got {value!r}")
    return number


def non_negative_int(name: str, value: object) -> int:
    """``value`` as an int >= 0: TypeError unless it is an integer (not a bool), ValueError below 0."""
    number = _integral(name, value, "a non-negative int")
    if number < 0:
        raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    return number
