"""The online profile's one estimator: a robust, forgetting fit of ``t = max_j (A_j · θ)`` with bounds on θ.

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

__all__ = ["HUBER_K", "SIGMA_FLOOR", "RobustFit", "fit_max_linear", "weighted_median"]

# Huber threshold in robust standard deviations (1.345: 95% efficiency on Gaussian noise, as kvcopy.calibration.fit).
HUBER_K = 1.345
# The smallest residual spread assumed (log units, ~3%): repeated engine timings never agree more closely,
# and a spread of 0 (noise-free data) would make every residual an outlier.
SIGMA_FLOOR = 0.03
# MAD -> standard deviation for Gaussian noise.
_MAD_TO_SIGMA = 1.4826
# Gauss-Newton iterations; from the prior the fit settles in 10-30 even when the prior is 10x off.
_ITERATIONS = 60
# Step halvings tried before an iteration gives up (the step no longer lowers the loss).
_HALVINGS = 30
# Convergence: no parameter moved by more than this fraction of itself in an iteration.
_TOLERANCE = 1e-6


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
        return max(SIGMA_FLOOR, _MAD_TO_SIGMA * weighted_median(np.abs(r[data]), self.weights[data]))

    def loss(self, theta: np.ndarray, sigma: float) -> float:
        r, _, _ = self.residuals(theta)
        return float(np.sum(self.weights * _huber_loss(r / sigma)))

    def descend(self, theta: np.ndarray) -> np.ndarray:
        # Parameters differ by 10 orders of magnitude (seconds vs seconds per byte): steps are taken in units
        # of each parameter's typical size, so that the normal equations stay well conditioned.
        scale = np.where(theta > 0, theta, 1.0 / np.maximum(self.features.max(axis=(0, 1)), 1e-300))
        for _ in range(_ITERATIONS):
            r, pred, branch = self.residuals(theta)
            sigma = self.sigma(theta)
            u = np.abs(r) / sigma
            w = self.weights * np.where(u <= HUBER_K, 1.0, HUBER_K / np.maximum(u, 1e-300))
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
