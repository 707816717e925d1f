"""Judging an engine adapter's Planner: its prediction errors, and its choices against both paths measured.

Shared by benchmarks/bench_engine.py and examples/transformers_offload.py. ``stats`` is an adapter's
OffloadStats (kvcopy.integrations); nothing here imports an engine.
"""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

__all__ = ["DEFAULT_SKIP", "compare_paths", "crowding_summary", "error_summary"]

# Decisions of a run not judged: the first ones, made before the engine had been observed for long.
DEFAULT_SKIP = 10


def error_summary(stats: Any, skip: int = DEFAULT_SKIP) -> dict[str, object]:
    """The median and p90 of ``|predicted for the path taken / measured - 1|`` over the decisions after the first
    ``skip``, how many decisions there were and how many of them were measured ("" where none was)."""
    errors = stats.prediction_errors(skip)
    if not errors:
        return dict(decisions=len(stats.decisions), error_median="", error_p90="", errors_measured=0)
    p50, p90 = np.percentile(errors, [50, 90])
    return dict(
        decisions=len(stats.decisions),
        error_median=round(float(p50), 3),
        error_p90=round(float(p90), 3),
        errors_measured=len(errors),
    )


def crowding_summary(stats: Any, skip: int = DEFAULT_SKIP) -> str:
    """The error split by whether a forward on the measured path also carried another request's prefill chunk
    (``crowding_tokens``), which the request then waited beside: what no prediction at decision time can see,
    and what the measurement leaves out of the request's part of that forward."""
    judged = [d for d in stats.decisions[skip:] if d.prediction_error is not None]
    parts = []
    for label, mine in (
        ("alone or with decode steps", [d for d in judged if not d.crowding_tokens]),
        ("beside another request's prefill chunk", [d for d in judged if d.crowding_tokens]),
    ):
        errors = [d.prediction_error for d in mine]
        if errors:
            p50, p90 = np.percentile(errors, [50, 90])
            parts.append(f"{label}: {len(errors)}, error median {p50:.3f}, p90 {p90:.3f}")
        else:
            parts.append(f"{label}: none")
    return "; ".join(parts)


def compare_paths(auto: Any, reload_run: Any, recompute_run: Any, skip: int = DEFAULT_SKIP) -> str:
    """Where a reload-always and a recompute-always run measured the same preemption (request and cached tokens),
    did ``auto`` take the faster path, and where not, by how much was it slower (against its median error)?"""

    def measured(stats: Any) -> dict[tuple[str, int], float]:
        return {(d.request_id, d.prefix_tokens): d.measured_s for d in stats.decisions if d.measured_s}

    paths = {"reload": measured(reload_run), "recompute": measured(recompute_run)}
    errors = auto.prediction_errors(skip)
    both = faster = 0
    worst = 0.0
    for d in auto.decisions[skip:]:
        key = (d.request_id, d.prefix_tokens)
        if key in paths["reload"] and key in paths["recompute"]:
            both += 1
            other = "recompute" if d.action == "reload" else "reload"
            slower = paths[d.action][key] / paths[other][key] - 1
            faster += slower <= 0
            worst = max(worst, slower)
    if not both:
        return f"no preemption after the first {skip} decisions was measured both ways"
    return (
        f"{both} preemptions measured both ways: auto took the faster path in {faster}; where it did not, it was "
        f"at most {worst:.0%} slower (its median prediction error: {statistics.median(errors) if errors else 0:.0%})"
    )
