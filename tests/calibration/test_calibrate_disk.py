"""Calibrating the disk (kvcopy/calibration/disk.py): a small sweep of DiskKVStore puts and gets lands in a
Profile as directions h2f and f2h, fitted per range size, saved and loaded like the other links."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("nixl_cu13", reason="the disk store needs the nixl extra (pip install 'kvcopy[nixl]')")

from kvcopy.calibration import disk as link
from kvcopy.calibration.network import RangeSweep
from kvcopy.calibration.timing import Timing
from kvcopy.profile import Profile

SMALL = RangeSweep((16384, 65536), (1, 4), 1 << 20, 2)
# Real timings: 16 KiB to 1 MiB per call, a span no load on the machine flattens into one time.
WIDE = RangeSweep((16384, 65536), (1, 16), 1 << 20, 2)
# A known line per range size (alpha s, bytes/s), so the fit is checked exactly, whatever the machine's load.
KNOWN = {16384: (50e-6, 0.5e9), 65536: (20e-6, 2e9)}


def test_the_disk_lands_in_the_profile_per_range_size(tmp_path, monkeypatch):
    """The real puts and gets run (counted); their timings are replaced by the known lines, which the
    per-range-size fits must give back."""
    calls: list[str] = []

    def known_timing(fn, *, warmup, repeats, **_):
        for _ in range(warmup + repeats):
            fn()
        calls.append(fn.__name__)
        size, count = shapes[(len(calls) - 1) // 2]  # a put and a get per shape, in sweep order
        alpha, beta = KNOWN[size]
        seconds = alpha + size * count / beta
        return Timing(median=seconds, p20=seconds, p80=seconds, repeats=repeats)

    shapes = [(s, c) for s in SMALL.range_nbytes for c in SMALL.ranges_per_read]
    monkeypatch.setattr(link, "QUICK_SWEEP", SMALL)
    monkeypatch.setattr(link, "measure", known_timing)
    block_sizes: list[int] = []
    create = link.DiskKVStore.create

    def recording_create(path, like, num_blocks, **kwargs):
        block_sizes.append(like.nbytes_per_block)
        return create(path, like, num_blocks, **kwargs)

    monkeypatch.setattr(link.DiskKVStore, "create", staticmethod(recording_create))
    profile = Profile(hardware={"device": "cpu"}, directions={}, peaks={})
    link.add_disk_fits(profile, str(tmp_path / "disk"), progress=False)
    assert calls == ["put", "get"] * len(shapes)  # every shape was written and read through the store
    assert block_sizes == [16384, 65536]  # a store per range size, one block per range: per-block costs count once
    for direction in (link.DISK_WRITE, link.DISK_READ):
        fits = profile.directions[direction][link.DISK_METHOD]
        assert sorted(fits.by_block_nbytes) == [16384, 65536]
        for size, (alpha, beta) in KNOWN.items():
            fit = fits.by_block_nbytes[size]
            assert fit.alpha_s == pytest.approx(alpha, rel=1e-6) and fit.beta_bytes_per_s == pytest.approx(beta)
        assert len(fits.points) == 4  # one per shape
        # NIXL descriptors per call: one per range (fewer where two random ranges happened to be adjacent)
        assert all(1 <= row[1] <= count for row, (_, count) in zip(fits.points, shapes, strict=True))
    assert "NIXL POSIX" in profile.hardware["disk"] and str(tmp_path / "disk") in profile.hardware["disk"]
    assert list((tmp_path / "disk").iterdir()) == []  # the calibration store is gone
    profile.save(tmp_path / "p.json")
    again = Profile.load(tmp_path / "p.json")
    assert again.directions[link.DISK_READ][link.DISK_METHOD].by_block_nbytes.keys() == {16384, 65536}


def test_the_measured_disk_gives_well_formed_points_and_usable_fits(tmp_path, monkeypatch):
    """Real puts and gets, timed by the real clock: what no load can invert holds (every time positive, p20 <=
    median <= p80, each row the shape it measured). The fit is checked on known laws (a load can flatten or
    invert real times at these sizes): the real rows with their times replaced by a line per range size, one
    point of each size slowed threefold as a burst of load would, still give a usable line per direction."""
    measured = link.measure_disk(str(tmp_path), WIDE, progress=False)
    shapes = [(s, c) for s in WIDE.range_nbytes for c in WIDE.ranges_per_read if s * c <= WIDE.max_read_bytes]
    for direction in (link.DISK_WRITE, link.DISK_READ):
        rows = measured["points"][direction]
        assert [(int(r[2]), int(r[0]) // int(r[2])) for r in rows] == shapes
        for total, descriptors, size, median, p20, p80 in rows:
            assert 0 < p20 <= median <= p80
            assert 1 <= descriptors <= total / size
    assert list(tmp_path.iterdir()) == []  # the calibration stores are gone

    def known(rows: list[list[float]]) -> list[list[float]]:
        out = []
        for i, (total, descriptors, size, *_) in enumerate(rows):
            alpha, beta = KNOWN[int(size)]
            seconds = (alpha + total / beta) * (3.0 if i % 2 == 0 else 1.0)  # a burst on each size's smallest
            out.append([total, descriptors, size, seconds, seconds, seconds])
        return out

    lawful = {**measured, "points": {d: known(rows) for d, rows in measured["points"].items()}}
    monkeypatch.setattr(link, "measure_disk", lambda *args, **kwargs: lawful)
    profile = link.add_disk_fits(
        Profile(hardware={"device": "cpu"}, directions={}, peaks={}), str(tmp_path), progress=False
    )
    for direction in (link.DISK_WRITE, link.DISK_READ):
        fits = profile.directions[direction][link.DISK_METHOD]
        assert len(fits.points) == 4
        assert set(fits.by_block_nbytes) <= {16384, 65536}  # a size whose line the burst inverted is left out
        assert all(f.alpha_s >= 0 and f.beta_bytes_per_s > 0 for f in [fits.fit, *fits.by_block_nbytes.values()])


def test_times_that_do_not_grow_are_measured_again_then_said_plainly(tmp_path, monkeypatch):
    """A busy machine can flatten a sweep: measured once more, and if the times still do not grow, a
    ValueError that says so (not the fit's own words alone)."""
    flat = [[16384.0 * c, c, 16384.0, 1e-3, 1e-3, 1e-3] for c in (1, 4)]
    calls: list[str] = []

    def flat_disk(directory, sweep, *, progress):
        calls.append(directory)
        return {"points": {link.DISK_WRITE: flat, link.DISK_READ: flat}, "direct": True, "queue": "q"}

    monkeypatch.setattr(link, "measure_disk", flat_disk)
    with pytest.raises(ValueError, match="measured twice, and both times its times did not grow"):
        link.add_disk_fits(Profile(hardware={}, directions={}, peaks={}), str(tmp_path), progress=False)
    assert len(calls) == 2


def test_an_unusable_directory_is_refused_before_anything_is_measured(tmp_path, monkeypatch, capsys):
    """`kvcopy calibrate --disk` under a file, or on a filesystem without room, fails at once: not after the
    whole calibration (24 s), which was then thrown away."""
    from kvcopy.calibration import local
    from kvcopy.tools.cli import main

    (tmp_path / "a-file").write_text("")
    under_a_file = tmp_path / "a-file" / "disk"
    with pytest.raises(NotADirectoryError, match="directory: cannot make a store under"):
        link.check_disk_directory(under_a_file)
    with pytest.raises(TypeError, match="directory: expected a path"):
        link.check_disk_directory(None)

    def never(*args, **kwargs):
        raise AssertionError("the calibration ran before --disk was checked")

    monkeypatch.setattr(local, "calibrate", never)
    assert main(["calibrate", "--quick", "--disk", str(under_a_file)]) == 2
    assert capsys.readouterr().err.startswith(f"kvcopy calibrate: --disk: cannot make a store under {under_a_file}")
    monkeypatch.setattr(link.shutil, "disk_usage", lambda path: SimpleNamespace(free=1 << 20))
    assert main(["calibrate", "--quick", "--disk", str(tmp_path / "full")]) == 2
    assert "--disk: the calibration stores need" in capsys.readouterr().err
    with pytest.raises(OSError, match=r"calibration stores need \d+ bytes free under"):
        link.check_disk_directory(tmp_path / "full")
