"""Calibrating the network link to a peer (kvcopy.calibration.network, `kvcopy calibrate --remote`, `kvcopy peer`) and
the planner's fetch option on the command line. Peers run in other processes of this machine (loopback)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("nixl_cu13", reason="kvcopy.remote needs the nixl extra (pip install 'kvcopy[nixl]')")

from kvcopy.calibration.network import (
    CALIBRATION_UNIT_BYTES,
    LOOPBACK,
    QUICK_SWEEP,
    REMOTE_METHOD,
    add_remote_link,
)
from kvcopy.profile import REMOTE_DIRECTION, CostLine, MethodProfile, PrefillProfile, Profile, fit_problems
from kvcopy.tools import cli

from helpers.remote import remote_peer

# Seconds for a `kvcopy peer` process to write its descriptor (it imports torch and NIXL first).
PEER_START_S = 120


def _point(nbytes: float, seconds: float) -> list[float]:
    """A calibration point: bytes, blocks, plane-block bytes, median, p20 and p80 seconds."""
    return [nbytes, 1, nbytes, seconds, 0.9 * seconds, 1.1 * seconds]


def _local_profile() -> Profile:
    fit = CostLine(alpha_s=1e-5, beta_bytes_per_s=2e10, r2=0.99, max_abs_residual=0.2)
    return Profile(
        hardware={"device_name": "test", "torch": "x", "torch_threads": 2, "date": "now"},
        directions={"h2h": {"cpu": MethodProfile(fit, points=[_point(n, fit.predict(n)) for n in (1e5, 1e7)])}},
        peaks={"h2h": 2e10},
        prefill=PrefillProfile(
            model="llama-3.1-8b", alpha_s=0.01, flops_per_s=1e12, r2=0.99, points=((1e11, 0.11), (2e11, 0.21))
        ),
    )


def _assert_link(profile: Profile, label: str) -> None:
    link = profile.directions[REMOTE_DIRECTION][REMOTE_METHOD]
    shapes = {
        (size, count)
        for size in QUICK_SWEEP.range_nbytes
        for count in QUICK_SWEEP.ranges_per_read
        if size * count <= QUICK_SWEEP.max_read_bytes
    }
    # One point per shape: its bytes, the descriptors a read became (random ranges rarely touch and merge),
    # the range size, and ordered percentiles.
    seen = set()
    for total, descriptors, size, median, p20, p80 in link.points:
        count = total // size
        assert (size, count) in shapes and 1 <= descriptors <= count
        assert 0 < p20 <= median <= p80
        seen.add((size, count))
    assert seen == shapes and len(link.points) == len(shapes)
    assert set(link.by_block_nbytes) <= set(QUICK_SWEEP.range_nbytes)
    assert link.fit.beta_bytes_per_s > 0 and link.fit.alpha_s >= 0
    assert profile.peaks[REMOTE_DIRECTION] > 0
    assert profile.hardware["remote_link"] == label


@pytest.mark.slow
def test_loopback_calibration_measures_the_link_to_a_peer_process_and_says_so():
    profile = add_remote_link(_local_profile(), progress=False)
    _assert_link(profile, LOOPBACK)
    assert "h2h" in profile.directions  # the local links stay


@pytest.mark.slow
def test_calibration_against_a_served_peer_reads_its_descriptor_file(tmp_path):
    descriptor = tmp_path / "peer.desc"
    peer = subprocess.Popen(
        [sys.executable, "-m", "kvcopy", "peer", "--descriptor", str(descriptor), "--name", "other-node"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "NIXL_LOG_LEVEL": "WARN"},
    )
    try:
        deadline = time.monotonic() + PEER_START_S
        while not descriptor.exists() or not descriptor.stat().st_size:
            assert peer.poll() is None, peer.communicate()
            assert time.monotonic() < deadline, "kvcopy peer wrote no descriptor"
            time.sleep(0.2)
        time.sleep(0.2)  # the file is written in one call; let it land whole
        profile = add_remote_link(_local_profile(), descriptor.read_bytes(), progress=False)
        _assert_link(profile, "peer 'other-node' (NIXL, UCX)")
    finally:
        peer.terminate()
        out, err = peer.communicate(timeout=60)
    assert "its descriptor is in" in out and "kvcopy calibrate --remote" in out, (out, err)


@pytest.mark.slow
def test_calibrate_remote_adds_the_link_and_prints_it_per_range_size(monkeypatch, tmp_path, capsys):
    from kvcopy.calibration import local as calibrator

    monkeypatch.setattr(calibrator, "calibrate", lambda *a, **k: _local_profile())  # the local part: not here
    out, plot = tmp_path / "profile.json", tmp_path / "calib.png"
    args = ["calibrate", "--device", "cpu", "--quick", "--remote", "--out", str(out), "--plot", str(plot)]
    status = cli.main([*args, "--no-progress"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert plot.read_bytes().startswith(b"\x89PNG")  # with the link's panel, one line per range size
    saved = Profile.load(out)
    _assert_link(saved, LOOPBACK)
    assert f"remote link ({REMOTE_DIRECTION}): {LOOPBACK}" in printed
    for size in saved.directions[REMOTE_DIRECTION][REMOTE_METHOD].by_block_nbytes:
        assert f"{size // 1024:>6} KiB ranges:" in printed


@pytest.mark.slow
def test_calibrate_remote_refuses_a_bad_descriptor_before_measuring(monkeypatch, tmp_path, capsys):
    from kvcopy.calibration import local as calibrator

    monkeypatch.setattr(calibrator, "calibrate", lambda *a, **k: pytest.fail("measured despite a bad --remote"))
    junk = tmp_path / "junk.desc"
    junk.write_bytes(b"not a descriptor")
    for path, fragment in (
        (tmp_path / "missing.desc", "cannot read the peer's descriptor"),
        (junk, "expected a KVPeer descriptor"),
    ):
        assert cli.main(["calibrate", "--remote", str(path), "--out", str(tmp_path / "p.json")]) == 2
        assert fragment in capsys.readouterr().err
    with remote_peer("bf16") as remote:  # a KV pool's peer, not a calibration peer
        other = tmp_path / "kv.desc"
        other.write_bytes(remote.descriptor)
        assert cli.main(["calibrate", "--remote", str(other), "--out", str(tmp_path / "p.json")]) == 2
    assert "not as a calibration peer's" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["read-only", "under a file", "a folder"])
def test_peer_refuses_a_descriptor_it_cannot_write_before_its_agent_starts(monkeypatch, tmp_path, capsys, where):
    from kvcopy.calibration import network

    if where == "read-only" and not os.path.isdir("/proc/self"):
        pytest.skip("no /proc: no directory where no one, root included, can create a file")
    started = []  # the agent, were it made: a descriptor it could not write would leave it serving for nothing
    monkeypatch.setattr(network, "serve_calibration_peer", lambda *a, **k: started.append("peer"))
    monkeypatch.setattr("kvcopy.remote.peer.nixl_module", lambda: started.append("agent"))
    (tmp_path / "afile").write_text("kept")
    descriptor, said = {
        "read-only": ("/proc/kvcopy-peer.desc", "cannot write /proc/kvcopy-peer.desc: cannot create files in /proc"),
        "under a file": (str(tmp_path / "afile" / "peer.desc"), "which is a file, not a directory"),
        "a folder": (str(tmp_path), "is a directory"),
    }[where]
    assert cli.main(["peer", "--descriptor", descriptor, "--seconds", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcopy peer: --descriptor: ") and said in err and len(err.splitlines()) == 1, err
    assert started == []
    assert (tmp_path / "afile").read_text() == "kept" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def _with_link(profile: Profile) -> Profile:
    profile.directions[REMOTE_DIRECTION] = {
        REMOTE_METHOD: MethodProfile(CostLine(alpha_s=1e-4, beta_bytes_per_s=1e9, r2=0.99, max_abs_residual=0.1))
    }
    profile.hardware["remote_link"] = LOOPBACK
    return profile


@pytest.mark.slow
def test_plan_from_peer_prints_fetch_against_recompute(tmp_path, capsys):
    path = tmp_path / "profile.json"
    _with_link(_local_profile()).save(path)
    plot = tmp_path / "plan.png"
    args = ["plan", "--model", "llama-3.1-8b", "--profile", str(path), "--prefix", "4096", "--from-peer"]
    assert cli.main([*args, "--plot", str(plot)]) == 0
    printed = capsys.readouterr().out
    assert f"4096 tokens held by a peer ({LOOPBACK})" in printed
    options = [line.lstrip(" *").split()[0] for line in printed.splitlines() if line.startswith("  ")]
    assert options == ["fetch", "split", "recompute"]  # no local reload: the prefix is not here
    assert "decision: fetch (fetch from the peer" in printed  # the 8B model's prefill on this profile: 1 TFLOP/s
    assert "threshold: " in printed and plot.read_bytes().startswith(b"\x89PNG")


def test_plan_from_peer_without_a_link_is_a_user_error(tmp_path, capsys):
    path = tmp_path / "profile.json"
    _local_profile().save(path)
    assert cli.main(["plan", "--model", "llama-3.1-8b", "--profile", str(path), "--from-peer"]) == 2
    assert "--from-peer: the profile has no network link" in capsys.readouterr().err


def test_the_link_to_a_peer_is_judged_per_range_size():
    profile = _with_link(_local_profile())
    link = profile.directions[REMOTE_DIRECTION][REMOTE_METHOD]
    link.fit = CostLine(alpha_s=1e-4, beta_bytes_per_s=1e9, r2=0.5, max_abs_residual=5.0)  # sizes differ per byte
    link.by_block_nbytes = {CALIBRATION_UNIT_BYTES: CostLine(1e-4, 2e8, 0.99, 0.1)}
    assert fit_problems(profile) == []
    link.by_block_nbytes[2 << 20] = CostLine(1e-4, 3e9, 0.4, 0.1)
    assert fit_problems(profile) == [f"{REMOTE_DIRECTION} {REMOTE_METHOD} 2097152 B ranges: R^2 0.400, max resid 10%"]
