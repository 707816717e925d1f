"""kvcopy's robust fits: the calibrator's line and the online profile's bounded, forgetting fit, with one
Huber threshold and one robust spread.

**The calibrator's line**, ``t = alpha + x / beta`` (:func:`fit_alpha_beta`). Timings are noisy
multiplicatively (a slow repeat is slow by a factor) and sometimes wildly off (a page fault, another tenant),
so the fit is a least-squares line on *relative* residuals with Huber weights, iterated: points more than
HUBER_K robust standard deviations off count less.

**The online profile's estimator**, ``t = max_j (A_j · θ)`` with bounds on θ (:func:`fit_max_linear`).
A copy link is one branch (``t = alpha + bytes · s``, ``s = 1 / beta``); prefill is two (the roofline
``alpha + max(flops · c_f, weight_bytes · c_m)``). Every point has a weight: an observation's halves with its
age in half-lives (forgetting), a prior pseudo-point's is its share of the prior's worth.

Residuals are in log space, ``r = log(t) - log(pred)``: timing noise is multiplicative, and a prior that is
10x too fast or 10x too slow is the same distance from the data either way, so neither traps the fit
(normalising by the measured time cannot leave a far-too-fast prior; by the prediction, a far-too-slow one).
Each point's influence is bounded by Huber weights on ``r / sigma``, the prior's pseudo-points included;
``sigma`` is the robust spread of the observations' residuals (never below SIGMA_FLOOR). The loss is
minimised by projected Gauss-Newton steps with backtracking, from the prior's parameters. Deterministic:
no randomness, a fixed number of iterations at most.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "HUBER_K",
    "MAD_TO_SIGMA",
    "SIGMA_FLOOR",
    "LinearFit",
    "RobustFit",
    "fit_alpha_beta",
    "fit_max_linear",
    "huber_weights",
    "weighted_median",
]

# Huber threshold in robust standard deviations (1.345 gives 95% efficiency on Gaussian noise).
HUBER_K = 1.345
# Median absolute deviation -> standard deviation, for Gaussian noise.
MAD_TO_SIGMA = 1.4826
# The calibrator's reweighting rounds; the weights settle in a handful.
_REWEIGHTING_ROUNDS = 20
# The smallest residual spread the online fit assumes (log units, ~3%): repeated engine timings never agree
# more closely, and a spread of 0 (noise-free data) would make every residual an outlier.
SIGMA_FLOOR = 0.03
# Gauss-Newton iterations; from the prior the online fit settles in 10-30 even when the prior is 10x off.
_GAUSS_NEWTON_ITERATIONS = 60
# Step halvings tried before an iteration gives up (the step no longer lowers the loss).
_HALVINGS = 30
# Convergence: no parameter moved by more than this fraction of itself in an iteration.
_TOLERANCE = 1e-6


def huber_weights(u: np.ndarray) -> np.ndarray:
    """Huber's weights for residuals ``u`` in robust standard deviations: 1 within HUBER_K, HUBER_K / |u|
    beyond it, so that no point's influence grows past HUBER_K."""
    return np.where(u <= HUBER_K, 1.0, HUBER_K / np.maximum(u, 1e-300))


# --------------------------------------------------------------------------- the calibrator's line


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
    for _ in range(_REWEIGHTING_ROUNDS):
        predicted = intercept + slope * xs
        relative = (ts - predicted) / np.maximum(predicted, 1e-12)
        scale = MAD_TO_SIGMA * np.median(np.abs(relative - np.median(relative))) or 1e-12
        robust = huber_weights(np.abs(relative) / scale)
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


# --------------------------------------------------------------------------- the online profile's estimator


@dataclass(frozen=True)
class RobustFit:
    """The fitted parameters, and how well they describe the observations (not the prior's pseudo-points)."""

    params: np.ndarray
    r2: float  # 1 - SS_res / SS_tot on relative residuals, weighted by age
    max_abs_residual: float  # largest |t - pred| / pred among the observations the fit kept (Huber weight 1)


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The value below which half the weight lies (the lower one on a tie)."""
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, 0.5 * cumulative[-1])])


def _predict(features: np.ndarray, params: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Predictions ``max_j A_j θ`` and, per point, the branch that attains it."""
    per_branch = features @ params  # (branches, n)
    branch = np.argmax(per_branch, axis=0)
    return per_branch[branch, np.arange(per_branch.shape[1])], branch


def _huber_loss(u: np.ndarray) -> np.ndarray:
    a = np.abs(u)
    return np.where(a <= HUBER_K, 0.5 * u * u, HUBER_K * a - 0.5 * HUBER_K * HUBER_K)


def fit_max_linear(
    features: np.ndarray,
    seconds: np.ndarray,
    weights: np.ndarray,
    is_data: np.ndarray,
    starts: Sequence[np.ndarray],
    lower: np.ndarray,
    upper: np.ndarray,
) -> RobustFit:
    """Fits θ in ``[lower, upper]`` to ``seconds`` ≈ ``max_j features[j] @ θ``.

    ``features``: (branches, points, parameters), non-negative; ``seconds``, ``weights``, ``is_data``:
    per point (``is_data`` False for the prior's pseudo-points). ``starts``: first guesses (clipped into the
    bounds); with several branches the loss is not convex (a branch that is nowhere the maximum has no
    gradient), so each start is descended and the lowest loss wins. At least one point must be an observation.
    """
    problem = _Problem(features, np.log(seconds), weights, is_data, lower, upper)
    ends = [problem.descend(np.clip(np.asarray(s, dtype=np.float64), lower, upper)) for s in starts]
    common = min(problem.sigma(theta) for theta in ends)
    best = min(ends, key=lambda theta: problem.loss(theta, common))
    return _quality(features, seconds, weights, is_data, best, problem.sigma(best))


class _Problem:
    """One fit's points and bounds; :meth:`descend` runs projected Gauss-Newton from a start."""

    def __init__(
        self,
        features: np.ndarray,
        log_t: np.ndarray,
        weights: np.ndarray,
        is_data: np.ndarray,
        lower: np.ndarray,
        upper: np.ndarray,
    ) -> None:
        self.features, self.log_t, self.weights, self.is_data = features, log_t, weights, is_data
        self.lower, self.upper = lower, upper

    def residuals(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        pred, branch = _predict(self.features, theta)
        return self.log_t - np.log(np.maximum(pred, 1e-300)), pred, branch

    def sigma(self, theta: np.ndarray) -> float:
        """The observations' robust residual spread at ``theta`` (never below SIGMA_FLOOR)."""
        r, _, _ = self.residuals(theta)
        data = self.is_data
        return max(SIGMA_FLOOR, MAD_TO_SIGMA * weighted_median(np.abs(r[data]), self.weights[data]))

    def loss(self, theta: np.ndarray, sigma: float) -> float:
        r, _, _ = self.residuals(theta)
        return float(np.sum(self.weights * _huber_loss(r / sigma)))

    def descend(self, theta: np.ndarray) -> np.ndarray:
        # Parameters differ by 10 orders of magnitude (seconds vs seconds per byte): steps are taken in units
        # of each parameter's typical size, so that the normal equations stay well conditioned.
        scale = np.where(theta > 0, theta, 1.0 / np.maximum(self.features.max(axis=(0, 1)), 1e-300))
        for _ in range(_GAUSS_NEWTON_ITERATIONS):
            r, pred, branch = self.residuals(theta)
            sigma = self.sigma(theta)
            w = self.weights * huber_weights(np.abs(r) / sigma)
            # d log(pred) / d θ on each point's active branch, in scaled units
            jac = self.features[branch, np.arange(len(pred))] / pred[:, None] * scale
            normal = jac.T @ (jac * w[:, None])
            normal += np.eye(len(theta)) * (1e-12 * np.trace(normal) + 1e-300)
            step = np.linalg.solve(normal, jac.T @ (w * r)) * scale
            current = self.loss(theta, sigma)
            moved = np.zeros_like(theta)
            for _ in range(_HALVINGS):
                candidate = np.clip(theta + step, self.lower, self.upper)
                if self.loss(candidate, sigma) < current:
                    moved, theta = candidate - theta, candidate
                    break
                step = step / 2
            if np.all(np.abs(moved) <= _TOLERANCE * np.maximum(np.abs(theta), scale * 1e-6)):
                break
        return theta


def _quality(
    features: np.ndarray,
    seconds: np.ndarray,
    weights: np.ndarray,
    is_data: np.ndarray,
    theta: np.ndarray,
    sigma: float,
) -> RobustFit:
    """How well ``theta`` describes the observations; ``sigma``: their residual spread there."""
    pred, _ = _predict(features, theta)
    t, p, w = seconds[is_data], pred[is_data], weights[is_data]
    relative = (t - p) / p
    kept = np.abs(np.log(t) - np.log(p)) <= HUBER_K * sigma
    rel_w = w / (t * t)
    mean = np.sum(rel_w * t) / np.sum(rel_w)
    ss_tot = float(np.sum(rel_w * (t - mean) ** 2))
    ss_res = float(np.sum(rel_w * (t - p) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return RobustFit(
        params=theta,
        r2=float(r2),
        max_abs_residual=float(np.max(np.abs(relative[kept]))) if kept.any() else 0.0,
    )
