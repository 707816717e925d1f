"""kvcopy.calibration.timing: measure's warm-up and repeat counts, per-call division, percentiles and argument
checks; cycling's turns; interleaved's rounds and samples; seconds_to_completion's synchronization."""

from __future__ import annotations

import functools
import time

import pytest
import torch

from kvcopy.calibration.timing import cycling, interleaved, measure, seconds_to_completion


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


def test_cycling_runs_the_next_call_each_time_round_and_round():
    ran = []
    call = cycling(functools.partial(ran.append, name) for name in "abc")  # any iterable, taken once
    for _ in range(7):
        call()
    assert ran == list("abcabca")


def test_interleaved_gives_every_call_its_turn_in_each_round():
    ran = []
    calls = {name: functools.partial(ran.append, name) for name in ("a", "b")}
    after = {"b": functools.partial(ran.append, "after b")}
    samples = interleaved(calls, 2, warmup=1, inner=2, after=after)
    # per turn: 1 warm-up and 2 timed calls; b's untimed work after each of its turns
    assert ran == (["a"] * 3 + ["b"] * 3 + ["after b"]) * 2
    assert list(samples) == ["a", "b"] and all(len(s) == 2 for s in samples.values())


def test_interleaved_keeps_every_sample_per_call_in_round_order(monkeypatch):
    # perf_counter read twice per turn: a, b, a, b take 2, 4, 6, 8 seconds for their 2 calls.
    ticks = iter([0, 2, 0, 4, 0, 6, 0, 8])
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks))
    samples = interleaved({"a": lambda: None, "b": lambda: None}, 2, inner=2)
    assert samples == {"a": [1, 3], "b": [2, 4]}  # seconds per call, not per turn of 2


@pytest.mark.parametrize(
    ("kw", "name"), [({"rounds": 0}, "rounds"), ({"warmup": -1}, "warmup"), ({"inner": 0}, "inner")]
)
def test_interleaved_bad_arguments(kw, name):
    ran = []
    with pytest.raises(ValueError, match=name):
        interleaved({"a": lambda: ran.append(1)}, **{"rounds": 1, **kw})
    assert ran == []  # checked before anything runs


def test_seconds_to_completion_synchronizes_each_cuda_device_before_and_after(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: events.append(f"sync {device}"))
    ticks = iter([10.0, 10.5])
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks))
    devices = [torch.device("cuda", 0), "cpu", "cuda:0", torch.device("cuda", 1)]  # cuda:0 twice: once is enough
    seconds = seconds_to_completion(lambda: events.append("call"), devices)
    assert events == ["sync cuda:0", "sync cuda:1", "call", "sync cuda:0", "sync cuda:1"]
    assert seconds == 0.5


def test_seconds_to_completion_on_the_cpu_needs_no_synchronization(monkeypatch):
    def no_sync(device):
        raise AssertionError(f"synchronized {device} for a CPU call")

    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    ticks = iter([3.0, 5.0])
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks))
    ran = []
    assert seconds_to_completion(lambda: ran.append(1), [torch.device("cpu")]) == 2.0
    assert ran == [1]
