"""Calibrating the disk (kvcopy/storage/link.py): a small sweep of DiskKVStore puts and gets lands in a
Profile as directions h2f and f2h, fitted per range size, saved and loaded like the other links."""

from __future__ import annotations

import pytest

pytest.importorskip("nixl_cu13", reason="the disk store needs the nixl extra (pip install 'kvcopy[nixl]')")

from kvcopy.profile import Profile  # noqa: E402
from kvcopy.remote.link import LinkSweep  # noqa: E402
from kvcopy.storage import link  # noqa: E402

SMALL = LinkSweep((16384, 65536), (1, 4), 1 << 20, 2)


def test_the_disk_lands_in_the_profile_per_range_size(tmp_path, monkeypatch):
    monkeypatch.setattr(link, "QUICK_SWEEP", SMALL)
    profile = Profile(hardware={"device": "cpu"}, links={}, peaks={})
    link.add_disk_link(profile, str(tmp_path / "disk"), progress=False)
    for direction in (link.DISK_WRITE, link.DISK_READ):
        fits = profile.links[direction][link.DISK_METHOD]
        assert sorted(fits.by_block_nbytes) == [16384, 65536]
        assert all(f.alpha_s >= 0 and f.beta_bytes_per_s > 0 for f in fits.by_block_nbytes.values())
        assert len(fits.points) == 4  # one per shape
    assert "NIXL POSIX" in profile.hardware["disk"] and str(tmp_path / "disk") in profile.hardware["disk"]
    assert list((tmp_path / "disk").iterdir()) == []  # the calibration store is gone
    profile.save(tmp_path / "p.json")
    again = Profile.load(tmp_path / "p.json")
    assert again.links[link.DISK_READ][link.DISK_METHOD].by_block_nbytes.keys() == {16384, 65536}
