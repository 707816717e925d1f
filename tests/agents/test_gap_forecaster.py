"""GapForecaster: pause lengths learned online, against known distributions drawn with seeded numpy RNGs (never
the clock).

* the prior: TraceLab's laws before any pause, recomputed here from the published quantiles;
* the pooled distribution against an independently written mixture (levels shrunk by n / (n + kappa));
* quantiles against the samples' own: log-normal and bimodal pauses;
* pooling: an unseen tool falls back to all tool pauses, a session with its own history moves toward it,
  one with few pauses stays near its parent, and sessions never mix;
* a client's estimates: a biased one corrected, an exact one tight, a noisy one calibrated;
* bounds: the window forgets, least recently used levels go, an ended session is forgotten;
* saving and loading (identical answers), bad files (FileFormatError naming the field), bad arguments;
* cdf and quantile consistent and monotone (hypothesis).
"""

from __future__ import annotations

import json
import math
from statistics import NormalDist

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcopy
import kvcopy.agents.forecast as forecast_mod
from kvcopy import FileFormatError
from kvcopy.agents import PSEUDO_OBSERVATIONS, GapForecaster
from kvcopy.agents.gap_forecast import KERNEL_SCALE
from kvcopy.agents.history import MIN_GAP_S, SESSION_WINDOW, WINDOW

KAPPA = 8.0  # the documented pseudo-observations, restated: a change of the constant must be deliberate
Z90 = 1.2815515655446004
QS = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95)


def lognormal_cdf(t, median, sigma):
    return NormalDist(math.log(median), sigma).cdf(math.log(t))


def tool_prior_cdf(t):
    """TraceLab's tool gap: p50 0.3 s, p90 13.6 s."""
    return lognormal_cdf(t, 0.3, math.log(13.6 / 0.3) / Z90)


def untooled_prior_cdf(t):
    """8 in 9 tool gaps, 1 in 9 human waits (p50 84 s, p90 20.6 min)."""
    human = lognormal_cdf(t, 84.0, math.log(20.6 * 60 / 84.0) / Z90)
    return 8 / 9 * tool_prior_cdf(t) + 1 / 9 * human


def kernel_cdf(t, log_gaps):
    """The smoothed empirical CDF of remembered pauses: logistic kernels of scale KERNEL_SCALE in log-space."""
    z = (math.log(t) - np.asarray(log_gaps)) / KERNEL_SCALE
    return float(np.mean(1.0 / (1.0 + np.exp(-z))))


def pooled_cdf(t, levels, prior_cdf):
    """The reference mixture: ``levels`` (lists of gaps in seconds, the most specific first) each weigh
    n / (n + kappa) of what the levels before them leave; the prior takes the rest."""
    remaining, total = 1.0, 0.0
    for gaps in levels:
        share = remaining * len(gaps) / (len(gaps) + KAPPA)
        if gaps:
            total += share * kernel_cdf(t, np.log(gaps))
        remaining -= share
    return total + remaining * prior_cdf(t)


def ks_distance(forecast, samples):
    """Kolmogorov distance between a forecast's CDF and the samples' empirical one."""
    s = np.sort(samples)
    n = len(s)
    return max(max(abs(forecast.cdf(x) - (i + 1) / n), abs(forecast.cdf(x) - i / n)) for i, x in enumerate(s))


def feed(forecaster, gaps, **where):
    for gap in gaps:
        forecaster.observe(float(gap), **where)


# ------------------------------------------------------------------ the prior


def test_constants_are_the_documented_ones():
    assert PSEUDO_OBSERVATIONS == KAPPA
    assert kvcopy.GapForecaster is GapForecaster


def test_prior_before_any_pause_is_tracelab():
    f = GapForecaster()
    assert f.quantile(0.5, tool="grep") == pytest.approx(0.3, rel=1e-9)
    assert f.quantile(0.9, tool="grep") == pytest.approx(13.6, rel=1e-9)
    for t in (1e-3, 0.1, 1.0, 30.0, 600.0, 1e5):
        assert f.cdf(t, tool="grep", session="s") == pytest.approx(tool_prior_cdf(t), abs=1e-12)
        assert f.cdf(t) == pytest.approx(untooled_prior_cdf(t), abs=1e-12)
        assert f.cdf(t, session="s") == pytest.approx(untooled_prior_cdf(t), abs=1e-12)


# ------------------------------------------------------------------ the pooled mixture, against a reference


def test_pooled_distribution_matches_the_reference_mixture():
    rng = np.random.default_rng(7)
    f = GapForecaster()
    other = np.exp(rng.normal(0.0, 1.5, 40))  # other tools' pauses: the root's
    mine = np.exp(rng.normal(2.0, 0.4, 5))  # session s under tool t
    theirs = np.exp(rng.normal(-1.0, 0.7, 20))  # tool t, other sessions
    for i, gap in enumerate(other):
        f.observe(float(gap), tool=f"tool-{i % 4}", session=f"x-{i}")
    feed(f, theirs, tool="t", session="y")
    feed(f, mine, tool="t", session="s")
    tool_t = [*theirs, *mine]
    root = [*other, *tool_t]
    for t in np.exp(np.linspace(-6, 8, 57)):
        expected = pooled_cdf(t, [list(mine), tool_t, root], tool_prior_cdf)
        assert f.cdf(float(t), session="s", tool="t") == pytest.approx(expected, abs=1e-12)
        assert f.cdf(float(t), tool="t") == pytest.approx(pooled_cdf(t, [tool_t, root], tool_prior_cdf), abs=1e-12)
        # an unseen tool, or a session never seen under t: all tool pauses, then the prior
        expected_root = pooled_cdf(t, [root], tool_prior_cdf)
        assert f.cdf(float(t), tool="never-seen") == pytest.approx(expected_root, abs=1e-12)
        assert f.cdf(float(t), session="s", tool="never-seen") == pytest.approx(expected_root, abs=1e-12)
        assert f.cdf(float(t), session="new", tool="t") == f.cdf(float(t), tool="t")
        # no tool named: the other root, untouched by tool pauses
        assert f.cdf(float(t), session="s") == pytest.approx(untooled_prior_cdf(t), abs=1e-12)


def test_levels_are_reported_with_their_weights():
    f = GapForecaster()
    feed(f, [1.0] * 8, session="s", tool="t")
    forecast = f.forecast(session="s", tool="t")
    names = [level.name for level in forecast.levels]
    assert names == ["session 's' under tool 't'", "tool 't'", "all tool pauses", "prior: TraceLab's tool gap"]
    assert [level.pauses for level in forecast.levels] == [8, 8, 8, 8]
    assert [level.weight for level in forecast.levels] == pytest.approx([0.5, 0.25, 0.125, 0.125])
    assert sum(level.weight for level in forecast.levels) == pytest.approx(1.0)
    words = forecast.explain()
    assert "session 's' under tool 't' (8 pauses, weight 0.50)" in words
    assert words.startswith(f"median {forecast.median_s:.3g} s (10-90%: {forecast.quantile(0.1):.3g} s to ")


# ------------------------------------------------------------------ against known distributions


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lognormal_quantiles_match_the_samples(seed):
    rng = np.random.default_rng(seed)
    samples = np.exp(rng.normal(math.log(2.0), 1.0, WINDOW))
    f = GapForecaster()
    feed(f, samples, tool="t")
    for q in QS:
        assert math.log(f.quantile(q, tool="t") / np.quantile(samples, q)) == pytest.approx(0.0, abs=0.06), q
    assert ks_distance(f.forecast(tool="t"), samples) < 0.025


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bimodal_quantiles_match_the_samples(seed):
    """Fast reads (0.1 s) and test runs (30 s), 60/40: no log-normal fits, the kernels do."""
    rng = np.random.default_rng(seed)
    fast = np.exp(rng.normal(math.log(0.1), 0.3, 307))
    slow = np.exp(rng.normal(math.log(30.0), 0.5, WINDOW - 307))
    samples = rng.permutation(np.concatenate([fast, slow]))
    f = GapForecaster()
    feed(f, samples, tool="t")
    for q in (0.05, 0.2, 0.4, 0.7, 0.8, 0.95):  # away from the gap between the modes, where a quantile jumps
        assert math.log(f.quantile(q, tool="t") / np.quantile(samples, q)) == pytest.approx(0.0, abs=0.06), q
    assert ks_distance(f.forecast(tool="t"), samples) < 0.025
    assert f.cdf(1.0, tool="t") == pytest.approx(307 / WINDOW, abs=0.02)  # the mass between the modes


# ------------------------------------------------------------------ pooling


def pooled_forecaster(rng):
    """Tool t's pauses around 1 s over many sessions."""
    f = GapForecaster()
    for i, gap in enumerate(np.exp(rng.normal(0.0, 0.5, 400))):
        f.observe(float(gap), session=f"other-{i % 50}", tool="t")
    return f


def test_a_session_with_its_own_history_moves_toward_it():
    rng = np.random.default_rng(3)
    f = pooled_forecaster(rng)
    feed(f, np.exp(rng.normal(math.log(20.0), 0.3, 40)), session="slow", tool="t")
    assert 12.0 < f.quantile(0.5, session="slow", tool="t") < 25.0
    # the tool's forecast moves a little (40 of 440 pauses), another session's not past it
    assert f.quantile(0.5, tool="t") < 1.5
    assert f.quantile(0.5, session="other-1", tool="t") < 1.5


def test_few_observations_stay_near_the_parent():
    rng = np.random.default_rng(4)
    f = pooled_forecaster(rng)
    f.observe(20.0, session="new", tool="t")
    tool_median = f.quantile(0.5, tool="t")
    assert math.log(f.quantile(0.5, session="new", tool="t") / tool_median) == pytest.approx(0.0, abs=0.2)
    # and the one pause weighs 1 / (1 + kappa) of the session's forecast
    assert f.forecast(session="new", tool="t").levels[0].weight == pytest.approx(1 / (1 + KAPPA))


def test_an_unseen_tool_falls_back_to_all_tool_pauses():
    rng = np.random.default_rng(5)
    f = GapForecaster()
    reads = np.exp(rng.normal(math.log(0.1), 0.3, 200))
    tests = np.exp(rng.normal(math.log(30.0), 0.5, 200))
    feed(f, reads, tool="read")
    feed(f, tests, tool="test")
    everything = np.concatenate([reads, tests])
    assert ks_distance(f.forecast(tool="web"), everything) < 0.03
    assert ks_distance(f.forecast(tool="test"), tests) < 0.05
    # a human wait (no tool) is not taught by tool pauses
    assert f.quantile(0.5) == pytest.approx(GapForecaster().quantile(0.5))


def test_sessions_never_mix():
    f = GapForecaster()
    feed(f, [100.0] * 30, session="a", tool="t")
    feed(f, [0.1] * 30, session="b", tool="t")
    assert f.quantile(0.5, session="a", tool="t") > 10 * f.quantile(0.5, session="b", tool="t")
    feed(f, [50.0] * 30, session="a")
    assert f.quantile(0.5, session="a") > 20.0
    assert f.quantile(0.5, session="b") == pytest.approx(f.quantile(0.5))  # b has no untooled pauses


# ------------------------------------------------------------------ the client's estimate


def test_a_biased_client_is_corrected():
    """Estimates a third of the real pause: believed at first, corrected by the pauses observed."""
    rng = np.random.default_rng(6)

    def draws(n):
        gaps = np.exp(rng.normal(math.log(20.0), 1.0, n))
        return gaps, gaps / 3.0 * np.exp(rng.normal(0.0, 0.1, n))

    f = GapForecaster()
    fresh = f.quantile(0.5, session="s", tool="build", resume_in_s=10.0)
    assert 5.0 < fresh < 12.0  # near the estimate (the prior's median 0.3 s pulls a little)
    for gap, estimate in zip(*draws(60), strict=True):
        f.observe(float(gap), session="s", tool="build", resume_in_s=float(estimate))
    corrected = f.forecast(session="s", tool="build", resume_in_s=10.0)
    assert corrected.median_s == pytest.approx(30.0, rel=0.15)
    assert corrected.estimate.corrected_s == pytest.approx(30.0, rel=0.15)
    assert corrected.estimate.pairs == 60 and corrected.estimate.share > 0.9
    assert "corrected x3" in corrected.explain()
    # the correction is the tool's too: another session of the same client's tool is corrected
    assert f.quantile(0.5, session="s2", tool="build", resume_in_s=10.0) == pytest.approx(30.0, rel=0.2)
    # and calibrated: new pauses fall in the 10-90% band about 80% of the time
    inside = [
        f.quantile(0.1, session="s", tool="build", resume_in_s=float(e))
        <= g
        <= f.quantile(0.9, session="s", tool="build", resume_in_s=float(e))
        for g, e in zip(*draws(300), strict=True)
    ]
    assert 0.7 < np.mean(inside) < 0.95


def test_an_exact_client_ends_tight():
    rng = np.random.default_rng(8)
    f = GapForecaster()
    feed_gaps = np.exp(rng.normal(math.log(5.0), 1.5, 100))
    for gap in feed_gaps:
        f.observe(float(gap), session="s", tool="t", resume_in_s=float(gap))
    forecast = f.forecast(session="s", tool="t", resume_in_s=42.0)
    assert 0.95 * 42.0 < forecast.quantile(0.1) < 42.0 < forecast.quantile(0.9) < 1.05 * 42.0


def test_a_noisy_client_is_weighed_and_calibrated():
    """Estimates off by a log-normal factor (sigma 0.5), as the agent bench's hints: the forecast with the
    estimate beats the one without, and its 10-90% band holds about 80% of the pauses."""
    rng = np.random.default_rng(9)

    def draws(n):
        gaps = np.exp(rng.normal(math.log(10.0), 1.2, n))
        return gaps, gaps * np.exp(rng.normal(0.0, 0.5, n))

    f = GapForecaster()
    for gap, estimate in zip(*draws(300), strict=True):
        f.observe(float(gap), tool="x", resume_in_s=float(estimate))
    gaps, estimates = draws(1000)
    with_estimate, without, inside = [], [], []
    for gap, estimate in zip(gaps, estimates, strict=True):
        forecast = f.forecast(tool="x", resume_in_s=float(estimate))
        with_estimate.append(abs(math.log(forecast.median_s / gap)))
        without.append(abs(math.log(f.quantile(0.5, tool="x") / gap)))
        inside.append(forecast.quantile(0.1) <= gap <= forecast.quantile(0.9))
    assert np.mean(with_estimate) < 0.6 * np.mean(without)
    assert 0.72 < np.mean(inside) < 0.88


# ------------------------------------------------------------------ bounds


def test_the_window_forgets_old_pauses():
    f = GapForecaster()
    feed(f, [1.0] * WINDOW, tool="t")
    feed(f, [100.0] * WINDOW, tool="t")
    assert f.quantile(0.05, tool="t") == pytest.approx(100.0, rel=0.2)
    feed(f, [1.0] * SESSION_WINDOW, session="s", tool="t")
    feed(f, [100.0] * SESSION_WINDOW, session="s", tool="t")
    assert f.forecast(session="s", tool="t").levels[0].pauses == SESSION_WINDOW


def test_least_recently_used_levels_are_forgotten(monkeypatch):
    monkeypatch.setattr(forecast_mod, "MAX_SESSION_LEVELS", 3)
    monkeypatch.setattr(forecast_mod, "MAX_TOOLS", 2)
    f = GapForecaster()
    for name in ("a", "b", "c"):
        f.observe(5.0, session=name, tool="t")
    f.quantile(0.5, session="a", tool="t")  # asked: a is used again
    f.observe(5.0, session="d", tool="t")  # b goes
    kept = {(s["session"], s["tool"]) for s in f.to_dict()["sessions"]}
    assert kept == {("a", "t"), ("c", "t"), ("d", "t")}
    f.observe(1.0, tool="u")
    f.observe(1.0, tool="v")  # t goes
    assert [t["tool"] for t in f.to_dict()["tools"]] == ["u", "v"]


def test_an_ended_session_is_forgotten():
    f = GapForecaster()
    feed(f, [9.0] * 20, session="s", tool="t")
    feed(f, [90.0] * 20, session="s")
    feed(f, [9.0] * 20, session="keep", tool="t")
    f.end_session("s")
    assert {s["session"] for s in f.to_dict()["sessions"]} == {"keep"}
    assert f.forecast(session="s", tool="t").levels[0].pauses == 0
    f.end_session("never-seen")
    with pytest.raises(TypeError, match="session"):
        f.end_session(None)


def test_a_gap_of_zero_is_a_millisecond():
    f = GapForecaster()
    feed(f, [0.0] * 100, tool="t")
    assert f.quantile(0.5, tool="t") == pytest.approx(MIN_GAP_S, rel=0.01)
    assert f.cdf(0.0, tool="t") == 0.0
    assert f.cdf(math.inf, tool="t") == 1.0


# ------------------------------------------------------------------ saving and loading


def trained(seed=10):
    rng = np.random.default_rng(seed)
    f = GapForecaster()
    for i in range(300):
        tool = ["read", "test", None][i % 3]
        gap = float(np.exp(rng.normal(0.0, 2.0)))
        estimate = float(gap * np.exp(rng.normal(0.3, 0.4))) if i % 2 else None
        f.observe(gap, session=f"s-{i % 7}", tool=tool, resume_in_s=estimate)
    return f


QUERIES = [
    {},
    {"tool": "read"},
    {"session": "s-3", "tool": "test"},
    {"session": "s-3"},
    {"session": "s-1", "tool": "read", "resume_in_s": 4.0},
    {"tool": "unseen", "resume_in_s": 0.5},
]


def test_save_and_load_answer_identically(tmp_path):
    f = trained()
    path = tmp_path / "deep" / "forecaster.json"
    f.save(path)
    loaded = GapForecaster.load(path)
    assert loaded.to_dict() == f.to_dict()
    for query in QUERIES:
        for q in (0.01, 0.1, 0.5, 0.9, 0.99):
            assert loaded.quantile(q, **query) == f.quantile(q, **query)
        for t in (0.01, 1.0, 100.0):
            assert loaded.cdf(t, **query) == f.cdf(t, **query)
    document = json.loads(path.read_text())
    assert (document["format"], document["version"]) == ("kvcopy-gap-forecaster", 1)
    assert not list(tmp_path.glob("deep/.*"))  # no temporary file left
    # both go on learning alike (each window's oldest pause is the next forgotten)
    for forecaster in (f, loaded):
        feed(forecaster, [3.0] * 600, tool="read")
    assert loaded.to_dict() == f.to_dict()
    assert GapForecaster.from_dict(json.loads(json.dumps(f.to_dict()))).to_dict() == f.to_dict()


def bad_documents():
    good = trained().to_dict()

    def changed(edit):
        doc = json.loads(json.dumps(good))
        edit(doc)
        return doc

    def pop(key):
        return lambda d: d.pop(key)

    return [
        ([1, 2], "(top level)"),
        (changed(lambda d: d.update(format="kvcopy-profile")), "format"),
        (changed(pop("format")), "format"),
        (changed(lambda d: d.update(version=2)), "version"),
        (changed(lambda d: d.update(version=True)), "version"),
        (changed(pop("version")), "version"),
        (changed(lambda d: d.update(extra=1)), "extra"),
        (changed(pop("sessions")), "sessions"),
        (changed(lambda d: d["roots"].pop("untooled")), "roots.untooled"),
        (changed(lambda d: d["roots"].update(other=d["roots"]["tool"])), "roots.other"),
        (
            changed(lambda d: d["roots"]["tool"]["log_gaps"].append("1.0")),
            f"roots.tool.log_gaps[{len(good['roots']['tool']['log_gaps'])}]",
        ),
        (changed(lambda d: d["roots"]["tool"].update(log_gaps=[0.0] * (WINDOW + 1))), "roots.tool.log_gaps"),
        (changed(lambda d: d["roots"]["tool"].update(log_gaps={})), "roots.tool.log_gaps"),
        (changed(lambda d: d["tools"][0].update(log_gaps=[True])), "tools[0].log_gaps[0]"),
        (changed(lambda d: d["tools"][1].update(log_ratios=[1e6])), "tools[1].log_ratios[0]"),
        (changed(lambda d: d["tools"][1].update(log_gaps=[-50.0])), "tools[1].log_gaps[0]"),
        (changed(lambda d: d["tools"][1].update(tool="read")), "tools[1].tool"),
        (changed(lambda d: d["tools"][0].update(tool="")), "tools[0].tool"),
        (changed(lambda d: d["sessions"][2].pop("tool")), "sessions[2].tool"),
        (changed(lambda d: d["sessions"][2].update(session=None)), "sessions[2].session"),
        (changed(lambda d: d["sessions"][2].update(log_gaps=[0.0] * (SESSION_WINDOW + 1))), "sessions[2].log_gaps"),
        (changed(lambda d: d["sessions"].append(dict(d["sessions"][0]))), f"sessions[{len(good['sessions'])}]"),
        (changed(lambda d: d.update(sessions="s-1")), "sessions"),
    ]


@pytest.mark.parametrize(("document", "field"), bad_documents())
def test_bad_files_name_the_field(tmp_path, document, field):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document))
    with pytest.raises(FileFormatError) as caught:
        GapForecaster.load(path)
    assert (caught.value.file, caught.value.field) == (str(path), field)
    assert str(caught.value).startswith(f"{path}: {field}: expected ")
    with pytest.raises(FileFormatError, match="<gap forecaster dict>"):
        GapForecaster.from_dict(document)


@pytest.mark.parametrize(
    ("content", "found"),
    [
        (b"{", "Expecting property name"),
        (b'{"format": "\xc3\x28"}', "UnicodeDecodeError"),
        (b'{"format": NaN}', "NaN is not JSON"),
    ],
)
def test_unreadable_files(tmp_path, content, found):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(FileFormatError, match=found) as caught:
        GapForecaster.load(path)
    assert caught.value.field == "(the file)"
    with pytest.raises(FileFormatError, match="a directory"):
        GapForecaster.load(tmp_path)
    with pytest.raises(FileNotFoundError, match="no file at"):
        GapForecaster.load(tmp_path / "missing.json")
    with pytest.raises(TypeError, match="path"):
        GapForecaster.load(3)


# ------------------------------------------------------------------ bad arguments


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda f: f.observe(-1.0), ValueError, "gap_s: expected a finite number >= 0, got -1.0"),
        (lambda f: f.observe(math.nan), ValueError, "gap_s"),
        (lambda f: f.observe(math.inf), ValueError, "gap_s"),
        (lambda f: f.observe(True), TypeError, "gap_s"),
        (lambda f: f.observe("3"), TypeError, "gap_s"),
        (lambda f: f.observe(1.0, session=3), TypeError, "session: expected a non-empty str or None, got int 3"),
        (lambda f: f.observe(1.0, session=""), ValueError, "session"),
        (lambda f: f.observe(1.0, tool=b"grep"), TypeError, "tool"),
        (lambda f: f.observe(1.0, tool=""), ValueError, "tool"),
        (lambda f: f.observe(1.0, resume_in_s=-2), ValueError, "resume_in_s"),
        (lambda f: f.observe(1.0, resume_in_s=False), TypeError, "resume_in_s"),
        (lambda f: f.quantile(0.0), ValueError, "q: expected a probability in (0, 1) (open), got 0.0"),
        (lambda f: f.quantile(1.0), ValueError, "q"),
        (lambda f: f.quantile(1.5), ValueError, "q"),
        (lambda f: f.quantile(math.nan), ValueError, "q"),
        (lambda f: f.quantile(True), TypeError, "q"),
        (lambda f: f.quantile("0.5"), TypeError, "q"),
        (lambda f: f.quantile(0.5, tool=1), TypeError, "tool"),
        (lambda f: f.quantile(0.5, resume_in_s=math.nan), ValueError, "resume_in_s"),
        (lambda f: f.cdf(-1.0), ValueError, "t_s: expected a number of seconds >= 0, got -1.0"),
        (lambda f: f.cdf(math.nan), ValueError, "t_s"),
        (lambda f: f.cdf(None), TypeError, "t_s"),
        (lambda f: f.cdf(True), TypeError, "t_s"),
        (lambda f: f.cdf(1.0, session=[]), TypeError, "session"),
    ],
)
def test_bad_arguments_change_nothing(call, error, words):
    f = trained()
    before = f.to_dict()
    with pytest.raises(error) as caught:
        call(f)
    assert words in str(caught.value)
    assert f.to_dict() == before


def test_numpy_numbers_are_numbers():
    f = GapForecaster()
    f.observe(np.float32(2.0), resume_in_s=np.int64(2))
    assert f.quantile(np.float64(0.5)) == f.quantile(0.5)


# ------------------------------------------------------------------ cdf and quantile, for any state

FORECASTER = trained(11)
WHERE = st.sampled_from(QUERIES)
PROBABILITY = st.floats(min_value=1e-9, max_value=1 - 1e-9)


@settings(max_examples=200, deadline=None)
@given(q=PROBABILITY, where=WHERE)
def test_cdf_of_the_quantile_is_q(q, where):
    assert FORECASTER.cdf(FORECASTER.quantile(q, **where), **where) == pytest.approx(q, abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(a=PROBABILITY, b=PROBABILITY, where=WHERE)
def test_quantile_is_monotone(a, b, where):
    lo, hi = sorted((a, b))
    assert FORECASTER.quantile(lo, **where) <= FORECASTER.quantile(hi, **where) * (1 + 1e-9)


@settings(max_examples=200, deadline=None)
@given(a=st.floats(min_value=0, max_value=1e8), b=st.floats(min_value=0, max_value=1e8), where=WHERE)
def test_cdf_is_monotone_and_a_probability(a, b, where):
    lo, hi = sorted((a, b))
    low, high = FORECASTER.cdf(lo, **where), FORECASTER.cdf(hi, **where)
    assert 0.0 <= low <= high <= 1.0


@pytest.mark.parametrize("where", QUERIES)
def test_all_of_a_plans_quantiles_at_once_are_each_q(where):
    """What plan_pause asks: 255 quantiles in one search, each the q-quantile to the scalar's tolerance."""
    forecast = FORECASTER.forecast(**where)
    qs = np.arange(1, 256) / 256
    found = forecast.quantiles(qs)
    assert np.all(np.diff(found) >= 0)
    assert [forecast.cdf(float(t)) for t in found] == pytest.approx(qs.tolist(), abs=1e-9)
