"""Profiles built by hand (CostLine, MethodProfile), whose every prediction is known in advance."""

from __future__ import annotations

import kvcopy
import kvcopy.calibration.local as calibrator
from kvcopy.profile import CostLine, MethodProfile, PrefillProfile, Profile

# The planes per block a calibration copies (a profile's per-block sizes are per plane).
CAL_PLANES = calibrator.CALIBRATION_PLANES


def exact_line(alpha: float, beta: float) -> CostLine:
    """``t = alpha + bytes / beta``, fitted exactly."""
    return CostLine(alpha_s=alpha, beta_bytes_per_s=beta, r2=1.0, max_abs_residual=0.0)


def points_of(fit: CostLine, shapes) -> list[list[float]]:
    """Calibration points on ``fit`` at each (plane-block bytes, block count): rows of [bytes, blocks,
    plane-block bytes, median, p20, p80]."""
    rows = []
    for block, count in shapes:
        nbytes = block * count * CAL_PLANES
        t = fit.predict(nbytes)
        rows.append([nbytes, count, block, t, t * 0.95, t * 1.05])
    return rows


def synthetic_profile(fast: str = "torch", slow: str = "cpu", direction: str = "h2h", *, by_block=False) -> Profile:
    """``fast`` predicted well ahead of ``slow`` at every size in ``direction``."""
    fast_fit, slow_fit = exact_line(1e-6, 1e12), exact_line(1e-3, 1e8)
    shapes = [(4096, 1), (4096, 64), (262144, 1), (262144, 8)]
    links = {
        direction: {
            fast: MethodProfile(
                fast_fit, {4096: fast_fit, 262144: fast_fit} if by_block else {}, points_of(fast_fit, shapes)
            ),
            slow: MethodProfile(slow_fit, {4096: slow_fit} if by_block else {}, points_of(slow_fit, shapes)),
        }
    }
    return Profile(
        hardware={
            "device": "cpu",
            "device_name": "synthetic",
            "calibration_planes": CAL_PLANES,
            "torch": "x",
            "kvcopy": kvcopy.__version__,
            "date": "2025-01-01T00:00:00+00:00",
            "host_cpu": "synthetic",
        },
        directions=links,
        peaks={direction: 5e10},
        prefill=PrefillProfile(
            model="llama-3.1-8b", alpha_s=0.01, flops_per_s=1e13, r2=0.99, points=((1e12, 0.11), (2e12, 0.21))
        ),
    )


def size_dependent_profile() -> Profile:
    """Like a real CPU calibration: small plane-blocks move slower (fits per block size)."""
    per_block = {4096: exact_line(10e-6, 20e9), 32768: exact_line(18e-6, 33e9), 262144: exact_line(32e-6, 42e9)}
    shapes = [(b, n) for b in per_block for n in (1, 8, 64) if b * n * CAL_PLANES <= 64 << 20]
    points = [row for b, f in per_block.items() for row in points_of(f, [s for s in shapes if s[0] == b])]
    return Profile(
        hardware={"device": "cpu", "device_name": "synthetic", "calibration_planes": CAL_PLANES},
        directions={"h2h": {"cpu": MethodProfile(exact_line(13e-6, 33e9), per_block, points)}},
        peaks={"h2h": 5e10},
    )
