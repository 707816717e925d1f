"""The Planner an engine adapter decides with, learning from the engine while it serves.

Engine-independent: an adapter feeds it every finished transfer (:meth:`OnlinePlanner.observe_transfer`, a
TransferEngine observer) and every forward it timed (:meth:`OnlinePlanner.observe_forward`), and asks it for
the Planner of the moment (:meth:`OnlinePlanner.current`) and for a preempted request's two costs in the
engine's terms (:func:`predict_paths`). With ``learn=False`` it is the calibrated Planner, unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvcopy.engine.transfer import Transfer
from kvcopy.model.spec import ModelSpec
from kvcopy.online.profile import OnlineProfile
from kvcopy.planner.planner import DEFAULT_BLOCK_TOKENS, Planner
from kvcopy.profile import Profile

__all__ = [
    "MATERIAL_CHANGE",
    "REFIT_EVERY",
    "OnlinePlanner",
    "forward_seconds",
    "own_share",
    "predict_paths",
]

# New observations before a decision refits the learned profile: a refit costs milliseconds (it is timed
# inside the engine's step), and this many more observations move a fit of hundreds by a few percent at most.
REFIT_EVERY = 64
# A refitted profile replaces the Planner when one of its probe predictions moved by more than this fraction.
MATERIAL_CHANGE = 0.02
# Probes of that comparison: copies of this many blocks, forwards of this many tokens.
_PROBE_BLOCKS = (1, 64)
_PROBE_TOKENS = (1, 64, 1024)
_PROBE_BATCH = ((1, 1), (0, 0))  # and a decode step of two requests (the work per request beside the first)


def own_share(planner: Planner | None, new: Sequence[int], cached: Sequence[int], index: int) -> float:
    """The part of one measured forward that is request ``index``'s own: the forward it would have been alone,
    over the forward of the whole batch, both by ``planner``'s law (at most 1). 1 without a law."""
    if planner is None:
        return 1.0
    whole = planner.t_forward(new, cached)
    if whole <= 0.0:
        return 1.0
    return min(1.0, planner.t_forward((new[index],), (cached[index],)) / whole)


def forward_seconds(planner: Planner, tokens: int, cached: int, max_forward_tokens: int | None) -> float:
    """Predicted seconds of the forwards that process ``tokens`` after ``cached`` ones, at most
    ``max_forward_tokens`` per forward (None: one forward), each costed whole by the planner."""
    step = max_forward_tokens or max(tokens, 1)
    total, done = 0.0, 0
    while done < tokens:
        chunk = min(step, tokens - done)
        total += planner.t_prefill(chunk, cached + done)
        done += chunk
    return total


def predict_paths(
    planner: Planner,
    prefix_tokens: int,
    new_tokens: int,
    reload_nbytes: int,
    max_forward_tokens: int | None,
    *,
    cached_tokens: int = 0,
) -> tuple[float, float]:
    """(reload, recompute) seconds of a request, in the terms its path is measured in: the reload's copy
    plus the forwards of its new tokens; the forwards of all its tokens. ``cached_tokens``: tokens before the
    prefix that are on the device either way (an engine's own prefix cache)."""
    reload = planner.t_load_nbytes(reload_nbytes) + forward_seconds(
        planner, new_tokens, cached_tokens + prefix_tokens, max_forward_tokens
    )
    return reload, forward_seconds(planner, prefix_tokens + new_tokens, cached_tokens, max_forward_tokens)


def _materially_different(old: Planner, new: Planner, block_nbytes: int) -> bool:
    pairs = [(old.t_load_nbytes(n * block_nbytes), new.t_load_nbytes(n * block_nbytes)) for n in _PROBE_BLOCKS]
    pairs += [(old.t_prefill(n), new.t_prefill(n)) for n in _PROBE_TOKENS]
    pairs.append((old.t_forward(*_PROBE_BATCH), new.t_forward(*_PROBE_BATCH)))
    return any(abs(b - a) > MATERIAL_CHANGE * max(a, 1e-12) for a, b in pairs)


class OnlinePlanner:
    """The calibrated Planner for ``spec`` (None without a ``base`` profile or a spec), and with ``learn``,
    an :class:`~kvcopy.OnlineProfile` of the engine's transfers and forwards whose refits replace it when
    they change its predictions materially. Decision k is made from what was observed before it."""

    def __init__(
        self,
        spec: ModelSpec | None,
        base: Profile | None,
        *,
        learn: bool,
        half_life: int = 256,
        decode_share: float = 0.0,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
    ) -> None:
        self.spec = spec
        self.base = base
        self.online = OnlineProfile(spec, base, half_life=half_life) if learn and spec is not None else None
        self.decode_share = decode_share  # the Planner's options (kvcopy.Planner.from_profile)
        self.block_tokens = block_tokens
        self._planner = self._plan(base) if base is not None else None
        self._observations = 0  # the engine's observations in the profile the planner was built from
        self._refitted_at = 0
        self._lock = threading.Lock()  # decisions and the user's stats.profile may come from two threads

    def observe_transfer(self, transfer: Transfer) -> None:
        """A TransferEngine observer: a finished offload or reload, by its turnaround (queueing included)."""
        if transfer.turnaround is not None:
            self.observe_copy(
                transfer.profile_direction, transfer.method, transfer.nbytes, transfer.turnaround, transfer.num_blocks
            )

    def observe_copy(self, direction: str, method: str, nbytes: int, seconds: float, num_blocks: int = 1) -> None:
        """A finished copy reported from elsewhere (another process's engine): its Profile direction, method,
        bytes, turnaround and blocks."""
        if self.online is not None:
            self.online.observe_copy(direction, method, nbytes, seconds, num_blocks=num_blocks)

    @property
    def planner(self) -> Planner | None:
        """The Planner of the last decision, without a refit: the law a measured forward is shared out by."""
        return self._planner

    def observe_forward(self, tokens: list[int], cached_tokens: list[int], seconds: float) -> None:
        """One forward the engine timed: each request's new and cached tokens."""
        if self.online is not None and tokens:
            self.online.observe_forward(tokens, seconds, cached_tokens=cached_tokens)

    def current(self) -> tuple[Planner | None, int]:
        """The Planner to decide with now, and how many of the engine's observations its profile holds."""
        online = self.online
        if online is None:
            return self._planner, 0
        with self._lock:
            total = sum(online.num_observations.values())
            due = total - self._refitted_at >= REFIT_EVERY or (self._planner is None and total > self._refitted_at)
            if due:
                self._refitted_at = total
                try:
                    candidate = self._plan(online.profile())
                except ValueError:  # no base, and not yet both a copy link and forwards observed
                    candidate = None
                assert self.spec is not None  # an OnlineProfile is only made with a spec
                block = self.spec.block_nbytes(self.block_tokens)
                if candidate is not None and (
                    self._planner is None or _materially_different(self._planner, candidate, block)
                ):
                    self._planner, self._observations = candidate, total
            return self._planner, self._observations

    def _plan(self, profile: Profile) -> Planner | None:
        if self.spec is None:
            return None
        return Planner.from_profile(profile, self.spec, block_tokens=self.block_tokens, decode_share=self.decode_share)

    def profile(self) -> Profile | None:
        """The learned profile (with ``learn``), else the calibrated one."""
        if self.online is None:
            return self.base
        with self._lock:
            return self.online.profile()
