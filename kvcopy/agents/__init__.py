"""The pause of an agent session: what a client says of it (:class:`PauseHint`, from vLLM's
``kv_transfer_params`` or its hint envelope) and when the session will come back (:class:`GapForecaster`,
learned online, and the :class:`GapForecast` it gives for one pause), which session paused and came back
(:class:`PauseTracker`), and where its KV waits meanwhile (:func:`plan_pause`, a :class:`PausePlan`)."""

from __future__ import annotations

from kvcopy.agents.forecast import PSEUDO_OBSERVATIONS, GapForecaster
from kvcopy.agents.gap_forecast import EstimateCorrection, GapForecast, PooledLevel
from kvcopy.agents.hint import (
    FAULT_KINDS,
    PAUSE_ACTION_TYPE,
    PAUSE_ACTION_VERSION,
    PauseHint,
    PauseHintReading,
    PauseHintTypeError,
    PauseHintValueError,
    classify_hint_fault,
    read_pause_hint,
)
from kvcopy.agents.plan import PauseCosts, PausePlan, hold_price, plan_pause
from kvcopy.agents.sessions import Pause, PauseTracker

__all__ = [
    "FAULT_KINDS",
    "PAUSE_ACTION_TYPE",
    "PAUSE_ACTION_VERSION",
    "PSEUDO_OBSERVATIONS",
    "EstimateCorrection",
    "GapForecast",
    "GapForecaster",
    "Pause",
    "PauseCosts",
    "PauseHint",
    "PauseHintReading",
    "PauseHintTypeError",
    "PauseHintValueError",
    "PausePlan",
    "PauseTracker",
    "PooledLevel",
    "classify_hint_fault",
    "hold_price",
    "plan_pause",
    "read_pause_hint",
]
