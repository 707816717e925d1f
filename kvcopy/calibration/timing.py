"""The one timer the calibrator and the benchmarks share.

- :func:`measure`: warm-up, repeats, median with the 20th and 80th
  percentiles. On CUDA the interval is measured with events on the current
  stream; on CPU with ``time.perf_counter`` around a call that returns when
  its work is done.
- :func:`cycling`: one call of the next of several each time, so that
  successive timed calls touch different (cold) blocks (:data:`COLD_BYTES`).
- :func:`interleaved`: several calls timed in the same rounds, in turn, every
  sample kept, so that a machine whose speed drifts slows each alike.
- :func:`seconds_to_completion`: one call, wall-clock, until the work it
  queued on its devices is done (a first call, which may compile or fault
  pages in, judged before the timed ones).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

__all__ = ["COLD_BYTES", "Timing", "cycling", "interleaved", "measure", "seconds_to_completion"]

# Successive timed calls should together touch at least this many bytes (the
# calibrator and the benchmark cycle over id sets that cover it): twice a
# 32 MiB L3, so a small copy is not timed on data the previous call left in
# cache. Real offloads touch cold blocks.
COLD_BYTES = 64 << 20

_Key = TypeVar("_Key")


@dataclass(frozen=True)
class Timing:
    """Seconds per call over ``repeats`` timed calls."""

    median: float
    p20: float
    p80: float
    repeats: int

    def gbps(self, nbytes: int) -> float:
        """Decimal GB/s for ``nbytes`` moved per call, at the median."""
        return nbytes / self.median / 1e9


def measure(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    repeats: int = 10,
    device: torch.device | str | None = None,
    inner: int = 1,
) -> Timing:
    """Times ``fn``: ``warmup`` untimed calls, then ``repeats`` samples of ``inner`` calls each.

    ``device`` of type cuda times with CUDA events on its current stream;
    otherwise wall-clock. ``inner`` > 1 amortises timer overhead for calls of
    a few microseconds; each sample is divided by it.
    """
    if warmup < 0 or repeats < 1 or inner < 1:
        raise ValueError(f"expected warmup >= 0, repeats >= 1, inner >= 1; got {warmup}, {repeats}, {inner}")
    cuda = device is not None and torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / inner)
        else:
            begin = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - begin) / inner)
    p20, p80 = np.percentile(samples, [20, 80])
    return Timing(median=statistics.median(samples), p20=float(p20), p80=float(p80), repeats=repeats)


def cycling(calls: Iterable[Callable[[], object]]) -> Callable[[], object]:
    """A call that runs the next of ``calls`` each time, round and round: given calls over id sets that
    together cover :data:`COLD_BYTES`, :func:`measure` times each on blocks the previous one did not leave in
    cache."""
    turn = itertools.cycle(list(calls))
    return lambda: next(turn)()


def interleaved(
    calls: Mapping[_Key, Callable[[], object]],
    rounds: int,
    *,
    warmup: int = 0,
    inner: int = 1,
    device: torch.device | str | None = None,
    after: Mapping[_Key, Callable[[], object]] | None = None,
) -> dict[_Key, list[float]]:
    """Seconds per call of each of ``calls`` in each of ``rounds`` rounds: every sample, by key, in round order.

    Each round gives every call a turn, in the mapping's order: :func:`measure` of ``warmup`` untimed calls
    and one sample of ``inner`` timed ones. Timed in turn, a machine whose speed drifts (a cloud disk's burst
    credits, a neighbour's load) slows every call alike, where timed one after the other the later calls would
    pay for it. ``after``: per key, untimed work after each of its turns. The calls are called as given (no
    wrapper: a call of a microsecond is timed as it is).
    """
    if rounds < 1:
        raise ValueError(f"expected rounds >= 1; got {rounds}")
    samples: dict[_Key, list[float]] = {key: [] for key in calls}
    for _ in range(rounds):
        for key, call in calls.items():
            samples[key].append(measure(call, warmup=warmup, repeats=1, inner=inner, device=device).median)
            if after is not None and key in after:
                after[key]()
    return samples


def seconds_to_completion(fn: Callable[[], object], devices: Iterable[torch.device | str] = ()) -> float:
    """Wall-clock seconds of one call of ``fn`` until the work it queued on ``devices`` is done.

    Each CUDA device among ``devices`` is synchronized before the call (so work queued earlier is not
    counted) and after it; other devices need nothing (a CPU call returns when its work is done). One call,
    with whatever a first call pays (compiling, first touches of pages): what a benchmark judges a call by
    before it times it with :func:`measure`.
    """
    cuda = [d for d in dict.fromkeys(torch.device(d) for d in devices) if d.type == "cuda"]
    for device in cuda:
        torch.cuda.synchronize(device)
    began = time.perf_counter()
    fn()
    for device in cuda:
        torch.cuda.synchronize(device)
    return time.perf_counter() - began
