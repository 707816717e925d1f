"""kvcopy.calibration.fit.fit_alpha_beta: the robust ``t = alpha + x / beta`` fit behind every profile.

Synthetic timings with known alpha and beta: exact, with multiplicative noise,
with gross outliers (a page fault, another tenant), with a fixed cost below
the noise (negative intercept, clamped), and the input errors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvcopy.calibration.fit import LinearFit, fit_alpha_beta

# Sizes like the calibrator's: bytes per call from 64 KiB to 256 MiB, two repeats each.
SIZES = np.repeat(np.geomspace(64 << 10, 256 << 20, 14), 2)

# (alpha seconds, beta bytes/s): a host memcpy, a PCIe link, a slow path with a big fixed cost.
CASES = [(8e-6, 20e9), (12e-6, 50e9), (2e-3, 1e9)]


def _times(alpha: float, beta: float, x=SIZES) -> np.ndarray:
    return alpha + np.asarray(x, dtype=np.float64) / beta


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


# --------------------------------------------------------------------------- exact data


@pytest.mark.parametrize("alpha,beta", CASES)
def test_noiseless_recovers_alpha_and_beta_exactly(alpha, beta):
    fit = fit_alpha_beta(SIZES, _times(alpha, beta))
    assert isinstance(fit, LinearFit)
    assert _rel(fit.alpha, alpha) < 1e-9
    assert _rel(fit.beta, beta) < 1e-9
    assert fit.r2 == pytest.approx(1.0, abs=1e-9)
    assert len(fit.residuals) == len(SIZES)
    assert fit.max_abs_residual < 1e-9
    for x in (0.0, 1e3, 5e7, 1e10):
        assert fit.predict(x) == pytest.approx(alpha + x / beta, rel=1e-9)


def test_two_points_are_enough():
    fit = fit_alpha_beta([1e6, 4e6], [1e-5 + 1e6 / 1e10, 1e-5 + 4e6 / 1e10])
    assert fit.alpha == pytest.approx(1e-5, rel=1e-9)
    assert fit.beta == pytest.approx(1e10, rel=1e-9)


def test_accepts_lists_tuples_and_arrays():
    x = [1e5, 1e6, 1e7, 1e8]
    t = [float(v) for v in _times(5e-6, 1e10, x)]
    fits = [
        fit_alpha_beta(x, t),
        fit_alpha_beta(tuple(x), tuple(t)),
        fit_alpha_beta(np.array(x), np.array(t)),
        fit_alpha_beta(np.array(x, dtype=np.int64), np.array(t, dtype=np.float32)),
    ]
    for fit in fits:
        assert fit.alpha == pytest.approx(5e-6, rel=1e-5)
        assert fit.beta == pytest.approx(1e10, rel=1e-5)
        assert all(isinstance(v, float) for v in (fit.alpha, fit.beta, fit.r2))


def test_zero_fixed_cost_is_recovered_as_zero():
    fit = fit_alpha_beta(SIZES, SIZES / 3e10)
    assert fit.alpha >= 0.0
    assert fit.alpha < 1e-12
    assert _rel(fit.beta, 3e10) < 1e-9


# --------------------------------------------------------------------------- noise and outliers


@pytest.mark.parametrize("alpha,beta", CASES)
@pytest.mark.parametrize("seed", range(5))
def test_three_percent_multiplicative_noise(alpha, beta, seed):
    rng = np.random.default_rng(seed)
    t = _times(alpha, beta) * (1 + 0.03 * rng.standard_normal(len(SIZES)))
    fit = fit_alpha_beta(SIZES, t)
    assert _rel(fit.beta, beta) < 0.03, fit
    assert _rel(fit.alpha, alpha) < 0.05, fit
    assert 0.9 < fit.r2 <= 1.0
    assert 0.0 < fit.max_abs_residual < 0.2


@pytest.mark.parametrize("alpha,beta", CASES)
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("where", ["spread", "small", "large"])
def test_gross_outliers_are_discounted(alpha, beta, seed, where):
    """2-3 samples slowed x3 / x5 (on top of 3% noise) move the fit by at most ~5%."""
    rng = np.random.default_rng(100 + seed)
    t = _times(alpha, beta) * (1 + 0.03 * rng.standard_normal(len(SIZES)))
    n = len(SIZES)
    index = {"spread": [1, n // 2, n - 3], "small": [0, 3], "large": [n - 1, n - 4]}[where]
    factors = [3.0, 5.0, 3.0][: len(index)]
    for i, f in zip(index, factors, strict=True):
        t[i] *= f
    fit = fit_alpha_beta(SIZES, t)
    assert _rel(fit.beta, beta) < 0.05, fit
    assert _rel(fit.alpha, alpha) < 0.08, fit
    # The outliers stand out in the relative residuals; the rest stay near the noise.
    for i, f in zip(index, factors, strict=True):
        assert fit.residuals[i] > f - 1.5
    others = [abs(r) for i, r in enumerate(fit.residuals) if i not in index]
    assert max(others) < 0.2


def test_residuals_are_relative_to_the_prediction():
    rng = np.random.default_rng(7)
    t = _times(1e-5, 1e10) * (1 + 0.05 * rng.standard_normal(len(SIZES)))
    fit = fit_alpha_beta(SIZES, t)
    for x, ti, r in zip(SIZES, t, fit.residuals, strict=True):
        predicted = fit.alpha + x / fit.beta
        assert r == pytest.approx((ti - predicted) / predicted, rel=1e-9, abs=1e-12)
    assert fit.max_abs_residual == pytest.approx(max(abs(r) for r in fit.residuals))


def test_noisier_data_has_lower_r2():
    rng = np.random.default_rng(3)
    noise = rng.standard_normal(len(SIZES))
    r2 = [fit_alpha_beta(SIZES, _times(1e-5, 1e10) * (1 + s * noise)).r2 for s in (0.0, 0.03, 0.3)]
    assert r2[0] > r2[1] > r2[2]


# --------------------------------------------------------------------------- negative intercept


def test_negative_intercept_is_clamped_to_zero():
    """A line through the points would cross below 0 at x = 0: alpha is 0 and beta refitted."""
    x = np.geomspace(1e6, 1e8, 10)
    t = x / 1e10 - 2e-5  # every time positive (the smallest is 8e-5 s), intercept -20 us
    assert np.all(t > 0)
    fit = fit_alpha_beta(x, t)
    assert fit.alpha == 0.0
    assert fit.beta > 0
    assert fit.predict(0) == 0.0
    assert all(fit.predict(v) > 0 for v in x)
    # Through the origin the slope is between the true one and the steepest chord from 0.
    assert 1e10 * 0.9 < fit.beta < 1e10 * 1.3
    # Residuals are computed against the clamped line.
    for xi, ti, r in zip(x, t, fit.residuals, strict=True):
        assert r == pytest.approx((ti - xi / fit.beta) / (xi / fit.beta), rel=1e-9, abs=1e-12)


def test_tiny_negative_intercept_from_noise_is_clamped():
    rng = np.random.default_rng(11)
    for _ in range(20):
        t = _times(0.0, 1e10) * (1 + 0.03 * rng.standard_normal(len(SIZES)))
        fit = fit_alpha_beta(SIZES, t)
        assert fit.alpha >= 0.0
        assert _rel(fit.beta, 1e10) < 0.03


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "x,t",
    [
        ([1e6], [1e-3]),
        ([1e6, 1e6, 1e6], [1e-3, 1.1e-3, 0.9e-3]),
        ([], []),
    ],
)
def test_fewer_than_two_distinct_sizes_is_an_error(x, t):
    with pytest.raises(ValueError, match="x"):
        fit_alpha_beta(x, t)


@pytest.mark.parametrize("bad", [0.0, -1e-3, math.nan, math.inf])
def test_non_positive_or_non_finite_times_are_an_error(bad):
    t = list(_times(1e-5, 1e10, [1e5, 1e6, 1e7]))
    t[1] = bad
    with pytest.raises(ValueError, match="t"):
        fit_alpha_beta([1e5, 1e6, 1e7], t)


@pytest.mark.parametrize(
    "x,t",
    [
        ([1e5, 1e6, 1e7], [1e-3, 2e-3]),
        ([1e5, 1e6], [1e-3, 2e-3, 3e-3]),
        ([[1e5, 1e6], [1e7, 1e8]], [[1e-3, 2e-3], [3e-3, 4e-3]]),
    ],
)
def test_mismatched_or_non_1d_inputs_are_an_error(x, t):
    with pytest.raises(ValueError, match="x, t"):
        fit_alpha_beta(x, t)


def test_times_that_fall_with_size_are_an_error():
    with pytest.raises(ValueError, match="grow"):
        fit_alpha_beta([1e5, 1e6, 1e7, 1e8], [4e-3, 3e-3, 2e-3, 1e-3])
