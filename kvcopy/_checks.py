"""Argument checks shared by kvcopy.policy: ValueError naming the argument and the value given."""

from __future__ import annotations

__all__ = ["non_negative_int", "positive_int"]


def positive_int(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what}: expected a positive int, got {value!r}")
    return value


def non_negative_int(what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what}: expected a non-negative int, got {value!r}")
    return value
