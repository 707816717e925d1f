"""OnlineProfile: the engine's own transfers and forwards recalibrate the profile while it serves.

The calibrator times copies and one layer's prefill in isolation; an engine adds what it never sees
(per-forward scheduling, batch assembly, sampling and Python, copies queued behind others and contending
with decode). Those costs decide small prefixes, and only the engine measures them. An OnlineProfile takes
those measurements (:meth:`OnlineProfile.observe_copy`, :meth:`OnlineProfile.observe_forward`) and gives a
:class:`~kvcopy.Profile` in the calibrator's terms (:meth:`OnlineProfile.profile`), usable wherever one is.

The model (docs/decisions.md, "Learning the engine's costs online"):

- the calibrated ``base`` is a prior worth PRIOR_WEIGHT observations, as pseudo-points of its own law, so
  the first decisions are the calibrator's and a few observations move them only part of the way;
- observation k of a stream (a copy link, or prefill) weighs ``0.5 ** ((newest - k) / half_life)``: the
  fit follows drift, and what is HISTORY_HALF_LIVES half-lives old is forgotten;
- the fit is robust (log-space residuals with bounded influence, kvcopy.calibration.fit) and bounded:
  alpha >= 0, a copy's bandwidth at most BANDWIDTH_CAP_FACTOR x the calibrated peak.

Observing is cheap (checks and an append; no lock, no fit): fits run in :meth:`profile`, only when
something new was observed.
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvcopy._checks import positive_int
from kvcopy.calibration.fit import fit_max_linear, weighted_median
from kvcopy.model.spec import ModelSpec
from kvcopy.online.observations import Stream, age_weights, checked_seconds, count, token_counts
from kvcopy.online.prefill import ForwardLaw
from kvcopy.profile import DISK_READ_DIRECTION, DISK_WRITE_DIRECTION, REMOTE_DIRECTION, CostLine, MethodProfile, Profile

__all__ = [
    "BANDWIDTH_CAP_FACTOR",
    "DIRECTIONS",
    "HISTORY_HALF_LIVES",
    "PRIOR_WEIGHT",
    "OnlineProfile",
]

# Directions a copy may be observed in: the calibrator's four and the network link to a peer.
DIRECTIONS = ("d2h", "h2d", "h2h", "d2d", REMOTE_DIRECTION, DISK_WRITE_DIRECTION, DISK_READ_DIRECTION)
# What the calibrated base is worth, in observations: enough that one odd transfer does not overturn a
# calibration, few enough that a few dozen of the engine's own measurements outweigh it.
PRIOR_WEIGHT = 4.0
# Observations older than this many half-lives weigh under 0.1% and are dropped (bounds memory and fit time).
HISTORY_HALF_LIVES = 10
# A learned bandwidth is at most this multiple of the calibrated peak (the contiguous copy; kvcopy's own
# paths measured up to 1.2x it): a faster one would be explaining noise, not a link.
BANDWIDTH_CAP_FACTOR = 2.0
# Without a calibrated peak, the cap is this multiple of the fastest rate observed (bytes / seconds of one
# transfer, which includes its fixed cost, so the link itself is faster than any one transfer shows).
OBSERVED_RATE_CAP_FACTOR = 16.0
# Where the prior's pseudo-points sit: copies of this many blocks. They span the transfers engines make, so
# the prior's shape holds where the engine has not been observed.
PRIOR_BLOCK_COUNTS = (1, 16, 256)
# Distinct plane-block sizes fitted per link; more (an engine with many block sizes) join the nearest.
MAX_SIZES_PER_LINK = 16
# Shapes (copies) and forwards kept in the snapshot's points, for plots: the most recent.
MAX_POINTS = 64
_PREFILL = "prefill"
# A method the base never measured has the base's fastest method there as its prior: fastest at this size.
_STAND_IN_PROBE_NBYTES = 1 << 20


class OnlineProfile:
    """A Profile learned from an engine's measured transfers and forwards, with ``base`` as its prior.

    Observing never blocks a copy worker; :meth:`profile` fits lazily and returns a copy (one fit at a time,
    behind a lock that observing never takes).

    Parameters:

    - ``spec``: the ModelSpec the engine runs (its forwards are costed with ``spec.prefill_flops`` and
      ``spec.weight_bytes``).
    - ``base``: the calibrated Profile, a prior worth PRIOR_WEIGHT observations (None: no prior; the first
      fits are the observations' own).
    - ``half_life``: in observations of each stream; an observation weighs half as much ``half_life``
      observations later.
    """

    def __init__(self, spec: ModelSpec, base: Profile | None = None, *, half_life: int = 256) -> None:
        if not isinstance(spec, ModelSpec):
            raise TypeError(f"spec: expected a ModelSpec, got {type(spec).__name__}")
        if base is not None and not isinstance(base, Profile):
            raise TypeError(f"base: expected a Profile or None, got {type(base).__name__}")
        self.spec = spec
        self.base = base
        self.half_life = positive_int("half_life", half_life)
        self._window = HISTORY_HALF_LIVES * self.half_life
        self._copies: dict[tuple[str, str], Stream] = {}
        self._forwards = Stream(self._window)
        self._cached: tuple[tuple[Any, ...], Profile] | None = None
        self._prefill = ForwardLaw(spec)
        self._fit_lock = threading.Lock()  # profile() from two threads; observing never takes it
        self.refits = 0  # snapshots fitted (profile() calls that found new observations)
        self._base_json = None if base is None else json.dumps(base.to_dict(), sort_keys=True)

    # ------------------------------------------------------------------ observing

    def observe_copy(self, direction: str, method: str, nbytes: int, seconds: float, *, num_blocks: int = 1) -> None:
        """One transfer as the engine measured it: ``nbytes`` in ``num_blocks`` blocks took ``seconds`` from its
        submission until it was done (queueing and contention included), with copy ``method``. A measured 0 s
        (below the clock's resolution) is kept as MIN_SECONDS.

        The methods observed in a direction replace the base's there (the base's, timed without the engine's
        queueing, are not comparable), so in a direction the base measured, ``method`` must be one of the
        base's methods there: ValueError naming it and them otherwise (a misspelt name would replace the
        calibration). In a direction the base did not measure (or without a base), any method name is taken.
        TypeError for an argument of the wrong type, ValueError for a wrong value; nothing is kept then."""
        if not isinstance(direction, str):
            raise TypeError(f"direction: expected a str, got {type(direction).__name__}")
        if direction not in DIRECTIONS:
            raise ValueError(f"direction: expected one of {DIRECTIONS}, got {direction!r}")
        if not isinstance(method, str):
            raise TypeError(f"method: expected a method name (str), got {type(method).__name__}")
        if not method:
            raise ValueError("method: expected a method name, got ''")
        calibrated = self.base.directions.get(direction) if self.base is not None else None
        if calibrated and method not in calibrated:
            raise ValueError(
                f"method: {method!r} was not calibrated for {direction}; the base measured {sorted(calibrated)} "
                f"there, which observations of another method would replace"
            )
        nbytes = positive_int("nbytes", nbytes)
        seconds = checked_seconds(seconds)
        num_blocks = positive_int("num_blocks", num_blocks)
        if num_blocks > nbytes:  # a block holds at least one byte
            raise ValueError(
                f"num_blocks: expected at most nbytes ({nbytes}) blocks, as a block holds at least one byte; "
                f"got {num_blocks}"
            )
        key = (direction, method)
        stream = self._copies.get(key) or self._copies.setdefault(key, Stream(self._window))
        stream.append(nbytes, num_blocks, seconds)

    def observe_forward(
        self, tokens: int | Sequence[int], seconds: float, *, cached_tokens: int | Sequence[int] = 0
    ) -> None:
        """One forward of the engine's model: ``tokens`` new tokens after ``cached_tokens`` cached ones took
        ``seconds``. A batched forward gives one count per request in both (sequences of one length). A measured
        0 s is kept as MIN_SECONDS. TypeError for a count or seconds of the wrong type, ValueError for a wrong
        value; nothing is kept then."""
        new, cached = token_counts(tokens, cached_tokens)
        self._forwards.append(new, cached, checked_seconds(seconds))

    @property
    def num_observations(self) -> dict[str, int]:
        """Observations so far, per copy link (``"h2d cuda"``: direction and method) and for ``"prefill"``."""
        counts = {f"{d} {m}": count(s.snapshot()) for (d, m), s in sorted(self._copies.items())}
        counts[_PREFILL] = count(self._forwards.snapshot())
        return counts

    # ------------------------------------------------------------------ the snapshot

    def profile(self) -> Profile:
        """The learned Profile (a copy; the base is never changed). Equal to the base with no observations."""
        with self._fit_lock:
            copies = {key: stream.snapshot() for key, stream in sorted(self._copies.items())}
            forwards = self._forwards.snapshot()
            key = (*((k, count(items)) for k, items in copies.items()), (_PREFILL, count(forwards)))
            if self._cached is None or self._cached[0] != key:
                self._cached = (key, self._fit(copies, forwards))
                self.refits += 1
            return copy.deepcopy(self._cached[1])

    def _fit(self, copies: dict[tuple[str, str], tuple[tuple[Any, ...], ...]], forwards: tuple) -> Profile:
        if not forwards and not any(copies.values()):
            return copy.deepcopy(self.base) if self.base is not None else Profile(hardware=self._online_note({}))
        base = self.base
        profile = copy.deepcopy(base) if base is not None else Profile(hardware={})
        counts: dict[str, int] = {}
        observed_directions = {direction for (direction, _), items in copies.items() if items}
        for direction in observed_directions:  # see _fit_link: unobserved methods are not comparable
            profile.directions[direction] = {}
        for (direction, method), items in copies.items():
            if items:
                profile.directions[direction][method] = self._fit_link(direction, method, items)
                counts[f"{direction} {method}"] = count(items)
        if forwards:
            profile.prefill = self._prefill.fit(forwards, self._prior_prefill(), self.half_life, PRIOR_WEIGHT)
            counts[_PREFILL] = count(forwards)
        profile.hardware = {**profile.hardware, **self._online_note(counts)}
        return profile

    def _online_note(self, counts: dict[str, int]) -> dict[str, Any]:
        base = None
        if self.base is not None and self._base_json is not None:  # (both or neither)
            hw = self.base.hardware
            base = {
                "device_name": hw.get("device_name"),
                "date": hw.get("date"),
                "sha256": hashlib.sha256(self._base_json.encode()).hexdigest()[:16],
            }
        return {
            "online": {
                "learned_online": True,
                "model": self.spec.name,
                "half_life": self.half_life,
                "prior_weight": PRIOR_WEIGHT,
                "observations": counts,
                "base": base,
            }
        }

    # ------------------------------------------------------------------ the prior

    def _prior_prefill(self) -> tuple[float, float, float | None] | None:
        """(alpha of one whole forward of ``spec``, FLOP/s, weight bytes/s) from the base, as
        ``Planner.from_profile`` reads them (a fixed cost per layer-forward, scaled to ``spec``'s layers)."""
        prefill = self.base.prefill if self.base is not None else None
        if prefill is None:
            return None
        alpha = prefill.alpha_for(self.spec.name.split("@")[0], self.spec.num_layers)
        return alpha, prefill.flops_per_s, prefill.weight_bytes_per_s

    def _planes(self) -> int:
        return int(self.base.hardware.get("calibration_planes", 1)) if self.base is not None else 1

    def _prior_link(self, direction: str, method: str) -> MethodProfile | None:
        """The base's profile of this method in this direction; else its best method there; else None."""
        measured = self.base.directions.get(direction, {}) if self.base is not None else {}
        if method in measured:
            return measured[method]
        if not measured:
            return None
        return min(measured.values(), key=lambda mp: mp.fit.predict(_STAND_IN_PROBE_NBYTES))

    # ------------------------------------------------------------------ copies

    def _bandwidth_cap(self, direction: str, rates: np.ndarray) -> float:
        base = self.base
        if base is not None and base.peaks.get(direction):
            return BANDWIDTH_CAP_FACTOR * base.peaks[direction]
        fits = [
            f
            for mp in (base.directions.get(direction, {}) if base else {}).values()
            for f in (mp.fit, *mp.by_block_nbytes.values())
        ]
        if fits:
            return BANDWIDTH_CAP_FACTOR * max(f.beta_bytes_per_s for f in fits)
        return OBSERVED_RATE_CAP_FACTOR * float(rates.max())

    def _fit_link(self, direction: str, method: str, items: tuple[tuple[Any, ...], ...]) -> MethodProfile:
        """The method's overall fit and one per plane-block size the engine moved, from its observations.

        A transfer of (nbytes, num_blocks) has plane-blocks of ``nbytes / num_blocks / calibration_planes``
        bytes, the size ``Profile.predict`` looks up for it, so a query of the same transfer lands on the
        fit its observations made. The base's fits at other sizes are dropped: they measure a copy without
        the engine's queueing and contention, and interpolating between the two would mix them.
        """
        seqs = np.array([item[0] for item in items], dtype=np.float64)
        nbytes = np.array([item[1] for item in items], dtype=np.float64)
        blocks = np.array([item[2] for item in items], dtype=np.float64)
        seconds = np.array([item[3] for item in items], dtype=np.float64)
        weights = age_weights(seqs, self.half_life)
        planes = self._planes()
        sizes = _size_buckets(nbytes / blocks / planes)
        cap = self._bandwidth_cap(direction, nbytes / seconds)
        prior = self._prior_link(direction, method)
        overall = self._link_fit(nbytes, seconds, weights, prior.fit if prior else None, cap, planes, None)
        by_size = {}
        for size in sorted(set(sizes.tolist())):
            mine = sizes == size
            prior_fit = prior.line_at(size) if prior else None
            by_size[int(size)] = self._link_fit(
                nbytes[mine], seconds[mine], weights[mine], prior_fit, cap, planes, size
            )
        return MethodProfile(fit=overall, by_block_nbytes=by_size, points=_copy_points(nbytes, blocks, seconds, planes))

    def _link_fit(
        self,
        nbytes: np.ndarray,
        seconds: np.ndarray,
        weights: np.ndarray,
        prior: CostLine | None,
        cap: float,
        planes: int,
        size: float | None,
    ) -> CostLine:
        x, t, w = nbytes, seconds, weights
        is_data = np.ones(len(x), dtype=bool)
        if prior is not None:
            block = size * planes if size else float(np.median(nbytes))
            px = np.array([block * n for n in PRIOR_BLOCK_COUNTS])
            x = np.concatenate([x, px])
            t = np.concatenate([t, [prior.predict(v) for v in px]])
            w = np.concatenate([w, np.full(len(px), PRIOR_WEIGHT / len(px))])
            is_data = np.concatenate([is_data, np.zeros(len(px), dtype=bool)])
            start = np.array([prior.alpha_s, 1.0 / min(prior.beta_bytes_per_s, cap)])
        elif len(np.unique(x)) < 2:  # one size and no prior: alpha and beta cannot be told apart; no fixed cost
            beta = min(_rate(x, t, w), cap)
            pred = x / beta
            rel = (t - pred) / pred
            return CostLine(alpha_s=0.0, beta_bytes_per_s=beta, r2=1.0, max_abs_residual=float(np.max(np.abs(rel))))
        else:
            start = np.array([float(t.min()) / 2, 1.0 / min(_rate(x, t, w), cap)])
        features = np.stack([np.ones_like(x), x], axis=1)[None]
        fit = fit_max_linear(
            features, t, w, is_data, [start], lower=np.array([0.0, 1.0 / cap]), upper=np.array([np.inf, np.inf])
        )
        alpha, per_byte = fit.params
        return CostLine(
            alpha_s=float(alpha),
            beta_bytes_per_s=float(1.0 / per_byte),
            r2=fit.r2,
            max_abs_residual=fit.max_abs_residual,
        )


def _rate(x: np.ndarray, t: np.ndarray, w: np.ndarray) -> float:
    """Units per second of the weighted-median observation (x / t; its fixed cost included)."""
    return 1.0 / weighted_median(t / x, w)


def _size_buckets(plane_blocks: np.ndarray) -> np.ndarray:
    """Each observation's plane-block size (rounded to a byte); beyond MAX_SIZES_PER_LINK distinct sizes, the
    less frequent ones join the nearest kept size (by ratio)."""
    sizes = np.maximum(np.rint(plane_blocks), 1.0)
    distinct, counts = np.unique(sizes, return_counts=True)
    if len(distinct) <= MAX_SIZES_PER_LINK:
        return sizes
    kept = np.sort(distinct[np.argsort(-counts, kind="stable")[:MAX_SIZES_PER_LINK]])
    nearest = np.abs(np.log(sizes)[:, None] - np.log(kept)[None, :]).argmin(axis=1)
    return kept[nearest]


def _copy_points(nbytes: np.ndarray, blocks: np.ndarray, seconds: np.ndarray, planes: int) -> list[list[float]]:
    """Per distinct transfer shape (the MAX_POINTS most recently seen): [bytes, blocks, plane-block bytes,
    median s, p20 s, p80 s], as the calibrator's points."""
    shapes: dict[tuple[float, float], list[float]] = {}
    for b, n, s in zip(nbytes.tolist(), blocks.tolist(), seconds.tolist(), strict=True):
        shapes.setdefault((b, n), []).append(s)
        shapes[(b, n)] = shapes.pop((b, n))  # most recent last
    rows = []
    for (b, n), times in list(shapes.items())[-MAX_POINTS:]:
        times.sort()
        rows.append([b, n, b / n / planes, _quantile(times, 0.5), _quantile(times, 0.2), _quantile(times, 0.8)])
    return sorted(rows)


def _quantile(ordered: list[float], q: float) -> float:
    """numpy's default (linear) quantile of a sorted list, without numpy's per-call cost."""
    at = q * (len(ordered) - 1)
    lo = int(at)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (at - lo)
