"""The decision at a pause: where a paused session's KV waits, and when it comes back.

When a session's request finishes and the session will resume (a tool runs, its user reads), its chunks can

- stay in host RAM under a lease until ``lease_end_s`` after the pause (**keep**);
- leave host RAM for the secondary tier that already holds them, to be read back into host RAM from
  ``prefetch_at_s`` on, so that they are there when the session returns (**demote**, with or without a
  prefetch);
- stay nowhere (**drop**): the resume computes them again.

:func:`plan_pause` picks the plan of least expected cost, in seconds, over the forecast distribution of the
gap G (the pause's length, a :class:`~kvcopy.agents.GapForecaster`'s or any object with ``quantile(q)``).
A plan is a timeline after the pause; what a resume at G pays is

- ``host_s`` when the chunks are in host RAM at G (under the lease, or a prefetch landed);
- ``fallback_s`` when they are only in the tier (after a lease ended, or before the prefetch started): the
  read and load, or the recompute when that is cheaper (the resume's own judgment picks);
- the rest of the prefetch's read (``read_s`` in all) plus ``host_s`` when the resume comes while the
  prefetch is in flight: it waits on that read, it does not start a second one;
- ``recompute_s`` when nothing is retained;

plus the price of the host bytes the plan holds before G: ``hold_price`` seconds of other sessions' delay per
byte-second (:func:`hold_price` prices it from how much of what the host tier evicts traffic asks for again).

Without a lease the chunks are LRU's, and LRU keeps them too: a request that just finished left the tier's
most recent chunks, which go only once the tier has stored a capacity's worth after them (``lru_s``). So a
resume within ``lru_s`` is a host hit at no price, whatever the plan but a demotion, and a lease pays only
for what it holds past ``lru_s``; a keep whose lease ends by then needs no lease at all (``PausePlan.leased``
is False): the chunks are left to LRU, and a pause shorter than LRU's memory, an agent's back-to-back turn,
costs the other sessions nothing. Chunks read back are LRU's most recent in their turn: a read back from P is
kept ``lru_s`` after P unleased, and priced only past that.
A lease, and a prefetched hold, end at the latest at ``lease_cap_s`` (the forecast's high quantile plus
slack): past it the chunks fall back to LRU, as if demoted. Early prefetches cost only residency and late ones
forfeit the gain, so the best start is a low quantile of G minus the read; the optimum is found exactly on the
forecast's points (every breakpoint of the piecewise-linear cost is a candidate), with numpy, in well under a
millisecond (the forecast's 255 quantiles take most of a plan's few milliseconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from kvcopy._checks import non_negative_number
from kvcopy.planner.decision import seconds_text

__all__ = [
    "DEFAULT_MAX_LEASED_FRACTION",
    "DEFAULT_MAX_SESSION_FRACTION",
    "GAP_POINTS",
    "LEASE_QUANTILE",
    "LEASE_SLACK_S",
    "Choice",
    "GapDistribution",
    "PauseCosts",
    "PausePlan",
    "hold_price",
    "lease_cap",
    "plan_pause",
]

Choice = Literal["keep", "demote", "drop"]

# Leases (kvcopy.integrations.vllm.agents.leases) hold at most half the host tier: the rest stays LRU's for the
# traffic of the sessions that are running, which is what pays for the leases.
DEFAULT_MAX_LEASED_FRACTION = 0.5
# One session holds at most a tenth of the tier, so that a client that hints much cannot starve the others: ten
# paused sessions fill the leased half only if each is large.
DEFAULT_MAX_SESSION_FRACTION = 0.1

# The gap's distribution is cut into GAP_POINTS bins of equal probability: a bin is whole on one side of every
# candidate lease end and prefetch start (they are taken at the bins' edges), so the probability that a resume
# comes before one is exact, and only the seconds inside a bin are taken at its median. 128 bins (255
# quantiles of the forecast) keep every brute-force scenario of the tests within 1% of a 4,000-point search,
# and the search (~380 candidates x 128 bins) well under a millisecond.
GAP_POINTS = 128
# A lease (and a prefetched hold) ends at the latest at this quantile of the forecast plus LEASE_SLACK_S: a
# session that has not come back by then most likely went elsewhere, and its bytes go back to LRU.
LEASE_QUANTILE = 0.95
# Slack past that quantile: a pause whose forecast is tight (a client's exact estimates) still gets a second for
# the client's own jitter (a request's network and queueing time).
LEASE_SLACK_S = 1.0


class GapDistribution(Protocol):
    """A pause's length as a distribution: what :func:`plan_pause` needs of a forecast (one that also has
    ``quantiles(qs)``, as GapForecast, is asked for all its quantiles at once)."""

    def quantile(self, q: float) -> float:
        """The gap, in seconds, that the pause is shorter than with probability ``q``."""
        ...


@dataclass(frozen=True)
class PauseCosts:
    """What a resume pays, in seconds, by where the session's chunks are when it comes, and what they hold.

    ``host_s``: loaded from host RAM (and the new tokens computed). ``recompute_s``: nothing retained, the
    prefix computed. ``tier_s``: read from the secondary tier into host RAM, then loaded (None: no tier holds
    them, so a demotion is not an option). ``read_s``: the read alone, what a prefetch takes (None with
    ``tier_s``). ``nbytes``: the host bytes the chunks occupy while held.
    """

    host_s: float
    recompute_s: float
    nbytes: int
    tier_s: float | None = None
    read_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("host_s", "recompute_s"):
            non_negative_number(f"PauseCosts.{name}", getattr(self, name))
        if not isinstance(self.nbytes, int) or isinstance(self.nbytes, bool):
            raise TypeError(f"PauseCosts.nbytes: expected an int, got {type(self.nbytes).__name__}")
        if self.nbytes < 0:
            raise ValueError(f"PauseCosts.nbytes: expected >= 0, got {self.nbytes}")
        if (self.tier_s is None) != (self.read_s is None):
            raise ValueError("PauseCosts.tier_s / read_s: give both (a tier holds the chunks) or neither")
        if self.tier_s is not None:
            non_negative_number("PauseCosts.tier_s", self.tier_s)
            non_negative_number("PauseCosts.read_s", self.read_s)

    @property
    def fallback_s(self) -> float:
        """What a resume pays when the chunks are not in host RAM: the tier's read and load, or the recompute
        where that is cheaper (the resume's judgment picks the cheaper)."""
        return self.recompute_s if self.tier_s is None else min(self.tier_s, self.recompute_s)


@dataclass(frozen=True)
class PausePlan:
    """Where a paused session's chunks wait, and when they come back; times in seconds after the pause.

    ``choice``: "keep" (in host RAM under a lease until ``lease_end_s``), "demote" (host RAM freed; read back
    from the tier from ``prefetch_at_s``, then held until ``lease_end_s``; with ``prefetch_at_s`` None, left
    in the tier) or "drop" (nothing retained); a keep whose lease ends within ``lru_s`` (how long LRU keeps
    them unleased) is left to LRU (:attr:`leased` False). ``p_in_host``: the forecast's probability that the
    chunks are in host RAM when the session returns. ``expected_cost_s``: the plan's expected resume delay plus its
    holding price; ``expected_saving_s``: what it saves over dropping. ``options``: each choice's best
    expected cost (the ones not possible absent). ``explanation`` says it in words, as a Decision does.
    """

    choice: Choice
    lease_end_s: float | None
    prefetch_at_s: float | None
    expected_cost_s: float
    expected_saving_s: float
    p_in_host: float
    explanation: str
    options: dict[str, float] = field(default_factory=dict)
    lru_s: float = 0.0

    @property
    def leased(self) -> bool:
        """Whether the plan holds the chunks under a lease: a keep whose hold outlasts ``lru_s``, what LRU keeps
        them for without one, or a read back whose hold outlasts ``lru_s`` after it starts (LRU keeps the chunks
        it reads back as it keeps those it stores)."""
        if self.lease_end_s is None:
            return False
        return self.lease_end_s > (self.prefetch_at_s or 0.0) + self.lru_s

    @classmethod
    def released(cls, reason: str) -> PausePlan:
        """The plan of a session that needs nothing retained (its client said ``done``): dropped at once."""
        return cls("drop", None, None, 0.0, 0.0, 0.0, f"drop: {reason}")


def lease_cap(gaps: GapDistribution) -> float:
    """The latest a lease may end, in seconds after the pause: the forecast's LEASE_QUANTILE plus
    LEASE_SLACK_S."""
    return float(gaps.quantile(LEASE_QUANTILE)) + LEASE_SLACK_S


def hold_price(*, reuse_per_s: float, miss_s_per_byte: float) -> float:
    """The price of holding one host byte for one second, in seconds of other sessions' delay.

    ``reuse_per_s``: the fraction of the host tier's capacity that the other sessions' traffic asks for again,
    per second, soon after the tier evicted it (within one capacity's worth of later evictions: the chunks a
    tier one capacity larger would still have held); ``miss_s_per_byte``: what such a byte costs its session
    when it is not there (the tier's read, or the recompute, per byte). A byte held for a second takes that
    second from LRU's room; a tier whose evicted chunks come back at that rate misses that share of them more.
    A host tier whose evicted chunks are never asked for again (or that evicts nothing) holds for free, and
    then every pause keeps its chunks until its lease cap.

    (Priced by eviction alone, the fraction evicted per second, every evicted byte counted as a miss: on the
    agent bench's busy host tier, 10 of the 13 hinted pauses longer than 14 s were left in the tier with no
    read ahead.)
    """
    non_negative_number("reuse_per_s", reuse_per_s)
    non_negative_number("miss_s_per_byte", miss_s_per_byte)
    return reuse_per_s * miss_s_per_byte


def plan_pause(
    gaps: GapDistribution,
    costs: PauseCosts,
    *,
    hold_price: float,
    room_bytes: int | None = None,
    cap_s: float | None = None,
    lru_s: float = 0.0,
) -> PausePlan:
    """The plan of least expected cost for a paused session (see the module).

    ``gaps``: the pause's forecast (``quantile(q)``, seconds). ``costs``: what a resume pays, by where the
    chunks are. ``hold_price``: seconds of delay per byte-second held (:func:`hold_price`). ``room_bytes``: the
    host bytes the session may hold under a lease (its share; None: no bound): a session larger than that is
    not leased nor prefetched (LRU may still keep it). ``cap_s``: the latest a lease ends (default
    :func:`lease_cap` of ``gaps``). ``lru_s``: how long the host tier's LRU keeps the chunks without a lease
    (0: not at all, as a tier whose every new chunk evicts one of them; ``math.inf``: a tier that evicts
    nothing).
    """
    if not isinstance(costs, PauseCosts):
        raise TypeError(f"costs: expected a PauseCosts, got {type(costs).__name__}")
    price = non_negative_number("hold_price", hold_price) * costs.nbytes
    if room_bytes is not None and (not isinstance(room_bytes, int) or isinstance(room_bytes, bool)):
        raise TypeError(f"room_bytes: expected an int or None, got {type(room_bytes).__name__}")
    given_cap = None if cap_s is None else non_negative_number("cap_s", cap_s)
    lru = math.inf if lru_s == math.inf else non_negative_number("lru_s", lru_s)  # (inf: a tier that evicts nothing)
    edges, g, high = _bins(gaps)
    cap = high + LEASE_SLACK_S if given_cap is None else given_cap  # (lease_cap's, from the same search)
    host, fallback = costs.host_s, costs.fallback_s
    may_hold = room_bytes is None or costs.nbytes <= room_bytes

    options: dict[str, float] = {"drop": costs.recompute_s}
    plans: dict[str, tuple[float, float | None, float | None, float]] = {"drop": (costs.recompute_s, None, None, 0.0)}
    # keep until L: a resume at g <= max(L, lru) is a host hit (leased for what of g is past lru), a later one
    # falls back (leased for what of L is past lru). L = lru is LRU's keeping, unleased (with lru 0, a
    # demotion); a longer lease only with room for it.
    leases = np.array([lru] if lru > 0 else [])
    if may_hold and lru < cap:
        leases = np.unique(np.concatenate((leases, [cap], edges[(edges > lru) & (edges < cap)])))
    if len(leases):
        inside = g[None, :] <= leases[:, None]
        held = np.minimum(g[None, :], leases[:, None]) - lru
        held = np.where(np.isfinite(held), np.maximum(held, 0.0), 0.0)  # (inf - inf: LRU keeps them, unleased)
        cost = np.where(inside, host, fallback).mean(axis=1) + price * held.mean(axis=1)
        best = _last_min(cost)  # (on a tie, the longer lease: holding was free)
        plans["keep"] = (float(cost[best]), float(leases[best]), None, float(inside[best].mean()))
        options["keep"] = float(cost[best])
    if costs.tier_s is not None:
        assert costs.read_s is not None
        read = costs.read_s
        plans["demote"] = (fallback, None, None, 0.0)  # left in the tier, never read back ahead
        options["demote"] = fallback
        starts = np.empty(0)
        if may_hold:
            starts = np.concatenate((edges, edges - read, edges - lru, [cap - lru]))
            # after the pause (a read back at once is a keep with a round trip) and landing by the cap
            starts = np.unique(starts[(starts > 0.0) & (starts + read < cap)])
        if len(starts):
            # read back from P: released before P, in flight on [P, P + read), then in host RAM until the resume,
            # or until the cap or what LRU keeps a chunk it took at P, whichever is later; held (priced) from P
            # until the resume or the cap, less what LRU keeps it anyway. Every breakpoint is a candidate: a
            # bin's edge, an edge less the read or less LRU's keeping, the cap less LRU's keeping.
            p, gg = starts[:, None], g[None, :]
            held = price * np.maximum(np.minimum(gg, cap) - p - lru, 0.0)  # (lru inf: nothing charged)
            until = np.maximum(cap, p + lru)
            cost = np.where(
                gg < p,
                fallback,
                np.where(gg < p + read, p + read - gg + host + held, np.where(gg < until, host, fallback) + held),
            ).mean(axis=1)
            best = int(np.argmin(cost))  # (on a tie, the earlier read: the more margin)
            if cost[best] < fallback:
                in_host = ((gg >= p + read) & (gg < until))[best].mean()
                plans["demote"] = (float(cost[best]), cap, float(starts[best]), float(in_host))
                options["demote"] = float(cost[best])
    least = min(plan[0] for plan in plans.values())
    # (within rounding, the plan that holds least: drop, then demote, then keep)
    choice: Choice = next(name for name in _BY_HOLDING if name in plans and plans[name][0] <= least + 1e-12)
    expected, lease_end, prefetch_at, in_host = plans[choice]
    return PausePlan(
        choice=choice,
        lease_end_s=lease_end,
        prefetch_at_s=prefetch_at,
        expected_cost_s=expected,
        expected_saving_s=costs.recompute_s - expected,
        p_in_host=in_host,
        explanation=_explain(choice, lease_end, prefetch_at, in_host, options, g, may_hold, lru),
        options=options,
        lru_s=lru,
    )


_BY_HOLDING: tuple[Choice, ...] = ("drop", "demote", "keep")


def _bins(gaps: GapDistribution) -> tuple[np.ndarray, np.ndarray, float]:
    """The gap's GAP_POINTS equal-probability bins, in seconds: their inner edges (GAP_POINTS - 1) and their
    medians (GAP_POINTS), ascending; and its LEASE_QUANTILE, asked with them. A forecast that gives a negative or
    non-finite quantile is refused."""
    qs = np.append(np.arange(1, 2 * GAP_POINTS) / (2 * GAP_POINTS), LEASE_QUANTILE)  # odd: medians; even: edges
    many = getattr(gaps, "quantiles", None)  # (a GapForecast finds them all in one search)
    if many is not None:
        found = np.asarray(many(qs), dtype=np.float64)
    else:
        found = np.array([float(gaps.quantile(float(q))) for q in qs])
    if not np.all(np.isfinite(found)) or np.any(found < 0):
        raise ValueError(f"gaps: its quantiles must be finite seconds >= 0, got {found[:3]}...")
    points = np.maximum.accumulate(found[:-1])  # (a forecast's rounding never makes them decrease)
    return points[1::2], points[0::2], float(found[-1])


def _last_min(cost: np.ndarray) -> int:
    """The index of the last of ``cost``'s minima (within rounding)."""
    return int(np.flatnonzero(cost <= cost.min() + 1e-12)[-1])


def _explain(
    choice: Choice,
    lease_end: float | None,
    prefetch_at: float | None,
    in_host: float,
    options: dict[str, float],
    g: np.ndarray,
    may_hold: bool,
    lru: float,
) -> str:
    median = float(np.median(g))
    said = ", ".join(f"{name} {seconds_text(cost)}" for name, cost in sorted(options.items(), key=lambda o: o[1]))
    if choice == "keep" and lease_end is not None and lease_end <= lru:
        kept = "as long as the tier evicts nothing" if math.isinf(lru) else f"about {seconds_text(lru)}"
        what = f"keep in host RAM without a lease: LRU keeps them {kept} (back by then with p={in_host:.2f})"
    elif choice == "keep":
        assert lease_end is not None
        what = f"keep in host RAM until {seconds_text(lease_end)} (back by then with p={in_host:.2f})"
    elif choice == "demote" and prefetch_at is not None:
        unleased = ", LRU's from then, no lease" if lease_end is not None and lease_end <= prefetch_at + lru else ""
        what = (
            f"demote, read back from {seconds_text(prefetch_at)}{unleased} (in host RAM at the resume with "
            f"p={in_host:.2f})"
        )
    elif choice == "demote":
        what = "demote, no read ahead (the tier's read at the resume is cheaper than holding)"
    else:
        what = "drop (the resume recomputes)"
    room = "" if may_hold else "; larger than its share of the leases: not leased"
    if not math.isfinite(median):
        return f"{choice}: {what}"
    return f"{what}: expected {said}; gap median {seconds_text(median)}{room}"
