"""Planner: reload / layer-wise / split / recompute decisions, the roofline prefill, the threshold.

Expected values are computed here independently of the planner: from
``spec.kv_bytes`` / ``spec.prefill_flops`` / ``spec.weight_bytes``, from the
model formulas, and by brute force over every prefix length or split point.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import kvcopy
import kvcopy.planner.planner as planner_mod
from kvcopy import Planner
from kvcopy.profile import CostLine, MethodProfile, PrefillProfile, Profile

LLAMA = kvcopy.ModelSpec.preset("llama-3.1-8b")
B_TOK = LLAMA.kv_bytes_per_token()  # 131072 = 2^17 bytes per token, all layers

MISTRAL_CONFIG = {
    "model_type": "mistral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "torch_dtype": "bfloat16",
}
WINDOW = 256
MISTRAL_SWA = kvcopy.ModelSpec.from_hf_config({**MISTRAL_CONFIG, "sliding_window": WINDOW}, name="mistral-swa")
MISTRAL_FULL = kvcopy.ModelSpec.from_hf_config(MISTRAL_CONFIG, name="mistral-full")


MIXTRAL = kvcopy.ModelSpec.preset("mixtral-8x7b")
DEEPSEEK = kvcopy.ModelSpec.preset("deepseek-v3")


def linear(spec=LLAMA, *, la, bw, r, pa=0.0, share=0.0, **kw) -> Planner:
    return Planner(spec, load=CostLine(la, bw), prefill_tokens_per_s=r, prefill_alpha_s=pa, decode_share=share, **kw)


def flops(spec=LLAMA, *, la, bw, fps, pa=0.0, share=0.0, wbps=None, **kw) -> Planner:
    return Planner(
        spec,
        load=CostLine(la, bw),
        prefill_flops_per_s=fps,
        prefill_alpha_s=pa,
        weight_bytes_per_s=wbps,
        decode_share=share,
        **kw,
    )


def h200_like(spec=LLAMA, **kw) -> Planner:
    """Published H200 + PCIe Gen5 figures: 50 GB/s loads with 20 us per call, 500 TFLOP/s prefill,
    4.8 TB/s weight reads (not measured)."""
    return flops(spec, la=20e-6, bw=50e9, fps=5e14, wbps=4.8e12, **kw)


def wins(planner: Planner, prefix: int, new: int = 1) -> bool:
    """decide() keeps the cache: an option that beats recompute (a split by the margin)."""
    d = planner.decide(prefix, new)
    keep = [t for t in (d.t_reload, d.t_layerwise) if t is not None]
    if d.t_split is not None and d.t_split < min([*keep, d.t_recompute]) * (1 - planner.split_margin):
        keep.append(d.t_split)
    assert (d.action != "recompute") == (min(keep) < d.t_recompute), d
    return d.action != "recompute"


def brute_threshold(planner: Planner, limit: int, new: int = 1) -> int | None:
    """The smallest P such that every P' in [P, limit] wins, scanning every length."""
    if not wins(planner, limit, new):
        return None
    threshold = limit
    for prefix in range(limit - 1, 0, -1):
        if not wins(planner, prefix, new):
            break
        threshold = prefix
    return threshold


def model_flops(spec, tokens: int, cached: int = 0) -> float:
    """Prefill FLOPs of a full-attention MHA spec from its fields: 2·N·n + 4·L·H·d·(n·P + n²/2)."""
    return 2 * spec.active_params * tokens + 4 * spec.num_layers * spec.num_attention_heads * spec.head_dim * (
        tokens * cached + tokens * tokens / 2
    )


# --------------------------------------------------------------------------- the roofline prefill


@pytest.mark.parametrize("spec", [LLAMA, MISTRAL_SWA, MIXTRAL, DEEPSEEK], ids=lambda s: s.name)
def test_prefill_is_the_slower_of_compute_and_weight_reads(spec):
    planner = flops(spec, la=0.0, bw=1e9, fps=4e14, wbps=3e12, pa=1e-4)
    for tokens, cached in ((1, 0), (16, 0), (100, 0), (4096, 0), (8, 2000), (1000, 64)):
        compute = spec.prefill_flops(tokens, cached) / 4e14
        memory = spec.weight_bytes(tokens, cached) / 3e12
        assert planner.t_prefill(tokens, cached) == pytest.approx(1e-4 + max(compute, memory), rel=1e-12)
    assert planner.t_prefill(0) == 0.0
    without_floor = flops(spec, la=0.0, bw=1e9, fps=4e14, pa=1e-4)
    assert without_floor.t_prefill(1) == pytest.approx(1e-4 + spec.prefill_flops(1) / 4e14, rel=1e-12)


def test_a_planner_predicts_for_its_spec_and_rates_as_they_are_now():
    """A planner keeps each forward's FLOPs and bytes (a threshold scan asks for the same ones thousands of
    times): a spec put in its place, or a rate learned online, is what the next prediction uses."""
    planner = flops(LLAMA, la=0.0, bw=1e9, fps=4e14, pa=1e-4)
    assert planner.t_prefill(1000, 64) == pytest.approx(1e-4 + LLAMA.prefill_flops(1000, 64) / 4e14, rel=1e-12)
    planner.spec = MIXTRAL
    assert planner.t_prefill(1000, 64) == pytest.approx(1e-4 + MIXTRAL.prefill_flops(1000, 64) / 4e14, rel=1e-12)
    planner.prefill_flops_per_s = 1e14
    assert planner.t_prefill(1000, 64) == pytest.approx(1e-4 + MIXTRAL.prefill_flops(1000, 64) / 1e14, rel=1e-12)


def test_weight_bytes_of_a_dense_model_from_its_parameters():
    """Every non-embedding weight and the LM head once per forward, in the checkpoint's dtype, plus the
    cached KV; the same for one token or a thousand."""
    weights = (LLAMA.active_params + LLAMA.vocab_size * LLAMA.hidden_size) * 2  # bf16
    assert LLAMA.weight_bytes(1) == LLAMA.weight_bytes(1000) == weights
    assert 15e9 < weights < 17e9  # an 8B model reads ~16 GB per forward
    assert LLAMA.weight_bytes(1, 4096) == weights + 4096 * B_TOK


def test_weight_bytes_of_a_moe_model_grow_with_the_experts_touched():
    spec = MIXTRAL  # 8 experts, 2 per token
    assert spec.experts_touched(1) == pytest.approx(2)
    assert spec.experts_touched(2) == pytest.approx(8 * (1 - 0.75**2))
    assert spec.experts_touched(10_000) == pytest.approx(8)
    one, many = spec.weight_bytes(1), spec.weight_bytes(10_000)
    assert many - one == pytest.approx(6 * spec.expert_params * 2, rel=1e-9)  # the 6 experts a token skips
    assert one == pytest.approx((spec.active_params + spec.vocab_size * spec.hidden_size) * 2, rel=1e-9)


def test_the_roofline_knee_of_a_dense_8b_model():
    """Compute catches up with reading 16 GB of weights at ~100-200 tokens on an H200-like machine."""
    planner = h200_like()
    floor = LLAMA.weight_bytes(1) / 4.8e12
    assert planner.t_prefill(1) == pytest.approx(floor)
    assert planner.t_prefill(64) == pytest.approx(floor)  # still memory-bound
    assert planner.t_prefill(1024) > 2 * floor  # compute-bound
    knee = next(n for n in range(1, 2000) if LLAMA.prefill_flops(n) / 5e14 > LLAMA.weight_bytes(n) / 4.8e12)
    assert 100 <= knee <= 200


# --------------------------------------------------------------------------- the threshold

THRESHOLD_CASES = [
    pytest.param(LLAMA, dict(la=20e-6, bw=50e9, fps=5e14, wbps=4.8e12), id="llama-h200"),
    pytest.param(LLAMA, dict(la=3e-3, bw=10e9, fps=2e14, pa=0.5e-3), id="llama-big-load-cost"),
    pytest.param(MISTRAL_SWA, dict(la=1e-3, bw=5e8, fps=1e14, wbps=2e12), id="mistral-window-slow-link"),
    pytest.param(MIXTRAL, dict(la=20e-6, bw=50e9, fps=5e14, wbps=4.8e12), id="mixtral-h200"),
    pytest.param(DEEPSEEK, dict(la=20e-6, bw=50e9, fps=5e14, wbps=4.8e12), id="deepseek-h200"),
    pytest.param(LLAMA, dict(la=1e-4, bw=2.0**27, fps=1e14, pa=1e-3), id="llama-loses-long-prefixes"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "kw"), THRESHOLD_CASES)
@pytest.mark.parametrize("new", [1, 64])
def test_threshold_matches_a_brute_force_scan_of_decide(spec, kw, new):
    limit = 3000
    planner = flops(spec, **kw)
    expected = brute_threshold(planner, limit, new)
    assert planner.threshold_tokens(new, max_tokens=limit) == expected


@pytest.mark.slow
def test_threshold_on_an_h200_like_machine_is_past_the_roofline_knee():
    """Short prefixes are as cheap to recompute as one token's forward: keeping them does not pay."""
    threshold = h200_like().threshold_tokens(max_tokens=8192)
    assert threshold is not None and 64 <= threshold <= 400
    without_floor = flops(la=20e-6, bw=50e9, fps=5e14).threshold_tokens(max_tokens=8192)
    assert without_floor is not None and without_floor < threshold


def test_threshold_is_none_when_recompute_wins_at_the_longest_prefix():
    """Loading a token costs 25x computing it and a split gains less than the 10% margin: at 4096 cached
    tokens with 64 new ones recompute wins, so there is no threshold, whatever shorter prefixes do."""
    planner = flops(la=1e-4, bw=2.0**25, fps=1e14, pa=1e-3, split_margin=0.1)
    assert planner.decide(4096, 64).action == "recompute"
    assert planner.threshold_tokens(64, max_tokens=4096) is None
    assert brute_threshold(planner, 4096, 64) is None


def test_threshold_scans_up_to_the_models_context_length():
    short = kvcopy.ModelSpec.from_hf_config({**MISTRAL_CONFIG, "max_position_embeddings": 1024}, name="short")
    assert short.context_length == 1024
    planner = flops(short, la=1e-4, bw=2.0**27, fps=1e14, pa=1e-3)
    # the longest prefix that leaves room for the one new token
    assert planner.threshold_tokens() == brute_threshold(planner, 1023)


def test_threshold_is_one_when_reloading_always_wins():
    planner = linear(la=0.0, bw=10e9, r=5000, pa=1e-3)
    assert planner.threshold_tokens(max_tokens=2000) == 1


# --------------------------------------------------------------------------- decisions


def test_decide_needs_at_least_one_new_token():
    planner = linear(la=0.0, bw=1e9, r=1e3)
    assert planner.decide(10).new_tokens == 1
    with pytest.raises(ValueError, match="at least the token it continues from"):
        planner.decide(10, 0)


def test_tiny_prefix_with_a_big_load_fixed_cost_recomputes():
    planner = linear(la=10e-3, bw=10e9, r=5000)
    for prefix in (1, 2, 4, 16):
        d = planner.decide(prefix)
        assert d.action == "recompute", d
        assert d.t_recompute == pytest.approx((prefix + 1) / 5000)
        assert d.t_reload == pytest.approx(10e-3 + LLAMA.kv_bytes(prefix) / 10e9 + 1 / 5000)
        assert d.prefix_tokens == prefix and d.new_tokens == 1
        assert d.explanation.startswith("recompute")


def test_long_prefixes_reload_when_a_prefill_has_a_big_fixed_cost():
    """Every forward (and so every split) pays 0.2 s; loading a few thousand tokens is cheaper."""
    planner = linear(la=1e-4, bw=25e9, r=1e5, pa=0.2)
    for prefix in (1024, 4096, 16384):
        d = planner.decide(prefix)
        assert d.action == "reload", d
        assert d.t_reload == pytest.approx(1e-4 + prefix * B_TOK / 25e9 + 0.2 + 1e-5)
        assert d.t_split is not None and d.t_split >= 0.4 > d.t_reload
        assert str(prefix) in d.explanation and d.explanation.startswith("reload")


@pytest.mark.parametrize("prefix,new", [(1, 1), (500, 100), (4096, 1), (4096, 3000)])
def test_new_tokens_add_the_extend_cost(prefix, new):
    la, bw, fps, pa, wbps = 2e-3, 10e9, 2e14, 1e-3, 2e12
    d = flops(la=la, bw=bw, fps=fps, pa=pa, wbps=wbps).decide(prefix, new)
    extend = pa + max(model_flops(LLAMA, new, prefix) / fps, LLAMA.weight_bytes(new, prefix) / wbps)
    assert d.new_tokens == new
    assert d.t_reload == pytest.approx(la + LLAMA.kv_bytes(prefix) / bw + extend, rel=1e-12)
    assert d.t_recompute == pytest.approx(
        pa + max(model_flops(LLAMA, prefix + new) / fps, LLAMA.weight_bytes(prefix + new) / wbps), rel=1e-12
    )


def test_load_nbytes_overrides_the_prefix_bytes():
    planner = linear(la=1e-3, bw=1e9, r=1e4)
    d = planner.decide(100, 1, load_nbytes=5_000_000)
    assert d.t_reload == pytest.approx(1e-3 + 5e-3 + 1e-4)


def test_the_load_takes_the_fastest_option_at_each_size():
    """A method with a small fixed cost wins small loads; a fast one wins large loads."""
    planner = linear(la=1e-6, bw=1e9, r=1e4, load_options=[CostLine(100e-6, 50e9)])
    small, large = 16384, 4096 * B_TOK
    assert planner.t_load_nbytes(small) == pytest.approx(1e-6 + small / 1e9)
    assert planner.t_load_nbytes(large) == pytest.approx(100e-6 + large / 50e9)
    assert planner.t_load(4096) == planner.t_load_nbytes(large)


def _split_costs(planner, spec, prefix):
    """Independent split time for every x in [1, prefix - 1]: full layers still load the tokens after x,
    sliding layers the part of their last W tokens that x does not cover."""
    per_layer = spec.kv_bytes_per_token() // spec.num_layers
    costs = {}
    for x in range(1, prefix):
        rest = 0
        for kind in spec.layer_types:
            if kind == "sliding_attention":
                window = min(prefix, spec.sliding_window)
                rest += window - max(0, x - (prefix - window))
            else:
                rest += prefix - x
        costs[x] = max(planner.t_prefill(x), planner.t_load_nbytes(rest * per_layer))
    return costs


@pytest.mark.parametrize("prefix", [10, 999, 4096])
def test_split_beats_both_when_load_and_compute_are_comparable(prefix):
    """Loading a token takes as long as computing one: compute the first half while the rest loads."""
    bw = B_TOK * 5000.0
    d = linear(la=0.0, bw=bw, r=5000).decide(prefix)
    assert d.action == "split", d
    assert d.t_split == pytest.approx(
        min(_split_costs(linear(la=0.0, bw=bw, r=5000), LLAMA, prefix).values()) + 1 / 5000, rel=1e-12
    )
    assert abs(d.split_tokens - prefix / 2) <= 1
    assert f"first {d.split_tokens} of {prefix}" in d.explanation


@pytest.mark.parametrize("spec", [LLAMA, MISTRAL_SWA], ids=lambda s: s.name)
@pytest.mark.parametrize("prefix", [2, 64, 777, 3000])
def test_split_point_is_the_best_one(spec, prefix):
    planner = flops(spec, la=2e-3, bw=8e9, fps=3e14, pa=1e-3, wbps=3e12)
    d = planner.decide(prefix)
    costs = _split_costs(planner, spec, prefix)
    extend = planner.t_prefill(1, prefix)
    assert d.t_split == pytest.approx(min(costs.values()) + extend, rel=1e-12)
    assert d.t_split == pytest.approx(costs[d.split_tokens] + extend, rel=1e-12)


def test_split_on_a_long_sliding_window_prefix_saves_nothing():
    """Beyond the window the first tokens are not cached in sliding layers: computing them saves no load,
    so a split is never cheaper than a reload there (it used to claim it was)."""
    planner = flops(MISTRAL_SWA, la=1e-3, bw=5e8, fps=1e14, wbps=2e12)
    for prefix in (1000, 32768):
        d = planner.decide(prefix)
        assert d.t_split >= d.t_reload
        assert d.action != "split"


def test_a_split_must_beat_the_others_by_the_margin():
    bw = B_TOK * 5000.0
    exact = linear(la=0.0, bw=bw, r=5000).decide(1000)
    assert exact.action == "split"
    gain = 1 - exact.t_split / min(exact.t_reload, exact.t_recompute)
    assert linear(la=0.0, bw=bw, r=5000, split_margin=gain * 0.9).decide(1000).action == "split"
    assert linear(la=0.0, bw=bw, r=5000, split_margin=gain * 1.1).decide(1000).action != "split"


def test_layerwise_reload_overlaps_the_load_with_the_new_tokens():
    planner = flops(la=1e-4, bw=25e9, fps=2e14, pa=1e-3, wbps=3e12, layerwise=True)
    for prefix, new in ((4096, 512), (1024, 64), (50, 2000)):
        d = planner.decide(prefix, new)
        load = 1e-4 + LLAMA.kv_bytes(prefix) / 25e9
        extend = planner.t_prefill(new, prefix)
        assert d.t_layerwise == pytest.approx(max(load, extend) + load / LLAMA.num_layers, rel=1e-12)
        assert d.t_layerwise <= d.t_reload
    assert planner.decide(4096, 512).action == "layerwise"
    assert flops(la=1e-4, bw=25e9, fps=2e14, pa=1e-3).decide(4096, 512).t_layerwise is None


def test_a_prefix_too_short_to_split():
    d = linear(la=0.0, bw=B_TOK * 5000.0, r=5000).decide(1)
    assert d.t_split is None and d.split_tokens == 0
    assert d.action in ("reload", "recompute")


def test_empty_prefix_recomputes():
    planner = linear(la=0.0, bw=1e12, r=10.0)  # reloading would be free
    d = planner.decide(0, 50)
    assert d.action == "recompute"
    assert d.t_split is None and d.split_tokens == 0
    assert d.t_recompute == pytest.approx(50 / 10.0)
    assert "no cached prefix" in d.explanation


# --------------------------------------------------------------------------- decode share


@pytest.mark.parametrize("share", [0.1, 0.5, 0.9, 0.999])
def test_decode_share_slows_the_byte_term_only(share):
    la, bw = 4e-3, 10e9
    base = linear(la=la, bw=bw, r=5000)
    shared = linear(la=la, bw=bw, r=5000, share=share)
    for prefix in (16, 1024, 100_000):
        assert shared.t_load(prefix) == pytest.approx(la + LLAMA.kv_bytes(prefix) / (bw * (1 - share)), rel=1e-12)
        assert shared.decide(prefix).t_recompute == base.decide(prefix).t_recompute


def test_decode_share_can_flip_a_reload():
    kw = dict(la=1e-4, bw=25e9, r=1e5, pa=0.2)
    assert linear(**kw).decide(4096).action == "reload"
    assert linear(**kw, share=0.9).decide(4096).action != "reload"


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(load=CostLine(0.0, 1e9)),  # neither prefill rate
        dict(load=CostLine(0.0, 1e9), prefill_tokens_per_s=1e3, prefill_flops_per_s=1e12),  # both
        dict(load=CostLine(0.0, 1e9), prefill_tokens_per_s=1e3, weight_bytes_per_s=1e12),  # no roofline
        dict(load=CostLine(0.0, 1e9), prefill_flops_per_s=1e12, weight_bytes_per_s=0.0),
        dict(load=CostLine(0.0, 1e9), prefill_flops_per_s=1e12, load_options=[CostLine(0.0, -1.0)]),
        dict(load=CostLine(0.0, 1e9), prefill_flops_per_s=1e12, split_margin=1.0),
        dict(load=CostLine(-1e-6, 1e9), prefill_tokens_per_s=1e3),
        dict(load=CostLine(0.0, 0.0), prefill_tokens_per_s=1e3),
        dict(load=CostLine(0.0, -1e9), prefill_tokens_per_s=1e3),
        dict(load=CostLine(0.0, 1e9), prefill_tokens_per_s=0.0),
        dict(load=CostLine(0.0, 1e9), prefill_tokens_per_s=-5.0),
        dict(load=CostLine(0.0, 1e9), prefill_flops_per_s=-1e12),
        dict(load=CostLine(0.0, 1e9), prefill_tokens_per_s=1e3, prefill_alpha_s=-1e-3),
        dict(load=CostLine(0.0, 1e9), prefill_tokens_per_s=1e3, decode_share=1.0),
        dict(load=CostLine(0.0, 1e9), prefill_tokens_per_s=1e3, decode_share=1.5),
        dict(load=CostLine(0.0, 1e9), prefill_tokens_per_s=1e3, decode_share=-0.1),
        dict(load=CostLine(math.nan, 1e9), prefill_tokens_per_s=1e3),
        dict(load=CostLine(0.0, math.nan), prefill_tokens_per_s=1e3),
        dict(load=CostLine(0.0, 1e9), prefill_tokens_per_s=1e3, decode_share=math.nan),
    ],
)
def test_bad_arguments_are_value_errors(kwargs):
    with pytest.raises(ValueError):
        Planner(LLAMA, **kwargs)


@pytest.mark.parametrize(
    ("prefix", "new", "error"),
    [
        (-1, 1, ValueError),
        (10, -1, ValueError),
        (10, 0, ValueError),
        (1.5, 1, TypeError),
        (True, 1, TypeError),
        ("10", 1, TypeError),
        (10, 2.0, TypeError),
        (10, False, TypeError),
    ],
)
def test_decide_rejects_bad_token_counts(prefix, new, error):
    with pytest.raises(error, match="prefix_tokens" if prefix != 10 else "new_tokens"):
        linear(la=0.0, bw=1e9, r=1e3).decide(prefix, new)


# --------------------------------------------------------------------------- from_profile


def _fit(alpha, beta):
    return CostLine(alpha_s=alpha, beta_bytes_per_s=beta, r2=1.0, max_abs_residual=0.0)


def _profile(links, prefill=True, planes=16):
    return Profile(
        hardware={"device_name": "synthetic", "calibration_planes": planes},
        directions=links,
        prefill=PrefillProfile(model="llama-3.1-8b", alpha_s=0.03, flops_per_s=2e13, r2=1.0) if prefill else None,
    )


def test_from_profile_uses_the_fit_at_the_models_block_size():
    per_block = {4096: _fit(10e-6, 20e9), 32768: _fit(18e-6, 33e9), 262144: _fit(32e-6, 42e9)}
    p = _profile(
        {
            "h2h": {
                "cpu": MethodProfile(_fit(13e-6, 30e9), per_block),
                "torch": MethodProfile(_fit(1e-3, 1e9), {b: _fit(1e-3, 1e9) for b in per_block}),
            }
        }
    )
    # Llama: 16 tokens x 8 heads x 128 x 2 bytes = 32 KiB per K (or V) plane-block.
    assert LLAMA.block_nbytes(16) / (2 * LLAMA.num_layers) == 32768
    planner = Planner.from_profile(p, LLAMA, decode_share=0.25)
    assert planner.load.alpha_s == pytest.approx(18e-6)
    assert planner.load.beta_bytes_per_s == pytest.approx(33e9)
    assert planner.prefill_flops_per_s == 2e13 and planner.prefill_tokens_per_s is None
    assert planner.prefill_alpha_s == 0.03
    assert planner.decode_share == 0.25
    assert planner.spec is LLAMA


def test_from_profile_without_block_fits_uses_the_overall_fit():
    p = _profile({"h2h": {"torch": MethodProfile(_fit(7e-6, 9e9))}})
    planner = Planner.from_profile(p, LLAMA)
    assert (planner.load.alpha_s, planner.load.beta_bytes_per_s) == (7e-6, 9e9)


def test_from_profile_prefers_host_to_device():
    p = _profile(
        {
            "h2h": {"torch": MethodProfile(_fit(7e-6, 9e9))},
            "h2d": {"copy_engine": MethodProfile(_fit(20e-6, 50e9)), "cuda": MethodProfile(_fit(5e-6, 1e9))},
            "d2h": {"cuda": MethodProfile(_fit(1e-6, 1e12))},
        }
    )
    planner = Planner.from_profile(p, LLAMA)
    # 64 blocks of 2 MiB: copy_engine is far ahead on h2d.
    assert (planner.load.alpha_s, planner.load.beta_bytes_per_s) == (20e-6, 50e9)


def test_from_profile_picks_the_method_fastest_at_the_models_block_size():
    """Two methods that swap places between 32 KiB and 256 KiB plane-blocks.

    Llama's plane-blocks are 32 KiB, where "cpu" moves 50 GB/s and "torch" 1 GB/s: the planner
    (documented: "the profile's best ... method at this model's plane-block size") should load
    at 50 GB/s. from_profile asks Profile.best_method, which splits a block over the 16
    calibration planes (128 KiB, nearest fit 256 KiB, where "torch" wins), then takes torch's
    32 KiB fit: 1 GB/s.
    """
    fast, slow = _fit(1e-6, 50e9), _fit(1e-3, 1e9)
    p = _profile(
        {
            "h2h": {
                "cpu": MethodProfile(_fit(1e-5, 20e9), {32768: fast, 262144: slow}),
                "torch": MethodProfile(_fit(1e-5, 20e9), {32768: slow, 262144: fast}),
            }
        }
    )
    planner = Planner.from_profile(p, LLAMA)
    assert planner.load.beta_bytes_per_s == pytest.approx(50e9)
    assert planner.load.alpha_s == pytest.approx(1e-6)


def test_from_profile_errors():
    with pytest.raises(ValueError, match="host"):
        Planner.from_profile(_profile({"d2h": {"cuda": MethodProfile(_fit(1e-6, 1e10))}}), LLAMA)
    with pytest.raises(ValueError, match="prefill"):
        Planner.from_profile(_profile({"h2h": {"torch": MethodProfile(_fit(1e-6, 1e10))}}, prefill=False), LLAMA)


@pytest.mark.slow
def test_from_profile_plans_for_mla_and_sliding_specs():
    p = _profile({"h2h": {"torch": MethodProfile(_fit(7e-6, 9e9), {4096: _fit(5e-6, 5e9), 32768: _fit(7e-6, 9e9)})}})
    for spec in (kvcopy.ModelSpec.preset("deepseek-v3"), kvcopy.ModelSpec.preset("gemma-2-9b"), MISTRAL_SWA):
        planner = Planner.from_profile(p, spec)
        d = planner.decide(4096, 16)
        assert d.action in ("reload", "recompute", "split")
        threshold = planner.threshold_tokens()
        if threshold is not None:
            assert planner.t_load(threshold) < planner.t_prefill(threshold)
            assert threshold == 1 or not planner.t_load(threshold - 1) < planner.t_prefill(threshold - 1)


def test_from_profile_scales_a_prefill_calibrated_on_another_model():
    p = _profile({"h2h": {"torch": MethodProfile(_fit(7e-6, 9e9))}})
    p.prefill = PrefillProfile(
        model="llama-3.1-8b", alpha_s=0.032, flops_per_s=2e13, r2=1.0, weight_bytes_per_s=1e11, num_layers=32
    )
    same = Planner.from_profile(p, LLAMA)
    assert same.note == "" and same.prefill_alpha_s == 0.032 and same.weight_bytes_per_s == 1e11
    big = kvcopy.ModelSpec.preset("llama-3.1-70b")
    other = Planner.from_profile(p, big)
    assert other.prefill_alpha_s == pytest.approx(0.032 * big.num_layers / 32)  # per-layer fixed cost
    assert (other.prefill_flops_per_s, other.weight_bytes_per_s) == (2e13, 1e11)  # rates carry over
    assert "prefill calibrated on llama-3.1-8b, scaled to llama-3.1-70b" in other.decide(1000).explanation
    # FLOPs and weight bytes scale it: a 70B forward reads ~9x the weights of an 8B one.
    assert other.t_prefill(1) / same.t_prefill(1) == pytest.approx(
        (0.032 * 80 / 32 + big.weight_bytes(1) / 1e11) / (0.032 + LLAMA.weight_bytes(1) / 1e11), rel=1e-9
    )


def test_from_profile_loads_with_the_fastest_method_at_each_size():
    small_fast = _fit(2e-6, 5e9)  # little fixed cost, slow
    big_fast = _fit(200e-6, 50e9)  # DMA-like: fixed cost, fast
    p = _profile({"h2d": {"cuda": MethodProfile(small_fast), "copy_engine": MethodProfile(big_fast)}})
    planner = Planner.from_profile(p, LLAMA)
    for tokens in (1, 16, 1024, 16384):
        nbytes = LLAMA.kv_bytes(tokens)
        assert planner.t_load(tokens) == pytest.approx(min(small_fast.predict(nbytes), big_fast.predict(nbytes)))
    assert planner.t_load(1) == pytest.approx(small_fast.predict(B_TOK))
    assert planner.t_load(16384) == pytest.approx(big_fast.predict(16384 * B_TOK))


def test_a_profile_written_before_the_roofline_still_loads(tmp_path):
    p = _profile({"h2h": {"torch": MethodProfile(_fit(7e-6, 9e9))}})
    data = p.to_dict()
    del data["prefill"]["weight_bytes_per_s"], data["prefill"]["num_layers"]
    path = tmp_path / "old.json"
    path.write_text(__import__("json").dumps(data))
    old = Profile.load(path)
    assert old.prefill.weight_bytes_per_s is None and old.prefill.num_layers is None
    planner = Planner.from_profile(old, LLAMA)
    assert planner.weight_bytes_per_s is None  # no memory-bound floor: prefill as before
    assert planner.t_prefill(1) == pytest.approx(0.03 + LLAMA.prefill_flops(1) / 2e13)


# --------------------------------------------------------------------------- tensor parallelism


def test_shard_splits_heads_flops_and_weights():
    big = kvcopy.ModelSpec.preset("llama-3.1-70b")
    rank = big.shard(4)
    assert (rank.tp, rank.num_attention_heads, rank.num_kv_heads) == (4, 16, 2)
    assert rank.block_nbytes(16) / (2 * rank.num_layers) == 8192  # the bench's llama70b-tp4-16 plane-blocks
    assert rank.kv_bytes_per_token() == big.kv_bytes_per_token() // 4
    assert rank.prefill_flops(512) == pytest.approx(big.prefill_flops(512) / 4, rel=1e-3)
    assert rank.weight_bytes(1) == pytest.approx(big.weight_bytes(1) / 4, rel=1e-3)
    assert big.shard(1) is big
    eight = big.shard(16)  # 8 KV heads over 16 ranks: one replicated head each
    assert eight.num_kv_heads == 1 and eight.kv_bytes_per_token() == big.kv_bytes_per_token() // 8
    with pytest.raises(ValueError, match="already one of 4 ranks"):
        rank.shard(2)
    with pytest.raises(ValueError, match="cannot split 64 attention heads"):
        big.shard(6)
    odd_kv = kvcopy.ModelSpec.from_hf_config({**MISTRAL_CONFIG, "num_key_value_heads": 4}).shard(8)
    assert odd_kv.num_kv_heads == 1  # 4 KV heads over 8 ranks: replicated
    with pytest.raises(ValueError, match="cannot split 8 KV heads"):
        kvcopy.ModelSpec.from_hf_config({**MISTRAL_CONFIG, "num_attention_heads": 48, "head_dim": 128}).shard(6)


def test_shard_replicates_mla_latents():
    rank = DEEPSEEK.shard(8)
    assert rank.kv_bytes_per_token() == DEEPSEEK.kv_bytes_per_token()
    assert rank.prefill_flops(100) == pytest.approx(DEEPSEEK.prefill_flops(100) / 8, rel=1e-3)


def test_from_profile_plans_for_one_rank():
    p = _profile({"h2h": {"torch": MethodProfile(_fit(7e-6, 9e9))}})
    big = kvcopy.ModelSpec.preset("llama-3.1-70b")
    planner = Planner.from_profile(p, big, tp=4)
    assert planner.spec.tp == 4 and planner.spec.num_kv_heads == 2
    assert planner.t_load(1000) == pytest.approx(7e-6 + big.kv_bytes(1000) / 4 / 9e9)


# --------------------------------------------------------------------------- argument errors


@pytest.mark.parametrize("prefix", [100.0, True, "100", None])
def test_a_token_count_of_another_type_is_a_type_error_naming_it(prefix):
    planner = linear(la=0.0, bw=1e9, r=1e3)
    with pytest.raises(TypeError, match=r"^prefix_tokens"):
        planner.decide(prefix)
    with pytest.raises(TypeError, match=r"^new_tokens"):
        planner.decide(100, prefix)


@pytest.mark.parametrize(
    "prefix", [LLAMA.context_length, 10**7, 10**30, 10**400], ids=["context", "1e7", "1e30", "1e400"]
)
def test_decide_beyond_the_models_context_length_is_a_value_error_naming_the_limit(prefix):
    """A prefix and its new tokens longer than the model takes (max_position_embeddings) is no request to
    plan: a ValueError naming the arguments and the model's limit, never "reload" (nor an OverflowError)."""
    planner = linear(la=0.0, bw=1e9, r=1e3)
    assert LLAMA.context_length == 131072
    with pytest.raises(ValueError, match=r"^prefix_tokens \+ new_tokens: expected at most 131072 tokens") as err:
        planner.decide(prefix)
    assert "max_position_embeddings" in str(err.value) and "llama-3.1-8b" in str(err.value)
    # the longest request the model takes is planned
    assert planner.decide(LLAMA.context_length - 16, 16).action in planner_mod.ACTIONS


def test_without_a_context_length_the_planner_takes_its_own_documented_limit():
    planner = linear(MISTRAL_FULL, la=0.0, bw=1e9, r=1e3)
    assert MISTRAL_FULL.context_length is None
    limit = planner_mod.MAX_TOKENS_WITHOUT_CONTEXT_LENGTH
    assert planner.max_sequence_tokens()[0] == limit
    decision = planner.decide(limit - 1)
    assert math.isfinite(decision.t_recompute) and math.isfinite(decision.t_reload)
    for prefix in (limit, 10**30):
        with pytest.raises(ValueError, match="gives no context length"):
            planner.decide(prefix)


def test_a_load_beyond_an_int64_of_bytes_is_a_value_error():
    with pytest.raises(ValueError, match=r"^load_nbytes"):
        linear(la=0.0, bw=1e9, r=1e3).decide(100, load_nbytes=10**400)


@pytest.mark.parametrize(
    ("max_tokens", "error"), [(0, ValueError), (-5, ValueError), (1.5, TypeError), (True, TypeError), ("8", TypeError)]
)
def test_threshold_max_tokens_is_checked_and_named(max_tokens, error):
    """0 is not "the default" and -5 is not a prefix_tokens error: each names max_tokens."""
    with pytest.raises(error, match=r"^max_tokens"):
        linear(la=0.0, bw=1e9, r=1e3).threshold_tokens(max_tokens=max_tokens)


def test_threshold_max_tokens_beyond_the_context_length_is_a_value_error():
    planner = linear(la=0.0, bw=1e9, r=1e3)
    with pytest.raises(ValueError, match=r"^max_tokens: expected at most 131071"):
        planner.threshold_tokens(max_tokens=LLAMA.context_length)
    assert planner.threshold_tokens(max_tokens=LLAMA.context_length - 1) is not None


@pytest.mark.parametrize("profile", [None, "/tmp/profile.json", Path("/tmp/profile.json"), "llama-3.1-8b"])
def test_from_profile_of_what_is_not_a_profile_is_a_type_error_naming_it(profile):
    with pytest.raises(TypeError, match=r"^profile: expected a Profile"):
        Planner.from_profile(profile, LLAMA)


def test_from_profile_argument_types():
    profile = _profile({"h2h": {"cpu": MethodProfile(_fit(1e-6, 1e10))}})
    with pytest.raises(TypeError, match=r"^spec: expected a ModelSpec"):
        Planner.from_profile(profile, "llama-3.1-8b")
    with pytest.raises(TypeError, match=r"^layerwise: expected a bool"):
        Planner.from_profile(profile, LLAMA, layerwise="no")
    with pytest.raises(TypeError, match=r"^layerwise: expected a bool"):
        linear(la=0.0, bw=1e9, r=1e3, layerwise=1)
    with pytest.raises(TypeError, match=r"^decode_share"):
        Planner.from_profile(profile, LLAMA, decode_share="0.5")


@pytest.mark.parametrize("flag", ["from_disk", "from_peer"])
@pytest.mark.parametrize("value", ["no", "yes", 1, 0, None])
def test_the_deprecated_source_flags_are_booleans(flag, value):
    """from_disk="no" is truthy: it read as True and fetched from the disk. A flag that is not a bool is a
    TypeError (before the deprecation warning), in decide and threshold_tokens alike."""
    planner = linear(la=0.0, bw=1e9, r=1e3, fetch=CostLine(1e-4, 1e9), disk=CostLine(1e-4, 1e9))
    with pytest.raises(TypeError, match=rf"^{flag}: expected a bool"):
        planner.decide(100, **{flag: value})
    with pytest.raises(TypeError, match=rf"^{flag}: expected a bool"):
        planner.threshold_tokens(max_tokens=64, **{flag: value})


@pytest.mark.parametrize(
    ("source", "error"), [("x", ValueError), ("Disk", ValueError), (1, TypeError), (None, TypeError)]
)
def test_a_source_that_is_none_of_the_choices_names_them(source, error):
    planner = linear(la=0.0, bw=1e9, r=1e3, disk=CostLine(1e-4, 1e9))
    for call in (lambda: planner.decide(100, source=source), lambda: planner.threshold_tokens(source=source)):
        with pytest.raises(error, match=r"^source: expected one of \('host', 'peer', 'disk'\)"):
            call()
