"""The decision at a pause (kvcopy.agents.plan) against a brute-force expected-cost search.

The reference here is written apart from the module: the expected cost of a plan is integrated over 4,000
equal-probability points of a log-normal gap (the module uses 64), and every plan of a grid, (keep, demote,
drop) x lease end x prefetch start, is costed the same way. The module's plan must cost no more than the grid's
best, up to the two discretisations' difference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import pytest

from kvcopy.agents.plan import LEASE_QUANTILE, LEASE_SLACK_S, PauseCosts, PausePlan, hold_price, plan_pause

FINE_POINTS = 4000


@dataclass(frozen=True)
class LogNormal:
    median_s: float
    sigma: float

    def quantile(self, q: float) -> float:
        return self.median_s * math.exp(self.sigma * NormalDist().inv_cdf(q))


def fine_points(gaps: LogNormal) -> list[float]:
    return [gaps.quantile((i + 0.5) / FINE_POINTS) for i in range(FINE_POINTS)]


def resume_cost(
    g: float, costs: PauseCosts, price: float, cap: float, *, lease: float | None, prefetch: float | None, kept: bool
) -> float:
    """What one resume at ``g`` costs under a plan, written out case by case (the reference)."""
    fallback = costs.recompute_s if costs.tier_s is None else min(costs.tier_s, costs.recompute_s)
    hold = price * costs.nbytes
    if not kept:  # drop
        return costs.recompute_s
    if prefetch is None:  # keep until `lease` (0: demoted, never read back)
        assert lease is not None
        return costs.host_s + hold * g if g <= lease else fallback + hold * lease
    assert costs.read_s is not None
    if g < prefetch:
        return fallback
    if g < prefetch + costs.read_s:
        return (prefetch + costs.read_s - g) + costs.host_s + hold * (g - prefetch)
    if g < cap:
        return costs.host_s + hold * (g - prefetch)
    return fallback + hold * (cap - prefetch)


def expected(points: list[float], **plan: object) -> float:
    return sum(resume_cost(g, **plan) for g in points) / len(points)  # type: ignore[arg-type]


def plan_cost(plan: PausePlan, points: list[float], costs: PauseCosts, price: float, cap: float) -> float:
    common = dict(costs=costs, price=price, cap=cap)
    if plan.choice == "drop":
        return expected(points, lease=None, prefetch=None, kept=False, **common)
    if plan.choice == "keep":
        return expected(points, lease=plan.lease_end_s, prefetch=None, kept=True, **common)
    if plan.prefetch_at_s is None:
        return expected(points, lease=0.0, prefetch=None, kept=True, **common)
    return expected(points, lease=None, prefetch=plan.prefetch_at_s, kept=True, **common)


def brute_force(points: list[float], costs: PauseCosts, price: float, cap: float, *, may_hold: bool) -> float:
    common = dict(costs=costs, price=price, cap=cap)
    best = expected(points, lease=None, prefetch=None, kept=False, **common)
    grid = [cap * i / 80 for i in range(81)]
    if may_hold:
        best = min(best, *(expected(points, lease=t, prefetch=None, kept=True, **common) for t in grid))
    if costs.tier_s is not None:
        best = min(best, expected(points, lease=0.0, prefetch=None, kept=True, **common))
        if may_hold:
            best = min(best, *(expected(points, lease=None, prefetch=t, kept=True, **common) for t in grid[:-1]))
    return best


GIB = 1 << 30
SCENARIOS = {
    # a tool pause (TraceLab's p50 0.3 s, p90 13.6 s); 2 GiB of KV; a disk read of 0.5 s; a busy host tier
    "tool_gap_busy_host": (LogNormal(0.3, 2.98), PauseCosts(0.05, 8.0, 2 * GIB, tier_s=0.6, read_s=0.5), 2e-11),
    # the same with an idle host tier: holding is free
    "tool_gap_idle_host": (LogNormal(0.3, 2.98), PauseCosts(0.05, 8.0, 2 * GIB, tier_s=0.6, read_s=0.5), 0.0),
    # a minute's pause, forecast within a factor 1.6, over 8 GiB: holding costs, the read (4 s) saves much
    "minute_gap_dear_host": (LogNormal(60.0, 0.5), PauseCosts(0.1, 30.0, 8 * GIB, tier_s=4.1, read_s=4.0), 5e-12),
    # a human pause (p50 84 s, TraceLab's spread): too wide to time a read ahead; held while likely back
    "human_gap": (LogNormal(84.0, 2.10), PauseCosts(0.1, 30.0, 8 * GIB, tier_s=4.1, read_s=4.0), 5e-13),
    # holding so dear (1 s a second) that no read ahead pays: demoted, read at the resume
    "human_gap_dearest_host": (LogNormal(84.0, 2.10), PauseCosts(0.05, 8.0, 2 * GIB, tier_s=1.2, read_s=1.0), 5e-10),
    # a tight forecast (a client's good estimate, 12 s): read back just before it
    "tight_estimate": (LogNormal(12.0, 0.2), PauseCosts(0.05, 8.0, 2 * GIB, tier_s=2.1, read_s=2.0), 2e-11),
    # no tier: keep, or drop when holding costs more than recomputing saves
    "no_tier_cheap_hold": (LogNormal(5.0, 1.0), PauseCosts(0.05, 3.0, GIB, None, None), 1e-11),
    "no_tier_dear_hold": (LogNormal(60.0, 1.0), PauseCosts(0.05, 0.5, GIB, None, None), 1e-10),
    # a read longer than most of the gaps: a prefetch would land late; the tier beats holding or not
    "slow_tier": (LogNormal(1.0, 0.5), PauseCosts(0.05, 4.0, 4 * GIB, tier_s=3.1, read_s=3.0), 3e-10),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_plan_costs_no_more_than_a_brute_force_search(name: str) -> None:
    gaps, costs, price_per_byte_s = SCENARIOS[name]
    plan = plan_pause(gaps, costs, hold_price=price_per_byte_s)
    cap = gaps.quantile(LEASE_QUANTILE) + LEASE_SLACK_S
    points = fine_points(gaps)
    mine = plan_cost(plan, points, costs, price_per_byte_s, cap)
    best = brute_force(points, costs, price_per_byte_s, cap, may_hold=True)
    assert mine <= best * 1.02 + 1e-3, (plan.explanation, mine, best)
    assert plan.expected_cost_s == pytest.approx(mine, rel=0.1, abs=0.01)  # its own estimate, on 64 points
    assert plan.expected_saving_s == pytest.approx(costs.recompute_s - plan.expected_cost_s)


def test_an_idle_host_tier_keeps_until_the_lease_cap() -> None:
    gaps, costs, _ = SCENARIOS["tool_gap_idle_host"]
    plan = plan_pause(gaps, costs, hold_price=0.0)
    assert plan.choice == "keep"
    assert plan.lease_end_s == pytest.approx(gaps.quantile(LEASE_QUANTILE) + LEASE_SLACK_S)
    assert "keep in host RAM until" in plan.explanation


def test_a_dear_host_and_a_long_pause_demote_and_read_back_ahead_of_a_low_quantile() -> None:
    gaps, costs, price = SCENARIOS["minute_gap_dear_host"]
    plan = plan_pause(gaps, costs, hold_price=price)
    assert plan.choice == "demote" and plan.prefetch_at_s is not None
    assert costs.read_s is not None
    lands = plan.prefetch_at_s + costs.read_s
    assert gaps.quantile(0.01) < lands < gaps.quantile(0.5)  # early costs only residency: a low quantile
    assert "read back from" in plan.explanation


def test_a_tight_forecast_reads_back_to_land_just_before_the_resume() -> None:
    gaps, costs, price = SCENARIOS["tight_estimate"]
    plan = plan_pause(gaps, costs, hold_price=price)
    assert plan.choice == "demote" and plan.prefetch_at_s is not None and costs.read_s is not None
    lands = plan.prefetch_at_s + costs.read_s
    assert gaps.quantile(0.005) <= lands <= gaps.quantile(0.2)
    assert plan.p_in_host >= 0.8


def test_a_session_larger_than_its_share_is_not_held() -> None:
    gaps, costs, price = SCENARIOS["tool_gap_idle_host"]
    plan = plan_pause(gaps, costs, hold_price=price, room_bytes=costs.nbytes - 1)
    assert plan.choice == "demote" and plan.prefetch_at_s is None and plan.lease_end_s is None
    assert "keep" not in plan.options
    assert "share" in plan.explanation


def test_holding_dearer_than_any_read_ahead_saves_demotes_without_one() -> None:
    gaps, costs, price = SCENARIOS["human_gap_dearest_host"]
    plan = plan_pause(gaps, costs, hold_price=price)
    assert (plan.choice, plan.prefetch_at_s, plan.lease_end_s) == ("demote", None, None)
    assert plan.expected_cost_s == pytest.approx(costs.fallback_s)


def test_without_a_tier_a_dear_hold_drops() -> None:
    gaps, costs, price = SCENARIOS["no_tier_dear_hold"]
    plan = plan_pause(gaps, costs, hold_price=price)
    assert plan.choice == "drop" and "demote" not in plan.options


def test_a_cap_given_bounds_the_lease() -> None:
    gaps, costs, _ = SCENARIOS["tool_gap_idle_host"]
    plan = plan_pause(gaps, costs, hold_price=0.0, cap_s=5.0)
    assert plan.choice == "keep" and plan.lease_end_s == 5.0


def test_a_released_plan_holds_nothing() -> None:
    plan = PausePlan.released("the client said done")
    assert (plan.choice, plan.lease_end_s, plan.prefetch_at_s) == ("drop", None, None)
    assert "done" in plan.explanation


def test_hold_price_is_reuse_after_eviction_times_the_cost_of_a_miss() -> None:
    assert hold_price(reuse_per_s=0.01, miss_s_per_byte=1e-9) == pytest.approx(1e-11)
    assert hold_price(reuse_per_s=0.0, miss_s_per_byte=1e-9) == 0.0
    with pytest.raises(ValueError, match="reuse_per_s"):
        hold_price(reuse_per_s=-1.0, miss_s_per_byte=1e-9)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(host_s=-1.0, recompute_s=1.0, nbytes=1), ValueError, "PauseCosts.host_s"),
        (dict(host_s=0.1, recompute_s=1.0, nbytes=1.5), TypeError, "PauseCosts.nbytes"),
        (dict(host_s=0.1, recompute_s=1.0, nbytes=-1), ValueError, "PauseCosts.nbytes"),
        (dict(host_s=0.1, recompute_s=1.0, nbytes=1, tier_s=1.0), ValueError, "tier_s / read_s"),
        (dict(host_s=0.1, recompute_s=float("nan"), nbytes=1), ValueError, "PauseCosts.recompute_s"),
    ],
)
def test_bad_costs_are_named(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        PauseCosts(**kwargs)  # type: ignore[arg-type]


def test_bad_arguments_are_named() -> None:
    gaps, costs, _ = SCENARIOS["tool_gap_idle_host"]
    with pytest.raises(TypeError, match="costs"):
        plan_pause(gaps, (0.1, 1.0), hold_price=0.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hold_price"):
        plan_pause(gaps, costs, hold_price=-1.0)
    with pytest.raises(TypeError, match="room_bytes"):
        plan_pause(gaps, costs, hold_price=0.0, room_bytes=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gaps"):
        plan_pause(LogNormal(-1.0, 1.0), costs, hold_price=0.0)


def test_a_read_longer_than_the_lease_cap_is_never_started_ahead() -> None:
    gaps = LogNormal(0.3, 0.2)  # back within a second and a half, surely; the read takes 5 s
    costs = PauseCosts(0.05, 8.0, GIB, tier_s=5.1, read_s=5.0)
    plan = plan_pause(gaps, costs, hold_price=1e-9)
    assert plan.prefetch_at_s is None and plan.choice in ("keep", "demote")


def lru_resume_cost(g: float, costs: PauseCosts, price: float, lru: float, lease: float) -> float:
    """A resume at ``g`` when the chunks are kept until ``lease`` and LRU keeps them ``lru`` seconds anyway: a
    host hit until the later of the two, the lease charged only for what it holds past ``lru`` (the
    reference, apart from the module)."""
    fallback = costs.recompute_s if costs.tier_s is None else min(costs.tier_s, costs.recompute_s)
    hold = price * costs.nbytes
    if g <= max(lease, lru):
        return costs.host_s + hold * max(0.0, min(g, lease) - lru)
    return fallback + hold * max(0.0, lease - lru)


def lru_read_back_cost(g: float, costs: PauseCosts, price: float, lru: float, cap: float, start: float) -> float:
    """A resume at ``g`` when the chunks were demoted and read back from ``start``, and LRU keeps what it read
    back ``lru`` seconds after it took it in: in host RAM from the read's end until the later of the cap and
    that, the hold charged only for what of it until the resume (or the cap) is past ``start + lru`` (the
    reference, apart from the module)."""
    assert costs.read_s is not None and costs.tier_s is not None
    fallback = min(costs.tier_s, costs.recompute_s)
    hold = price * costs.nbytes
    charged = hold * max(0.0, min(g, cap) - start - lru)
    if g < start:
        return fallback
    if g < start + costs.read_s:
        return (start + costs.read_s - g) + costs.host_s + charged
    if g < max(cap, start + lru):
        return costs.host_s + charged
    return fallback + charged


@pytest.mark.parametrize("lru", [0.05, 2.0, 30.0])
@pytest.mark.parametrize(
    "name", ["tool_gap_busy_host", "minute_gap_dear_host", "no_tier_dear_hold", "slow_tier", "tight_estimate"]
)
def test_with_lrus_memory_the_plan_costs_no_more_than_a_brute_force_search(name: str, lru: float) -> None:
    gaps, costs, price = SCENARIOS[name]
    plan = plan_pause(gaps, costs, hold_price=price, lru_s=lru)
    cap = gaps.quantile(LEASE_QUANTILE) + LEASE_SLACK_S
    points = fine_points(gaps)

    def keeping(lease: float) -> float:
        return sum(lru_resume_cost(g, costs, price, lru, lease) for g in points) / len(points)

    def reading_back(start: float) -> float:
        return sum(lru_read_back_cost(g, costs, price, lru, cap, start) for g in points) / len(points)

    common = dict(costs=costs, price=price, cap=cap)
    if plan.choice == "keep":
        assert plan.lease_end_s is not None
        mine = keeping(plan.lease_end_s)
        assert plan.leased == (plan.lease_end_s > lru)
    elif plan.prefetch_at_s is not None:
        mine = reading_back(plan.prefetch_at_s)
        assert plan.leased == (cap > plan.prefetch_at_s + lru)
    else:
        mine = plan_cost(plan, points, costs, price, cap)  # a demotion or a drop: LRU keeps nothing of it
    candidates = [
        expected(points, lease=None, prefetch=None, kept=False, **common),  # drop
        keeping(lru),  # left to LRU, unleased
        *(keeping(lru + (cap - lru) * i / 80) for i in range(81) if lru < cap),
    ]
    if costs.tier_s is not None:
        assert costs.read_s is not None
        candidates.append(expected(points, lease=0.0, prefetch=None, kept=True, **common))  # demoted, no read
        candidates += [reading_back(t) for t in (cap * i / 80 for i in range(1, 80)) if t + costs.read_s < cap]
    best = min(candidates)
    assert mine <= best * 1.02 + 1e-3, (plan.explanation, mine, best)


def test_a_pause_shorter_than_lrus_memory_is_left_to_lru_and_a_longer_one_leased() -> None:
    costs = PauseCosts(0.05, 8.0, 2 * GIB, tier_s=0.6, read_s=0.5)
    back_to_back = plan_pause(LogNormal(0.03, 0.5), costs, hold_price=2e-11, lru_s=2.0)
    assert back_to_back.choice == "keep" and not back_to_back.leased and back_to_back.lease_end_s == 2.0
    assert "without a lease" in back_to_back.explanation and back_to_back.p_in_host > 0.99
    tool_run = plan_pause(LogNormal(20.0, 0.3), PauseCosts(0.05, 8.0, 2 * GIB), hold_price=1e-12, lru_s=2.0)
    assert tool_run.choice == "keep" and tool_run.leased and tool_run.lease_end_s > 20.0
    idle = plan_pause(LogNormal(20.0, 0.3), costs, hold_price=0.0, lru_s=math.inf)  # a tier that evicts nothing
    assert idle.choice == "keep" and not idle.leased and idle.p_in_host == 1.0
    full = plan_pause(LogNormal(0.03, 0.5), costs, hold_price=0.0, room_bytes=0, lru_s=2.0)  # no room to lease
    assert full.choice == "keep" and not full.leased  # LRU still keeps it
