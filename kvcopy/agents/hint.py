"""The pause, as a client says it: :class:`PauseHint`, parsed from either of vLLM's two carriers.

A request may carry a pause hint, which describes what happens *after that request finishes*: which session
pauses (``session``), the tool that runs meanwhile (``tool``), the client's estimate of the pause
(``resume_in_s``) and whether the session ends instead (``done``). It reaches the engine in one of two ways:

- over HTTP, in the request body's ``kv_transfer_params``, which vLLM's OpenAI endpoints pass through to the
  connector: ``{"kv_transfer_params": {"kvcopy": {"session": "s-17", "tool": "run_tests", "resume_in_s": 12.0}}}``
  (:meth:`PauseHint.from_kv_transfer_params`);
- in vLLM's hint envelope (``AsyncLLM.generate(..., kv_hints=)``), as a ``KvHintAction`` with
  ``action_type="kvcopy.pause"``, ``action_version="1"`` and the same payload (:meth:`PauseHint.from_kv_hints`).

Called directly, the constructor and both parsers raise TypeError or ValueError naming the field. Each error
is a :class:`PauseHintTypeError` or :class:`PauseHintValueError`, whose ``kind`` (one of
:data:`FAULT_KINDS`) lets an engine, which must never fail a request for a malformed hint, log one warning per
kind and count by kind: :func:`read_pause_hint` is that lenient path.

Nothing here imports vLLM: the envelope and its actions are read by attribute (vLLM's msgspec structs), or by
key when they come as plain dicts (``msgspec.to_builtins`` of the envelope, as vLLM's own kvcr tier reads it).
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FAULT_KINDS",
    "HINT_FIELDS",
    "KV_TRANSFER_PARAMS_KEY",
    "PAUSE_ACTION_TYPE",
    "PAUSE_ACTION_VERSION",
    "PauseHint",
    "PauseHintReading",
    "PauseHintTypeError",
    "PauseHintValueError",
    "classify_hint_fault",
    "read_pause_hint",
]

# The key of kv_transfer_params under which a client puts its pause hint.
KV_TRANSFER_PARAMS_KEY = "kvcopy"
# The hint envelope's action that carries a pause hint, and the one version of its payload this kvcopy reads.
PAUSE_ACTION_TYPE = "kvcopy.pause"
PAUSE_ACTION_VERSION = "1"
# The fields of a hint's payload (both carriers), in the constructor's order; "session" is required.
HINT_FIELDS = ("session", "tool", "resume_in_s", "done")
# The kinds of fault a malformed hint has, each a warning of its own and a counter's label:
# "type": a field (or the carrier) of the wrong type; "value": a field's value out of range (a negative or
# non-finite resume_in_s, an empty tool); "unknown_key": a key the payload does not have; "empty_session": the
# session missing or empty; "version": a pause action of another action_version; "conflict": two hints for one
# request that disagree (two pause actions, or the two carriers naming different pauses).
FAULT_KINDS = ("type", "value", "unknown_key", "empty_session", "version", "conflict")


class PauseHintTypeError(TypeError):
    """A pause hint's field, or its carrier, of the wrong type. ``field`` names it; ``kind`` is "type"."""

    kind = "type"

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


class PauseHintValueError(ValueError):
    """A pause hint's field with a wrong value, an unknown key, a missing or empty session, a pause action of
    another version, or two hints that disagree. ``field`` names the field; ``kind`` is one of
    :data:`FAULT_KINDS` (never "type")."""

    def __init__(self, message: str, *, field: str, kind: str = "value") -> None:
        if kind not in FAULT_KINDS or kind == "type":
            raise ValueError(f"kind: expected one of {FAULT_KINDS[1:]}, got {kind!r}")
        super().__init__(message)
        self.field, self.kind = field, kind


def classify_hint_fault(exc: BaseException) -> str:
    """The kind (one of :data:`FAULT_KINDS`) of a fault the parsers raised: its ``kind`` for a
    :class:`PauseHintTypeError` or :class:`PauseHintValueError`; "type" for any other TypeError and "value" for
    any other ValueError (what a carrier object that misbehaves on attribute access may raise). TypeError for
    anything else: an engine that catches more than these is hiding a bug, not a malformed hint."""
    kind = getattr(exc, "kind", None)
    if isinstance(exc, (PauseHintTypeError, PauseHintValueError)) and kind in FAULT_KINDS:
        return str(kind)
    if isinstance(exc, TypeError):
        return "type"
    if isinstance(exc, ValueError):
        return "value"
    raise TypeError(f"exc: expected the TypeError or ValueError of a pause hint, got {type(exc).__name__} {exc!r}")


def _text(where: str, field: str, value: object, *, empty_kind: str, optional: bool = False) -> str:
    if not isinstance(value, str):
        expected = "a non-empty str" + (" or None" if optional else "")
        raise PauseHintTypeError(f"{where}: expected {expected}, got {type(value).__name__} {value!r:.80}", field=field)
    if not value:
        raise PauseHintValueError(f"{where}: expected a non-empty str, got ''", field=field, kind=empty_kind)
    return value


def _seconds(where: str, value: object) -> float | None:
    expected = "a finite number of seconds >= 0"
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise PauseHintTypeError(
            f"{where}: expected {expected} (or None), got {type(value).__name__} {value!r:.80}", field="resume_in_s"
        )
    try:
        seconds = float(value)
    except OverflowError:  # an int beyond any float
        seconds = math.inf
    if not math.isfinite(seconds) or seconds < 0:
        raise PauseHintValueError(f"{where}: expected {expected}, got {value!r:.80}", field="resume_in_s")
    return seconds


@dataclass(frozen=True)
class PauseHint:
    """What happens after the request that carries the hint finishes.

    Attributes:
        session: a non-empty str grouping the turns of one agent or conversation.
        tool: the tool that runs during the pause (a non-empty str), or None when none is named.
        resume_in_s: the client's estimate of the pause in seconds (a finite float >= 0; an int is taken), or
            None. Evidence, not truth: kvcopy.agents.GapForecaster learns how far a client's estimates run.
        done: True when the session ends with this request: nothing of it needs retaining.

    The constructor checks every field: PauseHintTypeError (a TypeError) for a wrong type (a bool is not a
    number), PauseHintValueError (a ValueError) for an empty session or tool, or a negative or non-finite
    ``resume_in_s``; each names the field (``PauseHint.resume_in_s: expected ...``).
    """

    session: str
    tool: str | None = None
    resume_in_s: float | None = None
    done: bool = False

    def __post_init__(self) -> None:
        self._check(lambda field: f"PauseHint.{field}")

    def _check(self, name: Callable[[str], str]) -> None:
        """Checks every field, ``name(field)`` naming it in errors; ``resume_in_s`` made a float."""
        _text(name("session"), "session", self.session, empty_kind="empty_session")
        if self.tool is not None:
            _text(name("tool"), "tool", self.tool, empty_kind="value", optional=True)
        object.__setattr__(self, "resume_in_s", _seconds(name("resume_in_s"), self.resume_in_s))
        if not isinstance(self.done, bool):
            raise PauseHintTypeError(
                f"{name('done')}: expected a bool, got {type(self.done).__name__} {self.done!r:.80}", field="done"
            )

    @classmethod
    def from_payload(cls, payload: object, *, where: str = "payload") -> PauseHint:
        """The hint a payload (``{"session": ..., "tool": ..., "resume_in_s": ..., "done": ...}``) describes,
        ``where`` naming it in errors. PauseHintTypeError unless it is a mapping with str keys, or for a field of
        the wrong type; PauseHintValueError for an unknown key (with the closest known one), a missing or empty
        session, or a field's wrong value."""
        if not isinstance(payload, Mapping):
            raise PauseHintTypeError(
                f"{where}: expected a dict of {', '.join(HINT_FIELDS)}, got {type(payload).__name__} {payload!r:.80}",
                field="(payload)",
            )
        for key in payload:
            if key not in HINT_FIELDS:
                close = difflib.get_close_matches(key, HINT_FIELDS, n=1) if isinstance(key, str) else []
                advice = f"; did you mean {close[0]!r}?" if close else f"; the keys are {', '.join(HINT_FIELDS)}"
                raise PauseHintValueError(
                    f"unknown key {key!r:.80} in {where}{advice}", field=str(key), kind="unknown_key"
                )
        if "session" not in payload:
            raise PauseHintValueError(
                f"{where}: the key 'session' is missing (a non-empty str naming the agent or conversation)",
                field="session",
                kind="empty_session",
            )
        hint = cls.__new__(cls)
        for name in HINT_FIELDS:
            object.__setattr__(hint, name, payload[name] if name in payload else _DEFAULTS[name])
        hint._check(lambda field: f"{where}[{field!r}]")
        return hint

    @classmethod
    def from_kv_transfer_params(cls, params: Mapping[str, Any] | None) -> PauseHint | None:
        """The hint in a request's ``kv_transfer_params`` (what vLLM's OpenAI endpoints pass through), under
        the key "kvcopy": None when ``params`` is None, holds no "kvcopy" key, or holds None there. Errors as
        :meth:`from_payload`; PauseHintTypeError when ``params`` is not a dict."""
        if params is None:
            return None
        if not isinstance(params, Mapping):
            raise PauseHintTypeError(
                f"kv_transfer_params: expected a dict or None, got {type(params).__name__} {params!r:.80}",
                field="kv_transfer_params",
            )
        payload = params.get(KV_TRANSFER_PARAMS_KEY)
        if payload is None:
            return None
        return cls.from_payload(payload, where=f"kv_transfer_params[{KV_TRANSFER_PARAMS_KEY!r}]")

    @classmethod
    def from_kv_hints(cls, envelope: object) -> PauseHint | None:
        """The hint in vLLM's hint envelope (a ``KvHintsEnvelope``, or the dict ``msgspec.to_builtins`` makes of
        one): None when ``envelope`` is None or has no action of ``action_type`` "kvcopy.pause". The pause
        action's ``action_version`` must be "1" (PauseHintValueError of kind "version" otherwise), and there
        must be one such action (kind "conflict"); its ``payload`` is read as :meth:`from_payload` reads it.
        PauseHintTypeError when the envelope or an action lacks the fields vLLM's protocol gives them."""
        if envelope is None:
            return None
        actions = _member(envelope, "actions", "kv_hints")
        if isinstance(actions, (str, bytes, Mapping)) or not isinstance(actions, Sequence):
            raise PauseHintTypeError(
                f"kv_hints.actions: expected a list of KvHintAction, got {type(actions).__name__} {actions!r:.80}",
                field="kv_hints.actions",
            )
        pauses = []
        for i, action in enumerate(actions):
            action_type = _member(action, "action_type", f"kv_hints.actions[{i}]")
            if action_type == PAUSE_ACTION_TYPE:
                pauses.append((i, action))
        if not pauses:
            return None
        if len(pauses) > 1:
            raise PauseHintValueError(
                f"kv_hints.actions: {len(pauses)} actions of type {PAUSE_ACTION_TYPE!r} (at "
                f"{', '.join(str(i) for i, _ in pauses)}); a request pauses once, so at most one",
                field="kv_hints.actions",
                kind="conflict",
            )
        i, action = pauses[0]
        at = f"kv_hints.actions[{i}]"
        version = _member(action, "action_version", at)
        if version != PAUSE_ACTION_VERSION:
            raise PauseHintValueError(
                f"{at}.action_version: expected {PAUSE_ACTION_VERSION!r} for {PAUSE_ACTION_TYPE!r} (the payload "
                f"version this kvcopy reads), got {version!r:.80}",
                field="action_version",
                kind="version",
            )
        return cls.from_payload(_member(action, "payload", at), where=f"{at}.payload")


_DEFAULTS: dict[str, Any] = {"tool": None, "resume_in_s": None, "done": False}


def _member(obj: object, name: str, at: str) -> Any:
    """``obj.name`` (vLLM's msgspec structs) or ``obj[name]`` (their builtins form, a dict)."""
    if isinstance(obj, Mapping):
        if name in obj:
            return obj[name]
    elif hasattr(obj, name):
        return getattr(obj, name)
    raise PauseHintTypeError(
        f"{at}: expected a vLLM KvHintsEnvelope / KvHintAction (or its dict) with {name!r}, got "
        f"{type(obj).__name__} {obj!r:.80}",
        field=f"{at}.{name}",
    )


@dataclass(frozen=True)
class PauseHintReading:
    """What an engine reads from one request's two carriers (:func:`read_pause_hint`): the ``hint`` (None when
    there is none, or when it was malformed), and for a malformed one the fault's ``kind`` (one of
    :data:`FAULT_KINDS`) and its ``message``, to log once per kind and count."""

    hint: PauseHint | None
    fault: str | None = None
    message: str | None = None


def read_pause_hint(kv_transfer_params: Mapping[str, Any] | None, kv_hints: object) -> PauseHintReading:
    """The lenient path an engine takes: both carriers of one request read, never raising for what a client
    sent. A malformed hint in either carrier is ignored (``hint`` None) and reported by kind; when both
    carriers hold a hint they must describe the same pause (fault "conflict" otherwise: kvcopy would rather
    retain nothing than mix two sessions)."""
    try:
        found = (PauseHint.from_kv_hints(kv_hints), PauseHint.from_kv_transfer_params(kv_transfer_params))
    except (TypeError, ValueError) as exc:
        return PauseHintReading(None, classify_hint_fault(exc), str(exc))
    hints = [hint for hint in found if hint is not None]
    if len(hints) == 2 and hints[0] != hints[1]:
        return PauseHintReading(
            None,
            "conflict",
            f"kv_hints and kv_transfer_params carry different pause hints ({hints[0]} and {hints[1]}); both ignored",
        )
    return PauseHintReading(hints[0] if hints else None)
