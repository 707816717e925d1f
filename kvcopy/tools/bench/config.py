"""What a benchmark run measures (BenchConfig), what each measured row holds (BenchRow), and the names and
bounds the runner (kvcopy.tools.bench.runner) uses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvcopy.tools.bench.baselines import DMA_BASELINES
from kvcopy.tools.bench.workloads import WORKLOADS

__all__ = ["LIMIT", "PER_BLOCK_LOOP", "PER_BLOCK_MEMCPY", "PER_LAYER_LOOP", "UNMERGED_BATCH", "BenchConfig", "BenchRow"]

LIMIT = "contiguous copy (limit)"
PER_LAYER_LOOP = "per-layer index loop"
PER_BLOCK_LOOP = "per-block copy_ loop"
PER_BLOCK_MEMCPY, UNMERGED_BATCH = DMA_BASELINES

# The device-side cache holds this many blocks per block moved, so random ids
# are scattered over it as in a busy cache rather than packed together.
CACHE_BLOCKS_PER_MOVED_BLOCK = 2
# The Python per-block loop issues one copy_ per (block, plane), 5-10 us each:
# above this many per call (1024 llama8b-16 blocks; every workload at 256
# blocks is under it) one call takes over half a second and the row adds
# nothing the smaller points do not show, so it is left out.
MAX_PYTHON_LOOP_COPIES = 1 << 16
# A row whose single call takes longer than SLOW_CALL_S is timed with one
# warm-up and SLOW_ROW_REPEATS calls: the slow baselines at thousands of blocks
# would otherwise take most of a GPU check's minutes, and their spread is small
# next to their distance from kvcopy.
SLOW_CALL_S = 0.05
SLOW_ROW_REPEATS = 3
# Successive timed calls of a point cycle over id sets (and offsets of the
# contiguous buffers) that together cover at least kvcopy.calibration.timing.COLD_BYTES, as
# the calibrator's do, up to this many sets.
MAX_ID_SETS = 32
# Each row's output is checked against plain indexing before it is timed, on
# the first ids of the call that move at most this many bytes (the check moves
# them twice more): all of them for most points. Where the device cache
# is at most MAX_WHOLE_CHECKED_BYTES, the check also keeps a copy of both
# sides and finds writes outside the named blocks.
MAX_CHECKED_BYTES = 1 << 30
MAX_WHOLE_CHECKED_BYTES = 2 << 30


@dataclass(frozen=True)
class BenchConfig:
    """What to run. :meth:`default` gives the set ``kvcopy bench`` runs.

    ``device``: "cpu", "cuda" or "cuda:N" (or a torch.device); a GPU device
    is resolved to its index.
    """

    device: torch.device
    workloads: tuple[str, ...] = tuple(WORKLOADS)
    ids: str = "random"  # or "sequential": one run of adjacent ids on each side
    blocks: int = 256
    counts: tuple[int, ...] = (1, 4, 16, 64, 256, 1024)
    block_tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    sweep_blocks: int = 128
    fixed_cost: bool = True
    repeats: int = 7
    warmup: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", _resolve_device(self.device))
        unknown = [w for w in self.workloads if w not in WORKLOADS]
        if unknown:
            raise ValueError(f"workloads: unknown {unknown}; known: {sorted(WORKLOADS)}")
        if self.ids not in ("random", "sequential"):
            raise ValueError(f"ids: expected 'random' or 'sequential', got {self.ids!r}")
        for name in ("blocks", "sweep_blocks", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive int, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup: expected an int >= 0, got {self.warmup}")
        for name in ("counts", "block_tokens"):
            values = getattr(self, name)
            if any(v < 1 for v in values) or len(set(values)) != len(values):
                raise ValueError(f"{name}: expected distinct positive ints, got {values}")

    @classmethod
    def default(cls, device: torch.device | str | None = None, *, quick: bool = False, **overrides: Any) -> BenchConfig:
        """The default set for ``device`` (default: the GPU if any, else the CPU); ``quick``: a smoke-test size."""
        device = _resolve_device("cuda" if device is None and torch.cuda.is_available() else device or "cpu")
        if quick:
            base: dict[str, Any] = dict(
                # a workload's own large cache (gigabytes) is no smoke test: left out unless asked for by name
                workloads=tuple(name for name, w in WORKLOADS.items() if w.cache_bytes is None),
                blocks=16,
                counts=(1, 4, 16),
                block_tokens=(1, 16),
                sweep_blocks=8,
                repeats=2,
                warmup=1,
            )
        elif device.type == "cuda":
            base = dict(counts=(1, 4, 16, 64, 256, 1024, 2048), sweep_blocks=256, repeats=10, warmup=3)
        else:
            base = {}
        return cls(device=device, **{**base, **overrides})


@dataclass(frozen=True)
class BenchRow:
    """One timed method at one point. Bytes count every plane of every block moved."""

    suite: str
    workload: str
    direction: str  # "gather" (cache -> host pool) or "scatter" (host pool -> cache)
    ids: str
    method: str
    num_blocks: int
    num_planes: int
    block_bytes: int  # one block, all planes
    median_s: float
    p20_s: float
    p80_s: float
    repeats: int
    predicted_s: float | None = field(default=None)

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def plane_block_bytes(self) -> int:
        """A block's bytes over its planes (the mean plane-block)."""
        return self.block_bytes // self.num_planes

    @property
    def gbps(self) -> float:
        return self.bytes / self.median_s / 1e9


def _resolve_device(device: torch.device | str) -> torch.device:
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device} asked for, but no CUDA device is available")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"device: {device} asked for, but there are {torch.cuda.device_count()} CUDA devices")
        return torch.device("cuda", index)
    if device.type != "cpu":
        raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {device}")
    return device
