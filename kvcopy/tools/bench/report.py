"""Benchmark rows as ratios, terminal tables and a CSV that names the machine they came from."""

from __future__ import annotations

import csv
import math
import os
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from kvcopy.tools.bench.runner import LIMIT, PER_BLOCK_LOOP, PER_BLOCK_MEMCPY, PER_LAYER_LOOP, BenchRow
from kvcopy.tools.bench.workloads import MIXED_PLANE_WORKLOADS

__all__ = ["CSV_COLUMNS", "IDENTITY_COLUMNS", "CsvWriter", "format_tables", "read_csv", "with_ratios", "write_csv"]

IDENTITY_COLUMNS = (
    "device",
    "device_name",
    "capability",
    "host_cpu",
    "host_cores",
    "torch_threads",
    "torch",
    "cuda",
    "driver",
    "kvcopy",
    "extension",
    "date",
)
MEASURED_COLUMNS = (
    "suite",
    "workload",
    "direction",
    "ids",
    "method",
    "num_blocks",
    "num_planes",
    "block_bytes",
    "plane_block_bytes",
    "bytes",
    "median_s",
    "p20_s",
    "p80_s",
    "repeats",
    "gbps",
    "x_limit",
    "x_per_block_memcpy",
    "x_per_block_loop",
    "x_layer_loop",
    "predicted_s",
    "prediction_error",
)
CSV_COLUMNS = MEASURED_COLUMNS + IDENTITY_COLUMNS
_TEXT_COLUMNS = {"suite", "workload", "direction", "ids", "method"} | set(IDENTITY_COLUMNS)


def _point_key(row: BenchRow) -> tuple:
    return row.suite, row.workload, row.direction, row.ids, row.num_blocks, row.block_bytes


def with_ratios(rows: Sequence[BenchRow]) -> list[dict[str, Any]]:
    """Each row as a dict of MEASURED_COLUMNS, with ratios against the rows of the same point.

    ``x_limit``: GB/s over the contiguous copy's; ``x_per_block_memcpy``,
    ``x_per_block_loop``, ``x_layer_loop``: how many times faster than that
    baseline (NaN where the point has no such row); ``prediction_error``:
    predicted over measured time, minus one.
    """
    by_point: dict[tuple, dict[str, BenchRow]] = defaultdict(dict)
    for row in rows:
        by_point[_point_key(row)][row.method] = row
    out = []
    for row in rows:
        point = by_point[_point_key(row)]

        def speedup(baseline: str, row: BenchRow = row, point: dict = point) -> float:
            return point[baseline].median_s / row.median_s if baseline in point else math.nan

        limit = point.get(LIMIT)
        out.append(
            {
                "suite": row.suite,
                "workload": row.workload,
                "direction": row.direction,
                "ids": row.ids,
                "method": row.method,
                "num_blocks": row.num_blocks,
                "num_planes": row.num_planes,
                "block_bytes": row.block_bytes,
                "plane_block_bytes": row.plane_block_bytes,
                "bytes": row.bytes,
                "median_s": row.median_s,
                "p20_s": row.p20_s,
                "p80_s": row.p80_s,
                "repeats": row.repeats,
                "gbps": row.gbps,
                "x_limit": row.gbps / limit.gbps if limit else math.nan,
                "x_per_block_memcpy": speedup(PER_BLOCK_MEMCPY),
                "x_per_block_loop": speedup(PER_BLOCK_LOOP),
                "x_layer_loop": speedup(PER_LAYER_LOOP),
                "predicted_s": row.predicted_s if row.predicted_s is not None else math.nan,
                "prediction_error": row.predicted_s / row.median_s - 1 if row.predicted_s is not None else math.nan,
            }
        )
    return out


def _ratio(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def _workload_table(
    rows: list[dict[str, Any]], has_memcpy: bool, has_prediction: bool, uniform_planes: bool
) -> list[str]:
    first = rows[0]
    mean = "" if uniform_planes else ", mean"
    lines = [
        f"\n{first['workload']}: {first['num_blocks']} {first['ids']} blocks x {first['num_planes']} planes "
        f"({first['plane_block_bytes'] / 1024:g} KiB plane-blocks{mean}) = {first['bytes'] / 1e6:.1f} MB per call"
    ]
    columns = [("direction", 9), ("method", 27), ("GB/s", 8), ("p20-p80", 13), ("x limit", 8)]
    columns += [("x memcpy loop", 13)] if has_memcpy else []
    columns += [("x block loop", 12), ("x layer loop", 12)]
    columns += [("pred. err", 10)] if has_prediction else []
    header = " ".join(f"{name:<{w}}" if i < 2 else f"{name:>{w}}" for i, (name, w) in enumerate(columns))
    lines += [header, "-" * len(header)]
    for r in rows:
        spread = f"{r['bytes'] / r['p80_s'] / 1e9:.1f}-{r['bytes'] / r['p20_s'] / 1e9:.1f}"
        cells = [
            f"{r['direction']:<9}",
            f"{r['method']:<27}",
            f"{r['gbps']:8.2f}",
            f"{spread:>13}",
            f"{_ratio(r['x_limit']):>8}",
        ]
        cells += [f"{_ratio(r['x_per_block_memcpy']):>13}"] if has_memcpy else []
        cells += [f"{_ratio(r['x_per_block_loop']):>12}", f"{_ratio(r['x_layer_loop']):>12}"]
        if has_prediction:
            error = r["prediction_error"]
            cells.append(f"{'-' if math.isnan(error) else f'{error:+.0%}':>10}")
        lines.append(" ".join(cells))
    return lines


def _sweep_table(rows: list[dict[str, Any]], suite: str) -> list[str]:
    x_name, x_of = (
        ("blocks", lambda r: str(r["num_blocks"]))
        if suite == "count_sweep"
        else ("KiB/plane-block", lambda r: f"{r['plane_block_bytes'] / 1024:g}")
    )
    first = rows[0]
    what = (
        f"llama8b-16, 64 planes, {first['ids']} ids, GB/s by blocks per call"
        if suite == "count_sweep"
        else f"Llama-3.1-8B cache, {first['num_blocks']} {first['ids']} blocks, GB/s by plane-block size"
    )
    lines = [f"\n{suite}: {what}"]
    xs = list(dict.fromkeys(x_of(r) for r in rows))
    for direction in dict.fromkeys(r["direction"] for r in rows):
        mine = [r for r in rows if r["direction"] == direction]
        header = f"{direction + ' / ' + x_name:<35}" + "".join(f"{x:>9}" for x in xs)
        lines += [header, "-" * len(header)]
        methods = list(dict.fromkeys(r["method"] for r in mine))
        for method in methods:
            by_x = {x_of(r): r["gbps"] for r in mine if r["method"] == method}
            lines.append(f"{method:<35}" + "".join(f"{by_x[x]:9.2f}" if x in by_x else f"{'-':>9}" for x in xs))
        for method in (m for m in methods if m.startswith("kvcopy ")):  # the same rows as fractions of the limit
            by_x = {x_of(r): r["x_limit"] for r in mine if r["method"] == method}
            lines.append(
                f"{method + ' x limit':<35}"
                + "".join(f"{_ratio(by_x[x]):>9}" if x in by_x else f"{'-':>9}" for x in xs)
            )
    return lines


def format_tables(rows: Sequence[BenchRow], identity: dict[str, Any]) -> str:
    """The terminal report: one table per workload, one per sweep, then the fixed cost of a call."""
    ratios = with_ratios(rows)
    has_memcpy = any(not math.isnan(r["x_per_block_memcpy"]) for r in ratios)
    has_prediction = any(not math.isnan(r["predicted_s"]) for r in ratios)
    lines = [
        f"kvcopy bench on {identity.get('device_name')} ({identity.get('device')}; "
        f"host {identity.get('host_cpu')}, "
        f"{identity.get('torch_threads')} threads; torch {identity.get('torch')}, "
        f"{'CUDA ' + str(identity['cuda']) if identity.get('cuda') else 'no CUDA'}), "
        f"{identity.get('date')}",
        "x limit: GB/s over one contiguous copy of the same bytes; x ... loop: times faster than that baseline",
    ]
    if has_prediction:
        lines.append(
            "pred. err: the calibration profile's predicted time over the measured one, minus 1 "
            "(+10% predicts 10% too slow, -10% too fast)"
        )
    workloads = [r for r in ratios if r["suite"] == "workloads"]
    for name in dict.fromkeys(r["workload"] for r in workloads):
        lines += _workload_table(
            [r for r in workloads if r["workload"] == name],
            has_memcpy,
            has_prediction,
            uniform_planes=name not in MIXED_PLANE_WORKLOADS,
        )
    for suite in ("count_sweep", "size_sweep"):
        mine = [r for r in ratios if r["suite"] == suite]
        if mine:
            lines += _sweep_table(mine, suite)
    fixed = [r for r in ratios if r["suite"] == "fixed_cost"]
    for name in dict.fromkeys(r["workload"] for r in fixed):
        mine = [r for r in fixed if r["workload"] == name]
        limits = {r["direction"]: r["median_s"] for r in mine if r["method"] == LIMIT}
        lines += [
            f"\nfixed cost ({name}): microseconds per 1-block call of {mine[0]['num_planes']} plane(s) x "
            f"{mine[0]['plane_block_bytes']} B (median, p20-p80), and times the limit (one copy_ of the "
            f"same bytes)"
        ]
        for r in mine:
            over = r["median_s"] / limits[r["direction"]] if limits.get(r["direction"]) else float("nan")
            lines.append(
                f"  {r['direction']:<8} {r['method']:<27} {r['median_s'] * 1e6:8.1f}   "
                f"{r['p20_s'] * 1e6:.1f}-{r['p80_s'] * 1e6:.1f}   {over:5.1f}x"
            )
    return "\n".join(lines)


class CsvWriter:
    """Writes rows as they are measured: the header at once, then each point's rows, flushed.

    A run cut short (a time limit on a lent GPU) leaves every finished point
    in the file. Ratios are within a point, so a point's rows are written together.
    """

    def __init__(self, path: str | os.PathLike[str], identity: dict[str, Any]) -> None:
        self._machine = {key: identity.get(key, "") for key in IDENTITY_COLUMNS}
        self._file = open(path, "w", newline="")  # noqa: SIM115 - closed by close()
        self._writer = csv.DictWriter(self._file, fieldnames=CSV_COLUMNS)
        self._writer.writeheader()
        self._file.flush()

    def write(self, rows: Sequence[BenchRow]) -> None:
        for row in with_ratios(rows):
            self._writer.writerow(
                {**{k: "" if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}, **self._machine}
            )
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> CsvWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def write_csv(rows: Sequence[BenchRow], identity: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Every row with its ratios (MEASURED_COLUMNS) and the machine identity (IDENTITY_COLUMNS)."""
    with CsvWriter(path, identity) as writer:
        writer.write(rows)


def read_csv(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Rows written by :func:`write_csv`: numbers as floats (NaN where empty), text and identity as strings."""
    with open(path, newline="") as f:
        return [
            {k: v if k in _TEXT_COLUMNS else (float(v) if v != "" else math.nan) for k, v in row.items()}
            for row in csv.DictReader(f)
        ]
