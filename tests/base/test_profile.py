"""Profile: predict and best_method, its JSON and load errors, the default profile (KVCOPY_PROFILE), and the
direction of a pair; on synthetic profiles built by hand (helpers.profiles), whose every prediction is known.
The calibrator that measures a Profile is tested in tests/calibration/test_calibrator.py, "auto" consulting
one in tests/core/test_auto_method.py."""

from __future__ import annotations

import copy
import itertools
import json
import math
import os
import re
import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcopy.profile as profile_mod
from kvcopy import FileFormatError
from kvcopy.profile import CostLine, MethodProfile, Profile

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


# --------------------------------------------------------------------------- every field checked at load

# A real calibration (a CPU VM's, with the disk's directions): the file the malformed ones are made from.
REAL_PROFILE = Path(__file__).resolve().parents[2] / "results" / "profile_cpu_disk.json"


def real_document() -> dict:
    """REAL_PROFILE as Profile.save writes it today (format 2)."""
    return Profile.load(REAL_PROFILE).to_dict()


def _set(doc: dict, path: tuple, value) -> dict:
    """A deep copy of ``doc`` with the field at ``path`` (keys and list indices) set to ``value``."""
    doc = copy.deepcopy(doc)
    *parents, last = path
    target = doc
    for key in parents:
        target = target[key]
    target[last] = value
    return doc


def _without(doc: dict, path: tuple) -> dict:
    doc = copy.deepcopy(doc)
    *parents, last = path
    target = doc
    for key in parents:
        target = target[key]
    del target[last]
    return doc


_FIT = ("directions", "h2h", "cpu", "fit")
# (what is wrong, the document, the field the error names, words of what was expected). The first five are
# what Profile.load raised from inside before: KeyError 'fit' / 'hardware', AttributeError on a list, an
# unexpected-keyword TypeError, and a string rate that loaded and failed later.
MALFORMED = {
    "a method without its fit": (lambda d: _without(d, _FIT), "directions.h2h.cpu.fit", "a value"),
    "no hardware": (lambda d: _without(d, ("hardware",)), "hardware", "a value"),
    "directions a list": (lambda d: _set(d, ("directions",), [1, 2]), "directions", "an object"),
    "a method a list": (lambda d: _set(d, ("directions", "h2h"), [{}]), "directions.h2h", "an object"),
    "an unknown field of a fit": (
        lambda d: _set(d, (*_FIT, "gamma"), 1.0),
        "directions.h2h.cpu.fit",
        "only the fields",
    ),
    "a rate that is a string": (
        lambda d: _set(d, (*_FIT, "beta_bytes_per_s"), "fast"),
        "directions.h2h.cpu.fit.beta_bytes_per_s",
        "> 0",
    ),
    "a rate of 0": (
        lambda d: _set(d, (*_FIT, "beta_bytes_per_s"), 0),
        "directions.h2h.cpu.fit.beta_bytes_per_s",
        "> 0",
    ),
    "a negative fixed cost": (lambda d: _set(d, (*_FIT, "alpha_s"), -1e-6), "directions.h2h.cpu.fit.alpha_s", ">= 0"),
    "a rate beyond any float": (
        lambda d: _set(d, (*_FIT, "beta_bytes_per_s"), 10**400),
        "directions.h2h.cpu.fit.beta_bytes_per_s",
        "finite",
    ),
    "a boolean fixed cost": (lambda d: _set(d, (*_FIT, "alpha_s"), True), "directions.h2h.cpu.fit.alpha_s", "number"),
    "an R^2 above 1": (lambda d: _set(d, (*_FIT, "r2"), 2.0), "directions.h2h.cpu.fit.r2", "<= 1"),
    "a per-size key that is no size": (
        lambda d: _set(d, ("directions", "h2h", "cpu", "by_block_nbytes", "big"), d[_FIT[0]]["h2h"]["cpu"]["fit"]),
        "directions.h2h.cpu.by_block_nbytes.big",
        "plane-block size",
    ),
    "a point of 5 numbers": (
        lambda d: _set(d, ("directions", "h2h", "cpu", "points", 0), [1, 2, 3, 4, 5]),
        "directions.h2h.cpu.points[0]",
        "6 numbers",
    ),
    "a point with a string": (
        lambda d: _set(d, ("directions", "h2h", "cpu", "points", 0, 3), "slow"),
        "directions.h2h.cpu.points[0][3]",
        "number",
    ),
    "a peak of -1": (lambda d: _set(d, ("peaks", "h2h"), -1), "peaks.h2h", "> 0"),
    "peaks a list": (lambda d: _set(d, ("peaks",), [1e9]), "peaks", "an object"),
    "hardware a list": (lambda d: _set(d, ("hardware",), ["cpu"]), "hardware", "an object"),
    "calibration planes of 0": (
        lambda d: _set(d, ("hardware", "calibration_planes"), 0),
        "hardware.calibration_planes",
        "int >= 1",
    ),
    "prefill a list": (lambda d: _set(d, ("prefill",), [1]), "prefill", "an object"),
    "prefill without its rate": (lambda d: _without(d, ("prefill", "flops_per_s")), "prefill.flops_per_s", "a value"),
    "prefill of an unknown field": (lambda d: _set(d, ("prefill", "tokens_per_s"), 1e4), "prefill", "only the fields"),
    "a model that is a number": (lambda d: _set(d, ("prefill", "model"), 8), "prefill.model", "model name"),
    "a layer count of 2.5": (lambda d: _set(d, ("prefill", "num_layers"), 2.5), "prefill.num_layers", "int >= 1"),
    "a weight rate of NaN": (
        lambda d: _set(d, ("prefill", "weight_bytes_per_s"), float("nan")),
        "prefill.weight_bytes_per_s",
        "> 0",
    ),
    "an unknown top-level field": (lambda d: _set(d, ("links",), {}), "(top level)", "only the fields"),
    "format 2 as a float": (lambda d: _set(d, ("format",), 2.0), "format", "2 (or 1)"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_profile_is_a_file_format_error_naming_file_and_field(tmp_path, case):
    make, field, expected = MALFORMED[case]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(make(real_document())))
    with pytest.raises(FileFormatError) as err:
        Profile.load(path)
    assert err.value.file == str(path)
    assert err.value.field == field
    assert expected in err.value.expected
    assert str(path) in str(err.value) and field in str(err.value)


def test_the_real_profiles_load_in_both_formats(tmp_path):
    """Format 1 (results/, fits keyed "links") and format 2 (what save writes): the same profile."""
    for path in sorted((REAL_PROFILE.parent).glob("profile_cpu*.json")):
        assert json.loads(path.read_text())["format"] == 1
        profile = Profile.load(path)
        profile.save(tmp_path / "again.json")
        assert Profile.load(tmp_path / "again.json") == profile, path


def test_a_format_2_file_with_links_or_a_format_1_file_with_directions_is_refused(tmp_path):
    data = real_document()
    data["format"] = 1  # format 1 keys its fits "links": "directions" is a field it does not have
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(data))
    with pytest.raises(FileFormatError, match="links"):
        Profile.load(path)


@pytest.mark.parametrize(
    ("content", "found"),
    [
        (b'{"format": \x80}', "UnicodeDecodeError"),  # not UTF-8
        (b"[" * 100_000, "RecursionError"),  # nested past the parser's depth
        (b'{"format": 2, "x": 1' + b"9" * 5000 + b"}", "digits"),  # an int past Python's 4300 digits
        (b'{"format": 2,', "line 1 column 14"),  # cut short
    ],
)
def test_a_file_that_is_not_json_names_the_file(tmp_path, content, found):
    path = tmp_path / "profile.json"
    path.write_bytes(content)
    with pytest.raises(FileFormatError, match=found) as err:
        Profile.load(path)
    assert err.value.file == str(path)


def test_a_directory_or_unreadable_file_names_the_file(tmp_path):
    with pytest.raises(FileFormatError, match="a directory") as err:
        Profile.load(tmp_path)
    assert err.value.file == str(tmp_path)
    path = tmp_path / "profile.json"
    real_profile = Profile.load(REAL_PROFILE)
    real_profile.save(path)
    path.chmod(0)
    try:
        if os.access(path, os.R_OK):
            pytest.skip("running as root: a file without permissions is still readable")
        with pytest.raises(PermissionError, match=re.escape(str(path))):
            Profile.load(path)
    finally:
        path.chmod(0o644)


@pytest.mark.parametrize("bad", [123, None, b"profile.json", ["profile.json"]])
def test_save_and_load_of_a_path_that_is_not_one_name_path(tmp_path, bad):
    with pytest.raises(TypeError, match=r"^path: expected a path"):
        synthetic_profile().save(bad)
    with pytest.raises(TypeError, match=r"^path: expected a path"):
        Profile.load(bad)


def test_save_under_a_file_names_the_path_and_the_file_and_writes_nothing(tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("not a folder")
    path = blocker / "sub" / "profile.json"
    message = rf"^path: {re.escape(str(path))} lies under {re.escape(str(blocker))}, which is a file, not a directory$"
    with pytest.raises(ValueError, match=message):
        synthetic_profile().save(path)
    assert blocker.read_text() == "not a folder" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_save_to_a_directory_is_refused_naming_path(tmp_path):
    with pytest.raises(ValueError, match=rf"^path: {re.escape(str(tmp_path))} is a directory"):
        synthetic_profile().save(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_save_refuses_a_profile_that_would_not_load_back_before_writing(tmp_path):
    profile = synthetic_profile()
    profile.peaks["h2h"] = float("nan")  # JSON would write NaN, which load refuses
    path = tmp_path / "profile.json"
    with pytest.raises(ValueError, match=r"peaks\.h2h"):
        profile.save(path)
    assert not path.exists()


def test_the_default_profile_ignores_a_malformed_file_with_a_warning(restore_default_profile, monkeypatch, tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(_set(real_document(), (*_FIT, "beta_bytes_per_s"), "fast")))
    monkeypatch.setenv("KVCOPY_PROFILE", str(path))
    profile_mod._default.clear()
    with pytest.warns(UserWarning, match=r"beta_bytes_per_s"):
        assert profile_mod.default_profile() is None


def test_offloading_raises_the_same_file_format_error_for_a_malformed_profile(tmp_path):
    """transformers' offloading(profile=path) reads the file before anything else (before transformers is
    even imported): the reader's error, not a traceback from inside."""
    from kvcopy.integrations.transformers import offloading

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(_without(real_document(), _FIT)))
    model = types.SimpleNamespace(generate_batch=print, config=types.SimpleNamespace(to_dict=dict))
    with pytest.raises(FileFormatError, match=r"directions\.h2h\.cpu\.fit") as err, offloading(model, profile=path):
        pass
    assert err.value.file == str(path)


# --------------------------------------------------------------------------- fuzzing the reader


def assert_every_number_is_valid(profile: Profile) -> None:
    """What the planner and the online profile rely on, checked on the loaded objects (not the file): every
    number finite, rates and counts positive, costs and points not negative, R^2 at most 1."""

    def line_ok(line: CostLine) -> bool:
        values = (line.alpha_s, line.beta_bytes_per_s, line.r2, line.max_abs_residual)
        return (
            all(isinstance(v, float) and math.isfinite(v) for v in values)
            and line.alpha_s >= 0
            and line.beta_bytes_per_s > 0
            and line.r2 <= 1
            and line.max_abs_residual >= 0
        )

    assert isinstance(profile.hardware, dict)
    planes = profile.hardware.get("calibration_planes", 1)
    assert isinstance(planes, int) and not isinstance(planes, bool) and planes >= 1
    assert all(isinstance(p, float) and math.isfinite(p) and p > 0 for p in profile.peaks.values())
    for direction, methods in profile.directions.items():
        for method, mp in methods.items():
            assert line_ok(mp.fit), (direction, method)
            assert all(isinstance(b, int) and b > 0 and line_ok(f) for b, f in mp.by_block_nbytes.items())
            assert all(len(row) == 6 and all(math.isfinite(x) and x >= 0 for x in row) for row in mp.points)
            for nbytes in (4096, 1 << 30):
                assert math.isfinite(profile.predict(direction, nbytes, num_blocks=4, method=method))
    prefill = profile.prefill
    if prefill is not None:
        assert isinstance(prefill.model, str)
        assert math.isfinite(prefill.alpha_s) and prefill.alpha_s >= 0
        assert math.isfinite(prefill.flops_per_s) and prefill.flops_per_s > 0
        assert math.isfinite(prefill.r2) and prefill.r2 <= 1
        assert math.isfinite(prefill.extra_request_s) and prefill.extra_request_s >= 0
        assert prefill.weight_bytes_per_s is None or (
            math.isfinite(prefill.weight_bytes_per_s) and prefill.weight_bytes_per_s > 0
        )
        assert prefill.num_layers is None or (isinstance(prefill.num_layers, int) and prefill.num_layers >= 1)
        assert all(len(row) == 2 and all(math.isfinite(x) and x >= 0 for x in row) for row in prefill.points)


def load_or_file_format_error(path: Path) -> None:
    """The one contract of Profile.load on any bytes: a Profile whose every number is valid, or a
    FileFormatError naming the file; any other exception fails the test."""
    try:
        profile = Profile.load(path)
    except FileFormatError as err:
        assert err.file == str(path) and str(path) in str(err)
        return
    assert_every_number_is_valid(profile)


def _paths(doc, at=()) -> list[tuple]:
    """Every field's path in a JSON document (keys and list indices), the document's own children first."""
    found = []
    children = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in children:
        found.append((*at, key))
        found.extend(_paths(value, (*at, key)))
    return found


# Values a field is swapped for: every JSON type, numbers at and beyond the edges of a float.
SWAPS = [None, True, False, "fast", "", [], {}, [1.0], {"x": 1}, 0, -1, 1, 2, 0.5, -1e-300, 1e308, 10**400, -(10**400)]
SWAPS += [float("nan"), float("inf"), float("-inf"), 2**63, 1e-320]
FUZZ = settings(
    max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
_REAL_BYTES = json.dumps(real_document(), indent=1).encode()
_REAL_PATHS = _paths(real_document())


@FUZZ
@given(cut=st.integers(0, len(_REAL_BYTES)))
def test_fuzz_a_truncated_profile(tmp_path, cut):
    path = tmp_path / "profile.json"
    path.write_bytes(_REAL_BYTES[:cut])
    load_or_file_format_error(path)


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, len(_REAL_BYTES) - 1), st.integers(0, 255)), min_size=1, max_size=8))
def test_fuzz_a_profile_with_flipped_bytes(tmp_path, flips):
    data = bytearray(_REAL_BYTES)
    for at, byte in flips:
        data[at] = byte
    path = tmp_path / "profile.json"
    path.write_bytes(bytes(data))
    load_or_file_format_error(path)


@FUZZ
@given(
    edits=st.lists(
        st.tuples(st.sampled_from(_REAL_PATHS), st.one_of(st.just("delete"), st.sampled_from(SWAPS))),
        min_size=1,
        max_size=3,
    )
)
def test_fuzz_a_profile_with_fields_deleted_or_swapped(tmp_path, edits):
    doc = real_document()
    for path_of, edit in edits:
        try:
            doc = _without(doc, path_of) if edit == "delete" else _set(doc, path_of, edit)
        except (KeyError, IndexError, TypeError):  # an earlier edit removed or replaced its parent
            continue
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    load_or_file_format_error(path)
