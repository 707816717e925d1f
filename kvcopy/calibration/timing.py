"""One timing helper for the benchmarks (and, later, the calibrator).

Warm-up, repeats, median with the 20th and 80th percentiles. On CUDA the
interval is measured with events on the current stream; on CPU with
``time.perf_counter`` around a call that returns when its work is done.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["COLD_BYTES", "Timing", "measure"]

# Successive timed calls should together touch at least this many bytes (the
# calibrator and the benchmark cycle over id sets that cover it): twice a
# 32 MiB L3, so a small copy is not timed on data the previous call left in
# cache. Real offloads touch cold blocks.
COLD_BYTES = 64 << 20


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
