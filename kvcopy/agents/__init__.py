"""The pause of an agent session: what a client says of it (:class:`PauseHint`, from vLLM's
``kv_transfer_params`` or its hint envelope)."""

from __future__ import annotations

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

__all__ = [
    "FAULT_KINDS",
    "PAUSE_ACTION_TYPE",
    "PAUSE_ACTION_VERSION",
    "PauseHint",
    "PauseHintReading",
    "PauseHintTypeError",
    "PauseHintValueError",
    "classify_hint_fault",
    "read_pause_hint",
]
