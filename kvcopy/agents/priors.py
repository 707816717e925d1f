"""What kvcopy believes about pause lengths before it has seen one, with the sources of every number.

Source: TraceLab (arXiv 2606.30560, data CC BY 4.0), traces of coding agents: 43 users, 4,265 sessions and
357,161 LLM steps. Per call or wait it reports:

- tool execution (positive): p50 0.3 s, p90 13.6 s (avg 18.4 s, p99 3.6 min);
- human think time (positive waits): p50 1.4 min, p90 20.6 min (avg 46.7 min, p99 13.9 h);
- per session, on average 73.6 tool-initiated steps and 9.2 user requests.

Each wait is taken as log-normal, fitted to its p50 and p90: mu = ln p50 and sigma = ln(p90 / p50) / z_0.9,
z_0.9 = 1.2816 the standard normal's 90% quantile. That gives sigma 2.98 for tools and 2.10 for humans. The
tails miss (a log-normal through p50 and p90 puts a tool's p99 at 305 s against 216 s measured, a human's at
3.1 h against 13.9 h), so these priors are a start, not a model: the forecaster's root counts them as
kvcopy.agents.forecast.PSEUDO_OBSERVATIONS pauses and moves to the data.

A pause with a tool named starts from the tool gap. A pause with no tool named is of unknown kind: a hinted
client's wait for its user, or any pause the engine learns without a hint (which are mostly tool gaps: in
TraceLab 73.6 of every 73.6 + 9.2 pauses, 8 in 9, follow a tool call). Its prior is the two waits mixed in TraceLab's
proportion: 8 in 9 tool gaps, 1 in 9 human waits (HUMAN_SHARE).

A client's ``resume_in_s`` is evidence: kvcopy learns r = ln(actual gap) - ln(resume_in_s). Before any such
pair is seen, r is taken as normal with mean 0 and sigma 1 (RATIO_PRIOR_MEAN, RATIO_PRIOR_SIGMA), an
assumption, not a measurement: an estimate is trusted to be unbiased and within a factor e (2.7) two times
in three. That is enough to
follow a fresh client's estimate over the tool prior (sigma 2.98) and little enough that a few observed
pauses overturn it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

__all__ = [
    "HUMAN_GAP",
    "HUMAN_SHARE",
    "RATIO_PRIOR_MEAN",
    "RATIO_PRIOR_SIGMA",
    "TOOL_GAP",
    "UNTOOLED_GAP",
    "Z_90",
    "LogNormal",
    "from_median_and_p90",
]

# The standard normal's 90% quantile: a log-normal's p90 / p50 = exp(sigma * Z_90).
Z_90 = NormalDist().inv_cdf(0.9)


@dataclass(frozen=True)
class LogNormal:
    """A positive quantity whose natural log is normal with mean ``mu`` and standard deviation ``sigma``
    (> 0). For a gap in seconds, ``mu`` is the log of its median. (For a log-ratio, which is already a log,
    the same record says the ratio is log-normal.)"""

    mu: float
    sigma: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.mu) and math.isfinite(self.sigma) and self.sigma > 0):
            raise ValueError(f"LogNormal: expected a finite mu and a finite sigma > 0, got {self.mu!r}, {self.sigma!r}")

    @property
    def median(self) -> float:
        return math.exp(self.mu)


def from_median_and_p90(median: float, p90: float) -> LogNormal:
    """The log-normal through a published median and 90% quantile (both > 0, ``p90 > median``)."""
    if not (0 < median < p90):
        raise ValueError(f"from_median_and_p90: expected 0 < median < p90, got {median!r}, {p90!r}")
    return LogNormal(math.log(median), math.log(p90 / median) / Z_90)


# A tool's execution, TraceLab: p50 0.3 s, p90 13.6 s (mu = ln 0.3, sigma 2.98).
TOOL_GAP = from_median_and_p90(0.3, 13.6)
# A human's think time, TraceLab: p50 1.4 min, p90 20.6 min (mu = ln 84 s, sigma 2.10).
HUMAN_GAP = from_median_and_p90(84.0, 20.6 * 60.0)
# The share of human waits among all pauses, TraceLab's per-session averages: 9.2 user requests against
# 73.6 tool-initiated steps, 9.2 / (73.6 + 9.2) = 1/9.
HUMAN_SHARE = 9.2 / (73.6 + 9.2)
# A pause with no tool named: (weight, law) pairs, the two waits in TraceLab's proportion.
UNTOOLED_GAP: tuple[tuple[float, LogNormal], ...] = ((1.0 - HUMAN_SHARE, TOOL_GAP), (HUMAN_SHARE, HUMAN_GAP))
# r = ln(actual gap) - ln(resume_in_s) before any pair is seen: mean 0, sigma 1 (an assumption; see above).
RATIO_PRIOR_MEAN, RATIO_PRIOR_SIGMA = 0.0, 1.0
