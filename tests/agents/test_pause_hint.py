"""PauseHint: the pause as a client says it, from vLLM's two carriers (kv_transfer_params over HTTP, and the
kv_hints envelope, built here from vLLM's own KvHintsEnvelope / KvHintAction), and every way a hint is bad:
the error's type, the field it names, its fault kind, and the engine's lenient read that never raises."""

from __future__ import annotations

import math

import numpy as np
import pytest

import kvcopy
from kvcopy.agents import (
    FAULT_KINDS,
    PauseHint,
    PauseHintReading,
    PauseHintTypeError,
    PauseHintValueError,
    classify_hint_fault,
    read_pause_hint,
)

PAYLOAD = {"session": "s-17", "tool": "run_tests", "resume_in_s": 12.0}
EXPECTED = PauseHint("s-17", tool="run_tests", resume_in_s=12.0)


class Envelope:
    """A stand-in with the attributes of vLLM's KvHintsEnvelope (duck typing: the parser never imports vLLM)."""

    def __init__(self, actions, protocol_version="1", message_id="m-1"):
        self.protocol_version, self.message_id, self.actions = protocol_version, message_id, actions


class Action:
    def __init__(self, action_type, payload, action_version="1", action_id="a-1"):
        self.action_id, self.action_type, self.action_version, self.payload = (
            action_id,
            action_type,
            action_version,
            payload,
        )


def fault_of(call):
    """The exception ``call`` raises, its kind checked against the classifier and the fault kinds."""
    with pytest.raises((TypeError, ValueError)) as caught:
        call()
    exc = caught.value
    assert isinstance(exc, (PauseHintTypeError, PauseHintValueError)), type(exc)
    assert exc.kind in FAULT_KINDS
    assert classify_hint_fault(exc) == exc.kind
    assert (exc.kind == "type") == isinstance(exc, TypeError)
    return exc


# ------------------------------------------------------------------ the constructor


def test_constructor_keeps_fields_and_defaults():
    hint = PauseHint("s-1")
    assert (hint.session, hint.tool, hint.resume_in_s, hint.done) == ("s-1", None, None, False)
    assert kvcopy.PauseHint is PauseHint
    full = PauseHint("s-1", tool="grep", resume_in_s=3, done=True)
    assert full.resume_in_s == 3.0 and isinstance(full.resume_in_s, float)  # an int is taken, as a float
    assert PauseHint("s", resume_in_s=np.float32(0.5)).resume_in_s == 0.5
    assert PauseHint("s", resume_in_s=0).resume_in_s == 0.0
    with pytest.raises(AttributeError):
        full.session = "other"  # frozen


@pytest.mark.parametrize(
    ("kwargs", "error", "field", "kind", "words"),
    [
        ({"session": 17}, TypeError, "session", "type", "PauseHint.session: expected a non-empty str, got int 17"),
        ({"session": None}, TypeError, "session", "type", "PauseHint.session"),
        ({"session": ""}, ValueError, "session", "empty_session", "PauseHint.session: expected a non-empty str"),
        ({"session": "s", "tool": 3}, TypeError, "tool", "type", "PauseHint.tool: expected a non-empty str or None"),
        ({"session": "s", "tool": ""}, ValueError, "tool", "value", "PauseHint.tool"),
        ({"session": "s", "resume_in_s": "12"}, TypeError, "resume_in_s", "type", "PauseHint.resume_in_s"),
        ({"session": "s", "resume_in_s": True}, TypeError, "resume_in_s", "type", "got bool True"),
        (
            {"session": "s", "resume_in_s": -1.0},
            ValueError,
            "resume_in_s",
            "value",
            "PauseHint.resume_in_s: expected a finite number of seconds >= 0, got -1.0",
        ),
        ({"session": "s", "resume_in_s": math.nan}, ValueError, "resume_in_s", "value", "got nan"),
        ({"session": "s", "resume_in_s": math.inf}, ValueError, "resume_in_s", "value", "got inf"),
        ({"session": "s", "resume_in_s": 10**400}, ValueError, "resume_in_s", "value", "PauseHint.resume_in_s"),
        ({"session": "s", "done": 1}, TypeError, "done", "type", "PauseHint.done: expected a bool, got int 1"),
        ({"session": "s", "done": "yes"}, TypeError, "done", "type", "PauseHint.done"),
    ],
)
def test_constructor_refuses_each_bad_field(kwargs, error, field, kind, words):
    exc = fault_of(lambda: PauseHint(**kwargs))
    assert isinstance(exc, error)
    assert exc.field == field and exc.kind == kind
    assert words in str(exc)


# ------------------------------------------------------------------ kv_transfer_params (HTTP)


def test_kv_transfer_params_carries_the_hint():
    assert PauseHint.from_kv_transfer_params({"kvcopy": dict(PAYLOAD)}) == EXPECTED
    done = PauseHint.from_kv_transfer_params({"kvcopy": {"session": "s-9", "done": True}, "other": 1})
    assert done == PauseHint("s-9", done=True)


@pytest.mark.parametrize("params", [None, {}, {"do_remote_prefill": True}, {"kvcopy": None}])
def test_kv_transfer_params_without_a_hint_is_none(params):
    assert PauseHint.from_kv_transfer_params(params) is None


@pytest.mark.parametrize(
    ("params", "kind", "words"),
    [
        ([("kvcopy", {})], "type", "kv_transfer_params: expected a dict or None"),
        ({"kvcopy": "s-17"}, "type", "kv_transfer_params['kvcopy']: expected a dict"),
        ({"kvcopy": {"tool": "x"}}, "empty_session", "the key 'session' is missing"),
        ({"kvcopy": {"session": ""}}, "empty_session", "kv_transfer_params['kvcopy']['session']"),
        ({"kvcopy": {"session": 5}}, "type", "kv_transfer_params['kvcopy']['session']: expected a non-empty str"),
        (
            {"kvcopy": {"session": "s", "resume_in_s": -1}},
            "value",
            "kv_transfer_params['kvcopy']['resume_in_s']: expected a finite number of seconds >= 0, got -1",
        ),
        ({"kvcopy": {"session": "s", "resume_in_s": "soon"}}, "type", "['resume_in_s']"),
        ({"kvcopy": {"session": "s", "done": "true"}}, "type", "['done']: expected a bool"),
        ({"kvcopy": {"session": "s", "tool": ["a"]}}, "type", "['tool']"),
        (
            {"kvcopy": {"session": "s", "resume_in": 3.0}},
            "unknown_key",
            "unknown key 'resume_in' in kv_transfer_params['kvcopy']; did you mean 'resume_in_s'?",
        ),
        ({"kvcopy": {"sesion": "s"}}, "unknown_key", "did you mean 'session'?"),
        (
            {"kvcopy": {"session": "s", "priority": 1}},
            "unknown_key",
            "unknown key 'priority' in kv_transfer_params['kvcopy']; the keys are session, tool, resume_in_s, done",
        ),
        ({"kvcopy": {"session": "s", 3: 1}}, "unknown_key", "unknown key 3"),
    ],
)
def test_kv_transfer_params_bad_hints_name_the_field(params, kind, words):
    exc = fault_of(lambda: PauseHint.from_kv_transfer_params(params))
    assert exc.kind == kind
    assert words in str(exc)


# ------------------------------------------------------------------ the kv_hints envelope


def test_envelope_carries_the_hint_among_other_actions():
    envelope = Envelope(
        [Action("vllm.retain", {"ttl_s": 5}, action_version="7"), Action("kvcopy.pause", dict(PAYLOAD))]
    )
    assert PauseHint.from_kv_hints(envelope) == EXPECTED


def test_envelope_as_a_dict_carries_the_hint():
    """As msgspec.to_builtins gives the envelope (what vLLM's own kvcr tier reads)."""
    envelope = {
        "protocol_version": "1",
        "message_id": "m",
        "actions": [{"action_id": "a", "action_type": "kvcopy.pause", "action_version": "1", "payload": PAYLOAD}],
    }
    assert PauseHint.from_kv_hints(envelope) == EXPECTED


@pytest.mark.parametrize("envelope", [None, Envelope([]), Envelope([Action("vllm.pin", {"x": 1})]), {"actions": []}])
def test_envelope_without_a_pause_is_none(envelope):
    assert PauseHint.from_kv_hints(envelope) is None


@pytest.mark.parametrize(
    ("envelope", "kind", "field", "words"),
    [
        (
            Envelope([Action("kvcopy.pause", PAYLOAD, action_version="2")]),
            "version",
            "action_version",
            "kv_hints.actions[0].action_version: expected '1'",
        ),
        (Envelope([Action("kvcopy.pause", PAYLOAD, action_version=1)]), "version", "action_version", "got 1"),
        (
            Envelope([Action("kvcopy.pause", PAYLOAD), Action("kvcopy.pause", PAYLOAD, action_id="b")]),
            "conflict",
            "kv_hints.actions",
            "2 actions of type 'kvcopy.pause'",
        ),
        (Envelope([Action("kvcopy.pause", "s-17")]), "type", "(payload)", "kv_hints.actions[0].payload"),
        (
            Envelope([Action("kvcopy.pause", {"session": "s", "resume_in_s": math.inf})]),
            "value",
            "resume_in_s",
            "kv_hints.actions[0].payload['resume_in_s']",
        ),
        (
            Envelope([Action("x", {}), Action("kvcopy.pause", {"session": "s", "tol": "grep"})]),
            "unknown_key",
            "tol",
            "unknown key 'tol' in kv_hints.actions[1].payload; did you mean 'tool'?",
        ),
        (Envelope("kvcopy.pause"), "type", "kv_hints.actions", "expected a list of KvHintAction"),
        (object(), "type", "kv_hints.actions", "with 'actions'"),
        (Envelope([{"action_type": "kvcopy.pause", "action_version": "1"}]), "type", "kv_hints.actions[0].payload", ""),
        (Envelope([42]), "type", "kv_hints.actions[0].action_type", ""),
    ],
)
def test_envelope_bad_hints_name_the_field(envelope, kind, field, words):
    exc = fault_of(lambda: PauseHint.from_kv_hints(envelope))
    assert (exc.kind, exc.field) == (kind, field)
    assert words in str(exc)


def test_vllm_own_envelope_classes():
    """vLLM 0.33's KvHintsEnvelope / KvHintAction (msgspec structs), as AsyncLLM.generate(kv_hints=) takes them,
    and their msgspec builtins form."""
    protocol = pytest.importorskip("vllm.v1.kv_hints.protocol", reason="vLLM is not installed")
    msgspec = pytest.importorskip("msgspec")
    envelope = protocol.KvHintsEnvelope(
        protocol_version="1",
        message_id="m-1",
        actions=[
            protocol.KvHintAction(action_id="a-0", action_type="vllm.retain", action_version="1", payload={}),
            protocol.KvHintAction(action_id="a-1", action_type="kvcopy.pause", action_version="1", payload=PAYLOAD),
        ],
    )
    assert PauseHint.from_kv_hints(envelope) == EXPECTED
    assert PauseHint.from_kv_hints(msgspec.to_builtins(envelope)) == EXPECTED
    # through msgpack, as the engine core receives a request's envelope
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(envelope), type=protocol.KvHintsEnvelope)
    assert PauseHint.from_kv_hints(decoded) == EXPECTED
    bad = protocol.KvHintsEnvelope(
        protocol_version="1",
        message_id="m-2",
        actions=[protocol.KvHintAction("a", "kvcopy.pause", "1", {"session": "s", "resume_in": 1.0})],
    )
    assert fault_of(lambda: PauseHint.from_kv_hints(bad)).kind == "unknown_key"


# ------------------------------------------------------------------ the engine's lenient read


def test_lenient_read_never_raises_and_reports_the_kind():
    assert read_pause_hint(None, None) == PauseHintReading(None)
    assert read_pause_hint({"kvcopy": PAYLOAD}, None) == PauseHintReading(EXPECTED)
    assert read_pause_hint(None, Envelope([Action("kvcopy.pause", PAYLOAD)])).hint == EXPECTED
    both = read_pause_hint({"kvcopy": PAYLOAD}, Envelope([Action("kvcopy.pause", dict(PAYLOAD))]))
    assert both == PauseHintReading(EXPECTED)  # the same pause in both carriers

    for params, envelope, kind in [
        ({"kvcopy": {"session": "s", "resume_in_s": -3}}, None, "value"),
        ({"kvcopy": {"session": ""}}, None, "empty_session"),
        ({"kvcopy": {"session": "s", "resum_in_s": 1}}, None, "unknown_key"),
        ({"kvcopy": 7}, None, "type"),
        (None, Envelope([Action("kvcopy.pause", PAYLOAD, action_version="9")]), "version"),
        # a good hint in one carrier is not used when the other is malformed
        ({"kvcopy": PAYLOAD}, Envelope([Action("kvcopy.pause", {"session": 1})]), "type"),
    ]:
        reading = read_pause_hint(params, envelope)
        assert reading.hint is None and reading.fault == kind, (params, reading)
        assert reading.message


def test_lenient_read_refuses_two_different_pauses():
    """Two carriers naming different sessions: nothing is retained for either (never one session's hint
    applied to another's pause)."""
    other = {"session": "s-99", "tool": "run_tests", "resume_in_s": 12.0}
    reading = read_pause_hint({"kvcopy": PAYLOAD}, Envelope([Action("kvcopy.pause", other)]))
    assert reading.hint is None and reading.fault == "conflict"
    assert "s-99" in reading.message and "s-17" in reading.message


def test_classify_hint_fault():
    assert classify_hint_fault(TypeError("x")) == "type"
    assert classify_hint_fault(ValueError("x")) == "value"
    assert classify_hint_fault(PauseHintValueError("m", field="f", kind="conflict")) == "conflict"
    with pytest.raises(TypeError, match="exc: expected the TypeError or ValueError"):
        classify_hint_fault(KeyError("x"))
    with pytest.raises(ValueError, match="kind"):
        PauseHintValueError("m", field="f", kind="type")
