"""The benchmark scripts run end to end on a small size, and check what they time.

bench_copy verifies every timed row's output against plain indexing before
timing it (an AssertionError fails the script); here it runs on 4 blocks.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("workload", "ids"), [
    ("llama8b-16", "random"), ("llama8b-16", "sequential"), ("llama70b-tp4-16", "random"),
    ("deepseek-v3-mla-64", "random"), ("llama8b-fp8-16", "random"),
])
def test_bench_copy_runs_and_checks_its_rows(tmp_path: Path, workload: str, ids: str) -> None:
    out = tmp_path / "copy.csv"
    result = _run("benchmarks/bench_copy.py", "--workload", workload, "--ids", ids, "--blocks", "3", "--repeats", "1",
                  "--csv", str(out))
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(out.open()))
    methods = {(r["direction"], r["method"]) for r in rows}
    for direction in ("gather", "scatter"):
        assert {(direction, "kvcopy cpu"), (direction, "per-block copy_ loop")} <= methods
    assert all(float(r["gbps"]) > 0 for r in rows if r["direction"] != "fixed_cost")
    assert "fixed cost per call" in result.stdout


def test_bench_overlap_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "overlap.csv"
    result = _run("benchmarks/bench_overlap.py", "--blocks", "4", "--rounds", "1", "--csv", str(out))
    assert result.returncode == 0, result.stderr
    rows = list(csv.DictReader(out.open()))
    assert [r["method"] for r in rows][:1] == ["solo"] and float(rows[0]["compute_throughput"]) > 0
