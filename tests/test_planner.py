"""Planner: reload / recompute / split decisions and the small-prefix threshold.

Expected values are computed here independently of the planner: from the
closed forms, from ``spec.kv_bytes`` / ``spec.prefill_flops``, from the model
formulas, and by brute force over every prefix length or split point.
"""

from __future__ import annotations

import math

import pytest

import kvcopy
from kvcopy import Planner
from kvcopy.profile import LinkFit, MethodProfile, PrefillProfile, Profile

LLAMA = kvcopy.ModelSpec.preset("llama-3.1-8b")
B_TOK = LLAMA.kv_bytes_per_token()  # 131072 = 2^17 bytes per token, all layers

MISTRAL_CONFIG = {
    "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "vocab_size": 32000, "torch_dtype": "bfloat16",
}
WINDOW = 256
MISTRAL_SWA = kvcopy.ModelSpec.from_hf_config({**MISTRAL_CONFIG, "sliding_window": WINDOW}, name="mistral-swa")
MISTRAL_FULL = kvcopy.ModelSpec.from_hf_config(MISTRAL_CONFIG, name="mistral-full")


def linear(spec=LLAMA, *, la, bw, r, pa=0.0, share=0.0) -> Planner:
    return Planner(spec, load_alpha_s=la, load_bytes_per_s=bw, prefill_tokens_per_s=r, prefill_alpha_s=pa,
                   decode_share=share)


def flops(spec=LLAMA, *, la, bw, fps, pa=0.0, share=0.0) -> Planner:
    return Planner(spec, load_alpha_s=la, load_bytes_per_s=bw, prefill_flops_per_s=fps, prefill_alpha_s=pa,
                   decode_share=share)


def first_win(reload, recompute, limit):
    """Smallest n in [1, limit] with reload(n) < recompute(n) strictly, else None."""
    for n in range(1, limit + 1):
        if reload(n) < recompute(n):
            return n
    return None


def model_flops(spec, tokens: int, cached: int = 0) -> float:
    """Prefill FLOPs of a full-attention MHA spec from its fields: 2·N·n + 4·L·H·d·(n·P + n²/2)."""
    return 2 * spec.active_params * tokens + 4 * spec.num_layers * spec.num_attention_heads * spec.head_dim * (
        tokens * cached + tokens * tokens / 2)


# --------------------------------------------------------------------------- threshold, linear prefill

LINEAR_CASES = [
    dict(la=3e-3, bw=10e9, r=5000, pa=0.5e-3),
    dict(la=20e-3, bw=25e9, r=12000, pa=0.0),
    dict(la=0.25, bw=3e9, r=1500, pa=0.05),
    dict(la=1e-4, bw=50e9, r=2e5, pa=2e-5),
]


@pytest.mark.parametrize("case", LINEAR_CASES)
def test_threshold_matches_the_closed_form(case):
    planner = linear(**case)
    denominator = 1 / case["r"] - B_TOK / case["bw"]
    assert denominator > 0
    ratio = (case["la"] - case["pa"]) / denominator
    assert ratio > 1 and abs(ratio - round(ratio)) > 1e-3  # not an integer tie
    expected = math.ceil(ratio)
    assert planner.threshold_tokens() == expected
    # Brute force, with the planner's own costs and independently.
    assert first_win(planner.t_load, planner.t_prefill, expected + 10) == expected
    assert first_win(lambda n: case["la"] + LLAMA.kv_bytes(n) / case["bw"],
                     lambda n: case["pa"] + n / case["r"], expected + 10) == expected
    # decide() agrees on either side of the threshold (no new tokens).
    below, at = planner.decide(expected - 1), planner.decide(expected)
    assert below.t_reload >= below.t_recompute
    assert at.t_reload < at.t_recompute


@pytest.mark.parametrize("la,pa", [(2.0**-7, 0.0), (2.0**-6, 2.0**-7), (2.0**-4, 2.0**-4 - 2.0**-7)])
def test_threshold_at_an_exact_integer_tie_needs_one_more_token(la, pa):
    """Powers of two make every cost exact: at n = 8 reload and recompute tie, so 9 is the answer."""
    planner = linear(la=la, bw=2.0**27, r=2.0**9, pa=pa)  # B/bw = 2^-10, 1/r = 2^-9: denominator 2^-10
    assert (la - pa) / (2.0**-9 - B_TOK / 2.0**27) == 8.0
    assert planner.t_load(8) == planner.t_prefill(8)
    assert planner.t_load(9) < planner.t_prefill(9)
    assert planner.threshold_tokens() == 9


@pytest.mark.parametrize("r", [2.0**10, 2.0**11, 1500.0])
def test_threshold_is_none_when_reloading_never_wins(r):
    """Per-token load cost >= per-token compute (denominator <= 0) and a bigger load fixed cost."""
    planner = linear(la=2e-3, bw=2.0**27, r=r, pa=1e-3)
    assert 1 / r - B_TOK / 2.0**27 <= 0
    assert planner.threshold_tokens() is None
    for n in (1, 1000, 10**6, 2**31):
        assert planner.t_load(n) >= planner.t_prefill(n)


@pytest.mark.parametrize("la,pa", [(0.0, 1e-3), (1e-4, 1e-3), (1e-3, 1e-3)])
def test_threshold_is_one_when_reloading_always_wins(la, pa):
    planner = linear(la=la, bw=10e9, r=5000, pa=pa)
    assert 1 / 5000 - B_TOK / 10e9 > 0
    assert planner.threshold_tokens() == 1
    assert planner.t_load(1) < planner.t_prefill(1)


def test_threshold_is_one_when_reload_wins_only_short_prefixes():
    """load_alpha < prefill_alpha but denominator <= 0: reload wins up to some length, then loses;
    the threshold is the smallest winning length, 1."""
    planner = linear(la=1e-3, bw=2.0**27, r=2.0**11, pa=2e-3)
    assert planner.threshold_tokens() == 1
    assert planner.t_load(10**6) > planner.t_prefill(10**6)


# --------------------------------------------------------------------------- threshold, FLOPs prefill

FLOPS_CASES = [
    dict(la=5e-3, bw=1e9, fps=1e14, pa=1e-3),  # the linear terms nearly cancel: attention decides
    dict(la=4e-3, bw=5e8, fps=1e14, pa=0.0),  # linear terms alone never let reload win
    dict(la=30e-3, bw=20e9, fps=4e14, pa=5e-3),
]


@pytest.mark.parametrize("case", FLOPS_CASES)
def test_flops_threshold_is_the_smallest_winning_length(case):
    planner = flops(**case)
    threshold = planner.threshold_tokens()
    assert threshold is not None and threshold > 1
    # Every shorter prefix loses, this one wins: the planner's own costs ...
    for n in range(1, threshold):
        assert not planner.t_load(n) < planner.t_prefill(n), n
    assert planner.t_load(threshold) < planner.t_prefill(threshold)
    # ... and costs computed independently from the spec, and from the model formula.
    def reload(n):
        return case["la"] + LLAMA.kv_bytes(n) / case["bw"]

    def recompute(n):
        return case["pa"] + LLAMA.prefill_flops(n) / case["fps"]

    def recompute_formula(n):
        return case["pa"] + model_flops(LLAMA, n) / case["fps"]

    assert first_win(reload, recompute, threshold + 5) == threshold
    assert first_win(lambda n: case["la"] + n * B_TOK / case["bw"], recompute_formula, threshold + 5) == threshold
    for n in range(threshold, threshold + 2000, 97):  # and it keeps winning
        assert planner.t_load(n) < planner.t_prefill(n)


def test_flops_threshold_counts_the_quadratic_attention_term():
    """With the linear part alone reloading never wins here; attention makes it win, at the root
    of c·n² + (a - b)·n = la - pa."""
    case = FLOPS_CASES[1]
    planner = flops(**case)
    a = 2 * LLAMA.active_params / case["fps"]
    b = B_TOK / case["bw"]
    assert a < b
    c = 2 * LLAMA.num_layers * LLAMA.num_attention_heads * LLAMA.head_dim / case["fps"]
    root = ((b - a) + math.sqrt((b - a) ** 2 + 4 * c * (case["la"] - case["pa"]))) / (2 * c)
    assert planner.threshold_tokens() == math.floor(root) + 1


def test_t_prefill_flops_model_matches_spec():
    planner = flops(la=0.0, bw=1e9, fps=2e14, pa=3e-3)
    for tokens, cached in ((1, 0), (100, 0), (4096, 0), (64, 1000), (1000, 64)):
        expected = 3e-3 + LLAMA.prefill_flops(tokens, cached) / 2e14
        assert planner.t_prefill(tokens, cached) == pytest.approx(expected, rel=1e-12)
        assert planner.t_prefill(tokens, cached) == pytest.approx(3e-3 + model_flops(LLAMA, tokens, cached) / 2e14,
                                                                   rel=1e-12)
    assert planner.t_prefill(0) == 0.0
    assert planner.t_prefill(0, 100) == 0.0
    assert planner.t_load(1000) == pytest.approx(LLAMA.kv_bytes(1000) / 1e9)


# --------------------------------------------------------------------------- threshold, sliding window


def test_sliding_window_threshold_by_brute_force():
    """Per-token loading is dearer than computing, so a full-attention model never reloads; with a
    256-token window every layer keeps at most 256 tokens, the load cost stops growing and
    reloading wins from some length on."""
    la, bw, r, pa = 1e-3, 5e8, 5000, 0.0
    assert B_TOK / bw > 1 / r
    assert MISTRAL_SWA.num_sliding_layers == MISTRAL_SWA.num_layers
    assert MISTRAL_SWA.kv_bytes(10 * WINDOW) == MISTRAL_SWA.kv_bytes(WINDOW) == WINDOW * B_TOK
    assert linear(MISTRAL_FULL, la=la, bw=bw, r=r, pa=pa).threshold_tokens() is None
    planner = linear(MISTRAL_SWA, la=la, bw=bw, r=r, pa=pa)
    threshold = planner.threshold_tokens()
    expected = first_win(lambda n: la + min(n, WINDOW) * B_TOK / bw, lambda n: pa + n / r, 10**5)
    assert expected is not None and expected > WINDOW
    assert threshold == expected
    assert first_win(planner.t_load, planner.t_prefill, 10**5) == expected
    assert expected == math.floor(r * (la + WINDOW * B_TOK / bw - pa)) + 1


@pytest.mark.parametrize("la,bw,fps,pa", [(5e-3, 1e9, 1e14, 1e-3), (0.2, 2e9, 5e13, 0.0)])
def test_sliding_window_flops_threshold_by_brute_force(la, bw, fps, pa):
    planner = flops(MISTRAL_SWA, la=la, bw=bw, fps=fps, pa=pa)
    threshold = planner.threshold_tokens()
    expected = first_win(lambda n: la + MISTRAL_SWA.kv_bytes(n) / bw,
                         lambda n: pa + MISTRAL_SWA.prefill_flops(n) / fps, 200_000)
    assert threshold == expected
    assert first_win(planner.t_load, planner.t_prefill, 200_000) == expected


def test_sliding_window_below_the_window_is_like_full_attention():
    case = dict(la=3e-3, bw=10e9, r=5000, pa=0.5e-3)  # threshold 14, well inside the window
    assert linear(MISTRAL_SWA, **case).threshold_tokens() == linear(MISTRAL_FULL, **case).threshold_tokens() == 14


# --------------------------------------------------------------------------- decisions


def test_tiny_prefix_with_a_big_load_fixed_cost_recomputes():
    planner = linear(la=10e-3, bw=10e9, r=5000)
    for prefix in (1, 2, 4, 16):
        d = planner.decide(prefix)
        assert d.action == "recompute", d
        assert d.t_recompute == pytest.approx(prefix / 5000)
        assert d.t_reload == pytest.approx(10e-3 + LLAMA.kv_bytes(prefix) / 10e9)
        assert d.t_recompute < d.t_reload
        assert d.t_split is None or d.t_split >= 10e-3
        assert d.prefix_tokens == prefix and d.new_tokens == 0
        assert "recompute" in d.explanation


def test_long_prefixes_reload_when_a_prefill_has_a_big_fixed_cost():
    """Every prefill (and so every split) pays 0.2 s; loading a few thousand tokens is cheaper."""
    planner = linear(la=1e-4, bw=25e9, r=1e5, pa=0.2)
    assert planner.threshold_tokens() == 1
    for prefix in (1024, 4096, 16384):
        d = planner.decide(prefix)
        assert d.action == "reload", d
        assert d.t_reload == pytest.approx(1e-4 + prefix * B_TOK / 25e9)
        assert d.t_reload < d.t_recompute
        assert d.t_split is not None and d.t_split >= 0.2 > d.t_reload
        assert str(prefix) in d.explanation and d.explanation.startswith("reload")


def test_long_prefixes_reload_with_the_flops_model():
    planner = flops(la=1e-4, bw=25e9, fps=1e14, pa=0.5)
    for prefix in (2048, 8192):
        d = planner.decide(prefix)
        assert d.action == "reload", d
        assert d.t_recompute == pytest.approx(0.5 + LLAMA.prefill_flops(prefix) / 1e14)


def test_reload_beats_recompute_beyond_the_threshold():
    planner = linear(la=3e-3, bw=10e9, r=5000, pa=0.5e-3)
    threshold = planner.threshold_tokens()
    for prefix in (threshold, 10 * threshold, 1000 * threshold):
        d = planner.decide(prefix)
        assert d.t_reload < d.t_recompute
        assert d.action in ("reload", "split")
        assert d.action == "reload" or d.t_split < d.t_reload


def _split_costs(planner, spec, prefix, *, la, bw, share=0.0):
    """Independent split time for every x in [1, prefix - 1]."""
    def prefill(x):
        if planner.prefill_tokens_per_s is not None:
            return planner.prefill_alpha_s + x / planner.prefill_tokens_per_s
        return planner.prefill_alpha_s + spec.prefill_flops(x) / planner.prefill_flops_per_s

    return {x: max(prefill(x), la + (spec.kv_bytes(prefix) - spec.kv_bytes(x)) / (bw * (1 - share)))
            for x in range(1, prefix)}


@pytest.mark.parametrize("prefix", [10, 999, 1000, 4096])
def test_split_beats_both_when_load_and_compute_are_comparable(prefix):
    """Loading a token takes as long as computing one: compute the first half while the rest loads."""
    bw = B_TOK * 5000.0
    planner = linear(la=0.0, bw=bw, r=5000)
    d = planner.decide(prefix)
    assert d.action == "split", d
    assert 0 < d.split_tokens < prefix
    assert d.t_split < min(d.t_reload, d.t_recompute)
    assert d.t_reload == pytest.approx(prefix / 5000)
    assert d.t_recompute == pytest.approx(prefix / 5000)
    x = d.split_tokens
    assert d.t_split == pytest.approx(max(x / 5000, (LLAMA.kv_bytes(prefix) - LLAMA.kv_bytes(x)) / bw), rel=1e-12)
    costs = _split_costs(planner, LLAMA, prefix, la=0.0, bw=bw)
    assert d.t_split == pytest.approx(min(costs.values()), rel=1e-12)
    assert abs(x - prefix / 2) <= 1
    assert d.t_split == pytest.approx(math.ceil(prefix / 2) / 5000, rel=1e-12)
    assert f"first {x} of {prefix}" in d.explanation


@pytest.mark.parametrize("kind,kw", [
    ("linear", dict(la=2e-3, bw=8e9, r=20000, pa=1e-3)),
    ("flops", dict(la=2e-3, bw=8e9, fps=3e14, pa=1e-3)),
    ("flops", dict(la=0.0, bw=2e9, fps=1e14, pa=0.0)),
])
@pytest.mark.parametrize("prefix", [2, 3, 64, 777, 3000])
def test_split_point_is_the_best_one(kind, kw, prefix):
    planner = linear(**kw) if kind == "linear" else flops(**kw)
    d = planner.decide(prefix)
    costs = _split_costs(planner, LLAMA, prefix, la=kw["la"], bw=kw["bw"])
    assert d.t_split is not None
    assert d.t_split == pytest.approx(min(costs.values()), rel=1e-12)
    assert d.t_split == pytest.approx(costs[d.split_tokens], rel=1e-12)
    assert 1 <= d.split_tokens <= prefix - 1
    best = min(d.t_reload, d.t_recompute, d.t_split)
    assert {"reload": d.t_reload, "recompute": d.t_recompute, "split": d.t_split}[d.action] == best


def test_split_on_a_sliding_window_model_by_brute_force():
    la, bw, r = 1e-3, 5e8, 5000
    planner = linear(MISTRAL_SWA, la=la, bw=bw, r=r)
    for prefix in (100, 300, 2000):
        d = planner.decide(prefix)
        costs = _split_costs(planner, MISTRAL_SWA, prefix, la=la, bw=bw)
        assert d.t_split == pytest.approx(min(costs.values()), rel=1e-12)
        assert d.t_reload == pytest.approx(la + min(prefix, WINDOW) * B_TOK / bw)


def test_a_prefix_too_short_to_split():
    d = linear(la=0.0, bw=B_TOK * 5000.0, r=5000).decide(1)
    assert d.t_split is None and d.split_tokens == 0
    assert d.action in ("reload", "recompute")


def test_empty_prefix_recomputes():
    planner = linear(la=0.0, bw=1e12, r=10.0)  # reloading would be free
    d = planner.decide(0)
    assert d.action == "recompute"
    assert d.t_split is None and d.split_tokens == 0
    assert d.t_reload == 0.0 and d.t_recompute == 0.0
    assert "no cached prefix" in d.explanation
    d = planner.decide(0, 50)
    assert d.action == "recompute"
    assert d.t_recompute == pytest.approx(50 / 10.0)
    assert d.t_reload == pytest.approx(d.t_recompute)  # only the new tokens to compute either way


# --------------------------------------------------------------------------- new tokens, decode share


@pytest.mark.parametrize("prefix,new", [(1, 1), (500, 100), (4096, 1), (4096, 3000)])
def test_new_tokens_add_the_extend_cost(prefix, new):
    la, bw, r, pa = 2e-3, 10e9, 8000, 1e-3
    d = linear(la=la, bw=bw, r=r, pa=pa).decide(prefix, new)
    assert d.new_tokens == new
    assert d.t_reload == pytest.approx(la + LLAMA.kv_bytes(prefix) / bw + pa + new / r, rel=1e-12)
    assert d.t_recompute == pytest.approx(pa + (prefix + new) / r, rel=1e-12)
    base = linear(la=la, bw=bw, r=r, pa=pa).decide(prefix)
    assert d.t_reload > base.t_reload
    if base.t_split is not None:
        assert d.t_split == pytest.approx(base.t_split + pa + new / r, rel=1e-12)

    fps = 2e14
    d = flops(la=la, bw=bw, fps=fps, pa=pa).decide(prefix, new)
    extend = pa + LLAMA.prefill_flops(new, prefix) / fps
    assert extend == pytest.approx(pa + model_flops(LLAMA, new, prefix) / fps, rel=1e-12)
    assert d.t_reload == pytest.approx(la + LLAMA.kv_bytes(prefix) / bw + extend, rel=1e-12)
    assert d.t_recompute == pytest.approx(pa + LLAMA.prefill_flops(prefix + new) / fps, rel=1e-12)


@pytest.mark.parametrize("share", [0.1, 0.5, 0.9, 0.999])
def test_decode_share_slows_the_byte_term_only(share):
    la, bw = 4e-3, 10e9
    base = linear(la=la, bw=bw, r=5000)
    shared = linear(la=la, bw=bw, r=5000, share=share)
    for prefix in (16, 1024, 100_000):
        d0, d = base.decide(prefix), shared.decide(prefix)
        assert d.t_reload - la == pytest.approx((d0.t_reload - la) / (1 - share), rel=1e-12)
        assert d.t_reload == pytest.approx(la + LLAMA.kv_bytes(prefix) / (bw * (1 - share)), rel=1e-12)
        assert d.t_recompute == d0.t_recompute
    t0, t = base.threshold_tokens(), shared.threshold_tokens()
    assert t is None or t >= t0


def test_decode_share_can_flip_a_reload():
    kw = dict(la=1e-4, bw=25e9, r=1e5, pa=0.2)
    assert linear(**kw).decide(4096).action == "reload"
    d = linear(**kw, share=0.9).decide(4096)
    assert d.action != "reload"
    assert d.t_reload > min(d.t_recompute, d.t_split)
    # Taken far enough, not even a split is worth it: recompute.
    kw = dict(la=1e-4, bw=1e9, r=1e5, pa=0.2)
    assert linear(**kw).decide(16).action == "reload"
    assert linear(**kw, share=0.9995).decide(16).action == "recompute"


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("kwargs", [
    dict(load_alpha_s=0.0, load_bytes_per_s=1e9),  # neither prefill rate
    dict(load_alpha_s=0.0, load_bytes_per_s=1e9, prefill_tokens_per_s=1e3, prefill_flops_per_s=1e12),  # both
    dict(load_alpha_s=-1e-6, load_bytes_per_s=1e9, prefill_tokens_per_s=1e3),
    dict(load_alpha_s=0.0, load_bytes_per_s=0.0, prefill_tokens_per_s=1e3),
    dict(load_alpha_s=0.0, load_bytes_per_s=-1e9, prefill_tokens_per_s=1e3),
    dict(load_alpha_s=0.0, load_bytes_per_s=1e9, prefill_tokens_per_s=0.0),
    dict(load_alpha_s=0.0, load_bytes_per_s=1e9, prefill_tokens_per_s=-5.0),
    dict(load_alpha_s=0.0, load_bytes_per_s=1e9, prefill_flops_per_s=-1e12),
    dict(load_alpha_s=0.0, load_bytes_per_s=1e9, prefill_tokens_per_s=1e3, prefill_alpha_s=-1e-3),
    dict(load_alpha_s=0.0, load_bytes_per_s=1e9, prefill_tokens_per_s=1e3, decode_share=1.0),
    dict(load_alpha_s=0.0, load_bytes_per_s=1e9, prefill_tokens_per_s=1e3, decode_share=1.5),
    dict(load_alpha_s=0.0, load_bytes_per_s=1e9, prefill_tokens_per_s=1e3, decode_share=-0.1),
    dict(load_alpha_s=math.nan, load_bytes_per_s=1e9, prefill_tokens_per_s=1e3),
    dict(load_alpha_s=0.0, load_bytes_per_s=math.nan, prefill_tokens_per_s=1e3),
    dict(load_alpha_s=0.0, load_bytes_per_s=1e9, prefill_tokens_per_s=1e3, decode_share=math.nan),
])
def test_bad_arguments_are_value_errors(kwargs):
    with pytest.raises(ValueError):
        Planner(LLAMA, **kwargs)


@pytest.mark.parametrize("prefix,new", [(-1, 0), (1.5, 0), (True, 0), ("10", 0), (10, -1), (10, 2.0), (10, False)])
def test_decide_rejects_bad_token_counts(prefix, new):
    with pytest.raises(ValueError):
        linear(la=0.0, bw=1e9, r=1e3).decide(prefix, new)


# --------------------------------------------------------------------------- from_profile


def _fit(alpha, beta):
    return LinkFit(alpha_s=alpha, beta_bytes_per_s=beta, r2=1.0, max_abs_residual=0.0)


def _profile(links, prefill=True, planes=16):
    return Profile(hardware={"device_name": "synthetic", "calibration_planes": planes}, links=links,
                   prefill=PrefillProfile(model="llama-3.1-8b", alpha_s=0.03, flops_per_s=2e13, r2=1.0)
                   if prefill else None)


def test_from_profile_uses_the_fit_at_the_models_block_size():
    per_block = {4096: _fit(10e-6, 20e9), 32768: _fit(18e-6, 33e9), 262144: _fit(32e-6, 42e9)}
    p = _profile({"h2h": {"cpu": MethodProfile(_fit(13e-6, 30e9), per_block),
                          "torch": MethodProfile(_fit(1e-3, 1e9), {b: _fit(1e-3, 1e9) for b in per_block})}})
    # Llama: 16 tokens x 8 heads x 128 x 2 bytes = 32 KiB per K (or V) plane-block.
    assert LLAMA.block_nbytes(16) / (2 * LLAMA.num_layers) == 32768
    planner = Planner.from_profile(p, LLAMA, decode_share=0.25)
    assert planner.load_alpha_s == pytest.approx(18e-6)
    assert planner.load_bytes_per_s == pytest.approx(33e9)
    assert planner.prefill_flops_per_s == 2e13 and planner.prefill_tokens_per_s is None
    assert planner.prefill_alpha_s == 0.03
    assert planner.decode_share == 0.25
    assert planner.spec is LLAMA


def test_from_profile_without_block_fits_uses_the_overall_fit():
    p = _profile({"h2h": {"torch": MethodProfile(_fit(7e-6, 9e9))}})
    planner = Planner.from_profile(p, LLAMA)
    assert (planner.load_alpha_s, planner.load_bytes_per_s) == (7e-6, 9e9)


def test_from_profile_prefers_host_to_device():
    p = _profile({"h2h": {"torch": MethodProfile(_fit(7e-6, 9e9))},
                  "h2d": {"copy_engine": MethodProfile(_fit(20e-6, 50e9)), "cuda": MethodProfile(_fit(5e-6, 1e9))},
                  "d2h": {"cuda": MethodProfile(_fit(1e-6, 1e12))}})
    planner = Planner.from_profile(p, LLAMA)
    # 64 blocks of 2 MiB: copy_engine is far ahead on h2d.
    assert (planner.load_alpha_s, planner.load_bytes_per_s) == (20e-6, 50e9)


def test_from_profile_picks_the_method_fastest_at_the_models_block_size():
    """Two methods that swap places between 32 KiB and 256 KiB plane-blocks.

    Llama's plane-blocks are 32 KiB, where "cpu" moves 50 GB/s and "torch" 1 GB/s: the planner
    (documented: "the profile's best ... method at this model's plane-block size") should load
    at 50 GB/s. from_profile asks Profile.best_method, which splits a block over the 16
    calibration planes (128 KiB, nearest fit 256 KiB, where "torch" wins), then takes torch's
    32 KiB fit: 1 GB/s.
    """
    fast, slow = _fit(1e-6, 50e9), _fit(1e-3, 1e9)
    p = _profile({"h2h": {"cpu": MethodProfile(_fit(1e-5, 20e9), {32768: fast, 262144: slow}),
                          "torch": MethodProfile(_fit(1e-5, 20e9), {32768: slow, 262144: fast})}})
    planner = Planner.from_profile(p, LLAMA)
    assert planner.load_bytes_per_s == pytest.approx(50e9)
    assert planner.load_alpha_s == pytest.approx(1e-6)


def test_from_profile_errors():
    with pytest.raises(ValueError, match="host"):
        Planner.from_profile(_profile({"d2h": {"cuda": MethodProfile(_fit(1e-6, 1e10))}}), LLAMA)
    with pytest.raises(ValueError, match="prefill"):
        Planner.from_profile(_profile({"h2h": {"torch": MethodProfile(_fit(1e-6, 1e10))}}, prefill=False), LLAMA)


def test_from_profile_plans_for_mla_and_sliding_specs():
    p = _profile({"h2h": {"torch": MethodProfile(_fit(7e-6, 9e9), {4096: _fit(5e-6, 5e9),
                                                                   32768: _fit(7e-6, 9e9)})}})
    for spec in (kvcopy.ModelSpec.preset("deepseek-v3"), kvcopy.ModelSpec.preset("gemma-2-9b"), MISTRAL_SWA):
        planner = Planner.from_profile(p, spec)
        d = planner.decide(4096, 16)
        assert d.action in ("reload", "recompute", "split")
        threshold = planner.threshold_tokens()
        if threshold is not None:
            assert planner.t_load(threshold) < planner.t_prefill(threshold)
            assert threshold == 1 or not planner.t_load(threshold - 1) < planner.t_prefill(threshold - 1)
