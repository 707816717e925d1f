"""benchmarks/bench_agents.py runs end to end in its --quick configuration (3 sessions of 3 turns, the tests' tiny
model, gaps under a second) through all five arms and the no-pause trace, and reports their structure: every arm's
rows by gap bucket, its counters, its fraction of the oracle's gain, the machine and its load; never how fast
anything was."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SUBPROCESS_TIMEOUT_S

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
ARMS = ("vllm_fs_lru", "kvcopy_off", "kvcopy_learned", "kvcopy_hints", "oracle")
BUCKETS = ("<1s", "1-10s", "10-60s", ">60s")
QUICK_SESSIONS, QUICK_TURNS = 3, 3  # bench_agents.QUICK
RESUMES = QUICK_SESSIONS * (QUICK_TURNS - 1)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[dict, str]:
    """The bench's --quick run: its rows by (kind, arm, metric, bucket) and its text report."""
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs it)")
    pytest.importorskip("nixl_cu13", reason="NIXL is part of the test install (pip install 'kvcopy[nixl]')")
    tmp = tmp_path_factory.mktemp("bench_agents")
    out, txt = tmp / "agents.csv", tmp / "agents.txt"
    result = subprocess.run(
        [sys.executable, "benchmarks/bench_agents.py", "--quick", "--dir", str(tmp / "d"), "--csv", str(out),
         "--txt", str(txt)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    rows = {(r["kind"], r["arm"], r["metric"], r["bucket"]): r for r in csv.DictReader(out.open())}
    assert not list((tmp / "d").iterdir()), "the bench left its tiers behind"
    return rows, txt.read_text()


def test_every_arm_reports_its_resumes_by_bucket_with_the_machine(quick_run):
    rows, text = quick_run
    for arm in ARMS:
        counted = sum(int(rows[("resume", arm, "ttft_p50", bucket)]["samples"]) for bucket in BUCKETS)
        assert counted == RESUMES, arm  # every resume in one bucket
        assert int(rows[("resume", arm, "ttft_mean", "all")]["samples"]) == RESUMES
        assert float(rows[("resume", arm, "ttft_mean", "all")]["value"]) > 0
        for metric in ("tokens_recomputed", "disk_read_bytes", "prefetched_wasted_bytes", "host_leased_byte_s"):
            assert float(rows[("arm", arm, metric, "")]["value"]) >= 0, (arm, metric)
    assert all(r["host_cpu"] and r["host_cores"] and r["load_avg_1min"] for r in rows.values())
    assert "load average at start" in text and "llama-3.1-8b on an H200" in text and "truncated at 0.5 s" in text


def test_the_text_has_one_fraction_line_per_arm_and_the_oracle_is_one(quick_run):
    _, text = quick_run
    lines = [line.split() for line in text.splitlines() if line.startswith("fraction_of_oracle_gain ")]
    assert [words[1] for words in lines] == list(ARMS)
    fractions = {words[1]: float(words[2]) for words in lines}
    assert fractions["vllm_fs_lru"] == 0.0 or str(fractions["vllm_fs_lru"]) == "nan"  # (LRU - LRU) / gain
    assert fractions["oracle"] == 1.0 or str(fractions["oracle"]) == "nan"
    assert sum(line.startswith("no_pause ") for line in text.splitlines()) == len(ARMS)


def test_only_the_agents_arms_lease_and_count_pauses(quick_run):
    rows, _ = quick_run
    for arm in ("vllm_fs_lru", "kvcopy_off"):
        assert float(rows[("arm", arm, "host_leased_byte_s", "")]["value"]) == 0
        assert not [key for key in rows if key[0] == "counter" and key[1] == arm]
        assert int(rows[("forecast", arm, "resumes_in_10_90_band", "")]["samples"]) == 0
    for arm in ("kvcopy_hints", "oracle"):
        # each session's last turn says done (the last one may end after the stats' last collection)
        assert 0 < float(rows[("counter", arm, "pauses:done", "")]["value"]) <= QUICK_SESSIONS
        assert 0 < int(rows[("forecast", arm, "resumes_in_10_90_band", "")]["samples"]) <= RESUMES
    resumes = [key for key in rows if key[:2] == ("counter", "kvcopy_learned") and key[2].startswith("resumes:")]
    assert resumes  # the learned arm found resumes by prefix continuation
    assert not [key for key in rows if key[:2] == ("counter", "kvcopy_learned") and key[2] == "pauses:done"]
