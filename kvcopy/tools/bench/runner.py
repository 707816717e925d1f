"""Runs the benchmark: every kvcopy method beside the baselines, on the same blocks, in one run.

Four suites, each a list of points (a cache, a block count, an id pattern),
and at each point both directions (gather: cache -> host pool; scatter: host
pool -> cache), each row checked against plain indexing and then timed with
kvcopy.calibration.timing:
- ``workloads``: each named workload (kvcopy.tools.bench.workloads) at ``blocks`` blocks;
- ``count_sweep``: llama8b-16 at each of ``counts`` blocks (1 to thousands);
- ``size_sweep``: Llama-3.1-8B's cache at each of ``block_tokens`` tokens per
  block (plane-blocks of 2 KiB per token), at ``sweep_blocks`` blocks;
- ``fixed_cost``: one block per call of 64 planes of 256 B (the fixed cost of a
  call that plans and launches 64 copies), and of one plane of 32 KiB, whose
  time over a bare copy_ of the same 32 KiB (the row's limit) is kvcopy's
  call overhead (``fixed_cost=True``).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from kvcopy import _ext
from kvcopy.calibration.timing import COLD_BYTES, cycling, measure, seconds_to_completion
from kvcopy.host.pool import HostKVPool
from kvcopy.layout import PagedKV
from kvcopy.methods.torch_method import word_views
from kvcopy.ops import available_methods, copy_blocks
from kvcopy.profile import Profile, direction_of
from kvcopy.tools.bench.baselines import (
    DMA_BASELINES,
    contiguous_copy,
    dma_baseline,
    has_dma_baselines,
    per_block_copy_loop,
    per_layer_index_loop,
)
from kvcopy.tools.bench.config import (
    CACHE_BLOCKS_PER_MOVED_BLOCK,
    LIMIT,
    MAX_CHECKED_BYTES,
    MAX_ID_SETS,
    MAX_PYTHON_LOOP_COPIES,
    MAX_WHOLE_CHECKED_BYTES,
    PER_BLOCK_LOOP,
    PER_BLOCK_MEMCPY,
    PER_LAYER_LOOP,
    SLOW_CALL_S,
    SLOW_ROW_REPEATS,
    UNMERGED_BATCH,
    BenchConfig,
    BenchRow,
)
from kvcopy.tools.bench.workloads import (
    DEFAULT_WORKLOAD,
    ONE_PLANE_32K,
    TINY_PLANES,
    WORKLOADS,
    Workload,
    llama8b_with_block_tokens,
)

__all__ = [
    "AUTO",
    "LIMIT",
    "PER_BLOCK_LOOP",
    "PER_BLOCK_MEMCPY",
    "PER_LAYER_LOOP",
    "UNMERGED_BATCH",
    "BenchConfig",
    "BenchRow",
    "check_output",
    "num_points",
    "point_specs",
    "run_benchmarks",
]


def check_output(
    name: str,
    fn: Callable[[], object],
    src: PagedKV,
    src_ids: torch.Tensor,
    dst: PagedKV,
    dst_ids: torch.Tensor,
    *,
    whole: bool = True,
    kept: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> float:
    """Clears the destination blocks, runs ``fn`` once and compares their bytes with plain indexing of the source.

    ``whole``: also check that the source and every other destination block
    are unchanged (keeps a copy of both caches meanwhile). ``kept``: where
    that copy is kept for the next check of the same caches and ids (filled
    when empty; used instead of copying the caches again when filled, which
    holds while only checks that passed ran on them in between: each leaves
    them as it found them, the blocks it cleared then copied aside). Raises
    AssertionError naming ``name`` and the first plane that differs; returns
    the seconds ``fn`` took (to its device's completion).
    """
    pairs = [word_views(s, d) for s, d in zip(src.planes, dst.planes, strict=True)]
    src_ids, dst_ids = src_ids.to(src.device), dst_ids.to(dst.device)
    for _, d_words in pairs:
        d_words[dst_ids] = 0
    if whole and kept:
        before = kept  # its dst_ids blocks are set to what the copy wrote before they are compared
    else:
        before = [(s_words.clone(), d_words.clone()) for s_words, d_words in pairs] if whole else []
        if whole and kept is not None:
            kept += before
    seconds = seconds_to_completion(fn, (src.device, dst.device))
    for p, (s_words, d_words) in enumerate(pairs):
        if not torch.equal(d_words[dst_ids].cpu(), s_words[src_ids].cpu()):
            raise AssertionError(f"{name}: plane {p} differs from plain indexing of the source")
    if not whole:
        return seconds
    for p, ((s_words, d_words), (s_before, d_before)) in enumerate(zip(pairs, before, strict=True)):
        d_before[dst_ids] = d_words[dst_ids]  # the copied blocks were checked above
        if not torch.equal(d_words, d_before):
            raise AssertionError(f"{name}: plane {p} has destination blocks written that dst_ids does not name")
        if s_words.data_ptr() != d_words.data_ptr() and not torch.equal(s_words, s_before):
            raise AssertionError(f"{name}: plane {p} of the source was written")
    return seconds


AUTO = "kvcopy auto"


def _methods(
    src: PagedKV,
    src_ids: torch.Tensor,
    dst: PagedKV,
    dst_ids: torch.Tensor,
    device: torch.device,
    *,
    with_auto: bool = False,
) -> dict[str, Callable[[], object]]:
    """Every kvcopy method that can run here (and with ``with_auto`` what "auto" picks, with the default
    profile), then the baselines, as calls to time."""
    calls: dict[str, Callable[[], object]] = {}
    if with_auto:
        calls[AUTO] = functools.partial(copy_blocks, src, src_ids, dst, dst_ids)
    for method in available_methods(src, dst):
        if method == "torch":
            continue  # the per-layer index loop below is the same code
        if method == "triton" and _ext.TRITON_INTERPRET:
            continue  # the interpreter is a test mode, not a copy method worth timing
        calls[f"kvcopy {method}"] = functools.partial(copy_blocks, src, src_ids, dst, dst_ids, method=method)
    calls[PER_LAYER_LOOP] = functools.partial(
        per_layer_index_loop, src, src_ids.to(src.device), dst, dst_ids.to(dst.device)
    )
    if src_ids.numel() * src.num_planes <= MAX_PYTHON_LOOP_COPIES:
        calls[PER_BLOCK_LOOP] = functools.partial(per_block_copy_loop, src, src_ids.tolist(), dst, dst_ids.tolist())
    if device.type == "cuda" and has_dma_baselines():
        for name in DMA_BASELINES:
            calls[name] = dma_baseline(name, src, src_ids, dst, dst_ids, device)
    return calls


def _id_sets(
    cache_blocks: int, host_blocks: int, n: int, num_sets: int, pattern: str, generator: torch.Generator
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_sets`` pairs of (cache ids, host ids), CPU int64: random draws, or for "sequential" one run of
    adjacent ids on each side, the sets' runs disjoint."""
    if pattern == "random":
        return [
            (
                torch.randperm(cache_blocks, generator=generator)[:n],
                torch.randperm(host_blocks, generator=generator)[:n],
            )
            for _ in range(num_sets)
        ]
    return [
        (torch.arange(cache_blocks - (k + 1) * n, cache_blocks - k * n), torch.arange(k * n, (k + 1) * n))
        for k in range(num_sets)
    ]


@dataclass
class _Point:
    suite: str
    workload: str
    kv: PagedKV
    host: HostKVPool
    num_blocks: int


def _time_point(
    point: _Point, config: BenchConfig, generator: torch.Generator, profile: Profile | None
) -> list[BenchRow]:
    kv, host, n, device = point.kv, point.host, point.num_blocks, config.device
    nbytes = n * kv.nbytes_per_block
    num_sets = max(
        1,
        min(
            MAX_ID_SETS,
            -(-COLD_BYTES // nbytes),
            host.num_blocks // n,
            kv.num_blocks // (CACHE_BLOCKS_PER_MOVED_BLOCK * n),
        ),
    )
    id_sets = _id_sets(kv.num_blocks, host.num_blocks, n, num_sets, config.ids, generator)
    # Contiguous limit: num_sets slices of the same bytes, on the device and in the (pinned) host pool.
    flat = torch.empty(num_sets * nbytes, dtype=torch.uint8, device=device).fill_(0x5A)  # touched: no zero pages
    flats = [(flat[k * nbytes :][:nbytes], host.buffer[k * nbytes :][:nbytes]) for k in range(num_sets)]
    rows = []
    for direction in ("gather", "scatter"):
        gather = direction == "gather"
        src, dst = (kv, host.paged) if gather else (host.paged, kv)
        pairs = [(c, h) if gather else (h, c) for c, h in id_sets]  # (src ids, dst ids) per set
        calls = {LIMIT: [contiguous_copy(*(pair if gather else pair[::-1])) for pair in flats]}
        for s_ids, d_ids in pairs:
            for method, fn in _methods(src, s_ids, dst, d_ids, device, with_auto=point.suite == "fixed_cost").items():
                calls.setdefault(method, []).append(fn)
        link = direction_of(src.device.type, dst.device.type)
        # Checked on the first ids that fit MAX_CHECKED_BYTES: all of them unless the call is larger.
        checked = max(1, min(n, MAX_CHECKED_BYTES // kv.nbytes_per_block))
        check_ids = (pairs[0][0][:checked], pairs[0][1][:checked])
        check_calls = _methods(src, check_ids[0], dst, check_ids[1], device) if checked < n else {}
        whole = kv.num_blocks * kv.nbytes_per_block <= MAX_WHOLE_CHECKED_BYTES
        # Every method checked before any is timed: one copy of the caches serves each check (a timing
        # writes other ids' blocks, after which the caches would have to be copied again).
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        checked_s = {
            method: check_output(
                f"{point.workload} {direction} {method}",
                check_calls.get(method, fns[0]),
                src,
                check_ids[0],
                dst,
                check_ids[1],
                whole=whole,
                kept=kept,
            )
            * n
            / checked
            for method, fns in calls.items()
            if method != LIMIT
        }
        del kept
        for method, fns in calls.items():
            one_call = seconds_to_completion(fns[0], (src.device, dst.device)) if method == LIMIT else checked_s[method]
            slow = one_call > SLOW_CALL_S
            # Warm-up visits every set: first touches of fresh host pages are not the copy's cost.
            warmup = 1 if slow else max(config.warmup, len(fns))
            repeats = min(config.repeats, SLOW_ROW_REPEATS) if slow else config.repeats
            timing = measure(
                cycling(fns), warmup=warmup, repeats=repeats, device=device if device.type == "cuda" else None
            )
            rows.append(
                BenchRow(
                    point.suite,
                    point.workload,
                    direction,
                    config.ids,
                    method,
                    n,
                    kv.num_planes,
                    kv.nbytes_per_block,
                    timing.median,
                    timing.p20,
                    timing.p80,
                    timing.repeats,
                    _predicted(profile, link, method, nbytes, n, kv.num_planes),
                )
            )
    return rows


def _predicted(profile: Profile | None, link: str, method: str, nbytes: int, n: int, planes: int) -> float | None:
    if profile is None or not method.startswith("kvcopy "):
        return None
    try:
        return profile.predict(link, nbytes, num_blocks=n, method=method.removeprefix("kvcopy "), planes=planes)
    except ValueError:  # not measured by that calibration
        return None


def _plan(config: BenchConfig) -> list[tuple[str, Workload, int]]:
    """(suite, workload, blocks per call) of every point, in the order they are timed."""
    plan = [("workloads", WORKLOADS[name], config.blocks) for name in config.workloads]
    plan += [("count_sweep", WORKLOADS[DEFAULT_WORKLOAD], n) for n in sorted(config.counts)]
    plan += [
        (
            "size_sweep",
            Workload(
                f"llama8b-{tokens}",
                f"Llama-3.1-8B's cache at {tokens} tokens per block",
                llama8b_with_block_tokens(tokens),
            ),
            config.sweep_blocks,
        )
        for tokens in sorted(config.block_tokens)
    ]
    plan += [("fixed_cost", TINY_PLANES, 1), ("fixed_cost", ONE_PLANE_32K, 1)] if config.fixed_cost else []
    return plan


def _cache_and_pool(workload: Workload, moved: int, device: torch.device) -> tuple[PagedKV, HostKVPool]:
    """A cache and a host pool with room for ``moved`` blocks per call, and for calls that cycle over
    COLD_BYTES; the cache holds at least the workload's ``cache_bytes``."""
    block_bytes = workload.build(1, device).nbytes_per_block
    room = max(moved, -(-COLD_BYTES // block_bytes))
    cache_blocks = max(CACHE_BLOCKS_PER_MOVED_BLOCK * room, -(-(workload.cache_bytes or 0) // block_bytes))
    kv = workload.build(cache_blocks, device)
    return kv, HostKVPool(kv, room)


def _points(config: BenchConfig) -> Iterator[_Point]:
    """The plan's points. Consecutive points of one suite and workload (the count sweep) share one cache,
    sized for the largest; each cache is dropped before the next one is built."""
    for (suite, _), group in itertools.groupby(_plan(config), key=lambda point: (point[0], point[1].name)):
        points = list(group)
        workload = points[0][1]
        kv, host = _cache_and_pool(workload, max(n for _, _, n in points), config.device)
        for _, _, n in points:
            yield _Point(suite, workload.name, kv, host, n)
        del kv, host
        gc.collect()  # a HostKVPool's buffer and region refer to each other: free its pinned memory now


def point_specs(config: BenchConfig) -> list[tuple[str, str, int]]:
    """(suite, workload, blocks per call) of every point, in the order :func:`run_benchmarks` times them."""
    return [(suite, workload.name, n) for suite, workload, n in _plan(config)]


def num_points(config: BenchConfig) -> int:
    """How many points :func:`run_benchmarks` times (for a progress bar)."""
    return len(point_specs(config))


def run_benchmarks(
    config: BenchConfig, *, profile: Profile | None = None, on_point: Callable[[list[BenchRow]], None] | None = None
) -> list[BenchRow]:
    """Runs every point of ``config``; returns all rows. ``profile``: also record its predictions for kvcopy rows.

    ``on_point`` is called with each point's rows as they are measured (progress, streaming output).
    """
    with torch.cuda.device(config.device) if config.device.type == "cuda" else contextlib.nullcontext():
        return _run(config, profile, on_point)


def _run(
    config: BenchConfig, profile: Profile | None, on_point: Callable[[list[BenchRow]], None] | None
) -> list[BenchRow]:
    generator = torch.Generator().manual_seed(0)
    rows: list[BenchRow] = []
    for point in _points(config):
        point_rows = _time_point(point, config, generator, profile)
        rows += point_rows
        del point  # before the next point's cache is built
        if on_point is not None:
            on_point(point_rows)
    return rows
