"""benchmarks/bench_disk_growth.py runs end to end in its --quick configuration (32 MiB of 2 MiB chunks, one
round) and reports each case: a store made at full size grows never, a growing one does, from free room and by
taking another identity's chunks; the structure of its rows, never how fast anything was."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcopy.tools.bench import IDENTITY_COLUMNS

from helpers import SUBPROCESS_TIMEOUT_S

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
CASES = ("full size", "growing", "growing, taking")


def test_bench_disk_growth_quick_reports_each_case(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs it)")
    pytest.importorskip("nixl_cu13", reason="NIXL is part of the test install (pip install 'kvcopy[nixl]')")
    out, txt = tmp_path / "growth.csv", tmp_path / "growth.txt"
    args = ["--quick", "--dir", str(tmp_path / "d"), "--csv", str(out), "--txt", str(txt)]
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_disk_growth.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        env={**os.environ, "PYTHONPATH": str(ROOT)},  # (the checkout's kvcopy, as the bench says to run it)
    )
    assert result.returncode == 0, result.stderr[-4000:]
    with out.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["case"] for r in rows] == list(CASES)
    assert set(IDENTITY_COLUMNS) <= set(rows[0])
    by_case = {r["case"]: r for r in rows}
    assert all(int(r["chunks"]) == 16 and int(r["chunk_bytes"]) == 2 << 20 for r in rows)
    assert float(by_case["full size"]["growths"]) == 0  # backed whole before the first cascade
    assert float(by_case["growing"]["growths"]) > 0 and float(by_case["growing, taking"]["growths"]) > 0
    assert float(by_case["full size"]["x_full_size"]) == 1.0
    assert all(float(r["gbps_median"]) > 0 for r in rows)
    assert txt.read_text().splitlines()[4].startswith("full size")
    assert not any((tmp_path / "d").glob("growth-*"))  # every case's path removed
