"""Planner: fetching a prefix from a peer (network read and local reload, pipelined) against recomputing it.

Expected values are computed here from the stage formulas, by brute force over every chunk count and
every prefix length, not by the planner's own helpers.
"""

from __future__ import annotations

import math

import pytest

import kvcopy
from kvcopy import Planner
from kvcopy.planner.pipeline import MAX_PIPELINE_CHUNKS, pipelined_seconds
from kvcopy.profile import CostLine, MethodProfile, PrefillProfile, Profile

LLAMA = kvcopy.ModelSpec.preset("llama-3.1-8b")
BLOCK = LLAMA.block_nbytes(16)  # one page-first block of 16 tokens: one network range


def planner(*, fa=50e-6, fb=12.5e9, la=20e-6, lb=50e9, fps=5e14, wbps=4.8e12, **kw) -> Planner:
    """Published-figure machine: a 100 Gb/s link (12.5 GB/s, 50 us per read), PCIe Gen5 reloads (50 GB/s,
    20 us per call), 500 TFLOP/s prefill, 4.8 TB/s weight reads."""
    return Planner(
        LLAMA,
        load=CostLine(la, lb),
        prefill_flops_per_s=fps,
        weight_bytes_per_s=wbps,
        fetch=CostLine(fa, fb),
        **kw,
    )


def expected_fetch(p: Planner, nbytes: int) -> float:
    """Every chunk count of whole blocks (not only powers of two) up to the cap, the best one; chunk i is read
    while chunk i-1 reloads."""
    blocks = math.ceil(nbytes / BLOCK)
    best = math.inf
    for k in range(1, min(blocks, MAX_PIPELINE_CHUNKS) + 1):
        if k & (k - 1):
            continue  # a pipeline is cut into a power-of-two count of chunks
        read = p.fetch.alpha_s + nbytes / k / p.fetch.beta_bytes_per_s
        load = p.load.alpha_s + nbytes / k / p.load.beta_bytes_per_s
        stages = [read] + [max(read, load)] * (k - 1) + [load]
        best = min(best, sum(stages))
    return best


def test_one_chunk_is_the_two_stages_one_after_the_other():
    seconds, chunks = pipelined_seconds(1e6, 1, lambda b: 1e-3 + b / 1e9, lambda b: 2e-3 + b / 2e9)
    assert chunks == 1 and seconds == pytest.approx(1e-3 + 1e-3 + 2e-3 + 0.5e-3)


def test_pipelining_hides_the_faster_stage_when_fixed_costs_are_small():
    nbytes = 1e9  # 1 s to read, 0.5 s to reload, no fixed costs: K chunks take 1 + 0.5 / K
    seconds, chunks = pipelined_seconds(nbytes, 10_000, lambda b: b / 1e9, lambda b: b / 2e9)
    assert chunks == MAX_PIPELINE_CHUNKS
    assert seconds == pytest.approx(1.0 + 0.5 / MAX_PIPELINE_CHUNKS)


@pytest.mark.parametrize("tokens", [1, 16, 100, 2048, 32768])
def test_fetch_time_is_the_best_pipeline_over_whole_blocks(tokens):
    p = planner()
    nbytes = LLAMA.kv_bytes(tokens)
    seconds, chunks = p.t_fetch_nbytes(nbytes)
    assert seconds == pytest.approx(expected_fetch(p, nbytes))
    assert 1 <= chunks <= max(1, math.ceil(nbytes / BLOCK))


@pytest.mark.parametrize("prefix", [1, 64, 1024, 16384])
def test_a_prefix_on_a_peer_is_fetched_or_recomputed(prefix):
    p = planner(layerwise=True)
    d = p.decide(prefix, 8, source="peer")
    extend = p.t_prefill(8, prefix)
    assert d.t_reload is None and d.t_layerwise is None  # not here, and no layer arrives before the others
    assert d.t_fetch == pytest.approx(expected_fetch(p, LLAMA.kv_bytes(prefix)) + extend)
    assert d.t_recompute == pytest.approx(p.t_prefill(prefix + 8))
    options = {"fetch": d.t_fetch, "recompute": d.t_recompute}
    if d.action == "split":
        assert d.t_split < min(options.values())
    else:
        assert d.action == min(options, key=options.get)
    assert "peer" in d.explanation or d.action != "fetch"


def test_fetching_costs_at_least_the_local_reload():
    p = planner()
    for prefix in (1, 16, 300, 4096, 65536):
        here, there = p.decide(prefix), p.decide(prefix, source="peer")
        assert there.t_fetch >= here.t_reload


def test_split_from_a_peer_computes_the_front_while_the_rest_is_fetched():
    p = planner(fb=1e9)  # a slow link: fetching and computing a prefix take comparable time
    prefix = 8192
    d = p.decide(prefix, source="peer")
    best = min(
        max(p.t_prefill(x), expected_fetch(p, LLAMA.kv_bytes(prefix - x))) for x in range(1, prefix, 1)
    ) + p.t_prefill(1, prefix)
    assert d.t_split == pytest.approx(best, rel=1e-9)
    assert d.split_tokens > 0


def brute_fetch_threshold(p: Planner, limit: int) -> int | None:
    """The smallest P such that every P' in [P, limit] is not recomputed, scanning every length."""
    if p.decide(limit, source="peer").action == "recompute":
        return None
    threshold = limit
    for prefix in range(limit - 1, 0, -1):
        if p.decide(prefix, source="peer").action == "recompute":
            break
        threshold = prefix
    return threshold


@pytest.mark.slow
@pytest.mark.parametrize("fa", [50e-6, 2e-3, 20e-3])
def test_fetch_threshold_matches_a_brute_force_scan(fa):
    p = planner(fa=fa)
    limit = 4096
    assert p.threshold_tokens(max_tokens=limit, source="peer") == brute_fetch_threshold(p, limit)


@pytest.mark.parametrize(("fetch_alpha_s", "limit"), [(0.2, 8192), (0.5, 16384)])
def test_the_fetch_threshold_above_4096_tokens_matches_a_brute_force_scan(fetch_alpha_s, limit):
    p = planner(fa=fetch_alpha_s)  # a link so slow per read that fetching pays only beyond 4096 tokens
    threshold = p.threshold_tokens(max_tokens=limit, source="peer")
    assert threshold is not None and threshold > 4096  # in the geometric grid, where the bisection runs
    assert threshold == brute_fetch_threshold(p, limit)


@pytest.mark.slow
def test_a_slower_link_fetches_only_longer_prefixes():
    thresholds = [planner(fa=fa).threshold_tokens(source="peer") for fa in (50e-6, 2e-3, 20e-3)]
    assert thresholds == sorted(thresholds) and thresholds[0] < thresholds[-1]


def test_no_network_link_is_a_clear_error():
    p = Planner(LLAMA, load=CostLine(20e-6, 50e9), prefill_flops_per_s=5e14)
    with pytest.raises(ValueError, match=r'source="peer": .*no network link.*calibrate --remote'):
        p.decide(1024, source="peer")
    with pytest.raises(ValueError, match='source="peer"'):
        p.threshold_tokens(source="peer")
    assert p.decide(1024).t_fetch is None


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [
        ({"fetch": CostLine(1e-4, 0.0)}, "fetch: expected a positive rate"),
        ({"fetch": CostLine(-1.0, 1e9)}, "fetch: expected seconds >= 0"),
        ({"fetch": CostLine(1e-4, float("nan"))}, "fetch: expected a positive rate"),
        ({"block_tokens": 0}, "block_tokens: expected a positive int"),
    ],
)
def test_bad_fetch_parameters(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        Planner(LLAMA, load=CostLine(0.0, 1e9), prefill_flops_per_s=1e12, **kw)


def test_a_fetch_line_that_is_not_a_cost_line_is_a_type_error():
    with pytest.raises(TypeError, match="fetch: expected a CostLine"):
        Planner(LLAMA, load=CostLine(0.0, 1e9), prefill_flops_per_s=1e12, fetch=(1e-4, 1e9))


def _profile(with_remote: bool) -> Profile:
    def method(alpha: float, beta: float, sizes: dict[int, tuple[float, float]]) -> MethodProfile:
        return MethodProfile(
            CostLine(alpha, beta, 1.0, 0.0), {size: CostLine(a, b, 1.0, 0.0) for size, (a, b) in sizes.items()}
        )

    links = {"h2h": {"cpu": method(20e-6, 10e9, {})}}
    if with_remote:  # slower per byte for small ranges, as measured
        links["r2h"] = {"nixl": method(1e-4, 3e9, {16384: (1e-4, 0.5e9), 2 << 20: (2e-4, 4e9)})}
    prefill = PrefillProfile("llama-3.1-8b", 1e-3, 1e12, 1.0, weight_bytes_per_s=20e9, num_layers=32)
    return Profile(hardware={"device_name": "test"}, directions=links, prefill=prefill)


def test_from_profile_takes_the_link_at_one_page_first_block():
    p = Planner.from_profile(_profile(with_remote=True), LLAMA)
    assert BLOCK == 2 << 20  # llama-8b: 16 tokens x 128 KiB
    assert (p.fetch.alpha_s, p.fetch.beta_bytes_per_s) == pytest.approx((2e-4, 4e9))
    assert p.decide(4096, source="peer").t_fetch is not None
    assert Planner.from_profile(_profile(with_remote=False), LLAMA).fetch is None


def test_the_transfer_part_is_exposed_without_the_compute():
    """What a measured fetch (network read plus reload) or reload compares with: ``t_transfer``."""
    p = planner()
    prefix = 2048
    there, here = p.decide(prefix, 64, source="peer"), p.decide(prefix, 64)
    assert there.t_transfer == pytest.approx(expected_fetch(p, LLAMA.kv_bytes(prefix)), rel=1e-12)
    assert there.t_fetch == pytest.approx(there.t_transfer + p.t_prefill(64, prefix), rel=1e-12)
    assert here.t_transfer == pytest.approx(
        p.load.alpha_s + LLAMA.kv_bytes(prefix) / p.load.beta_bytes_per_s, rel=1e-12
    )
    assert p.decide(0, 64, source="peer").t_transfer == 0.0
