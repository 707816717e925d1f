"""One pause's forecast: :class:`GapForecast`, the distribution of its length that
:class:`~kvcopy.agents.GapForecaster` pooled for it, with its CDF, its quantiles and what it was made from.

The distribution lives in log-space, y = ln(seconds). It is a mixture of

- logistic kernels of scale KERNEL_SCALE, one per remembered pause (a smoothed empirical CDF: continuous, so
  quantiles move continuously with q, and cheap: a logistic's CDF is closed form);
- normal components (a prior's log-normal laws, or the one log-normal of a forecast that weighed a client's
  estimate).

Its CDF is monotone by construction (a positively weighted sum of monotone terms, added in a fixed order). A
quantile is found by Newton's method safeguarded by bisection inside a bracket that is exact: a mixture's
q-quantile lies between the smallest and the largest of its components' q-quantiles, each in closed form.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

__all__ = [
    "KERNEL_SCALE",
    "QUANTILE_LOG_TOLERANCE",
    "EstimateCorrection",
    "GapForecast",
    "PooledLevel",
]

# The smoothing kernel's scale in ln-seconds (a logistic's; its standard deviation is pi / sqrt(3) times it,
# 0.09): a remembered pause of 10 s counts as one spread over about 9.1 to 11 s. Gaps are measured to a
# millisecond, and a retention decision turns on factors, not percents; a wider kernel would blur a tool
# whose pauses are tight (a fast read's 0.1 s), and the smoothing's own variance (0.008) stays far below a
# tool's spread (TraceLab's sigma ~3).
KERNEL_SCALE = 0.05
# A quantile is found to this width in ln-seconds: a relative error of 1e-10 in seconds.
QUANTILE_LOG_TOLERANCE = 1e-10
# ... or to where the CDF is this close to q: past it, a step is rounding (a CDF's sum of ~1,000 terms is exact
# to ~1e-16), and in a valley between two modes, where the density is ~1e-6, the steps would wander ~1e-10
# and bisection would go on to the width above.
QUANTILE_CDF_TOLERANCE = 1e-13
# Newton's steps, each falling back to bisection when it would leave the bracket: it converges in about ten;
# the bound (bisection alone halves a bracket of at most ~100 in log-space to the tolerance in ~40) only
# guards against a pathological mixture.
MAX_QUANTILE_STEPS = 200
# Before Newton's steps, the CDF is taken on this many points across every quantile's bracket, and each search
# starts inside the one cell that holds its quantile, where the CDF crosses q on the cell's chord: a cell of a
# typical forecast's span (~20 in log-space) is ~0.16 wide, three kernel scales, and a plan's 255 quantiles
# are then found in four of Newton's steps (from the components' bracket alone, bisection took ~50; 16 to 256
# points were timed, 128 the quickest with 60 to 3,000 pauses remembered).
START_GRID = 128
# The kernel's variance in log-space: a logistic of scale s has variance s^2 pi^2 / 3.
_KERNEL_VARIANCE = (KERNEL_SCALE * math.pi) ** 2 / 3.0
_STANDARD = NormalDist()
_ERFC = np.frompyfunc(math.erfc, 1, 1)  # (numpy has no erfc: a normal component's CDF, element by element)


def _erfc(x: np.ndarray) -> np.ndarray:
    return _ERFC(x).astype(np.float64)


@dataclass(frozen=True)
class PooledLevel:
    """One level a forecast drew on: its ``name`` in words ("tool 'run_tests'", "all tool pauses", "prior:
    ..."), the ``pauses`` it holds (for a prior, the pseudo-observations it counts as) and the ``weight`` of
    its distribution in the forecast (the weights of a forecast's levels sum to 1)."""

    name: str
    pauses: int
    weight: float


@dataclass(frozen=True)
class EstimateCorrection:
    """How a client's ``resume_in_s`` entered a forecast: the learned log-ratio r = ln(actual) - ln(estimate)
    (its pooled ``mean`` and ``sigma``, from ``pairs`` observed estimates), the estimate's corrected law
    (log-normal with median ``resume_in_s * exp(mean)`` and log-sigma ``sigma``) and the ``share`` of its
    precision in the forecast, which is the precision-weighted product of that law and the history's."""

    resume_in_s: float
    mean: float
    sigma: float
    pairs: int
    share: float

    @property
    def corrected_s(self) -> float:
        """The estimate corrected by the learned bias: ``resume_in_s * exp(mean)``."""
        return self.resume_in_s * math.exp(self.mean)


class GapForecast:
    """The forecast distribution of one pause's length, in seconds.

    A mixture in y = ln(seconds) of logistic kernels (scale KERNEL_SCALE) at ``centres`` with
    ``centre_weights``, and of normal components ``normals`` given as (weight, mu, sigma); all weights >= 0,
    summing to 1. ``levels`` and ``estimate`` say what it was pooled from (:meth:`explain`). Made by
    :class:`~kvcopy.agents.GapForecaster`; immutable, so a decision can ask it many questions at the cost of
    one pooling.
    """

    __slots__ = ("_centres", "_normals", "_weights", "estimate", "levels")

    def __init__(
        self,
        *,
        centres: np.ndarray,
        centre_weights: np.ndarray,
        normals: Sequence[tuple[float, float, float]],
        levels: Sequence[PooledLevel] = (),
        estimate: EstimateCorrection | None = None,
    ) -> None:
        keep = centre_weights > 0
        self._centres = np.ascontiguousarray(centres[keep], dtype=np.float64)
        self._weights = np.ascontiguousarray(centre_weights[keep], dtype=np.float64)
        self._normals = tuple((float(w), float(mu), float(sigma)) for w, mu, sigma in normals if w > 0)
        if not (len(self._centres) or self._normals):
            raise ValueError("GapForecast: expected at least one component of positive weight")
        self.levels = tuple(levels)
        self.estimate = estimate

    # ------------------------------------------------------------------ the distribution in log-space

    def _cdf_and_density(self, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """F(y) and its derivative dF/dy at each of ``y`` (ln(seconds))."""
        cdf, density = np.zeros_like(y), np.zeros_like(y)
        if len(self._centres):
            # a logistic's CDF is (1 + tanh(z / 2)) / 2 and its density (1 - tanh(z / 2)^2) / 4s, z = (y - c) / s:
            # one tanh over the (y x centres) matrix, in place, and two products with the weights (three times
            # faster than its exp form, and as exact in the probabilities a plan asks for: its error is ~1e-16
            # absolute, so a CDF below that reads 0, far under a plan's lowest quantile, 1/256)
            half = np.subtract.outer(y, self._centres)
            half *= 0.5 / KERNEL_SCALE
            tanh = np.tanh(half, out=half)
            total = float(self._weights.sum())
            cdf += 0.5 * (total + tanh @ self._weights)
            tanh *= tanh
            density += np.maximum(total - tanh @ self._weights, 0.0) * (0.25 / KERNEL_SCALE)
        for weight, mu, sigma in self._normals:
            z = (y - mu) / sigma
            cdf += weight * 0.5 * _erfc(-z / math.sqrt(2.0))
            density += weight * np.exp(-0.5 * z * z) / (sigma * math.sqrt(2.0 * math.pi))
        return cdf, density

    def log_moments(self) -> tuple[float, float]:
        """The mean and variance of ln(seconds) under this distribution (a kernel adds its own variance)."""
        means = [float(self._weights @ self._centres)] + [w * mu for w, mu, _ in self._normals]
        mean = sum(means)
        variance = float(self._weights @ (np.square(self._centres - mean) + _KERNEL_VARIANCE))
        variance += sum(w * (sigma * sigma + (mu - mean) ** 2) for w, mu, sigma in self._normals)
        return mean, variance

    def _log_quantiles(self, qs: np.ndarray) -> np.ndarray:
        """ln of each of ``qs``' quantiles, all at once (a plan asks for 255): bracketed by the components' own
        quantiles (a mixture's q-quantile lies between them), each bracket narrowed to one cell of the CDF taken
        on START_GRID points across them all and started where the CDF crosses q inside it, then a safeguarded
        Newton search, run on every unfinished one together."""
        logit = np.log(qs) - np.log1p(-qs)
        standard = np.array([_STANDARD.inv_cdf(float(q)) for q in qs])
        ends = [mu + sigma * standard for _, mu, sigma in self._normals]
        if len(self._centres):
            ends += [float(c) + KERNEL_SCALE * logit for c in (self._centres.min(), self._centres.max())]
        lo, hi = np.min(ends, axis=0), np.max(ends, axis=0)
        grid = np.linspace(lo.min(), hi.max(), START_GRID)
        at_grid = np.maximum.accumulate(self._cdf_and_density(grid)[0])  # (monotone, as the CDF is)
        cell = np.searchsorted(at_grid, qs)  # at_grid[cell - 1] < q <= at_grid[cell]
        below, above = np.maximum(cell - 1, 0), np.minimum(cell, START_GRID - 1)
        lo = np.where(cell > 0, np.maximum(lo, grid[below]), lo)
        hi = np.where(cell < START_GRID, np.minimum(hi, grid[above]), hi)
        rise = at_grid[above] - at_grid[below]
        with np.errstate(divide="ignore", invalid="ignore"):
            y = grid[below] + (qs - at_grid[below]) / rise * (grid[above] - grid[below])
        y = np.where((lo < y) & (y < hi), y, 0.5 * (lo + hi))
        found = np.zeros(len(qs), dtype=bool)
        for _ in range(MAX_QUANTILE_STEPS):
            at = np.flatnonzero(~found & (hi - lo > QUANTILE_LOG_TOLERANCE))
            if not len(at):
                break
            ya, qa = y[at], qs[at]
            cdf, density = self._cdf_and_density(ya)
            lo[at] = np.where(cdf < qa, ya, lo[at])
            hi[at] = np.where(cdf > qa, ya, hi[at])
            with np.errstate(divide="ignore", invalid="ignore"):
                step = np.where(density > 0, ya - (cdf - qa) / density, np.nan)
            step = np.where((lo[at] < step) & (step < hi[at]), step, 0.5 * (lo[at] + hi[at]))
            exact = np.abs(cdf - qa) <= QUANTILE_CDF_TOLERANCE
            y[at] = np.where(exact, ya, step)
            found[at] = exact | (np.abs(step - ya) <= QUANTILE_LOG_TOLERANCE)
        return np.where(found, y, 0.5 * (lo + hi))

    # ------------------------------------------------------------------ seconds

    def cdf(self, t_s: float) -> float:
        """P(pause <= ``t_s`` seconds): 0 at 0, 1 at infinity, non-decreasing. ``t_s`` is taken as checked
        (GapForecaster.cdf checks it)."""
        if t_s <= 0:
            return 0.0
        if math.isinf(t_s):
            return 1.0
        return min(1.0, max(0.0, float(self._cdf_and_density(np.array([math.log(t_s)]))[0][0])))

    def quantile(self, q: float) -> float:
        """The pause length in seconds that the pause stays under with probability ``q`` (in (0, 1), taken as
        checked): ``cdf(quantile(q)) == q`` to within the quantile's tolerance."""
        return float(self.quantiles([q])[0])

    def quantiles(self, qs: Sequence[float]) -> np.ndarray:
        """:meth:`quantile` of each of ``qs`` (each in (0, 1), taken as checked), found together: what a plan
        asks for (kvcopy.agents.plan_pause: 255 of them) in one search."""
        return np.exp(self._log_quantiles(np.asarray(qs, dtype=np.float64)))

    @property
    def median_s(self) -> float:
        return self.quantile(0.5)

    def explain(self) -> str:
        """In words: the forecast's median and 10-90% band, and what it was pooled from."""
        p10, p50, p90 = (self.quantile(q) for q in (0.1, 0.5, 0.9))
        pooled = ", ".join(f"{lv.name} ({lv.pauses} pauses, weight {lv.weight:.2f})" for lv in self.levels)
        words = f"median {_seconds(p50)} (10-90%: {_seconds(p10)} to {_seconds(p90)}) from {pooled or 'nothing'}"
        if self.estimate is not None:
            e = self.estimate
            words += (
                f"; the client's estimate {_seconds(e.resume_in_s)}, corrected x{math.exp(e.mean):.2f} to "
                f"{_seconds(e.corrected_s)} (log-sigma {e.sigma:.2f}, {e.pairs} estimates seen), weighs "
                f"{e.share:.0%} by precision"
            )
        return words

    def __repr__(self) -> str:
        return f"GapForecast({self.explain()})"


def _seconds(value: float) -> str:
    if value < 60:
        return f"{value:.3g} s"
    if value < 3600:
        return f"{value / 60:.3g} min"
    return f"{value / 3600:.3g} h"
