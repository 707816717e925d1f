"""Profile: predict and best_method, its JSON and load errors, the default profile (KVCOPY_PROFILE), and the
direction of a pair; on synthetic profiles built by hand (helpers.profiles), whose every prediction is known.
The calibrator that measures a Profile is tested in tests/calibration/test_calibrator.py, "auto" consulting
one in tests/core/test_auto_method.py."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

import kvcopy.profile as profile_mod
from kvcopy.profile import MethodProfile, Profile

from helpers.profiles import CAL_PLANES, exact_line, size_dependent_profile, synthetic_profile

# --------------------------------------------------------------------------- predict / best_method


def test_predict_uses_the_method_fit_and_min_over_methods():
    p = synthetic_profile()
    nbytes = 4 << 20
    torch_t = p.predict("h2h", nbytes, num_blocks=8, method="torch")
    cpu_t = p.predict("h2h", nbytes, num_blocks=8, method="cpu")
    assert torch_t == pytest.approx(1e-6 + nbytes / 1e12)
    assert cpu_t == pytest.approx(1e-3 + nbytes / 1e8)
    assert p.predict("h2h", nbytes, num_blocks=8) == min(torch_t, cpu_t)
    assert p.methods("h2h") == ["cpu", "torch"]
    assert p.methods("d2h") == []


def alpha_at(mp, plane_block):
    """The fixed cost interpolated linearly between the (here already increasing) per-size alphas."""
    sizes = sorted(mp.by_block_nbytes)
    alpha = {b: mp.by_block_nbytes[b].alpha_s for b in sizes}
    if plane_block <= sizes[0]:
        return alpha[sizes[0]]
    if plane_block >= sizes[-1]:
        return alpha[sizes[-1]]
    hi = next(b for b in sizes if b >= plane_block)
    lo = sizes[sizes.index(hi) - 1]
    return alpha[lo] + (plane_block - lo) / (hi - lo) * (alpha[hi] - alpha[lo])


def test_predict_interpolates_per_block_costs_between_measured_sizes():
    p = size_dependent_profile()
    mp = p.directions["h2h"]["cpu"]
    sizes = sorted(mp.by_block_nbytes)
    cost = {b: b / mp.by_block_nbytes[b].beta_bytes_per_s for b in sizes}  # seconds per plane-block
    assert all(cost[x] <= cost[y] for x, y in itertools.pairwise(sizes)), "fixture: costs must already be monotone"
    assert all(alpha_at(mp, x) <= alpha_at(mp, y) for x, y in itertools.pairwise(sizes)), "fixture: alphas too"
    num_blocks = 8
    for plane_block in (*sizes, 2048, 10000, 80000, 1 << 20):
        nbytes = plane_block * CAL_PLANES * num_blocks
        if plane_block <= sizes[0]:
            per_block = plane_block / sizes[0] * cost[sizes[0]]
        elif plane_block >= sizes[-1]:
            per_block = plane_block / sizes[-1] * cost[sizes[-1]]
        else:
            hi = next(b for b in sizes if b >= plane_block)
            lo = sizes[sizes.index(hi) - 1]
            per_block = cost[lo] + (plane_block - lo) / (hi - lo) * (cost[hi] - cost[lo])
        expected = alpha_at(mp, plane_block) + CAL_PLANES * num_blocks * per_block
        assert p.predict("h2h", nbytes, num_blocks=num_blocks) == pytest.approx(expected), plane_block
    # No block size given: the overall fit.
    assert mp.predict(1e6) == mp.fit.predict(1e6)


def test_predict_grows_with_blocks_at_a_fixed_block_size():
    p = size_dependent_profile()
    for block in (4096 * CAL_PLANES, 32768 * CAL_PLANES, 262144 * CAL_PLANES):
        times = [p.predict("h2h", block * n, num_blocks=n) for n in (1, 2, 4, 8, 64, 1024)]
        assert all(a < b for a, b in itertools.pairwise(times)), times


def test_predict_is_monotone_in_bytes_at_a_fixed_block_count():
    """More bytes in the same number of blocks never takes less time.

    With fits per plane-block size that differ the way a real calibration's do
    (small pages slower), ``predict`` switches from the 4 KiB fit to the 32 KiB
    fit where the plane-block size crosses their geometric mean (~11.6 KiB):
    at 8 blocks, 1.48 MB is predicted ~84 us and 1.49 MB ~63 us.
    """
    p = size_dependent_profile()
    for num_blocks in (1, 8, 64):
        lo = 1024 * CAL_PLANES * num_blocks
        sizes = np.geomspace(lo, lo * 2048, 600)
        times = [p.predict("h2h", float(n), num_blocks=num_blocks) for n in sizes]
        drops = [(float(sizes[i]), times[i], times[i + 1]) for i in range(len(times) - 1) if times[i + 1] < times[i]]
        assert not drops, f"num_blocks={num_blocks}: predicted time falls as bytes grow at {drops[:2]}"


def test_best_method_is_the_fastest_measured_one():
    assert synthetic_profile("torch", "cpu").best_method("h2h", 4096 * CAL_PLANES, 8) == "torch"
    assert synthetic_profile("cpu", "torch").best_method("h2h", 4096 * CAL_PLANES, 8) == "cpu"
    assert synthetic_profile("cuda", "copy_engine", "d2h").best_method("d2h", 1 << 20, 64) == "cuda"


def test_best_method_follows_the_crossover():
    """A method with a low fixed cost wins small copies, one with high bandwidth big ones."""
    p = Profile(
        hardware={"calibration_planes": 1},
        directions={
            "h2d": {
                "cuda": MethodProfile(exact_line(2e-6, 10e9)),
                "copy_engine": MethodProfile(exact_line(20e-6, 50e9)),
            }
        },
    )
    # Equal at nbytes = 18e-6 / (1/10e9 - 1/50e9) = 225 kB.
    assert p.best_method("h2d", 4096, 1) == "cuda"
    assert p.best_method("h2d", 4 << 20, 16) == "copy_engine"


@pytest.mark.parametrize("direction", ["d2h", "h2d", "bogus"])
def test_unknown_direction_is_a_value_error(direction):
    p = synthetic_profile()
    with pytest.raises(ValueError, match=direction):
        p.predict(direction, 1 << 20)
    with pytest.raises(ValueError, match=direction):
        p.best_method(direction, 1 << 20, 1)


def test_unknown_method_is_a_value_error():
    p = synthetic_profile()
    with pytest.raises(ValueError, match="copy_engine"):
        p.predict("h2h", 1 << 20, method="copy_engine")


# --------------------------------------------------------------------------- JSON


@pytest.mark.parametrize("by_block", [False, True])
def test_synthetic_profile_round_trips_through_json(tmp_path, by_block):
    p = synthetic_profile(by_block=by_block)
    path = tmp_path / "deep" / "er" / "profile.json"  # parents are made
    p.save(path)
    json.loads(path.read_text())  # plain JSON
    loaded = Profile.load(path)
    assert loaded.to_dict() == p.to_dict()
    assert loaded == p
    assert (
        loaded.directions["h2h"]["torch"].by_block_nbytes.keys() == p.directions["h2h"]["torch"].by_block_nbytes.keys()
    )
    assert loaded.predict("h2h", 1 << 20, num_blocks=4) == p.predict("h2h", 1 << 20, num_blocks=4)


def test_profile_without_prefill_round_trips(tmp_path):
    p = size_dependent_profile()
    p.save(tmp_path / "p.json")
    loaded = Profile.load(tmp_path / "p.json")
    assert loaded.prefill is None
    assert loaded.to_dict() == p.to_dict()


def test_load_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nowhere" / "profile.json"
    with pytest.raises(FileNotFoundError) as err:
        Profile.load(path)
    assert str(path) in str(err.value)
    assert "calibrate" in str(err.value)


@pytest.mark.parametrize("text", ["{", "not json at all", '{"format": 1, "hardware": {}', ""])
def test_load_malformed_json_is_a_value_error(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"bad\.json"):
        Profile.load(path)


def test_a_format_1_file_loads_its_links_as_directions(tmp_path):
    """Format 1 (kvcopy 0.1) keyed the fits by "links"; such a file still loads, the same profile."""
    profile = synthetic_profile()
    data = profile.to_dict()
    assert data["format"] == 2 and "links" not in data
    data["format"], data["links"] = 1, data.pop("directions")
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert Profile.load(path) == profile


@pytest.mark.parametrize("version", [0, 3, None, "2"])
def test_load_wrong_format_version_is_a_value_error(tmp_path, version):
    data = synthetic_profile().to_dict()
    if version is None:
        del data["format"]
    else:
        data["format"] = version
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="format"):
        Profile.load(path)


@pytest.mark.parametrize("text", ["[]", "null"])
def test_load_json_that_is_not_an_object_is_a_value_error(tmp_path, text):
    """Valid JSON that is not a profile object is rejected like any unreadable profile.

    Today from_dict calls ``data.get`` on it: AttributeError, which neither the CLI
    (``_load_profile`` catches ValueError/KeyError/TypeError) nor default_profile() catches.
    """
    path = tmp_path / "list.json"
    path.write_text(text)
    with pytest.raises(ValueError):
        Profile.load(path)


# --------------------------------------------------------------------------- the default profile and directions


def test_kvcopy_profile_environment_variable(restore_default_profile, monkeypatch, tmp_path):
    path = tmp_path / "profile.json"
    synthetic_profile("torch").save(path)
    monkeypatch.setenv("KVCOPY_PROFILE", str(path))
    profile_mod._default.clear()
    loaded = profile_mod.default_profile()
    assert loaded is not None and loaded.to_dict() == synthetic_profile("torch").to_dict()
    # Read once.
    path.unlink()
    assert profile_mod.default_profile() is loaded

    monkeypatch.setenv("KVCOPY_PROFILE", str(tmp_path / "absent.json"))
    profile_mod._default.clear()
    assert profile_mod.default_profile() is None

    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    monkeypatch.setenv("KVCOPY_PROFILE", str(bad))
    profile_mod._default.clear()
    with pytest.warns(UserWarning, match="ignoring"):
        assert profile_mod.default_profile() is None

    monkeypatch.setenv("KVCOPY_PROFILE", "none")
    profile_mod._default.clear()
    assert profile_mod.default_profile() is None


def test_direction_of():
    assert profile_mod.direction_of("cpu", "cpu") == "h2h"
    assert profile_mod.direction_of("cuda", "cpu") == "d2h"
    assert profile_mod.direction_of("cpu", "cuda") == "h2d"
    assert profile_mod.direction_of("cuda", "cuda") == "d2d"
