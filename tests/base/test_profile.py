"""Profile (JSON, predict, best_method), the calibrator, and "auto" consulting a profile.

Three kinds of test:

* synthetic profiles built by hand (CostLine / MethodProfile): exact behaviour
  of predict, best_method, JSON, load errors, and of "auto" with a profile;
* the calibrator with its timer replaced by a synthetic one (exact alpha/beta
  known in advance): how sweeps become fits, independent of wall-clock;
* one real quick CPU calibration per module (a few seconds): behaviour only
  (positive fits, identity, round trip), with loose sanity bounds on timings.
"""

from __future__ import annotations

import datetime
import json
import math
import warnings

import numpy as np
import pytest
import torch

import kvcopy
import kvcopy.calibration.local as calibrator
import kvcopy.profile as profile_mod
from kvcopy import _ext
from kvcopy.calibration.timing import Timing, measure
from kvcopy.methods import available_methods, choose_method
from kvcopy.profile import CostLine, MethodProfile, PrefillProfile, Profile

from helpers import HAS_CUDA
from helpers.copies import assert_same_bytes, byte_rows, dst_bytes, fill_random_, make_layout, reference_copy, snapshot

CAL_PLANES = calibrator.CALIBRATION_PLANES
# What a CPU calibration times in this process ("triton" under the interpreter is left out).
CPU_CALIBRATED = {"torch", "cpu"} if _ext.has_cpu_kernels() else {"torch"}


# --------------------------------------------------------------------------- helpers


def _fit(alpha: float, beta: float) -> CostLine:
    return CostLine(alpha_s=alpha, beta_bytes_per_s=beta, r2=1.0, max_abs_residual=0.0)


def _points(fit: CostLine, shapes) -> list[list[float]]:
    rows = []
    for block, count in shapes:
        nbytes = block * count * CAL_PLANES
        t = fit.predict(nbytes)
        rows.append([nbytes, count, block, t, t * 0.95, t * 1.05])
    return rows


def synthetic_profile(fast: str = "torch", slow: str = "cpu", direction: str = "h2h", *, by_block=False) -> Profile:
    """``fast`` predicted well ahead of ``slow`` at every size in ``direction``."""
    fast_fit, slow_fit = _fit(1e-6, 1e12), _fit(1e-3, 1e8)
    shapes = [(4096, 1), (4096, 64), (262144, 1), (262144, 8)]
    links = {
        direction: {
            fast: MethodProfile(
                fast_fit, {4096: fast_fit, 262144: fast_fit} if by_block else {}, _points(fast_fit, shapes)
            ),
            slow: MethodProfile(slow_fit, {4096: slow_fit} if by_block else {}, _points(slow_fit, shapes)),
        }
    }
    return Profile(
        hardware={
            "device": "cpu",
            "device_name": "synthetic",
            "calibration_planes": CAL_PLANES,
            "torch": "x",
            "kvcopy": kvcopy.__version__,
            "date": "2025-01-01T00:00:00+00:00",
            "host_cpu": "synthetic",
        },
        directions=links,
        peaks={direction: 5e10},
        prefill=PrefillProfile(
            model="llama-3.1-8b", alpha_s=0.01, flops_per_s=1e13, r2=0.99, points=((1e12, 0.11), (2e12, 0.21))
        ),
    )


def size_dependent_profile() -> Profile:
    """Like a real CPU calibration: small plane-blocks move slower (fits per block size)."""
    per_block = {4096: _fit(10e-6, 20e9), 32768: _fit(18e-6, 33e9), 262144: _fit(32e-6, 42e9)}
    shapes = [(b, n) for b in per_block for n in (1, 8, 64) if b * n * CAL_PLANES <= 64 << 20]
    points = [row for b, f in per_block.items() for row in _points(f, [s for s in shapes if s[0] == b])]
    return Profile(
        hardware={"device": "cpu", "device_name": "synthetic", "calibration_planes": CAL_PLANES},
        directions={"h2h": {"cpu": MethodProfile(_fit(13e-6, 33e9), per_block, points)}},
        peaks={"h2h": 5e10},
    )


@pytest.fixture
def restore_default_profile():
    """set_default_profile changes module state: put it back whatever the test does."""
    saved = dict(profile_mod._default)
    try:
        yield
    finally:
        kvcopy.set_default_profile(None)
        profile_mod._default.clear()
        profile_mod._default.update(saved)


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
    assert all(cost[x] <= cost[y] for x, y in zip(sizes, sizes[1:])), "fixture: costs must already be monotone"
    assert all(alpha_at(mp, x) <= alpha_at(mp, y) for x, y in zip(sizes, sizes[1:])), "fixture: alphas too"
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
        assert all(a < b for a, b in zip(times, times[1:])), times


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
        directions={"h2d": {"cuda": MethodProfile(_fit(2e-6, 10e9)), "copy_engine": MethodProfile(_fit(20e-6, 50e9))}},
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
    with pytest.raises(ValueError, match="bad.json"):
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


# --------------------------------------------------------------------------- calibrator, synthetic timer

# Synthetic link costs per method: alpha s, beta bytes/s.
FAKE_LINKS = {"torch": (40e-6, 5e9), "cpu": (8e-6, 30e9), "triton": (1e-3, 1e8)}
FAKE_PREFILL = (2e-3, 3e11, 2e10)  # alpha s per layer, FLOP/s, weight bytes/s
FAKE_PEAK_S = 4e-3


def _fake_layer_weight_bytes(spec) -> int:
    """What the fake layer "reads" per forward: one layer's share of the model's weights."""
    return spec.weight_bytes(1) // spec.num_layers


@pytest.fixture
def fake_timer(monkeypatch):
    """Replaces the calibrator's timer: copies and prefills "take" exactly the synthetic costs.

    copy_blocks is recorded, not run; the prefill layer records its token count.
    ``state["prefill_slow"]``: {tokens: factor} slows the first prefill timing of that many tokens.
    ``state["links"]`` may be changed to per-block-size costs: {(method, plane_block): (alpha, beta)}.
    """
    state = {"last": None, "links": None, "calls": 0, "prefill_slow": {}}

    def fake_copy(src, src_ids, dst, dst_ids, *, method):
        state["last"] = ("copy", method, len(src_ids) * src.nbytes_per_block, src.plane_block_nbytes[0])

    def fake_layer(spec, device):
        def forward(x):
            state["last"] = ("prefill", x.shape[0], spec)
            return x

        def executed_flops(tokens):  # the fake layer "executes" the model's per-layer FLOPs
            return spec.prefill_flops(tokens) / spec.num_layers

        return forward, executed_flops, torch.float32, _fake_layer_weight_bytes(spec)

    def fake_measure(fn, *, warmup=3, repeats=10, device=None, inner=1):
        state["last"] = None
        state["calls"] += 1
        fn()
        what = state["last"]
        if what is None:  # the contiguous peak
            t = FAKE_PEAK_S
        elif what[0] == "copy":
            _, method, nbytes, plane_block = what
            alpha, beta = (state["links"] or {}).get((method, plane_block), FAKE_LINKS[method])
            t = alpha + nbytes / beta
        else:
            _, tokens, spec = what
            compute = spec.prefill_flops(tokens) / spec.num_layers / FAKE_PREFILL[1]
            t = FAKE_PREFILL[0] + max(compute, _fake_layer_weight_bytes(spec) / FAKE_PREFILL[2])
            t *= state["prefill_slow"].pop(tokens, 1.0)  # a transient slowdown: the first timing only
        return Timing(median=t, p20=t * 0.9, p80=t * 1.1, repeats=repeats)

    monkeypatch.setattr(calibrator, "copy_blocks", fake_copy)
    monkeypatch.setattr(calibrator, "_layer_forward", fake_layer)
    monkeypatch.setattr(calibrator, "measure", fake_measure)
    return state


def test_calibrator_turns_timings_into_exact_fits(fake_timer):
    p = kvcopy.calibrate("cpu", quick=True, progress=False)
    assert set(p.directions) == {"h2h"}
    assert set(p.methods("h2h")) == CPU_CALIBRATED  # never the Triton interpreter
    for method, mp in p.directions["h2h"].items():
        alpha, beta = FAKE_LINKS[method]
        assert mp.fit.alpha_s == pytest.approx(alpha, rel=1e-6)
        assert mp.fit.beta_bytes_per_s == pytest.approx(beta, rel=1e-6)
        assert mp.fit.r2 == pytest.approx(1.0, abs=1e-6)
        assert mp.by_block_nbytes, method
        for block, fit in mp.by_block_nbytes.items():
            assert fit.alpha_s == pytest.approx(alpha, rel=1e-6)
            assert fit.beta_bytes_per_s == pytest.approx(beta, rel=1e-6)
        # Points: [total bytes, blocks, plane-block bytes, median, p20, p80].
        sizes = set()
        for nbytes, count, block, median, p20, p80 in mp.points:
            assert nbytes == count * block * CAL_PLANES
            assert median == pytest.approx(alpha + nbytes / beta)
            assert p20 <= median <= p80
            sizes.add(block)
        assert set(mp.by_block_nbytes) <= sizes
        assert len({row[0] for row in mp.points}) >= 3
    # Prefill: per-layer alpha scaled to the whole model, FLOP/s as timed.
    spec = kvcopy.ModelSpec.preset(calibrator.DEFAULT_MODEL)
    assert p.prefill.model == spec.name
    assert p.prefill.flops_per_s == pytest.approx(FAKE_PREFILL[1], rel=1e-6)
    assert p.prefill.alpha_s == pytest.approx(FAKE_PREFILL[0] * spec.num_layers, rel=1e-6)
    assert len(p.prefill.points) >= 2
    # The memory-bound floor: the fastest few-token forward, less the fixed cost.
    assert p.prefill.weight_bytes_per_s == pytest.approx(FAKE_PREFILL[2], rel=1e-6)
    assert p.prefill.num_layers == spec.num_layers
    # Peak: bytes of the contiguous copy over its time.
    assert p.peaks["h2h"] > 0
    assert p.hardware["calibration_planes"] == CAL_PLANES
    assert p.hardware["device"] == "cpu"


def test_calibrator_fits_each_block_size_separately(fake_timer):
    costs = {4096: (10e-6, 20e9), 32768: (18e-6, 33e9), 262144: (32e-6, 42e9)}
    fake_timer["links"] = {(m, b): c for m in FAKE_LINKS for b, c in costs.items()}
    p = kvcopy.calibrate("cpu", quick=True, progress=False, methods=["torch"])
    assert p.methods("h2h") == ["torch"]
    mp = p.directions["h2h"]["torch"]
    assert set(mp.by_block_nbytes) == {int(r[2]) for r in mp.points}
    for block, fit in mp.by_block_nbytes.items():
        alpha, beta = costs[block]
        assert fit.alpha_s == pytest.approx(alpha, rel=1e-6)
        assert fit.beta_bytes_per_s == pytest.approx(beta, rel=1e-6)
    # Predictions at a measured shape come from that shape's block-size fit.
    for nbytes, count, block, median, _, _ in mp.points:
        assert p.predict("h2h", nbytes, num_blocks=int(count)) == pytest.approx(median, rel=1e-6)


def test_calibrator_with_a_preset_or_spec_model(fake_timer):
    spec = kvcopy.ModelSpec.preset("qwen3-8b")
    for model in ("qwen3-8b", spec):
        p = kvcopy.calibrate("cpu", quick=True, progress=False, methods=["torch"], model=model)
        assert p.prefill.model == "qwen3-8b"
        assert p.prefill.alpha_s == pytest.approx(FAKE_PREFILL[0] * spec.num_layers, rel=1e-6)


def test_calibrator_survives_a_transient_slowdown_of_the_prefill_timing(fake_timer):
    """Another process slows the first prefill timings (seen here on a 2-core machine under a
    parallel test run: prefill medians of 0.612, 0.327, 0.199 s for 16, 32, 64 tokens).

    The quick CPU sweep times three prefill shapes once each; times that fall with size make
    fit_alpha_beta raise "times do not grow with x", and calibrate() fails with it. A slowdown
    that has passed when the shapes are timed again should not sink the whole calibration.
    """
    tokens = calibrator._QUICK_CPU.prefill_tokens
    fake_timer["prefill_slow"] = {tokens[0]: 6.0, tokens[1]: 2.5}
    p = kvcopy.calibrate("cpu", quick=True, progress=False, methods=["torch"])
    assert p.prefill.flops_per_s > 0
    assert p.prefill.flops_per_s == pytest.approx(FAKE_PREFILL[1], rel=0.05)


def test_calibrator_rejects_what_it_cannot_measure(fake_timer):
    with pytest.raises(ValueError, match="nope"):
        kvcopy.calibrate("cpu", quick=True, progress=False, methods=["nope"])
    with pytest.raises(ValueError, match="device"):
        kvcopy.calibrate("meta", quick=True, progress=False)
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="CUDA"):
            kvcopy.calibrate("cuda", quick=True, progress=False)
    with pytest.raises(ValueError, match="preset"):
        kvcopy.calibrate("cpu", quick=True, progress=False, methods=["torch"], model="no-such-model")


# --------------------------------------------------------------------------- real calibration


@pytest.fixture(scope="module")
def real_profile() -> Profile:
    """One quick CPU calibration for the whole module (a few seconds)."""
    try:
        return kvcopy.calibrate("cpu", quick=True, progress=False)
    except ValueError as err:
        # Seen once on a loaded 2-core machine: three prefill shapes timed three times each, one
        # slowed by another process, and the prefill fit found no growth. Retry once, loudly.
        warnings.warn(f"kvcopy.calibrate failed once ({err}); retrying", stacklevel=1)
        return kvcopy.calibrate("cpu", quick=True, progress=False)


def test_real_calibration_fits_are_positive(real_profile):
    p = real_profile
    assert set(p.directions) == {"h2h"}
    assert set(p.methods("h2h")) == CPU_CALIBRATED
    for method, mp in p.directions["h2h"].items():
        assert mp.fit.beta_bytes_per_s > 0, method
        # Every call has a fixed cost, but fit_alpha_beta clamps alpha at 0 when it drowns in noise
        # (seen with another process hogging both cores: r2 0.49). A clean fit finds it.
        assert mp.fit.alpha_s >= 0, method
        if mp.fit.r2 > 0.9:
            assert mp.fit.alpha_s > 0, (method, mp.fit)
        assert math.isfinite(mp.fit.r2)
        assert len(mp.points) >= 3
        for fit in mp.by_block_nbytes.values():
            assert fit.alpha_s >= 0 and fit.beta_bytes_per_s > 0
    assert p.peaks["h2h"] > 0
    assert p.prefill is not None
    assert p.prefill.flops_per_s > 0
    assert p.prefill.alpha_s >= 0
    assert p.prefill.model == calibrator.DEFAULT_MODEL


def test_real_calibration_records_the_hardware(real_profile):
    hw = real_profile.hardware
    assert hw["device"] == "cpu"
    assert isinstance(hw["device_name"], str) and hw["device_name"]
    assert isinstance(hw["host_cpu"], str) and hw["host_cpu"]
    assert hw["torch"] == torch.__version__
    assert hw["kvcopy"] == kvcopy.__version__
    date = datetime.datetime.fromisoformat(hw["date"])
    assert date.tzinfo is not None
    assert abs((datetime.datetime.now(datetime.timezone.utc) - date).total_seconds()) < 3600
    assert hw["calibration_planes"] == CAL_PLANES
    json.dumps(hw)


def test_real_profile_round_trips_through_json(real_profile, tmp_path):
    path = tmp_path / "cache" / "kvcopy" / "profile.json"
    real_profile.save(path)
    loaded = Profile.load(path)
    assert loaded.to_dict() == real_profile.to_dict()
    assert loaded == real_profile
    for method in real_profile.methods("h2h"):
        assert loaded.predict("h2h", 3 << 20, num_blocks=6, method=method) == real_profile.predict(
            "h2h", 3 << 20, num_blocks=6, method=method
        )


def test_real_predict_grows_with_bytes(real_profile):
    p = real_profile
    for block in (4096, 32768, 262144):
        times = [p.predict("h2h", block * CAL_PLANES * n, num_blocks=n) for n in (1, 4, 16, 64, 512)]
        assert all(t > 0 for t in times)
        assert all(a < b for a, b in zip(times, times[1:])), (block, times)
    # One block of growing size: the overall trend grows (by x16 steps across the fits).
    times = [p.predict("h2h", 1024 * CAL_PLANES * 16**k, num_blocks=1) for k in range(4)]
    assert all(a < b for a, b in zip(times, times[1:])), times


def test_real_best_method_is_measured(real_profile):
    p = real_profile
    for block, count in ((4096, 1), (32768, 8), (262144, 64)):
        assert p.best_method("h2h", block * CAL_PLANES, count) in p.methods("h2h")
    with pytest.raises(ValueError):
        p.predict("d2h", 1 << 20)
    with pytest.raises(ValueError):
        p.best_method("h2d", 1 << 20, 1)
    with pytest.raises(ValueError, match="copy_engine"):
        p.predict("h2h", 1 << 20, method="copy_engine")


def test_real_prediction_is_near_a_fresh_measurement(real_profile):
    """A mid-size copy (8 blocks of 16 x 32 KiB planes, 4 MiB) measured afresh, cold blocks as the
    calibrator times them: the prediction is within a loose factor (a sanity bound, not a benchmark)."""
    block, count = 32768, 8
    pool_blocks = (64 << 20) // (block * CAL_PLANES)
    planes = [torch.empty(pool_blocks, block, dtype=torch.uint8).random_() for _ in range(CAL_PLANES)]
    kv = kvcopy.PagedKV.from_planes(planes)
    pool = kvcopy.HostKVPool(kv, pool_blocks, pin_memory=False)
    pool.buffer.fill_(1)  # fault the pages in: first touches are not what a copy costs
    host = pool.paged
    method = real_profile.best_method("h2h", block * CAL_PLANES, count)
    gen = torch.Generator().manual_seed(5)
    id_sets = [
        (torch.randperm(pool_blocks, generator=gen)[:count], torch.randperm(pool_blocks, generator=gen)[:count])
        for _ in range(16)
    ]
    calls = iter(range(1 << 30))

    def copy_next():
        src_ids, dst_ids = id_sets[next(calls) % 16]
        kvcopy.copy_blocks(kv, src_ids, host, dst_ids, method=method)

    predicted = real_profile.predict("h2h", block * CAL_PLANES * count, num_blocks=count, method=method)
    assert predicted > 0

    def close(t: float) -> bool:
        return 1 / 3 < predicted / t < 3

    # Other processes on a small machine stall multi-threaded copies by whole scheduler slices
    # (all samples at 8 ms on 2 busy cores): take the faster samples, measure again, and last
    # on one thread, which no straggler thread can hold up (and is at most ~2x slower here).
    timings: list[tuple[int, Timing]] = []
    threads = torch.get_num_threads()
    try:
        for attempt in range(4):
            if attempt == 3:
                torch.set_num_threads(1)
            timing = measure(copy_next, warmup=2, repeats=15)
            timings.append((torch.get_num_threads(), timing))
            if close(timing.p20) or close(timing.median):
                return
    finally:
        torch.set_num_threads(threads)
    seen = [f"{n} threads: p20 {t.p20 * 1e6:.0f} us, median {t.median * 1e6:.0f} us" for n, t in timings]
    # Still apart. Tell a calibration made noisy by load (or a machine whose load changed since)
    # from a prediction that does not match what was measured.
    mp = real_profile.directions["h2h"][method]
    used = mp.by_block_nbytes.get(block, mp.fit)
    recorded = [row[3] for row in mp.points if row[1] == count and row[2] == block]
    fresh = min(t.p20 for _, t in timings)
    if used.max_abs_residual > 0.5 or (recorded and not 1 / 3 < recorded[0] / fresh < 3):
        pytest.skip(
            f"timings too noisy to compare (load from other processes): calibration fit {used}, "
            f"calibrated median {recorded}, fresh {seen}"
        )
    pytest.fail(f"{method}: predicted {predicted * 1e6:.0f} us for 4 MiB in 8 blocks; measured {seen}")


def test_real_profile_gives_a_planner(real_profile):
    spec = kvcopy.ModelSpec.preset("llama-3.1-8b")
    planner = kvcopy.Planner.from_profile(real_profile, spec)
    assert planner.prefill_flops_per_s == real_profile.prefill.flops_per_s
    assert planner.load_bytes_per_s > 0 and planner.load_alpha_s >= 0
    d = planner.decide(2048)
    assert d.action in ("reload", "recompute", "split")
    assert d.t_reload > 0 and d.t_recompute > 0
    threshold = planner.threshold_tokens()
    assert threshold is None or threshold >= 1


# --------------------------------------------------------------------------- "auto" with a profile


def _cpu_pair(seed=0, num_blocks=10, host_blocks=12):
    gen = torch.Generator().manual_seed(seed)
    kv = make_layout("vllm", num_blocks, torch.bfloat16, gen)
    pool = kvcopy.HostKVPool(kv, host_blocks, pin_memory=False)
    fill_random_(pool, gen)
    return kv, pool


@pytest.fixture
def record_methods(monkeypatch):
    """The methods kvcopy.dispatch.run is called with (the real copy still runs)."""
    seen: list[str] = []
    real = kvcopy.dispatch.run

    def run(method, src, src_ids, dst, dst_ids, num_ctas=None):
        seen.append(method.name)
        real(method, src, src_ids, dst, dst_ids, num_ctas)

    monkeypatch.setattr(kvcopy.dispatch, "run", run)
    return seen


def test_choose_method_follows_the_profile():
    kv, pool = _cpu_pair()
    available = available_methods(kv, pool.paged)
    default = choose_method(kv, pool.paged, available, host_ids=True, num_blocks=4)
    assert default == ("cpu" if _ext.has_cpu_kernels() else "torch")
    chosen = choose_method(kv, pool.paged, available, host_ids=True, num_blocks=4, profile=synthetic_profile("torch"))
    assert chosen == "torch"
    if _ext.has_cpu_kernels():
        assert (
            choose_method(
                kv, pool.paged, available, host_ids=True, num_blocks=4, profile=synthetic_profile("cpu", "torch")
            )
            == "cpu"
        )
    # A profile that did not measure this direction: the documented defaults.
    other = synthetic_profile("torch", "cpu", direction="d2h")
    assert choose_method(kv, pool.paged, available, host_ids=True, num_blocks=4, profile=other) == default


def test_choose_method_ignores_measured_methods_that_cannot_run():
    kv, pool = _cpu_pair()
    available = available_methods(kv, pool.paged)
    p = synthetic_profile("copy_engine", "torch")  # fastest measured, but not for a CPU pair
    assert choose_method(kv, pool.paged, available, host_ids=True, profile=p) == "torch"
    # "cpu" reads host ids: with device ids it is not a candidate.
    if _ext.has_cpu_kernels():
        p = synthetic_profile("cpu", "torch")
        assert choose_method(kv, pool.paged, available, host_ids=False, profile=p) == "torch"


def test_default_profile_steers_auto_copies(restore_default_profile, record_methods):
    kv, pool = _cpu_pair(seed=1)
    src_ids, dst_ids = [3, 0, 7, 7, 9], [11, 2, 5, 0, 8]
    kvcopy.set_default_profile(synthetic_profile("torch"))
    try:
        expected = reference_copy(kv, src_ids, pool, dst_ids)
        before = snapshot(kv)
        kvcopy.copy_blocks(kv, src_ids, pool, dst_ids, method="auto")
        assert_same_bytes(dst_bytes(pool), expected)
        assert_same_bytes(snapshot(kv), before)
        assert record_methods == ["torch"]
        # gather / scatter go through the same "auto".
        expected = reference_copy(pool, [1, 4], kv, [6, 2])
        kvcopy.copy_blocks(pool, [1, 4], kv, [6, 2])
        assert_same_bytes(dst_bytes(kv), expected)
        assert record_methods == ["torch", "torch"]
    finally:
        kvcopy.set_default_profile(None)
    # Without the profile: the default again (KVCOPY_PROFILE=none in conftest).
    record_methods.clear()
    kvcopy.copy_blocks(kv, [0], pool, [0], method="auto")
    assert record_methods == ["cpu" if _ext.has_cpu_kernels() else "torch"]


def test_engine_uses_its_profile(record_methods):
    kv, pool = _cpu_pair(seed=2)
    original = snapshot(kv)
    p = synthetic_profile("torch")
    with kvcopy.TransferEngine(kv, pool, profile=p) as eng:
        assert eng.profile is p
        block_ids, host_ids = [1, 5, 9, 0], [10, 3, 7, 0]
        expected_host = reference_copy(kv, block_ids, pool, host_ids)
        eng.offload(block_ids, host_ids).wait()
        assert_same_bytes(dst_bytes(pool), expected_host)
        targets = [2, 4, 6, 8]
        expected_dev = reference_copy(pool, host_ids, kv, targets)
        t = eng.reload(host_ids, targets, layerwise=True)
        t.wait()
        assert_same_bytes(dst_bytes(kv), expected_dev)
    for src, dst in zip(block_ids, targets):  # bitwise round trip
        for p_i, plane in enumerate(kv.planes):
            assert torch.equal(byte_rows(plane)[dst], original[p_i][src])
    assert record_methods and set(record_methods) == {"torch"}


def test_engine_profile_beats_the_default_profile(restore_default_profile, record_methods):
    if not _ext.has_cpu_kernels():
        pytest.skip("needs the compiled CPU kernels for a second method")
    kvcopy.set_default_profile(synthetic_profile("torch", "cpu"))
    kv, pool = _cpu_pair(seed=3)
    with kvcopy.TransferEngine(kv, pool, profile=synthetic_profile("cpu", "torch")) as eng:
        eng.offload([0, 1], [0, 1]).wait()
    assert set(record_methods) == {"cpu"}


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


def test_timed_layer_executes_the_dense_models_flops():
    """The calibrator fits FLOP/s against the FLOPs its layer runs; for a dense model those are the spec's."""
    spec = kvcopy.ModelSpec.from_hf_config(
        {
            "model_type": "llama",
            "hidden_size": 256,
            "intermediate_size": 512,
            "num_attention_heads": 8,
            "num_hidden_layers": 2,
            "num_key_value_heads": 2,
            "vocab_size": 1000,
        }
    )
    forward, executed, dtype, weight_bytes = calibrator._layer_forward(spec, torch.device("cpu"))
    assert forward(torch.randn(5, 256, dtype=dtype)).shape == (5, 256)
    for n in (1, 17, 128):
        assert executed(n) == pytest.approx(spec.prefill_flops(n) / spec.num_layers, rel=1e-9)
    # Its weights are one layer's: the model's non-embedding weights over the layers, in the timed dtype.
    assert weight_bytes == spec.active_params // spec.num_layers * dtype.itemsize
