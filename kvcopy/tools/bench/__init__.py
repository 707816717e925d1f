"""kvcopy's benchmark: every kvcopy method beside the copies a user would otherwise write, in one run.

``kvcopy bench`` runs :meth:`BenchConfig.default`; from Python::

    from kvcopy.tools.bench import BenchConfig, run_benchmarks, format_tables, write_csv
    from kvcopy.calibration.machine import machine_identity

    config = BenchConfig.default("cuda")
    rows = run_benchmarks(config)
    identity = machine_identity(config.device)
    print(format_tables(rows, identity))
    write_csv(rows, identity, "bench.csv")

Rows report medians with p20/p80 (kvcopy.calibration.timing) and, as ratios, how each
method compares with one contiguous copy of the same bytes (the limit) and
with the baselines (kvcopy.tools.bench.baselines). Each row's output is checked
against plain indexing before it is timed (a call over 1 GiB on its first
ids).
"""

from kvcopy.tools.bench.report import (
    CSV_COLUMNS,
    IDENTITY_COLUMNS,
    CsvWriter,
    format_tables,
    read_csv,
    with_ratios,
    write_csv,
)
from kvcopy.tools.bench.runner import (
    LIMIT,
    BenchConfig,
    BenchRow,
    check_output,
    num_points,
    point_specs,
    run_benchmarks,
)
from kvcopy.tools.bench.workloads import DEFAULT_WORKLOAD, WORKLOADS, Workload

__all__ = [
    "CSV_COLUMNS",
    "DEFAULT_WORKLOAD",
    "IDENTITY_COLUMNS",
    "LIMIT",
    "WORKLOADS",
    "BenchConfig",
    "BenchRow",
    "CsvWriter",
    "Workload",
    "check_output",
    "format_tables",
    "num_points",
    "point_specs",
    "read_csv",
    "run_benchmarks",
    "with_ratios",
    "write_csv",
]
