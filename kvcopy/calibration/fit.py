"""Robust fit of ``t = alpha + x / beta`` to timings: the calibrator's one model.

Timings are noisy multiplicatively (a slow repeat is slow by a factor) and
sometimes wildly off (a page fault, another tenant), so the fit is a
least-squares line on *relative* residuals with Huber weights, iterated:
points more than HUBER_K median absolute deviations off count less.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["LinearFit", "fit_alpha_beta"]

# Huber threshold in robust standard deviations (1.345 gives 95% efficiency on Gaussian noise).
HUBER_K = 1.345
# Reweighting rounds; the weights settle in a handful.
_ITERATIONS = 20
# MAD -> standard deviation for Gaussian noise.
_MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class LinearFit:
    """``t = alpha + x / beta``: alpha in seconds, beta in x-units per second."""

    alpha: float
    beta: float
    r2: float  # coefficient of determination of the weighted fit on the raw points
    residuals: tuple[float, ...]  # relative: (measured - predicted) / predicted, per point

    def predict(self, x: float) -> float:
        return self.alpha + x / self.beta

    @property
    def max_abs_residual(self) -> float:
        return max((abs(r) for r in self.residuals), default=0.0)


def fit_alpha_beta(x: Sequence[float], t: Sequence[float]) -> LinearFit:
    """Fits ``t = alpha + x / beta`` robustly; needs at least two distinct x and positive times.

    alpha may come out slightly negative when the fixed cost is below the
    noise; it is clamped at 0 (a call cannot take negative time), beta refitted.
    """
    xs = np.asarray(x, dtype=np.float64)
    ts = np.asarray(t, dtype=np.float64)
    if xs.shape != ts.shape or xs.ndim != 1:
        raise ValueError(f"x, t: expected two 1-D sequences of one length, got shapes {xs.shape} and {ts.shape}")
    if len(np.unique(xs)) < 2:
        raise ValueError("x: expected at least two distinct sizes to fit a line")
    if np.any(ts <= 0) or not np.all(np.isfinite(ts)):
        raise ValueError("t: expected positive, finite times")
    weights = 1.0 / ts**2  # relative error
    robust = np.ones_like(ts)
    slope, intercept = _weighted_line(xs, ts, weights)
    for _ in range(_ITERATIONS):
        predicted = intercept + slope * xs
        relative = (ts - predicted) / np.maximum(predicted, 1e-12)
        scale = _MAD_TO_SIGMA * np.median(np.abs(relative - np.median(relative))) or 1e-12
        u = np.abs(relative) / scale
        robust = np.where(u <= HUBER_K, 1.0, HUBER_K / np.maximum(u, 1e-12))
        slope, intercept = _weighted_line(xs, ts, weights * robust)
    if intercept < 0:  # refit through the origin: t = x * slope
        w = weights * robust
        intercept, slope = 0.0, float(np.sum(w * xs * ts) / np.sum(w * xs * xs))
    if slope <= 0:
        raise ValueError("t: times do not grow with x; cannot fit a bandwidth")
    predicted = intercept + slope * xs
    w = weights * robust
    mean = np.sum(w * ts) / np.sum(w)
    ss_res = np.sum(w * (ts - predicted) ** 2)
    ss_tot = np.sum(w * (ts - mean) ** 2)
    r2 = float(1 - ss_res / ss_tot) if ss_tot > 0 else 1.0
    residuals = tuple(float(r) for r in (ts - predicted) / predicted)
    return LinearFit(alpha=float(intercept), beta=float(1 / slope), r2=r2, residuals=residuals)


def _weighted_line(xs: np.ndarray, ts: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """Weighted least squares for t = intercept + slope * x."""
    sw = np.sum(w)
    mx, mt = np.sum(w * xs) / sw, np.sum(w * ts) / sw
    slope = np.sum(w * (xs - mx) * (ts - mt)) / np.sum(w * (xs - mx) ** 2)
    return float(slope), float(mt - slope * mx)
