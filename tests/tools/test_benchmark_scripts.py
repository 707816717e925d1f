"""The benchmark scripts run end to end on a small size, and check what they time.

bench_copy.py is ``kvcopy bench`` run from a checkout: it verifies every timed
row's output against plain indexing before timing it (an AssertionError fails
the script); here it runs on 3 blocks. device_check.sh walks its steps on the
CPU (--dry-run), and unpack_wheelhouse.py unpacks only what is missing.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvcopy.tools.bench import CSV_COLUMNS, IDENTITY_COLUMNS, LIMIT, read_csv

from helpers import HANG_TIMEOUT_S, HAS_CUDA, SUBPROCESS_TIMEOUT_S
from helpers.netns import NetnsUnavailable, netns_link

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
ROW_METHODS = {LIMIT, "kvcopy cpu", "per-layer index loop", "per-block copy_ loop"}
# The smallest bench_copy run: workloads only, one repeat.
SMALL = ("--device", "cpu", "--quick", "--no-sweeps", "--blocks", "3", "--repeats", "1", "--no-progress")


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, env=env
    )


def _describe(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("workload", "ids"),
    [
        ("llama8b-16", "random"),
        ("llama8b-16", "sequential"),
        ("llama70b-tp4-16", "random"),
        ("deepseek-v3-mla-64", "random"),
        ("llama8b-fp8-16", "random"),
    ],
)
def test_bench_copy_runs_and_checks_its_rows(tmp_path: Path, workload: str, ids: str) -> None:
    out = tmp_path / "copy.csv"
    result = _run("benchmarks/bench_copy.py", *SMALL, "--workload", workload, "--ids", ids, "--csv", str(out))
    assert result.returncode == 0, _describe(result)
    assert f"{workload}: 3 {ids} blocks" in result.stdout
    assert "fixed cost" not in result.stdout  # --no-sweeps
    with out.open(newline="") as f:
        assert next(csv.reader(f)) == list(CSV_COLUMNS)
    rows = read_csv(out)
    assert {(r["suite"], r["workload"], r["ids"], r["num_blocks"]) for r in rows} == {("workloads", workload, ids, 3)}
    for direction in ("gather", "scatter"):
        assert {r["method"] for r in rows if r["direction"] == direction} >= ROW_METHODS
    assert all(r["gbps"] > 0 and r["p20_s"] <= r["median_s"] <= r["p80_s"] for r in rows)
    assert all(r["device"] == "cpu" and r["kvcopy"] for r in rows)


@pytest.mark.slow
def test_bench_copy_sweeps_fixed_cost_and_plot(tmp_path: Path) -> None:
    out, plot = tmp_path / "copy.csv", tmp_path / "copy.png"
    result = _run(
        "benchmarks/bench_copy.py",
        "--device",
        "cpu",
        "--quick",
        "--workload",
        "llama8b-16",
        "--blocks",
        "2",
        "--repeats",
        "1",
        "--counts",
        "1,2",
        "--block-tokens",
        "1",
        "--sweep-blocks",
        "2",
        "--no-progress",
        "--csv",
        str(out),
        *(("--plot", str(plot)) if HAS_MATPLOTLIB else ()),
    )
    assert result.returncode == 0, _describe(result)
    assert "count_sweep:" in result.stdout and "size_sweep:" in result.stdout and "fixed cost" in result.stdout
    rows = read_csv(out)
    assert {r["suite"] for r in rows} == {"workloads", "count_sweep", "size_sweep", "fixed_cost"}
    assert sorted({r["num_blocks"] for r in rows if r["suite"] == "count_sweep"}) == [1, 2]
    if HAS_MATPLOTLIB:
        assert f"plot saved to {plot}" in result.stdout
        assert plot.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.slow
def test_bench_copy_help_lists_the_options() -> None:
    result = _run("benchmarks/bench_copy.py", "--help")
    assert result.returncode == 0, _describe(result)
    for option in ("--quick", "--no-sweeps", "--workload", "--ids", "--blocks", "--repeats", "--csv", "--plot"):
        assert option in result.stdout


@pytest.mark.slow
def test_bench_overlap_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "overlap.csv"
    result = _run("benchmarks/bench_overlap.py", "--blocks", "4", "--rounds", "1", "--csv", str(out))
    assert result.returncode == 0, _describe(result)
    rows = list(csv.DictReader(out.open()))
    assert [r["method"] for r in rows][:1] == ["solo"] and float(rows[0]["compute_throughput"]) > 0
    assert all(r["device"] == "cpu" and r["host_cpu"] for r in rows)


@pytest.mark.slow
def test_bench_call_overhead_reports_each_call_against_the_bare_copy(tmp_path: Path) -> None:
    out = tmp_path / "overhead.txt"
    result = _run("benchmarks/bench_call_overhead.py", "--rounds", "1", "--calls", "20", "--out", str(out))
    assert result.returncode == 0, _describe(result)
    lines = out.read_text().splitlines()
    assert "target: at most 2x the bare copy_" in lines[1]
    names = [line.split("  ")[1].strip() for line in lines[2:]]
    assert names == ["torch copy_ (bare)", 'kvcopy.gather method="cpu"', 'kvcopy.gather method="auto" + profile']
    assert lines[2].rstrip().endswith("1.0x")  # the bare copy_ is the unit; the others are not judged here


@pytest.mark.slow
def test_bench_remote_checks_and_reports_each_way(tmp_path: Path) -> None:
    pytest.importorskip("nixl_cu13", reason="the remote bench needs the nixl extra (pip install 'kvcopy[nixl]')")
    out = tmp_path / "remote.csv"
    result = _run("benchmarks/bench_remote.py", "--sizes", "2", "--blocks", "8", "--repeats", "1", "--csv", str(out))
    assert result.returncode == 0, _describe(result)  # it exits non-zero when a block's bytes differ
    rows = list(csv.DictReader(out.open()))
    assert [r["method"] for r in rows] == ["contiguous (limit)", "kvcopy read", "per-block NIXL loop"]
    assert [int(r["descriptors"]) for r in rows] == [1, 8, 8]  # random page-first blocks: one range each
    assert all(r["link"].startswith("loopback") and r["host_cpu"] and float(r["gbps"]) > 0 for r in rows)


@pytest.mark.slow
def test_bench_remote_says_when_its_serving_process_dies(tmp_path: Path) -> None:
    pytest.importorskip("nixl_cu13", reason="the remote bench needs the nixl extra (pip install 'kvcopy[nixl]')")
    # 128 TiB plane-blocks: the serving process's pool (2 PiB, past any x86-64 process's address space, whatever
    # the kernel's overcommit policy) fails to allocate, and the process exits
    result = _run("benchmarks/bench_remote.py", "--sizes", str(1 << 37), "--blocks", "1", "--repeats", "1")
    assert result.returncode == 1, _describe(result)
    assert "the serving process is gone" in result.stderr, _describe(result)


@pytest.mark.slow
@pytest.mark.netns
def test_bench_remote_over_network_namespaces_crosses_the_shaped_link(tmp_path: Path) -> None:
    pytest.importorskip("nixl_cu13", reason="the remote bench needs the nixl extra (pip install 'kvcopy[nixl]')")
    try:
        with netns_link("250mbit"):
            pass
    except NetnsUnavailable as why:
        pytest.skip(f"this sandbox cannot make network namespaces: {why}")
    before = set(_namespaces())  # a namespace some earlier run left behind is not this run's
    out = tmp_path / "remote.csv"
    result = _run(
        "benchmarks/bench_remote.py", "--netns", "250mbit", "--sizes", "2", "--blocks", "8", "--repeats", "1",
        "--csv", str(out),
    )  # fmt: skip
    assert result.returncode == 0, _describe(result)  # it exits non-zero when a block's bytes differ
    rows = list(csv.DictReader(out.open()))
    assert [r["method"] for r in rows] == ["contiguous (limit)", "kvcopy read", "per-block NIXL loop"]
    assert all("veth pair shaped to 250mbit" in r["link"] for r in rows)
    crossed = float(rows[0]["transport"].split("x ")[0])
    assert crossed >= 1.0, rows[0]["transport"]  # every byte read crossed the veth (TCP adds its headers)
    # 128 KiB cannot cross a 250 Mbit/s link faster than the link (tbf's 64 KiB burst aside)
    assert all(0 < float(r["x_rate"]) < 2 for r in rows)
    left = {name for name in _namespaces() if name.startswith("kvcopy-")} - before
    assert not left, f"the run left namespaces behind: {sorted(left)}\n{result.stderr}"


@pytest.mark.slow
def test_bench_remote_over_network_namespaces_says_why_it_cannot(tmp_path: Path) -> None:
    pytest.importorskip("nixl_cu13", reason="the remote bench needs the nixl extra (pip install 'kvcopy[nixl]')")
    env = {**os.environ, "PATH": str(tmp_path)}  # no iproute2 on it (the script runs as sys.executable)
    result = _run("benchmarks/bench_remote.py", "--netns", "1gbit", "--sizes", "2", env=env)
    assert result.returncode == 1, _describe(result)
    assert "--netns: this machine cannot make network namespaces" in result.stderr
    assert "Traceback" not in result.stderr


def _namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    return [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]


@pytest.mark.slow
def test_bench_disk_checks_and_reports_each_way(tmp_path: Path) -> None:
    pytest.importorskip("nixl_cu13", reason="the disk bench needs the nixl extra (pip install 'kvcopy[nixl]')")
    out = tmp_path / "disk.csv"
    result = _run(
        "benchmarks/bench_disk.py",
        "--dir",
        str(tmp_path / "d"),
        "--sizes",
        "4",
        "--blocks",
        "8",
        "--repeats",
        "1",
        "--csv",
        str(out),
    )
    assert result.returncode == 0, _describe(result)  # it exits non-zero when a get reads back other bytes
    rows = list(csv.DictReader(out.open()))
    methods = {(r["op"], r["method"]): int(r["descriptors"]) for r in rows}
    assert methods[("write", "contiguous (limit)")] == 1 and methods[("read", "per-block pwrite/pread")] == 8
    assert methods[("read-random", "per-block, 8 threads")] == 8  # every op against every baseline
    assert 1 <= methods[("write", "kvcopy")] <= 8  # random pool ids: adjacent ones merged, at most one each
    assert all(r["host_cpu"] and r["filesystem"] and float(r["gbps"]) > 0 for r in rows)


@pytest.mark.slow
@pytest.mark.engine
def test_bench_engine_runs_every_path_on_the_cpu(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the transformers extra is part of the test install")
    out = tmp_path / "engine.csv"
    result = _run(
        "benchmarks/bench_engine.py",
        "--requests",
        "8",
        "--min-prompt",
        "32",
        "--max-prompt",
        "64",
        "--new-tokens",
        "16",
        "--hidden",
        "128",
        "--layers",
        "2",
        "--skip",
        "0",
        "--csv",
        str(out),
    )
    assert result.returncode == 0, _describe(result)
    rows = list(csv.DictReader(out.open()))
    assert [r["path"] for r in rows] == [
        "transformers soft reset",
        "transformers offload",
        "kvcopy offload",
        "kvcopy recompute",
        "kvcopy auto, static",
        "kvcopy auto",
    ]
    assert all(r["same_tokens"] == "True" and float(r["tokens_per_s"]) > 0 for r in rows)
    # kvcopy's rows judge the Planner: decisions made, and the error over the measured ones
    assert [r["decisions"] == "" for r in rows] == [True, True, False, False, False, False]
    judged = [r for r in rows[2:] if int(r["errors_measured"])]
    assert judged and all(0 <= float(r["error_median"]) <= float(r["error_p90"]) for r in judged)
    assert "error: |predicted for the path taken / measured - 1|" in result.stdout
    assert all(r["device"] == "cpu" and r["host_cpu"] for r in rows)
    assert "pin_memory dropped" in rows[1]["note"]


@pytest.mark.slow
@pytest.mark.engine
def test_transformers_example_runs_and_every_token_matches() -> None:
    pytest.importorskip("transformers", reason="the transformers extra is part of the test install")
    result = _run("examples/transformers_offload.py", "--requests", "10")
    assert result.returncode == 0, _describe(result)
    assert "MISMATCH" not in result.stdout
    for policy in ("offload", "recompute", "auto, static", "auto"):
        assert re.search(rf"policy {policy} *: .*tokens of 10/10 requests match", result.stdout), policy
    assert "error: |predicted for the path taken / measured - 1|" in result.stdout
    assert re.search(r"^req_\d+ +\d+ (reload|recompute) ", result.stdout, re.M)  # one line per decision


# --------------------------------------------------------------------------- device_check.sh


@pytest.mark.slow
def test_device_check_dry_run(tmp_path: Path) -> None:
    """Every step of the GPU check the CPU can walk: a staged build, collect the GPU tests, calibrate, plan, bench."""
    out = tmp_path / "out"
    env = dict(os.environ)
    env.update(
        PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""),
        KVCOPY_WHEELHOUSE=str(tmp_path / "no-wheelhouse"),  # this Python has what the check needs
        MPLCONFIGDIR=str(tmp_path / "mpl"),
        TMPDIR=str(tmp_path),
    )
    env.pop("PYTHON", None)
    result = subprocess.run(
        ["bash", "benchmarks/device_check.sh", "--dry-run", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert result.returncode == 0, _describe(result)
    assert "device_check: done" in result.stdout
    steps = re.findall(r"^== (\S+) \(", result.stdout, re.M)
    assert {"build", "staged", "calibrate", "plan", "bench", "bench_overlap", "bench_engine"} <= set(steps), steps
    for step in steps:
        assert (out / f"{step}.log").is_file(), step
    summary = (out / "summary.txt").read_text().splitlines()  # a line as each step ends: what survives a kill
    assert summary[0] == "preflight ok" and summary[-1].startswith("done in ")
    step_lines = [line for line in summary[1:-1] if ": not checked (" not in line]
    assert [line.split()[0] for line in step_lines] == steps
    assert all(" ok in " in line for line in step_lines), summary
    # What the check cannot reach is said, never left to a skipped test: a dry run checks no GPU path.
    has_nixl = importlib.util.find_spec("nixl_cu13") is not None
    nixl_reason = "dry run" if has_nixl else "no NIXL on this machine"
    assert f"GDS and remote GPU paths: not checked ({nixl_reason})" in summary
    assert "transformers_import" in steps  # present means it imports (this Python has transformers)
    build_log = (out / "build.log").read_text()
    assert "did not match any files" not in build_log  # LICENSE is staged (license-files)
    # Without a GPU the dry run builds the CPU kernels only (scripts/setup.sh proves the CUDA build).
    assert HAS_CUDA or "kvcopy build: CPU kernels only" in build_log, build_log[-2000:]
    for name in ("profile.json", "bench.csv", "bench_overlap.csv", "bench_engine.csv", "date.txt"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    rows = read_csv(out / "bench.csv")
    assert any(r["method"] == "kvcopy cpu" for r in rows)
    assert any(r["method"] == "kvcopy cpu" and r["predicted_s"] > 0 for r in rows)  # --profile of the calibration
    assert set(IDENTITY_COLUMNS) <= set(rows[0])
    if HAS_MATPLOTLIB:
        for plot in ("calib.png", "plan.png", "bench.png"):
            assert (out / plot).read_bytes()[:8] == PNG_MAGIC, plot
    assert not list(tmp_path.glob("kvcopy-device-check.*"))  # the stage is removed


def _budget(script: str) -> str:
    """Runs ``script`` in bash after sourcing the check's step helpers, with a 100 s deadline begun now."""
    prelude = "source benchmarks/check_steps.sh; out=$(mktemp -d); started=$SECONDS; deadline=100; dry_run=0; "
    result = subprocess.run(
        ["bash", "-c", prelude + script], cwd=ROOT, capture_output=True, text=True, timeout=HANG_TIMEOUT_S
    )
    assert result.returncode == 0, _describe(result)
    return result.stdout.strip()


def test_steps_get_their_cap_or_what_is_left_of_the_deadline() -> None:
    assert _budget("budget 30 && echo $limit") == "30"  # room for the whole cap
    assert _budget("started=$((SECONDS - 80)); budget 30 && echo $limit") == "20"  # shortened to what is left
    assert _budget("started=$((SECONDS - 90)); budget 30 || echo skip") == "skip"  # under MIN_STEP_S: skipped
    assert _budget("dry_run=1; budget 10 && echo $limit") == "50"  # dry runs get DRY_RUN_SLOWDOWN x the cap
    assert _budget("started=$((SECONDS - 80)); shortened 30 && echo short") == "short"
    assert _budget("shortened 30 || echo whole") == "whole"


def test_import_step_fails_a_module_that_is_here_but_does_not_import(tmp_path: Path) -> None:
    """A package found but broken (a wheel for another Python, a missing dependency) is a failed step; its tests
    would otherwise skip the whole file (importorskip) and the summary would say ok."""
    (tmp_path / "kvcopy_broken_test").mkdir()
    (tmp_path / "kvcopy_broken_test" / "__init__.py").write_text("raise ImportError('no module named regex')\n")
    (tmp_path / "kvcopy_good_test.py").write_text("__version__ = '1.5'\n")
    script = (
        f"python={sys.executable}; stage=$out; export PYTHONPATH={tmp_path}; "
        "import_step broken_import kvcopy_broken_test && echo broken-present; "
        "import_step absent_import kvcopy_absent_test && echo absent-present; "
        "import_step good_import kvcopy_good_test && echo good-present; "
        "echo failed: ${failed[*]}; cat $out/summary.txt"
    )
    lines = _budget(script).splitlines()
    assert "broken-present" not in lines and "absent-present" not in lines and "good-present" in lines
    assert "failed: broken_import" in lines  # found but not importable: a failure; absent: not one
    assert any(line.startswith("broken_import failed (exit 1)") for line in lines), lines
    assert any(line.startswith("good_import ok in ") for line in lines), lines
    assert not any(line.startswith("absent_import") for line in lines), lines


def test_not_checked_says_so_in_the_summary() -> None:
    out = _budget('not_checked "GDS and remote GPU paths" "no NIXL on this machine"; cat $out/summary.txt')
    assert out == "GDS and remote GPU paths: not checked (no NIXL on this machine)"


def test_a_skipped_step_is_reported_and_not_run() -> None:
    out = _budget(
        "started=$((SECONDS - 95)); stage=$out; soft_step late 30 touch ran; "
        "echo ${skipped[*]}; cat $out/summary.txt; ls $out"
    )
    assert out.splitlines()[0] == "late" and "late skipped (deadline)" in out and "ran" not in out.split()


@pytest.mark.slow
def test_preflight_fails_in_seconds_without_a_gpu(tmp_path: Path) -> None:
    if HAS_CUDA:
        pytest.skip("this machine has a GPU: the preflight passes here")
    env = dict(
        os.environ,
        PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
        KVCOPY_WHEELHOUSE=str(tmp_path / "none"),
        TMPDIR=str(tmp_path),
    )
    result = subprocess.run(
        ["bash", "benchmarks/device_check.sh", str(tmp_path / "out")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_TIMEOUT_S,  # it fails in seconds: a hang, only, reaches this
    )
    assert result.returncode == 1
    assert "preflight: no CUDA device visible" in result.stderr
    assert "stopped: preflight" in (tmp_path / "out" / "summary.txt").read_text()
    assert not (tmp_path / "out" / "build.log").exists()  # failed before building anything


# --------------------------------------------------------------------------- unpack_wheelhouse.py


def _wheel(path: Path, files: dict[str, str]) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)


def test_unpack_wheelhouse_unpacks_only_missing_distributions(tmp_path: Path) -> None:
    house, target = tmp_path / "wheelhouse", tmp_path / "deps"
    house.mkdir()
    dist_info = "fakepkg_kvcopy_test-1.0.dist-info"
    _wheel(
        house / "fakepkg_kvcopy_test-1.0-py3-none-any.whl",
        {
            "fakepkg_kvcopy_test/__init__.py": "VALUE = 42\n",
            f"{dist_info}/METADATA": "Metadata-Version: 2.1\nName: fakepkg_kvcopy_test\nVersion: 1.0\n",
            f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
            f"{dist_info}/RECORD": "",
        },
    )
    _wheel(house / "numpy-0.0-py3-none-any.whl", {"numpy_marker.txt": "installed already\n"})
    (house / "notes.txt").write_text("not a wheel\n")

    result = _run("benchmarks/unpack_wheelhouse.py", str(house), str(target))
    assert result.returncode == 0, _describe(result)
    assert result.stdout.splitlines() == ["unpacked fakepkg_kvcopy_test-1.0-py3-none-any.whl"]
    assert (target / "fakepkg_kvcopy_test" / "__init__.py").is_file()
    assert not (target / "numpy_marker.txt").exists()
    # Unpacked is installed: importable, with its metadata, from TARGET on the path.
    check = _run(
        "-c",
        "import importlib.metadata as m, fakepkg_kvcopy_test as p; print(p.VALUE, m.version('fakepkg_kvcopy_test'))",
        env={**os.environ, "PYTHONPATH": str(target)},
    )
    assert check.returncode == 0, _describe(check)
    assert check.stdout.split() == ["42", "1.0"]


def test_unpack_wheelhouse_usage_errors(tmp_path: Path) -> None:
    no_args = _run("benchmarks/unpack_wheelhouse.py")
    assert no_args.returncode == 2 and "WHEELHOUSE" in no_args.stderr
    missing = _run("benchmarks/unpack_wheelhouse.py", str(tmp_path / "nope"), str(tmp_path / "deps"))
    assert missing.returncode == 2 and "no wheelhouse" in missing.stderr
    assert not (tmp_path / "deps").exists()


def test_unpack_wheelhouse_skips_other_pythons_and_moves_data_folders(tmp_path: Path) -> None:
    house, target = tmp_path / "wheelhouse", tmp_path / "deps"
    house.mkdir()
    other = "cp27" if sys.version_info.major == 3 else "cp312"
    _wheel(
        house / f"kvcopy_other_python-1.0-{other}-{other}-manylinux2014_x86_64.whl",
        {"kvcopy_other_python/__init__.py": ""},
    )
    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    _wheel(
        house / f"kvcopy_data_test-1.0-{here}-{here}-manylinux2014_x86_64.whl",
        {
            "kvcopy_data_test-1.0.data/platlib/kvcopy_data_test/__init__.py": "VALUE = 7\n",
            "kvcopy_data_test-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: kvcopy_data_test\nVersion: 1.0\n",
        },
    )
    result = _run("benchmarks/unpack_wheelhouse.py", str(house), str(target))
    assert result.returncode == 0, _describe(result)
    assert result.stdout.splitlines() == [f"unpacked kvcopy_data_test-1.0-{here}-{here}-manylinux2014_x86_64.whl"]
    assert (target / "kvcopy_data_test" / "__init__.py").read_text() == "VALUE = 7\n"
    assert not (target / "kvcopy_data_test-1.0.data").exists() and not (target / "kvcopy_other_python").exists()


def _unpack_wheelhouse_module():
    spec = importlib.util.spec_from_file_location("unpack_wheelhouse", ROOT / "benchmarks" / "unpack_wheelhouse.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The wheels fetch_wheelhouse.sh gets for the GPU machine's CPython 3.12, and whether 3.12 can use them
# (PEP 425: cpXY-abi3 is built on CPython X.Y's stable ABI and runs on every later CPython 3).
WHEEL_FITS_CPYTHON_312 = {
    "safetensors-0.8.0-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl": True,
    "tokenizers-0.23.3-cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl": True,
    "hf_xet-1.6.0-cp37-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl": True,
    "kvcopy_later-1.0-cp312-abi3-manylinux2014_x86_64.whl": True,
    "kvcopy_newer-1.0-cp313-abi3-manylinux2014_x86_64.whl": False,  # needs 3.13's stable ABI
    "numpy-2.5.5-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl": True,
    "numpy-2.5.5-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl": False,  # another CPython's ABI
    "kvcopy_no_abi-1.0-cp311-none-manylinux2014_x86_64.whl": False,
    "ninja-1.13.2-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl": True,
    "sortedcontainers-2.4.0-py2.py3-none-any.whl": True,
    "kvcopy_build-1.0-1build-cp310-abi3-linux_x86_64.whl": True,  # with a build tag
}


@pytest.mark.parametrize("name", sorted(WHEEL_FITS_CPYTHON_312))
def test_unpack_wheelhouse_takes_stable_abi_wheels_up_to_the_running_python(name: str) -> None:
    assert _unpack_wheelhouse_module().usable(Path(name), (3, 12)) is WHEEL_FITS_CPYTHON_312[name]


def test_unpack_wheelhouse_unpacks_abi3_wheels_and_scripts_onto_bin(tmp_path: Path) -> None:
    """tokenizers and safetensors are abi3 wheels (transformers does not import without them); ninja's binary
    is a wheel script, which the build finds on PATH, executable."""
    house, target = tmp_path / "wheelhouse", tmp_path / "deps"
    house.mkdir()
    abi3 = "kvcopy_abi3_test-1.0-cp38-abi3-manylinux2014_x86_64.whl"  # cp38: older than any Python kvcopy runs on
    _wheel(house / abi3, {"kvcopy_abi3_test/__init__.py": "VALUE = 3\n"})
    tool = "kvcopy_tool_test-1.0-py3-none-manylinux2014_x86_64.whl"
    _wheel(house / tool, {"kvcopy_tool_test-1.0.data/scripts/kvcopy-tool-test": "#!/bin/sh\necho tool ran\n"})
    result = _run("benchmarks/unpack_wheelhouse.py", str(house), str(target))
    assert result.returncode == 0, _describe(result)
    assert sorted(result.stdout.splitlines()) == [f"unpacked {abi3}", f"unpacked {tool}"]
    check = _run("-c", "import kvcopy_abi3_test as m; print(m.VALUE)", env={**os.environ, "PYTHONPATH": str(target)})
    assert check.stdout.split() == ["3"], _describe(check)
    ran = subprocess.run(
        ["kvcopy-tool-test"],
        env={**os.environ, "PATH": f"{target / 'bin'}{os.pathsep}{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=HANG_TIMEOUT_S,
    )
    assert ran.stdout == "tool ran\n" and not (target / "kvcopy_tool_test-1.0.data").exists()


@pytest.mark.parametrize(
    ("installed", "shadowed"), [("5.17.0", True), ("5.23.0", False), ("5.23.2", False), ("5.24.0", True)]
)
def test_unpack_wheelhouse_shadows_a_transformers_outside_kvcopys_range(
    tmp_path: Path, monkeypatch, installed: str, shadowed: bool
) -> None:
    """The GPU machine's image has transformers 5.17; kvcopy's adapter runs on 5.23 only (compat.py)."""
    from kvcopy.integrations.transformers import compat

    unpack_wheelhouse = _unpack_wheelhouse_module()
    wheel = tmp_path / "transformers-5.23.0-py3-none-any.whl"
    wheel.touch()
    monkeypatch.setattr(unpack_wheelhouse.importlib.metadata, "version", lambda name: installed)
    in_range = compat._version_tuple(compat.SUPPORTED_MIN) <= compat._version_tuple(installed)
    in_range = in_range and compat._version_tuple(installed) < compat._version_tuple(compat.SUPPORTED_BELOW)
    assert in_range is not shadowed  # the reference: the range kvcopy checks at run time
    assert unpack_wheelhouse.missing_wheels(tmp_path) == ([wheel] if shadowed else [])


def test_unpack_wheelhouse_shadows_installed_distributions_older_than_the_minimum(tmp_path: Path, monkeypatch) -> None:
    unpack_wheelhouse = _unpack_wheelhouse_module()
    (tmp_path / "pytest-999.0-py3-none-any.whl").touch()  # pytest is installed here, older than 999
    assert unpack_wheelhouse.missing_wheels(tmp_path) == []
    monkeypatch.setattr(unpack_wheelhouse, "MIN_VERSIONS", {"pytest": (999,)})
    assert unpack_wheelhouse.missing_wheels(tmp_path) == [tmp_path / "pytest-999.0-py3-none-any.whl"]
    assert [unpack_wheelhouse._release(v) for v in ("77.0.3", "2.1rc1", "x")] == [(77, 0, 3), (2, 1), ()]


@pytest.mark.slow
def test_decision_table_labels_itself_not_measured(tmp_path: Path) -> None:
    out = tmp_path / "decisions.md"
    result = _run("benchmarks/decision_table.py", "--out", str(out))
    assert result.returncode == 0, _describe(result)
    text = out.read_text()
    assert "NOT MEASURED" in text.splitlines()[0]
    for label in ("llama-3.1-8b", "llama-3.1-70b tp 4", "llama-3.1-70b tp 8", "deepseek-v3 tp 8"):
        assert f"| {label} | 4096 |" in text and f"- {label}: " in text
        assert text.count(f"| {label} | 4096 |") == 2  # kept here, and held by another node
    assert "## The prefix on another node: fetch or recompute (NOT MEASURED)" in text
    assert "Thresholds for fetching:" in text
