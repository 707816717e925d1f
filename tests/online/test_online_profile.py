"""OnlineProfile: a Profile learned from the engine's own transfers and forwards, with a calibration as prior.

Every observation here is synthetic, drawn from a known law with a seeded numpy RNG (lognormal noise, and
where said a share of outliers at 10x), never from the wall clock. What is checked:

* the estimator: it recovers a copy law and the forward roofline, shrugs off outliers, follows a link whose
  bandwidth drops, weighs the prior as a few observations and escapes one far too fast or far too slow, and
  keeps its bounds (alpha >= 0, bandwidth <= BANDWIDTH_CAP_FACTOR x the calibrated peak);
* the snapshot: the base itself with no observations, a copy that leaves the base untouched, usable as a
  Profile (predict, Planner.from_profile, save/load), saying that it was learned online, deterministic and
  clock-free, refitted only when something new was observed;
* bad observations: refused with ValueError / TypeError, changing nothing;
* observing is never blocked by a fit in progress in another thread.
"""

from __future__ import annotations

import datetime
import json
import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import kvcopy
import kvcopy.online.profile as online_mod
from kvcopy import OnlineProfile, Planner
from kvcopy.online.profile import BANDWIDTH_CAP_FACTOR, PRIOR_WEIGHT
from kvcopy.profile import CostLine, MethodProfile, PrefillProfile, Profile

from helpers import HANG_TIMEOUT_S

LLAMA = kvcopy.ModelSpec.preset("llama-3.1-8b")
LLAMA_BLOCK = LLAMA.block_nbytes(16)  # one 16-token block, all layers: 2 MiB
# A realistic calibrated base: a CPU VM's, with per-size fits at 4096/32768/262144-byte plane-blocks.
CPU_PROFILE = Path(__file__).resolve().parents[2] / "results" / "profile_cpu.json"
CAL_PLANES = 16  # the calibrator's planes per block (CPU_PROFILE's calibration_planes)

# The copy law the engine's transfers follow: 200 us per call, 5 GB/s, blocks of 2 MiB.
ALPHA_S = 200e-6
BETA = 5e9
BLOCK = 2 << 20
MAX_BLOCKS = 64
SHAPES = (1, 8, 64)  # block counts predictions are compared at
NOISE = 0.05  # lognormal sigma: 5% timing noise
OUTLIER_SHARE = 0.05
OUTLIER_FACTOR = 10.0

# The forward law: a whole forward of LLAMA costs 5 ms fixed + max(FLOPs at 400 TFLOP/s, reads at 4 TB/s).
FORWARD_ALPHA_S = 5e-3
FORWARD_FLOPS_PER_S = 4e14
FORWARD_BYTES_PER_S = 4e12
MAX_NEW_TOKENS = 512
MAX_CACHED_TOKENS = 2000
MAX_BATCH = 4
PLANNED_PREFIXES = tuple(64 << k for k in range(7))  # 64 .. 4096 tokens

SLOWDOWN = 10.0  # how far a prior is off in the prior tests: far too fast / far too slow


# --------------------------------------------------------------------------- synthetic laws and observations


def copy_law(alpha: float, beta: float):
    return lambda nbytes: alpha + nbytes / beta


def copy_observations(seed: int, count: int, law, *, block: int = BLOCK, outliers: bool = False):
    """``count`` transfers of 1..MAX_BLOCKS blocks (log-uniform: small transfers, which tell the fixed cost,
    as often as big ones) timed by ``law`` with NOISE; with ``outliers``, exactly
    OUTLIER_SHARE of them (the same ones for a seed) OUTLIER_FACTOR slower. The same seed gives the same
    shapes and noise either way, so a run with outliers differs from one without only in those."""
    rng = np.random.default_rng(seed)
    blocks = np.rint(2 ** rng.uniform(0.0, np.log2(MAX_BLOCKS), count)).astype(int)
    noise = rng.lognormal(0.0, NOISE, count)
    hit = np.zeros(count, dtype=bool)
    hit[rng.choice(count, int(OUTLIER_SHARE * count), replace=False)] = True
    factor = np.where(hit & outliers, OUTLIER_FACTOR, 1.0)
    return [
        (int(n) * block, int(n), law(int(n) * block) * float(e) * float(f))
        for n, e, f in zip(blocks, noise, factor, strict=True)
    ]


def feed_copies(online: OnlineProfile, observations, direction: str = "h2h", method: str = "cpu") -> None:
    for nbytes, num_blocks, seconds in observations:
        online.observe_copy(direction, method, nbytes, seconds, num_blocks=num_blocks)


def forward_seconds(
    new, cached, alpha=FORWARD_ALPHA_S, flops_per_s=FORWARD_FLOPS_PER_S, bytes_per_s=FORWARD_BYTES_PER_S
):
    """The issue's forward law: alpha + max(flops / F, bytes / W), the weights read once per forward and each
    request's cached KV once."""
    flops = sum(LLAMA.prefill_flops(n, p) for n, p in zip(new, cached, strict=True))
    read = LLAMA.weight_bytes(sum(new), 0) + sum(LLAMA.kv_bytes(p) for p in cached)
    return alpha + max(flops / flops_per_s, read / bytes_per_s)


def forward_observations(seed: int, count: int, law=forward_seconds, *, outliers: bool = True, min_batch: int = 1):
    """Batched forwards of ``min_batch``..MAX_BATCH requests, each with 1 (decode) to MAX_NEW_TOKENS new tokens
    (log-uniform) after 0..MAX_CACHED_TOKENS cached ones, timed by ``law`` with NOISE (and OUTLIER_SHARE at
    OUTLIER_FACTOR)."""
    rng = np.random.default_rng(seed)
    hit = np.zeros(count, dtype=bool)
    hit[rng.choice(count, int(OUTLIER_SHARE * count), replace=False)] = True
    rows = []
    for k in range(count):
        size = int(rng.integers(min_batch, MAX_BATCH + 1))
        new = [int(2 ** rng.uniform(0, np.log2(MAX_NEW_TOKENS))) for _ in range(size)]
        cached = [int(rng.integers(0, MAX_CACHED_TOKENS + 1)) for _ in range(size)]
        seconds = law(new, cached) * float(rng.lognormal(0.0, NOISE))
        rows.append((new, cached, seconds * (OUTLIER_FACTOR if outliers and hit[k] else 1.0)))
    return rows


def feed_forwards(online: OnlineProfile, observations) -> None:
    for new, cached, seconds in observations:
        if len(new) == 1:  # a single request as plain ints, a batch as sequences
            online.observe_forward(new[0], seconds, cached_tokens=cached[0])
        else:
            online.observe_forward(new, seconds, cached_tokens=cached)


def _fit(alpha: float, beta: float) -> CostLine:
    return CostLine(alpha_s=alpha, beta_bytes_per_s=beta, r2=1.0, max_abs_residual=0.0)


def hand_made_base(alpha: float, beta: float, *, peak: float, prefill: PrefillProfile | None = None) -> Profile:
    """A calibration with one h2h "cpu" law, the same at every plane-block size (fit and per-size fit at
    BLOCK / CAL_PLANES), and ``peak`` as the contiguous-copy peak."""
    fit = _fit(alpha, beta)
    points = [[n * BLOCK, n, BLOCK / CAL_PLANES] + [fit.predict(n * BLOCK)] * 3 for n in SHAPES]
    return Profile(
        hardware={
            "device": "cpu",
            "device_name": "synthetic",
            "date": "2025-01-01T00:00:00+00:00",
            "calibration_planes": CAL_PLANES,
        },
        directions={"h2h": {"cpu": MethodProfile(fit, {BLOCK // CAL_PLANES: fit}, points)}},
        peaks={"h2h": peak},
        prefill=prefill,
    )


def predictions(profile: Profile, direction: str = "h2h", method: str = "cpu", block: int = BLOCK) -> np.ndarray:
    return np.array([profile.predict(direction, n * block, num_blocks=n, method=method) for n in SHAPES])


def law_at_shapes(law, block: int = BLOCK) -> np.ndarray:
    return np.array([law(n * block) for n in SHAPES])


def max_relative_error(got, expected) -> float:
    got, expected = np.asarray(got, dtype=float), np.asarray(expected, dtype=float)
    return float(np.max(np.abs(got - expected) / expected))


# --------------------------------------------------------------------------- the copy estimator


def test_a_copy_law_is_recovered_with_noise_and_outliers():
    """alpha and beta within 5% from 5% noise; 5% of the transfers at 10x move the predictions by < 5%."""
    law = copy_law(ALPHA_S, BETA)
    # a half-life longer than the run: every observation counts (forgetting is tested below); the fixed cost
    # is then known to ~1% (one standard deviation over seeds), well inside 5%
    count = 4000
    clean, dirty = OnlineProfile(LLAMA, half_life=count // 2), OnlineProfile(LLAMA, half_life=count // 2)
    feed_copies(clean, copy_observations(1, count, law))
    feed_copies(dirty, copy_observations(1, count, law, outliers=True))
    for online in (clean, dirty):
        mp = online.profile().directions["h2h"]["cpu"]
        per_size = mp.by_block_nbytes[BLOCK]  # no base: one plane per block, a plane-block is a block
        for fit in (mp.fit, per_size):
            assert fit.alpha_s == pytest.approx(ALPHA_S, rel=0.05)
            assert fit.beta_bytes_per_s == pytest.approx(BETA, rel=0.05)
    moved = max_relative_error(predictions(dirty.profile()), predictions(clean.profile()))
    assert moved < 0.05


def test_a_link_whose_bandwidth_halves_is_followed_within_two_half_lives():
    half_life = 128
    online = OnlineProfile(LLAMA, half_life=half_life)
    before, after = copy_law(ALPHA_S, BETA), copy_law(ALPHA_S, BETA / 2)
    feed_copies(online, copy_observations(2, 600, before))
    assert max_relative_error(predictions(online.profile()), law_at_shapes(before)) < 0.05
    feed_copies(online, copy_observations(3, 2 * half_life, after))
    assert max_relative_error(predictions(online.profile()), law_at_shapes(after)) < 0.10


def test_the_half_life_counts_each_streams_own_observations():
    """Another link's and the forwards' observations do not age this link's."""
    half_life = 128
    online = OnlineProfile(LLAMA, half_life=half_life)
    law = copy_law(ALPHA_S, BETA)
    feed_copies(online, copy_observations(22, 600, law))
    # 2000 others: past the window (HISTORY_HALF_LIVES half-lives) if they counted against this link
    feed_copies(online, copy_observations(23, 2000, copy_law(ALPHA_S, BETA / 2)), method="torch")
    feed_forwards(online, forward_observations(24, 300))
    assert online.num_observations == {"h2h cpu": 600, "h2h torch": 2000, "prefill": 300}
    assert max_relative_error(predictions(online.profile(), method="cpu"), law_at_shapes(law)) < 0.05


# Prior and data 10x apart: (base alpha, base beta, data alpha, data beta). The base's peak is the faster
# bandwidth of the two (a contiguous copy is never slower than the method), so the cap allows the data.
PRIORS = {
    "prior far too fast": (ALPHA_S / SLOWDOWN, BETA * SLOWDOWN, ALPHA_S, BETA),
    "prior far too slow": (ALPHA_S * SLOWDOWN, BETA / SLOWDOWN, ALPHA_S, BETA),
}


@pytest.mark.parametrize("case", sorted(PRIORS))
def test_the_prior_is_worth_a_few_observations_and_is_escaped(case):
    base_alpha, base_beta, data_alpha, data_beta = PRIORS[case]
    base = hand_made_base(base_alpha, base_beta, peak=max(base_beta, data_beta))
    data = copy_law(data_alpha, data_beta)
    prior_t, data_t = predictions(base), law_at_shapes(data)
    online = OnlineProfile(LLAMA, base)
    assert online.profile().to_dict() == base.to_dict()  # no observations: the calibration itself

    rng = np.random.default_rng(4)
    few = [(n * BLOCK, n, data(n * BLOCK) * float(rng.lognormal(0.0, NOISE))) for n in SHAPES]
    assert len(few) < PRIOR_WEIGHT  # fewer observations than the prior is worth
    feed_copies(online, few)
    # How far along from the prior to the data each prediction moved, in log space (0: prior, 1: data).
    moved = np.log(predictions(online.profile()) / prior_t) / np.log(data_t / prior_t)
    assert np.all(moved > 0.2), moved  # clearly toward the data
    assert np.all(moved < 0.8), moved  # but not to it: the prior still counts

    feed_copies(online, copy_observations(5, 1000, data))
    assert max_relative_error(predictions(online.profile()), data_t) < 0.05


def test_the_bandwidth_is_capped_at_a_multiple_of_the_calibrated_peak():
    """Transfers implying 10x the CPU calibration's peak: the learned beta stays at <= 2x that peak."""
    base = Profile.load(CPU_PROFILE)
    peak = base.peaks["h2h"]
    cap = BANDWIDTH_CAP_FACTOR * peak
    online = OnlineProfile(LLAMA, base)
    feed_copies(online, copy_observations(6, 300, copy_law(ALPHA_S / 10, 10 * peak)))
    learned = online.profile()
    mp = learned.directions["h2h"]["cpu"]
    calibrated = base.directions["h2h"]["cpu"].fit.beta_bytes_per_s
    for fit in (mp.fit, *mp.by_block_nbytes.values()):
        assert fit.beta_bytes_per_s <= cap * (1 + 1e-9)
        assert fit.beta_bytes_per_s > calibrated  # capped, not frozen: it moved toward the data
    planner = Planner.from_profile(learned, LLAMA)
    assert all(line.beta_bytes_per_s <= cap * (1 + 1e-9) for line in planner.load_options)


def test_a_negative_intercept_shape_gives_no_negative_fixed_cost():
    """Times of bytes / beta - 1 ms (a line through them crosses zero at a positive size): alpha >= 0."""
    rng = np.random.default_rng(7)
    online = OnlineProfile(LLAMA)
    for n in rng.integers(8, MAX_BLOCKS + 1, 300):
        nbytes = int(n) * BLOCK
        online.observe_copy(
            "h2h", "cpu", nbytes, (nbytes / BETA - 1e-3) * float(rng.lognormal(0.0, NOISE)), num_blocks=int(n)
        )
    mp = online.profile().directions["h2h"]["cpu"]
    for fit in (mp.fit, *mp.by_block_nbytes.values()):
        assert fit.alpha_s >= 0.0
        assert fit.beta_bytes_per_s > 0.0


def test_a_negative_intercept_forward_shape_gives_no_negative_fixed_cost():
    """Compute-bound forwards of FLOPs / F - 2 ms: the learned prefill alpha is >= 0."""

    def law(new, cached):
        return forward_seconds(new, cached, alpha=0.0) - 2e-3

    rng = np.random.default_rng(8)
    online = OnlineProfile(LLAMA)
    for tokens in rng.integers(1024, 4097, 200):
        online.observe_forward(int(tokens), law([int(tokens)], [0]) * float(rng.lognormal(0.0, NOISE)))
    prefill = online.profile().prefill
    assert prefill.alpha_s >= 0.0
    assert prefill.flops_per_s > 0.0


# --------------------------------------------------------------------------- the forward estimator


def forward_prior(alpha: float, flops_per_s: float, bytes_per_s: float | None, *, model=LLAMA.name, layers=32):
    return PrefillProfile(
        model=model, alpha_s=alpha, flops_per_s=flops_per_s, r2=0.99, weight_bytes_per_s=bytes_per_s, num_layers=layers
    )


# A prior for the forwards (None: none), and the law the forwards follow: (alpha, FLOP/s, bytes/s).
_LAW = (FORWARD_ALPHA_S, FORWARD_FLOPS_PER_S, FORWARD_BYTES_PER_S)
_CPU_PREFILL = Profile.load(CPU_PROFILE).prefill
FORWARD_CASES = {
    "no base": (None, _LAW),
    "prior 5x too fast": (forward_prior(FORWARD_ALPHA_S / 5, FORWARD_FLOPS_PER_S * 5, FORWARD_BYTES_PER_S * 5), _LAW),
    "prior 5x too slow": (forward_prior(FORWARD_ALPHA_S * 5, FORWARD_FLOPS_PER_S / 5, FORWARD_BYTES_PER_S / 5), _LAW),
    # the weight reads calibrated 10x too slow: a floor far above every short forward observed
    "stale weight-read floor": (forward_prior(FORWARD_ALPHA_S, FORWARD_FLOPS_PER_S, FORWARD_BYTES_PER_S / 10), _LAW),
    # calibrated on a one-layer model: its fixed cost is per layer-forward
    "another model's calibration": (
        forward_prior(FORWARD_ALPHA_S / 32, FORWARD_FLOPS_PER_S, FORWARD_BYTES_PER_S, model="one-layer", layers=1),
        _LAW,
    ),
    # the CPU VM's calibration (no weight-read floor), with forwards 5x slower than it says (the engine's case)
    "cpu calibration 5x too fast": (_CPU_PREFILL, (_CPU_PREFILL.alpha_s * 5, _CPU_PREFILL.flops_per_s / 5, 5e9)),
}


@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_the_forward_roofline_is_learned_in_the_calibrators_terms(case):
    prior, (alpha, flops_per_s, bytes_per_s) = FORWARD_CASES[case]

    def law(new, cached):
        return forward_seconds(new, cached, alpha, flops_per_s, bytes_per_s)

    base = None if prior is None else hand_made_base(ALPHA_S, BETA, peak=BETA, prefill=prior)
    online = OnlineProfile(LLAMA, base)
    feed_copies(online, copy_observations(9, 50, copy_law(ALPHA_S, BETA)))  # the planner needs a load link
    feed_forwards(online, forward_observations(10, 600, law))
    learned = online.profile()
    assert learned.prefill.model == LLAMA.name
    assert learned.prefill.num_layers == LLAMA.num_layers

    planner = Planner.from_profile(learned, LLAMA)
    assert planner.prefill_alpha_s == learned.prefill.alpha_s  # the spec's own model: not rescaled
    for prefix in PLANNED_PREFIXES:
        assert planner.t_prefill(prefix) == pytest.approx(law([prefix], [0]), rel=0.10), prefix
        assert planner.decide(prefix, 1).t_recompute == pytest.approx(law([prefix + 1], [0]), rel=0.10), prefix
    # the memory-bound end too: a decode step after a cached prefix
    assert planner.t_prefill(1, 1000) == pytest.approx(law([1], [1000]), rel=0.10)


def test_batched_forwards_read_the_weights_once_and_each_requests_kv():
    """Only batches of 2..4 requests observed: a single sequence is still predicted, memory-bound decode
    steps included (the weights counted once per forward, not once per request)."""
    online = OnlineProfile(LLAMA)
    feed_copies(online, copy_observations(25, 50, copy_law(ALPHA_S, BETA)))
    feed_forwards(online, forward_observations(26, 600, min_batch=2))
    planner = Planner.from_profile(online.profile(), LLAMA)
    for tokens, cached in ((1, 0), (1, 1000), (8, 2000), *((p, 0) for p in PLANNED_PREFIXES)):
        assert planner.t_prefill(tokens, cached) == pytest.approx(forward_seconds([tokens], [cached]), rel=0.10)


# What an engine adds per request beside the first in a batched forward (transformers' continuous batching on
# the CPU VM: a decode step of two requests took 2.4x one of a single request).
EXTRA_REQUEST_S = 3e-3


def test_the_work_per_request_beside_the_first_is_learned():
    def law(new, cached):
        return forward_seconds(new, cached) + (len(new) - 1) * EXTRA_REQUEST_S

    online = OnlineProfile(LLAMA, hand_made_base(ALPHA_S, BETA, peak=BETA, prefill=forward_prior(*_LAW)))
    feed_copies(online, copy_observations(31, 50, copy_law(ALPHA_S, BETA)))
    feed_forwards(online, forward_observations(32, 600, law))
    learned = online.profile()
    assert learned.prefill.extra_request_s == pytest.approx(EXTRA_REQUEST_S, rel=0.05)
    planner = Planner.from_profile(learned, LLAMA)
    for batch in (([1], [1000]), ([1, 1], [500, 500]), ([64, 1, 1, 1], [0, 100, 200, 300]), ([512], [0])):
        assert planner.t_forward(*batch) == pytest.approx(law(*batch), rel=0.05), batch
    again = Profile.from_dict(json.loads(json.dumps(learned.to_dict())))
    assert again.prefill.extra_request_s == learned.prefill.extra_request_s


def test_forwards_without_work_per_request_learn_next_to_none():
    """The issue's law has no such term: what the fit puts there is noise, a small part of the fixed cost."""
    online = OnlineProfile(LLAMA)
    feed_copies(online, copy_observations(33, 50, copy_law(ALPHA_S, BETA)))
    feed_forwards(online, forward_observations(34, 600))
    assert 0.0 <= online.profile().prefill.extra_request_s <= 0.05 * FORWARD_ALPHA_S


def test_a_profile_saved_before_the_work_per_request_loads_without_it():
    data = Profile.load(CPU_PROFILE).to_dict()
    data["prefill"].pop("extra_request_s", None)
    assert Profile.from_dict(data).prefill.extra_request_s == 0.0


# --------------------------------------------------------------------------- the snapshot


def test_with_no_observations_the_snapshot_is_the_base():
    base = Profile.load(CPU_PROFILE)
    assert kvcopy.OnlineProfile is kvcopy.online.profile.OnlineProfile
    online = OnlineProfile(LLAMA, base)
    assert online.num_observations == {"prefill": 0}
    assert online.profile().to_dict() == base.to_dict()
    assert online.profile() is not base


@pytest.mark.parametrize("observed", [False, True], ids=["no observations", "observations"])
def test_the_snapshot_is_a_copy_and_leaves_the_base_untouched(observed):
    base = Profile.load(CPU_PROFILE)
    base_before = json.dumps(base.to_dict(), sort_keys=True)
    online = OnlineProfile(LLAMA, base)
    if observed:
        feed_copies(online, copy_observations(11, 100, copy_law(ALPHA_S, BETA)))
        feed_forwards(online, forward_observations(12, 50))
    first = online.profile()
    expected = first.to_dict()
    expected_json = json.dumps(expected, sort_keys=True)
    # mutate everything a caller could reach
    first.hardware["device_name"] = "mutated"
    first.hardware.pop("calibration_planes")
    first.peaks["h2h"] = 1.0
    mp = first.directions["h2h"]["cpu"]
    mp.by_block_nbytes.clear()
    mp.points.append([1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    first.directions["h2h"]["cpu"] = MethodProfile(_fit(1.0, 1.0))
    first.directions["d2h"] = {}
    first.prefill = None
    assert json.dumps(online.profile().to_dict(), sort_keys=True) == expected_json
    assert json.dumps(base.to_dict(), sort_keys=True) == base_before


def _fed(base: Profile) -> OnlineProfile:
    online = OnlineProfile(LLAMA, base)
    feed_copies(online, copy_observations(13, 120, copy_law(ALPHA_S, BETA)))
    feed_copies(online, copy_observations(14, 30, copy_law(ALPHA_S, BETA / 2)), method="torch")
    feed_forwards(online, forward_observations(15, 80))
    return online


def test_a_snapshot_round_trips_through_save_and_load(tmp_path):
    online = _fed(Profile.load(CPU_PROFILE))
    learned = online.profile()
    path = tmp_path / "online.json"
    learned.save(path)
    loaded = Profile.load(path)
    assert loaded.to_dict() == learned.to_dict()
    # and the loaded one works as the learned one does
    assert loaded.predict("h2h", 8 * BLOCK, num_blocks=8) == learned.predict("h2h", 8 * BLOCK, num_blocks=8)
    assert Planner.from_profile(loaded, LLAMA).decide(1024).t_recompute == pytest.approx(
        Planner.from_profile(learned, LLAMA).decide(1024).t_recompute, rel=1e-12
    )


def test_the_snapshot_says_it_was_learned_online_from_what_against_which_base():
    base = Profile.load(CPU_PROFILE)
    online = _fed(base)
    note = online.profile().hardware["online"]
    assert note["learned_online"] is True
    assert note["observations"] == {"h2h cpu": 120, "h2h torch": 30, "prefill": 80}
    assert online.num_observations == {"h2h cpu": 120, "h2h torch": 30, "prefill": 80}
    assert note["base"]["device_name"] == base.hardware["device_name"]
    assert note["base"]["date"] == base.hardware["date"]
    json.dumps(note)  # plain JSON
    # the calibration's identity stays, so that its plane-block sizes still apply
    assert online.profile().hardware["calibration_planes"] == base.hardware["calibration_planes"]
    # another base (same machine and date, other fits) is told apart
    other = Profile.load(CPU_PROFILE)
    other.peaks["h2h"] *= 2
    assert _fed(other).profile().hardware["online"]["base"] != note["base"]


def test_without_a_base_the_snapshot_says_so():
    online = OnlineProfile(LLAMA)
    feed_copies(online, copy_observations(27, 20, copy_law(ALPHA_S, BETA)))
    note = online.profile().hardware["online"]
    assert note["learned_online"] is True
    assert note["base"] is None
    assert note["observations"] == {"h2h cpu": 20}


@pytest.mark.slow
def test_a_saved_snapshot_plans_and_plots_as_a_calibration_does(tmp_path, capsys):
    from kvcopy.tools import cli, plots

    learned = _fed(Profile.load(CPU_PROFILE)).profile()
    path = tmp_path / "online.json"
    learned.save(path)
    assert cli.main(["plan", "--model", LLAMA.name, "--profile", str(path), "--prefix", "2048"]) == 0
    decision = Planner.from_profile(learned, LLAMA, layerwise=True).decide(2048)  # the CLI plans layer-wise
    assert f"decision: {decision.action} ({decision.explanation})" in capsys.readouterr().out
    plots.plot_calibration(learned, tmp_path / "calibration.png")
    assert (tmp_path / "calibration.png").stat().st_size > 0


def test_the_same_observations_give_the_same_profile():
    base = Profile.load(CPU_PROFILE)
    assert _fed(base).profile().to_dict() == _fed(base).profile().to_dict()


class _FarFuture(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return datetime.datetime(2099, 1, 1, tzinfo=tz)

    @classmethod
    def utcnow(cls):
        return datetime.datetime(2099, 1, 1)


def test_the_snapshot_holds_no_clock_values(monkeypatch):
    """The same observations fed (and fitted) a year later, by every clock, give the same snapshot."""
    base = Profile.load(CPU_PROFILE)
    expected = _fed(base).profile().to_dict()
    year = 365 * 86400
    for name in ("time", "monotonic", "perf_counter"):
        real = getattr(time, name)
        monkeypatch.setattr(time, name, lambda real=real: real() + year)
    for name in ("time_ns", "monotonic_ns", "perf_counter_ns"):
        real = getattr(time, name)
        monkeypatch.setattr(time, name, lambda real=real: real() + year * 10**9)
    monkeypatch.setattr(datetime, "datetime", _FarFuture)
    assert _fed(base).profile().to_dict() == expected


# --------------------------------------------------------------------------- bad observations

BAD_OBSERVATIONS = [
    # copies: non-positive sizes, bad seconds, unknown direction -> ValueError
    ("copy", dict(nbytes=0), ValueError),
    ("copy", dict(nbytes=-BLOCK), ValueError),
    ("copy", dict(num_blocks=0), ValueError),
    ("copy", dict(seconds=-1e-3), ValueError),
    ("copy", dict(seconds=float("nan")), ValueError),
    ("copy", dict(seconds=float("inf")), ValueError),
    ("copy", dict(seconds=float("-inf")), ValueError),
    ("copy", dict(direction="x2y"), ValueError),
    ("copy", dict(direction="d2h", nbytes=0), ValueError),  # a link not seen yet, refused: not created
    ("copy", dict(nbytes=4, num_blocks=5), ValueError),  # more blocks than bytes
    # copies: wrong types -> TypeError
    ("copy", dict(nbytes=1.5), TypeError),
    ("copy", dict(nbytes="8"), TypeError),
    ("copy", dict(nbytes=None), TypeError),
    ("copy", dict(num_blocks=2.0), TypeError),
    ("copy", dict(seconds="1"), TypeError),
    ("copy", dict(seconds=None), TypeError),
    ("copy", dict(direction=3), TypeError),
    ("copy", dict(method=3), TypeError),
    ("copy", dict(method=None), TypeError),
    ("copy", dict(num_blocks=True), TypeError),
    ("copy", dict(seconds=True), TypeError),
    ("copy", dict(nbytes=True), TypeError),
    # a method the base did not measure in a direction it did: it would replace the calibrated ones
    ("copy", dict(method="cdua"), ValueError),
    ("copy", dict(method=""), ValueError),
    # forwards
    ("forward", dict(tokens=0), ValueError),
    ("forward", dict(tokens=-1), ValueError),
    ("forward", dict(tokens=[4, 0], cached_tokens=[0, 0]), ValueError),
    ("forward", dict(tokens=[4, 8], cached_tokens=[0]), ValueError),
    ("forward", dict(cached_tokens=-1), ValueError),
    ("forward", dict(seconds=-1e-3), ValueError),
    ("forward", dict(seconds=float("nan")), ValueError),
    ("forward", dict(seconds=float("inf")), ValueError),
    ("forward", dict(tokens=1.5), TypeError),
    ("forward", dict(tokens="8"), TypeError),
    ("forward", dict(seconds="1"), TypeError),
    ("forward", dict(seconds=True), TypeError),
    ("forward", dict(seconds=None), TypeError),
    ("forward", dict(tokens=True), TypeError),
    ("forward", dict(tokens=None), TypeError),
    ("forward", dict(tokens=[]), ValueError),
    ("forward", dict(tokens=[4, "8"], cached_tokens=[0, 0]), TypeError),
    ("forward", dict(cached_tokens=0.5), TypeError),
    ("forward", dict(cached_tokens=True), TypeError),
    ("forward", dict(cached_tokens=None), TypeError),
    ("forward", dict(tokens=[4, 8], cached_tokens=0.0), TypeError),  # 0.0 == 0, yet not a count
    ("forward", dict(tokens=[4, 8], cached_tokens="0"), TypeError),
]


def _observe(online: OnlineProfile, kind: str, bad: dict) -> None:
    if kind == "copy":
        args = {"direction": "h2h", "method": "cpu", "nbytes": 8 * BLOCK, "seconds": 1e-3, "num_blocks": 8, **bad}
        online.observe_copy(
            args["direction"], args["method"], args["nbytes"], args["seconds"], num_blocks=args["num_blocks"]
        )
    else:
        args = {"tokens": 16, "seconds": 1e-2, "cached_tokens": 0, **bad}
        online.observe_forward(args["tokens"], args["seconds"], cached_tokens=args["cached_tokens"])


@pytest.mark.parametrize("kind, bad, error", BAD_OBSERVATIONS, ids=lambda v: repr(v) if isinstance(v, dict) else None)
def test_a_bad_observation_raises_and_changes_nothing(kind, bad, error):
    online = OnlineProfile(LLAMA, Profile.load(CPU_PROFILE))
    feed_copies(online, copy_observations(16, 20, copy_law(ALPHA_S, BETA)))
    feed_forwards(online, forward_observations(17, 20))
    _observe(online, kind, {})  # the good observation the bad one is made from is accepted
    counts, snapshot, refits = online.num_observations, online.profile().to_dict(), online.refits
    with pytest.raises(error):
        _observe(online, kind, bad)
    assert online.num_observations == counts
    assert online.profile().to_dict() == snapshot
    assert online.refits == refits  # nothing new: not refitted either


def test_more_blocks_than_bytes_is_refused_naming_both():
    online = OnlineProfile(LLAMA, Profile.load(CPU_PROFILE))
    online.observe_copy("h2h", "cpu", 5, 1e-3, num_blocks=5)  # one byte a block: the least a block holds
    with pytest.raises(ValueError, match=r"^num_blocks: expected at most nbytes \(5\) blocks.*got 6$"):
        online.observe_copy("h2h", "cpu", 5, 1e-3, num_blocks=6)
    assert online.num_observations["h2h cpu"] == 1


# --------------------------------------------------------------------------- lazy fits, concurrent observing

# How long a test waits on another thread before it fails (rather than hang).
THREAD_TIMEOUT_S = HANG_TIMEOUT_S


def test_profile_refits_only_when_something_new_was_observed():
    online = OnlineProfile(LLAMA, Profile.load(CPU_PROFILE))
    feed_copies(online, copy_observations(18, 500, copy_law(ALPHA_S, BETA)))
    feed_forwards(online, forward_observations(19, 200))
    start = online.refits
    first = online.profile()
    second = online.profile()
    assert online.refits == start + 1
    assert second.to_dict() == first.to_dict()
    online.observe_copy("h2h", "cpu", BLOCK, 1e-3)
    online.profile()
    assert online.refits == start + 2
    online.observe_forward(16, 1e-2)
    online.profile()
    online.profile()
    assert online.refits == start + 3


def test_an_observation_is_not_blocked_by_a_fit_in_progress(monkeypatch):
    online = OnlineProfile(LLAMA, Profile.load(CPU_PROFILE))
    feed_copies(online, copy_observations(20, 100, copy_law(ALPHA_S, BETA)))
    fitting, release = threading.Event(), threading.Event()
    real_fit = online_mod.fit_max_linear

    def blocked_fit(*args, **kwargs):
        fitting.set()
        release.wait(THREAD_TIMEOUT_S)
        return real_fit(*args, **kwargs)

    monkeypatch.setattr(online_mod, "fit_max_linear", blocked_fit)
    snapshots = []
    fitter = threading.Thread(target=lambda: snapshots.append(online.profile()), daemon=True)
    fitter.start()
    try:
        assert fitting.wait(THREAD_TIMEOUT_S), "profile() never reached the fit"
        observer = threading.Thread(target=online.observe_copy, args=("h2h", "cpu", BLOCK, 1e-3), daemon=True)
        observer.start()
        observer.join(THREAD_TIMEOUT_S)
        observed = not observer.is_alive()
        fit_still_blocked = fitter.is_alive() and not release.is_set()
    finally:
        release.set()
        fitter.join(THREAD_TIMEOUT_S)
    assert observed, "observe_copy waited for the fit"
    assert fit_still_blocked
    assert not fitter.is_alive() and len(snapshots) == 1
    # the observation made during the fit is not lost: the next snapshot refits with it
    refits = online.refits
    assert online.num_observations["h2h cpu"] == 101
    assert online.profile().hardware["online"]["observations"]["h2h cpu"] == 101
    assert online.refits == refits + 1


# --------------------------------------------------------------------------- a queried transfer lands on its fit

# Shapes observed against the CPU calibration: (block bytes, blocks). 2 MiB blocks have 128 KiB plane-blocks,
# between the calibration's per-size fits; 64 KiB blocks have 4 KiB plane-blocks, one of its sizes.
QUERIED_SHAPES = [(LLAMA_BLOCK, 32), (4096 * CAL_PLANES, 4)]


def _slow_cpu_link(block: int, num_blocks: int) -> tuple[OnlineProfile, float]:
    """An OnlineProfile fed 200 transfers of one shape, SLOWDOWN x slower than the CPU calibration says."""
    base = Profile.load(CPU_PROFILE)
    nbytes = block * num_blocks
    measured = SLOWDOWN * base.predict("h2h", nbytes, num_blocks=num_blocks, method="cpu")
    online = OnlineProfile(LLAMA, base)
    for noise in np.random.default_rng(21).lognormal(0.0, NOISE, 200):
        online.observe_copy("h2h", "cpu", nbytes, measured * float(noise), num_blocks=num_blocks)
    return online, measured


@pytest.mark.parametrize("block, num_blocks", QUERIED_SHAPES)
def test_a_transfer_queried_back_lands_on_the_learned_fit(block, num_blocks):
    online, measured = _slow_cpu_link(block, num_blocks)
    learned = online.profile()
    nbytes = block * num_blocks
    assert learned.predict("h2h", nbytes, num_blocks=num_blocks, method="cpu") == pytest.approx(measured, rel=0.10)


def test_the_planner_loads_at_the_learned_cost():
    online, measured = _slow_cpu_link(LLAMA_BLOCK, 32)
    planner = Planner.from_profile(online.profile(), LLAMA)
    assert planner.t_load_nbytes(32 * LLAMA_BLOCK) == pytest.approx(measured, rel=0.10)
    assert planner.t_load(32 * 16) == pytest.approx(measured, rel=0.10)  # 32 blocks of 16 tokens


# --------------------------------------------------------------------------- what an observation is taken as


def test_a_method_the_base_did_not_measure_is_refused_naming_it_and_the_measured_ones():
    """Observed methods replace the base's in their direction: a misspelt name would throw the calibration
    away. Where the base measured the direction only its methods are taken; elsewhere any name is."""
    base = Profile.load(CPU_PROFILE)
    assert sorted(base.directions["h2h"]) == ["cpu", "torch"] and "d2h" not in base.directions
    online = OnlineProfile(LLAMA, base)
    with pytest.raises(ValueError, match=r"^method: 'cdua' was not calibrated for h2h.*\['cpu', 'torch'\]"):
        online.observe_copy("h2h", "cdua", BLOCK, 1e-3)
    assert online.profile().directions["h2h"].keys() == base.directions["h2h"].keys()
    online.observe_copy("d2h", "cuda", BLOCK, 1e-3)  # a direction the base never measured
    online.observe_copy("h2h", "torch", BLOCK, 1e-3)
    assert online.num_observations == {"d2h cuda": 1, "h2h torch": 1, "prefill": 0}
    OnlineProfile(LLAMA).observe_copy("h2h", "my_method", BLOCK, 1e-3)  # no base: nothing to replace


@pytest.mark.parametrize("zero", [0.0, 0, np.float64(0.0)], ids=["float", "int", "numpy"])
def test_a_measured_zero_seconds_is_accepted_and_counted(zero):
    """A transfer or forward faster than the clock's resolution measures 0 s: a real observation (kept as
    MIN_SECONDS, so its logarithm exists), counted, and fitted with the rest."""
    online = OnlineProfile(LLAMA, Profile.load(CPU_PROFILE))
    online.observe_copy("h2h", "cpu", BLOCK, zero)
    online.observe_forward(16, zero)
    online.observe_forward([4, 8], zero, cached_tokens=[0, 16])
    assert online.num_observations == {"h2h cpu": 1, "prefill": 2}
    learned = online.profile()
    assert learned.hardware["online"]["observations"] == {"h2h cpu": 1, "prefill": 2}
    assert math.isfinite(learned.predict("h2h", BLOCK, num_blocks=1))


def test_observations_are_kept_for_ten_half_lives():
    """With half_life=16, 80 one-block transfers then 16 of 64 blocks, all of one law and without a base:
    the one-block transfers (16..95 observations old, within HISTORY_HALF_LIVES half-lives) still tell the
    fixed cost, so the one-block prediction is the law's. Kept for one half-life only, the 64-block ones
    alone would leave alpha and beta apart unknown (predicted ~30% low)."""
    half_life = 16
    online = OnlineProfile(LLAMA, half_life=half_life)
    law = copy_law(ALPHA_S, BETA)
    for num_blocks in [1] * 80 + [64] * 16:
        online.observe_copy("h2h", "cpu", num_blocks * BLOCK, law(num_blocks * BLOCK), num_blocks=num_blocks)
    predicted = online.profile().predict("h2h", BLOCK, num_blocks=1, method="cpu")
    assert predicted == pytest.approx(law(BLOCK), rel=0.05)


def test_without_a_base_the_bandwidth_cap_follows_the_fastest_observed_rate():
    """No calibration: the cap is OBSERVED_RATE_CAP_FACTOR x the fastest rate a transfer showed. 4 KiB and
    64 MiB transfers at 1 ms + 10 GB/s show 4 MB/s and 8.7 GB/s; a cap from the slowest (65 MB/s) would hold
    the learned bandwidth far below the link's 10 GB/s."""
    alpha, beta = 1e-3, 10e9
    online = OnlineProfile(LLAMA)
    for _ in range(10):
        for nbytes in (4 << 10, 64 << 20):
            online.observe_copy("h2h", "cpu", nbytes, alpha + nbytes / beta)
    fit = online.profile().directions["h2h"]["cpu"].fit
    assert fit.beta_bytes_per_s == pytest.approx(beta, rel=0.05)
    assert fit.alpha_s == pytest.approx(alpha, rel=0.05)
