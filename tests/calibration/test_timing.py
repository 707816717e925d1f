"""kvcopy.calibration.timing.measure: warm-up and repeat counts, per-call division, percentiles, argument checks."""

from __future__ import annotations

import time

import pytest

from kvcopy.calibration.timing import measure


def test_calls_warmup_then_repeats_times_inner():
    calls = []
    timing = measure(lambda: calls.append(1), warmup=2, repeats=5, inner=3)
    assert len(calls) == 2 + 5 * 3
    assert timing.repeats == 5


def test_samples_are_per_call_and_ordered():
    timing = measure(lambda: time.sleep(0.002), warmup=0, repeats=5, inner=2)
    assert 0.002 <= timing.p20 <= timing.median <= timing.p80 < 0.05  # seconds per call, not per sample of 2


def test_median_and_percentiles_of_known_samples(monkeypatch):
    # perf_counter read twice per sample: samples of 1, 2, 3, 4, 10 seconds.
    ticks = iter([0, 1, 0, 2, 0, 3, 0, 4, 0, 10])
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks))
    timing = measure(lambda: None, warmup=0, repeats=5)
    assert (timing.median, timing.repeats) == (3, 5)
    assert (timing.p20, timing.p80) == (pytest.approx(1.8), pytest.approx(5.2))  # numpy's linear percentiles
    assert timing.gbps(6e9) == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("kw", "name"), [({"warmup": -1}, "warmup"), ({"repeats": 0}, "repeats"), ({"inner": 0}, "inner")]
)
def test_bad_arguments(kw, name):
    with pytest.raises(ValueError, match=name):
        measure(lambda: None, **kw)
