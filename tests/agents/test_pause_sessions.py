"""Sessions found again when they resume (kvcopy.agents.sessions): by a hint's name, or by prefix continuation."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvcopy.agents import PauseHint
from kvcopy.agents.sessions import LEARNED_PREFIX, PauseTracker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Recorder:
    """What a forecaster was taught: (gap_s, session, tool, resume_in_s) per observation."""

    seen: list[tuple[float, str | None, str | None, float | None]] = field(default_factory=list)

    def observe(self, gap_s: float, *, session=None, tool=None, resume_in_s=None) -> None:
        self.seen.append((gap_s, session, tool, resume_in_s))


def tracker() -> tuple[PauseTracker, Clock, Recorder]:
    clock, recorder = Clock(), Recorder()
    return PauseTracker(recorder, clock=clock), clock, recorder


def test_a_hinted_session_is_found_by_its_name_and_its_gap_learned() -> None:
    pauses, clock, recorder = tracker()
    pause = pauses.paused("r1", PauseHint("s-17", tool="run_tests", resume_in_s=12.0), last_key=b"k3")
    assert pause is not None and (pause.session, pause.tool, pause.learned) == ("s-17", "run_tests", False)
    clock.now += 9.5
    assert pauses.resumed("r2", "s-17", keys=[b"k1"]) == (pause, 9.5)
    assert recorder.seen == [(9.5, "s-17", "run_tests", 12.0)]
    assert pauses.pause_of("s-17") is None and len(pauses) == 0


def test_two_sessions_are_never_mixed() -> None:
    pauses, clock, recorder = tracker()
    pauses.paused("a1", PauseHint("a", tool="grep"), last_key=b"a1")
    clock.now += 1.0
    pauses.paused("b1", PauseHint("b", tool="web"), last_key=b"b1")
    clock.now += 2.0
    resumed = pauses.resumed("b2", "b", keys=[b"a1", b"b1"])  # (a shared prefix: the name decides)
    assert resumed is not None and resumed[0].session == "b" and resumed[1] == 2.0
    assert recorder.seen == [(2.0, "b", "web", None)]
    assert pauses.pause_of("a") is not None


def test_without_hints_a_resume_is_found_by_prefix_continuation() -> None:
    pauses, clock, recorder = tracker()
    first = pauses.paused("r1", None, last_key=b"k2")
    assert first is not None and first.learned and first.session == LEARNED_PREFIX + "r1"
    clock.now += 0.3
    assert pauses.resumed("r9", None, keys=[b"x"]) is None  # another conversation's prompt
    resumed = pauses.resumed("r2", None, keys=[b"k0", b"k1", b"k2", b"k3"])
    assert resumed is not None and resumed[0] is first
    # the next turn pauses under the same learned session, and is found from its own last chunk
    again = pauses.paused("r2", None, last_key=b"k4")
    assert again is not None and again.session == first.session
    clock.now += 5.0
    assert pauses.resumed("r3", None, keys=[b"k2"]) is None  # the old last chunk ends nothing now
    assert pauses.resumed("r3", None, keys=[b"k2", b"k4"]) is not None
    assert [gap for gap, *_ in recorder.seen] == pytest.approx([0.3, 5.0])
    assert {session for _, session, _, _ in recorder.seen} == {first.session}


def test_done_forgets_the_session() -> None:
    pauses, _, recorder = tracker()
    pauses.paused("r1", PauseHint("s"), last_key=b"k")
    assert pauses.paused("r2", PauseHint("s", done=True), last_key=b"k2") is None
    assert pauses.pause_of("s") is None and pauses.resumed("r3", "s", keys=[]) is None
    assert recorder.seen == []


def test_the_oldest_pauses_are_forgotten_past_the_bound(monkeypatch) -> None:
    monkeypatch.setattr("kvcopy.agents.sessions.MAX_PAUSED", 2)
    pauses, _, _ = tracker()
    for i in range(3):
        pauses.paused(f"r{i}", None, last_key=f"k{i}".encode())
    assert len(pauses) == 2 and pauses.pause_of(LEARNED_PREFIX + "r0") is None
    assert pauses.resumed("n", None, keys=[b"k0"]) is None
    assert pauses.resumed("n", None, keys=[b"k2"]) is not None


def test_a_hinted_turn_that_arrives_before_its_previous_one_is_done_ends_that_pause_at_once() -> None:
    """vLLM can report a request finished after its session's next request arrived (it was still storing its
    last chunks): that pause ends as it begins, a gap of 0, and waits for nothing."""
    pauses, clock, recorder = tracker()
    hint = PauseHint("s-3", tool="read_file", resume_in_s=0.1)
    assert pauses.resumed("r1", "s-3", keys=()) is None  # the session's first request: nothing to resume
    assert pauses.resumed("r2", "s-3", keys=()) is None  # its next one, while r1 is not reported done
    assert pauses.resumed("r7", "s-other", keys=()) is None  # another session's
    pause = pauses.paused("r1", hint, last_key=b"k3")
    assert pause is not None and pause.resumed_by == "r2" and pauses.pause_of("s-3") is None
    assert recorder.seen == [(0.0, "s-3", "read_file", 0.1)]
    clock.now += 2.0
    later = pauses.paused("r2", hint, last_key=b"k5")  # r2 itself pauses as usual: r7 is not of its session
    assert later is not None and later.resumed_by is None and pauses.pause_of("s-3") is later


def test_a_learned_turn_that_arrives_before_its_previous_one_is_done_continues_its_session() -> None:
    pauses, _clock, recorder = tracker()
    first = pauses.paused("r1", None, last_key=b"k2")
    assert first is not None
    assert pauses.resumed("r2", None, keys=[b"k0", b"k1", b"k2"]) is not None  # r2 continues r1: learned
    assert pauses.resumed("r3", None, keys=[b"k0", b"k1", b"k2", b"k3", b"k4"]) is None  # before r2 is done
    assert pauses.resumed("r8", None, keys=[b"x4"]) is None  # another conversation's
    second = pauses.paused("r2", None, last_key=b"k4")
    assert second is not None and second.resumed_by == "r3" and second.session == first.session
    assert pauses.pause_of(first.session) is None  # nothing waits for a resume that has come
    third = pauses.paused("r3", None, last_key=b"k6")  # r3 is of the learned session: its own pause waits
    assert third is not None and third.session == first.session and third.resumed_by is None
    assert [gap for gap, *_ in recorder.seen] == [0.0, 0.0]  # r2's resume (clock unmoved) and r3's early one
