"""Calibrating the disk (kvcopy/calibration/disk.py): a small sweep of DiskKVStore puts and gets lands in a
Profile as directions h2f and f2h, fitted per range size, saved and loaded like the other links."""

from __future__ import annotations

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


def test_the_measured_disk_gives_usable_fits(tmp_path, monkeypatch):
    """Real timings: every point is a positive time, and every fit the sizes allowed is a usable line (a
    size whose times were flat within noise on a busy machine is left to the overall fit)."""
    monkeypatch.setattr(link, "QUICK_SWEEP", WIDE)
    profile = link.add_disk_fits(
        Profile(hardware={"device": "cpu"}, directions={}, peaks={}), str(tmp_path), progress=False
    )
    for direction in (link.DISK_WRITE, link.DISK_READ):
        fits = profile.directions[direction][link.DISK_METHOD]
        assert len(fits.points) == 4 and all(row[3] > 0 for row in fits.points)
        assert set(fits.by_block_nbytes) <= {16384, 65536}
        assert all(f.alpha_s >= 0 and f.beta_bytes_per_s > 0 for f in [fits.fit, *fits.by_block_nbytes.values()])
