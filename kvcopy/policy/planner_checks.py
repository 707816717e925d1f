"""The Planner's checks of its costs: rates positive, fixed seconds not negative, a link's two halves together."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["check_costs"]


def _positive_rate(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"{name}: expected a positive rate, got {value}")


def check_costs(
    *,
    rates: Mapping[str, float | None],
    links: Mapping[str, tuple[float | None, float | None]],
    seconds: Mapping[str, float],
    load_options: Sequence[tuple[float, float]],
) -> None:
    """ValueError naming the argument: a rate (bytes, FLOPs or tokens per second; None: not given) that is not
    positive, a link (``{name}_alpha_s``, ``{name}_bytes_per_s``) given by halves, fixed seconds below 0 (or
    NaN), or a bad (alpha_s, bytes_per_s) pair in ``load_options``."""
    for name, rate in rates.items():
        _positive_rate(name, rate)
    for what, (alpha, beta) in links.items():
        if (alpha is None) != (beta is None):
            raise ValueError(f"{what}_alpha_s / {what}_bytes_per_s: expected both (a link) or neither")
    for name, value in seconds.items():
        if not value >= 0:
            raise ValueError(f"{name}: expected seconds >= 0, got {value}")
    for alpha, beta in load_options:
        if not alpha >= 0:
            raise ValueError(f"load_options: expected seconds >= 0, got {alpha}")
        _positive_rate("load_options", beta)
