"""When will a paused session come back? :class:`GapForecaster` learns pause lengths online and forecasts one.

The model (docs/decisions.md, "Agents' pauses: the hint and the forecast"):

- **Levels, pooled from the specific to the general.** A pause with a tool named is forecast from
  (session, tool) -> tool -> all tool pauses; one with no tool from session -> all pauses with no tool named.
  Each level remembers its recent pauses (kvcopy/agents/history.py: a bounded window; least recently used
  sessions and tools forgotten). A level's distribution is a mixture, w * (its own pauses) + (1 - w) * (its
  parent's), with w = n / (n + PSEUDO_OBSERVATIONS) for its n pauses: a level seen a few times is shrunk
  toward its parent, one seen often follows its own history.
- **The prior** (kvcopy/agents/priors.py, from TraceLab's traces) is the roots' parent, worth
  PSEUDO_OBSERVATIONS pauses: the tool gap for the tool root, the tool and human waits mixed for the other.
- **Smoothed**: each remembered pause is a logistic kernel in log-space (kvcopy/agents/gap_forecast.py), so
  the CDF is continuous and a quantile moves continuously with q.
- **A client's resume_in_s is evidence, not truth.** Every level also learns r = ln(actual gap) -
  ln(resume_in_s) from the pauses that came with an estimate, pooled the same way (with a prior of mean 0 and
  sigma 1 at the root). Asked with an estimate, the forecaster corrects it, a log-normal of median
  ``resume_in_s * exp(mean r)`` and log-sigma the pooled spread of r, and multiplies that law with the
  history's (summarised as a log-normal by its log-mean and log-variance): the precision-weighted log-normal.
  A biased client is corrected as its pauses are observed; an exact one ends with a tight forecast around
  its estimates; a noisy one counts as much as its spread earns.

Cost: :meth:`GapForecaster.observe` is O(1) per level (three at most); a forecast is O(window) to pool and
about ten O(window) steps per quantile. Safe to call from several threads (one lock).
"""

from __future__ import annotations

import math
import numbers
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvcopy._checks import non_negative_number, path_argument
from kvcopy.agents.forecast_file import (
    FORMAT_NAME,
    FORMAT_VERSION,
    LevelValues,
    read_document,
    read_file,
    write_file,
)
from kvcopy.agents.gap_forecast import EstimateCorrection, GapForecast, PooledLevel
from kvcopy.agents.history import (
    MAX_SESSION_LEVELS,
    MAX_TOOLS,
    SESSION_WINDOW,
    WINDOW,
    LevelHistory,
    log_gap,
)
from kvcopy.agents.priors import RATIO_PRIOR_MEAN, RATIO_PRIOR_SIGMA, TOOL_GAP, UNTOOLED_GAP, LogNormal

__all__ = ["PSEUDO_OBSERVATIONS", "GapForecaster"]

# kappa: what a level's parent (and the roots' prior) is worth, in pauses. A level's own history weighs half
# after 8 pauses and 94% after 128: a session (TraceLab: p50 15 tool-initiated steps) follows its own pauses
# within its life, while its first one or two barely move it from its tool's.
PSEUDO_OBSERVATIONS = 8.0
_ROOT_NAMES = {"tool": "all tool pauses", "untooled": "all pauses with no tool named"}
_PRIORS: dict[str, tuple[str, tuple[tuple[float, LogNormal], ...]]] = {
    "tool": ("prior: TraceLab's tool gap", ((1.0, TOOL_GAP),)),
    "untooled": ("prior: TraceLab's pauses (8 in 9 tool gaps, 1 in 9 human waits)", UNTOOLED_GAP),
}


class GapForecaster:
    """Learns pause lengths online and forecasts a pause's distribution (see the module's doc).

    A pause is described by its ``session`` (None: none known), the ``tool`` that runs during it (None: none
    named) and the client's estimate ``resume_in_s`` (None: none given), as a
    :class:`~kvcopy.agents.PauseHint` carries them. Arguments are checked before anything is changed:
    TypeError for a wrong type (a bool is not a number; ``session`` and ``tool`` are a str or None), ValueError
    for a wrong value (naming the argument).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._roots = {name: LevelHistory(WINDOW) for name in _ROOT_NAMES}
        self._tools: OrderedDict[str, LevelHistory] = OrderedDict()
        self._sessions: OrderedDict[tuple[str, str | None], LevelHistory] = OrderedDict()
        self._tools_of_session: dict[str, set[str | None]] = {}

    # ------------------------------------------------------------------ learning

    def observe(
        self,
        gap_s: float,
        *,
        session: str | None = None,
        tool: str | None = None,
        resume_in_s: float | None = None,
    ) -> None:
        """Learns one pause of ``gap_s`` seconds (finite, >= 0; clamped to [MIN_GAP_S, MAX_GAP_S]): the time
        from a request's finish to the arrival of its session's next request. With ``resume_in_s``, the
        client's estimate given at the pause, it also learns how far that client's estimates run."""
        gap = non_negative_number("gap_s", gap_s)
        session, tool, estimate = _described(session, tool, resume_in_s)
        y = log_gap(gap)
        ratio = None if estimate is None else y - log_gap(estimate)
        with self._lock:
            for _, level in self._path(session, tool, create=True):
                assert level is not None
                level.observe(y, ratio)

    def end_session(self, session: str) -> None:
        """Forgets ``session``'s own levels (its pauses stay in its tools' and the roots'): it ended (a hint's
        ``done``), and its history will not be asked for again. Nothing happens for a session not kept."""
        _name("session", session, optional=False)
        with self._lock:
            for tool in self._tools_of_session.pop(session, ()):
                del self._sessions[(session, tool)]

    # ------------------------------------------------------------------ forecasting

    def forecast(
        self, *, session: str | None = None, tool: str | None = None, resume_in_s: float | None = None
    ) -> GapForecast:
        """The distribution of the next pause of ``session`` under ``tool`` (``resume_in_s``: the client's
        estimate, weighed by what its estimates have been worth), pooled once: ask it as many quantiles and
        CDF values as needed."""
        session, tool, estimate = _described(session, tool, resume_in_s)
        with self._lock:
            return self._forecast(session, tool, estimate)

    def quantile(
        self, q: float, *, session: str | None = None, tool: str | None = None, resume_in_s: float | None = None
    ) -> float:
        """The pause length in seconds that the pause stays under with probability ``q`` (in (0, 1), open).
        TypeError unless ``q`` is a number; ValueError outside (0, 1) or NaN."""
        if isinstance(q, bool) or not isinstance(q, numbers.Real):
            raise TypeError(f"q: expected a probability in (0, 1), got {type(q).__name__} {q!r:.80}")
        if not 0.0 < float(q) < 1.0:
            raise ValueError(f"q: expected a probability in (0, 1) (open), got {q!r}")
        return self.forecast(session=session, tool=tool, resume_in_s=resume_in_s).quantile(float(q))

    def cdf(
        self, t_s: float, *, session: str | None = None, tool: str | None = None, resume_in_s: float | None = None
    ) -> float:
        """P(the pause <= ``t_s`` seconds), for ``t_s`` >= 0 (infinity allowed: 1). TypeError unless it is a
        number; ValueError when it is negative or NaN."""
        if isinstance(t_s, bool) or not isinstance(t_s, numbers.Real):
            raise TypeError(f"t_s: expected a number of seconds >= 0, got {type(t_s).__name__} {t_s!r:.80}")
        if math.isnan(float(t_s)) or float(t_s) < 0:
            raise ValueError(f"t_s: expected a number of seconds >= 0, got {t_s!r}")
        return self.forecast(session=session, tool=tool, resume_in_s=resume_in_s).cdf(float(t_s))

    def _path(self, session: str | None, tool: str | None, *, create: bool) -> list[tuple[str, LevelHistory | None]]:
        """The levels a pause of (session, tool) pools, the most specific first, named; the root last. Levels
        not kept are None (or made, with ``create``); those found become the most recently used."""
        path: list[tuple[str, LevelHistory | None]] = []
        if session is not None:
            name = f"session {session!r} under tool {tool!r}" if tool is not None else f"session {session!r}"
            path.append((name, self._session_level(session, tool, create)))
        if tool is not None:
            path.append((f"tool {tool!r}", self._tool_level(tool, create)))
        root = "tool" if tool is not None else "untooled"
        path.append((_ROOT_NAMES[root], self._roots[root]))
        return path

    def _tool_level(self, tool: str, create: bool) -> LevelHistory | None:
        level = self._tools.get(tool)
        if level is not None:
            self._tools.move_to_end(tool)
        elif create:
            level = self._tools[tool] = LevelHistory(WINDOW)
            if len(self._tools) > MAX_TOOLS:
                self._tools.popitem(last=False)
        return level

    def _session_level(self, session: str, tool: str | None, create: bool) -> LevelHistory | None:
        key = (session, tool)
        level = self._sessions.get(key)
        if level is not None:
            self._sessions.move_to_end(key)
        elif create:
            level = self._sessions[key] = LevelHistory(SESSION_WINDOW)
            self._tools_of_session.setdefault(session, set()).add(tool)
            if len(self._sessions) > MAX_SESSION_LEVELS:
                (old_session, old_tool), _ = self._sessions.popitem(last=False)
                tools = self._tools_of_session[old_session]
                tools.discard(old_tool)
                if not tools:
                    del self._tools_of_session[old_session]
        return level

    def _forecast(self, session: str | None, tool: str | None, estimate: float | None) -> GapForecast:
        path = self._path(session, tool, create=False)
        root = "tool" if tool is not None else "untooled"
        prior_name, prior = _PRIORS[root]
        # the gaps: each level's pauses weigh w = n / (n + kappa) of what its descendants leave
        remaining, levels, centres, weights = 1.0, [], [], []
        for name, level in path:
            n = len(level.log_gaps) if level is not None else 0
            share = remaining * n / (n + PSEUDO_OBSERVATIONS)
            remaining -= share
            levels.append(PooledLevel(name, n, share))
            if n and level is not None:
                centres.append(level.log_gaps.values())
                weights.append(np.full(n, share / n))
        levels.append(PooledLevel(prior_name, int(PSEUDO_OBSERVATIONS), remaining))
        history = GapForecast(
            centres=np.concatenate(centres) if centres else np.empty(0),
            centre_weights=np.concatenate(weights) if weights else np.empty(0),
            normals=[(remaining * w, law.mu, law.sigma) for w, law in prior],
            levels=levels,
        )
        if estimate is None:
            return history
        # the estimate: r's pooled mean and variance (the mixture's), then the precision-weighted product
        ratio_mean, ratio_variance, pairs = _pooled_ratio(path)
        estimate_mean = log_gap(estimate) + ratio_mean
        history_mean, history_variance = history.log_moments()
        precision = 1.0 / history_variance + 1.0 / ratio_variance
        mean = (history_mean / history_variance + estimate_mean / ratio_variance) / precision
        correction = EstimateCorrection(
            resume_in_s=estimate,
            mean=ratio_mean,
            sigma=math.sqrt(ratio_variance),
            pairs=pairs,
            share=(1.0 / ratio_variance) / precision,
        )
        return GapForecast(
            centres=np.empty(0),
            centre_weights=np.empty(0),
            normals=[(1.0, mean, math.sqrt(1.0 / precision))],
            levels=levels,
            estimate=correction,
        )

    # ------------------------------------------------------------------ saving and loading

    def to_dict(self) -> dict[str, Any]:
        """The forecaster as a JSON-ready dict (kvcopy/agents/forecast_file.py's format), from which
        :meth:`from_dict` rebuilds one that answers exactly as this one."""

        def level(history: LevelHistory) -> dict[str, list[float]]:
            return {"log_gaps": history.log_gaps.oldest_first(), "log_ratios": history.log_ratios.oldest_first()}

        with self._lock:
            return {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "roots": {name: level(history) for name, history in self._roots.items()},
                "tools": [{"tool": tool, **level(history)} for tool, history in self._tools.items()],
                "sessions": [
                    {"session": session, "tool": tool, **level(history)}
                    for (session, tool), history in self._sessions.items()
                ],
            }

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], *, file: str | os.PathLike[str] = "<gap forecaster dict>"
    ) -> GapForecaster:
        """The forecaster ``data`` (a :meth:`to_dict`) describes. Every field is checked: FileFormatError (a
        ValueError) naming ``file`` and the first field that is not what :meth:`to_dict` writes."""
        document = read_document(data, file=file)

        def history(values: LevelValues, capacity: int) -> LevelHistory:
            return LevelHistory(capacity, values.log_gaps, values.log_ratios)

        forecaster = cls()
        forecaster._roots = {name: history(values, WINDOW) for name, values in document.roots.items()}
        forecaster._tools = OrderedDict((tool, history(values, WINDOW)) for tool, values in document.tools)
        for session, tool, values in document.sessions:
            forecaster._sessions[(session, tool)] = history(values, SESSION_WINDOW)
            forecaster._tools_of_session.setdefault(session, set()).add(tool)
        return forecaster

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes the forecaster as JSON at ``path`` (its folders made), atomically: a crash leaves the old
        file or the new one. TypeError naming ``path`` unless it is a path."""
        write_file(path_argument("path", path), self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> GapForecaster:
        """The forecaster saved at ``path``. TypeError unless it is a path; FileNotFoundError when there is no
        file; FileFormatError (a ValueError) naming the file and the field when it is not a forecaster's file
        (not JSON, another format or version, a field missing, unknown, of a wrong type or out of range)."""
        path = path_argument("path", path)
        return cls.from_dict(read_file(path), file=path)  # type: ignore[arg-type]  # read_document checks it

    def __repr__(self) -> str:
        with self._lock:
            roots = ", ".join(f"{name} {len(h.log_gaps)}" for name, h in self._roots.items())
            return (
                f"GapForecaster(pauses kept: {roots}; tools {len(self._tools)}, session levels {len(self._sessions)})"
            )


def _pooled_ratio(path: list[tuple[str, LevelHistory | None]]) -> tuple[float, float, int]:
    """The log-ratio r's pooled mean and variance along ``path`` (the mixture of each level's remembered r
    and, at the root's end, the prior's normal), and the pairs seen at the most specific level that has any."""
    shares, moments, pairs = [], [], 0
    remaining = 1.0
    for _, level in path:
        n = len(level.log_ratios) if level is not None else 0
        if n and level is not None:
            share = remaining * n / (n + PSEUDO_OBSERVATIONS)
            remaining -= share
            shares.append(share)
            moments.append(level.log_ratios.mean_and_variance())
            pairs = pairs or n
    shares.append(remaining)
    moments.append((RATIO_PRIOR_MEAN, RATIO_PRIOR_SIGMA**2))
    mean = sum(s * m for s, (m, _) in zip(shares, moments, strict=True))
    variance = sum(s * (v + (m - mean) ** 2) for s, (m, v) in zip(shares, moments, strict=True))
    return mean, variance, pairs


def _name(argument: str, value: object, *, optional: bool = True) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        expected = "a non-empty str" + (" or None" if optional else "")
        raise TypeError(f"{argument}: expected {expected}, got {type(value).__name__} {value!r:.80}")
    if not value:
        raise ValueError(f"{argument}: expected a non-empty str, got ''")
    return value


def _described(session: object, tool: object, resume_in_s: object) -> tuple[str | None, str | None, float | None]:
    """A pause's description checked: session and tool a non-empty str or None, resume_in_s None or a finite
    number of seconds >= 0."""
    estimate = None if resume_in_s is None else non_negative_number("resume_in_s", resume_in_s)
    return _name("session", session), _name("tool", tool), estimate
