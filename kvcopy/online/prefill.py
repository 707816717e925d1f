"""The prefill half of an OnlineProfile: the roofline of one whole forward of the engine's model, fitted to
its forwards.

A forward of new tokens ``n_i`` after cached ``P_i`` (one pair per request of a batch of k) is costed as the
planner costs one: ``alpha + (k - 1) * e + max(flops / F, bytes / W)``, with ``flops = Σ spec.prefill_flops(n_i,
P_i)`` and ``bytes = spec.weight_bytes(Σ n_i) + Σ spec.kv_bytes(P_i)`` (the weights are read once per forward,
each request's cached KV once). ``e`` is the engine's work per sequence beside the first (its attention
metadata, its sampling, its Python), which FLOPs and bytes do not see: in transformers' continuous batching on
the CPU VM, a decode step of two requests took 2.4x one of a single request. All four are fitted, so a stale
weight-read floor from the calibration gives way where the forwards are faster than it says; the calibration's
single-request forwards say nothing of ``e`` (its prior is 0).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcopy.calibration.fit import fit_max_linear
from kvcopy.model.spec import ModelSpec, forward_costs
from kvcopy.online.observations import age_weights
from kvcopy.profile import PrefillProfile

__all__ = ["FLOPS_CAP_FACTOR", "PRIOR_FORWARD_TOKENS", "ForwardLaw"]

# A learned prefill FLOP rate is at most this multiple of the calibrated one (another dtype or kernel may be
# faster than the calibrator's layer; by more, the forwards are not compute-bound and say nothing of it).
FLOPS_CAP_FACTOR = 8.0
# Without a calibration, the cap is this multiple of the fastest FLOP rate a forward showed (fixed cost
# included, so the compute itself is faster than any one forward shows).
OBSERVED_FLOPS_CAP_FACTOR = 16.0
# Where the prior's pseudo-points sit: single-sequence forwards of this many tokens, from a decode step to
# a long prefill chunk, so that the calibrated shape holds where the engine has not been observed.
PRIOR_FORWARD_TOKENS = (1, 64, 512, 4096)
# Forwards kept in the snapshot's points (for plots): the most recent.
MAX_POINTS = 64
# The start taken from the data splits the fastest forward this way between fixed cost and weight reads.
_START_FLOOR_SHARE = 0.5

# (new tokens per request, cached tokens per request)
Batch = tuple[tuple[int, ...], tuple[int, ...]]


class ForwardLaw:
    """Fits the forward roofline of ``spec``; remembers each batch shape's FLOPs and bytes between fits."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self._costs: dict[Batch, tuple[float, float]] = {}

    def costs(self, batch: Batch) -> tuple[float, float]:
        """(FLOPs, bytes read) of one forward of ``batch``."""
        found = self._costs.get(batch)
        if found is None:
            found = self._costs[batch] = forward_costs(self.spec, *batch)
        return found

    def fit(
        self,
        forwards: tuple[tuple[Any, ...], ...],
        prior: tuple[float, float, float | None] | None,
        half_life: int,
        prior_weight: float,
    ) -> PrefillProfile:
        """The law of ``forwards`` (``(seq, new, cached, seconds)``, oldest first) with ``prior``
        (alpha, FLOP/s, weight bytes/s or None) as pseudo-points worth ``prior_weight`` observations, as a
        PrefillProfile of one whole forward of ``spec`` (its name and layer count: not rescaled)."""
        live = {(item[1], item[2]) for item in forwards}
        self._costs = {batch: c for batch, c in self._costs.items() if batch in live}
        seqs = np.array([item[0] for item in forwards], dtype=np.float64)
        extra = np.array([len(item[1]) - 1 for item in forwards], dtype=np.float64)
        costs = np.array([self.costs((item[1], item[2])) for item in forwards], dtype=np.float64)
        seconds = np.array([item[3] for item in forwards], dtype=np.float64)
        weights = age_weights(seqs, half_life)
        is_data = np.ones(len(seconds), dtype=bool)
        if prior is not None:
            alpha0, flops0, weight0 = prior
            pseudo = np.array([self.costs(((n,), (0,))) for n in PRIOR_FORWARD_TOKENS])
            law = alpha0 + np.maximum(pseudo[:, 0] / flops0, pseudo[:, 1] / weight0 if weight0 else 0.0)
            costs = np.concatenate([costs, pseudo])
            extra = np.concatenate([extra, np.zeros(len(pseudo))])  # single-request forwards
            seconds = np.concatenate([seconds, law])
            weights = np.concatenate([weights, np.full(len(pseudo), prior_weight / len(pseudo))])
            is_data = np.concatenate([is_data, np.zeros(len(pseudo), dtype=bool)])
            flops_cap = FLOPS_CAP_FACTOR * flops0
        else:
            flops_cap = OBSERVED_FLOPS_CAP_FACTOR * float(np.max(costs[:, 0] / seconds))
        data = is_data
        # From the data: half the fastest forward fixed, the rest a floor, compute at the fastest rate seen.
        starts = [
            np.array(
                [
                    _START_FLOOR_SHARE * float(seconds[data].min()),
                    0.0,
                    float(np.min(seconds[data] / costs[data, 0])),
                    _START_FLOOR_SHARE * float(np.min(seconds[data] / costs[data, 1])),
                ]
            )
        ]
        if prior is not None:  # and from the calibration, floor and all (or none when it has none)
            starts.insert(0, np.array([alpha0, 0.0, 1.0 / flops0, 1.0 / weight0 if weight0 else 0.0]))
        ones, zeros = np.ones(len(seconds)), np.zeros(len(seconds))
        compute = np.stack([ones, extra, costs[:, 0], zeros], axis=1)
        memory = np.stack([ones, extra, zeros, costs[:, 1]], axis=1)
        fit = fit_max_linear(
            np.stack([compute, memory]),
            seconds,
            weights,
            is_data,
            starts,
            lower=np.array([0.0, 0.0, 1.0 / flops_cap, 0.0]),
            upper=np.full(4, np.inf),
        )
        alpha, per_request, per_flop, per_byte = fit.params
        layers = self.spec.num_layers
        points = tuple(  # per layer, as the calibrator's (one layer's forwards)
            (self.costs((item[1], item[2]))[0] / layers, item[3] / layers) for item in forwards[-MAX_POINTS:]
        )
        return PrefillProfile(
            model=self.spec.name.split("@")[0],
            alpha_s=float(alpha),
            flops_per_s=float(1.0 / per_flop),
            r2=fit.r2,
            points=points,
            weight_bytes_per_s=float(1.0 / per_byte) if per_byte > 0 else None,
            num_layers=layers,
            extra_request_s=float(per_request),
        )
