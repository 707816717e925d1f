"""examples/disk_prefix_cache.py end to end: an engine's prefix cache written by one process and used by
another, bitwise, and refused to another model (the issue [disk]'s "an engine uses it")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SUBPROCESS_TIMEOUT_S

pytest.importorskip("nixl_cu13", reason="the disk store needs the nixl extra (pip install 'kvcopy[nixl]')")
pytest.importorskip("transformers", reason="the transformers extra is part of the test install")

ROOT = Path(__file__).resolve().parents[1]
# The committed CPU profile with a disk link: the example then skips its own calibration (about 15 s).
PROFILE = ROOT / "results" / "profile_cpu_disk.json"


def _example(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "examples/disk_prefix_cache.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    result.described = (
        f"exit {result.returncode}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    )
    return result


@pytest.mark.slow
def test_a_prefix_saved_by_one_process_is_reused_by_the_next(tmp_path):
    store = str(tmp_path / "cache")
    served = _example("serve", "--store", store)
    assert served.returncode == 0, served.described
    assert "32 blocks (512 tokens)" in served.stdout and "saved in 1 NIXL descriptor(s)" in served.stdout
    again = _example("serve", "--store", store)  # a second run of the server: the prefix is already held
    assert again.returncode == 0 and "already held" in again.stdout, again.described

    resumed = _example("resume", "--store", store, "--profile", str(PROFILE))
    assert resumed.returncode == 0, resumed.described  # it exits 1 when the KV or the answer differ
    assert "matched 32 blocks (512 of 552 tokens)" in resumed.stdout
    assert "KV read back equals a fresh prefill bitwise: True; same answer: True" in resumed.stdout
    assert "planner says" in resumed.stdout and "read from disk, reload, prefill the rest:" in resumed.stdout

    other = _example("resume", "--store", store, "--profile", str(PROFILE), "--seed", "1")  # other weights
    assert other.returncode == 2, other.described
    assert "the store is not this model's: cache_key:" in other.stdout
