"""NixlTransfer (kvcopy/nixl/transfer.py), shared by remote reads and writes and a disk store's puts and gets,
against a scripted agent: a wrong timeout changes nothing, a failure is said on every later wait and done,
and a transfer NIXL lost track of (its agent removed while it ran) never reads as ended."""

from __future__ import annotations

import math

import pytest
import torch

from kvcopy.nixl.transfer import NixlTransfer, RemoteTransferError, RemoteTransferTimeout, WrittenBlocks

from helpers.fake_nixl import nixlBackendError, nixlNotFoundError


class ScriptedAgent:
    """Answers check_xfer_state from ``answers`` (a string is a state, an exception is raised), the last
    one repeated; records the handles released."""

    def __init__(self, *answers: str | Exception) -> None:
        self.answers, self.released, self.polls = list(answers), [], 0

    def check_xfer_state(self, handle: object) -> str:
        self.polls += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def release_xfer_handle(self, handle: object) -> None:
        self.released.append(handle)


def _transfer(agent: ScriptedAgent) -> NixlTransfer:
    return NixlTransfer(agent, "handle", "read", 1, 4096, WrittenBlocks("local", torch.tensor([3, 4])))


@pytest.mark.parametrize(
    ("timeout", "error"),
    [(-1, ValueError), (math.nan, ValueError), (math.inf, ValueError), ("x", TypeError), (True, TypeError)],
)
def test_a_wrong_timeout_is_refused_before_anything_changes(timeout, error):
    agent = ScriptedAgent("PROC", "DONE")
    transfer = _transfer(agent)
    with pytest.raises(error, match="timeout: expected a finite number >= 0"):
        transfer.wait(timeout)
    assert agent.polls == 0 and agent.released == []  # nothing polled, nothing ended or released
    transfer.wait(60)  # the transfer goes on and ends as it would have
    assert transfer.done() and agent.released == ["handle"]


def test_a_failed_transfer_raises_on_every_later_wait_and_done():
    agent = ScriptedAgent("PROC", nixlBackendError("NIXL_ERR_BACKEND"), "DONE")  # "DONE" after: never believed
    transfer = _transfer(agent)
    assert transfer.done() is False
    for _ in range(3):
        with pytest.raises(RemoteTransferError, match=r"read failed; local blocks \[3, 4\] hold no valid data"):
            transfer.wait(60)
        with pytest.raises(RemoteTransferError, match="read failed"):
            transfer.done()
        with pytest.raises(ValueError, match="timeout"):
            transfer.wait(-1)
    assert transfer.ended and transfer.failed and agent.released == ["handle"]


def test_a_timeout_leaves_it_in_flight_and_a_later_wait_sees_it_done():
    agent = ScriptedAgent("PROC", "PROC", "PROC", "DONE")
    transfer = _transfer(agent)
    with pytest.raises(RemoteTransferTimeout) as timed_out:
        transfer.wait(0)
    assert (timed_out.value.side, timed_out.value.block_ids) == ("local", [3, 4])
    assert not transfer.ended and agent.released == []
    transfer.wait(60)
    assert transfer.ended and not transfer.failed


def test_a_transfer_nixl_lost_fails_its_waits_but_never_ends():
    agent = ScriptedAgent(nixlNotFoundError("NIXL_ERR_NOT_FOUND"))
    transfer = _transfer(agent)
    for _ in range(2):
        with pytest.raises(RemoteTransferError, match=r"NIXL lost track of it .* may still be written by it"):
            transfer.wait(60)
    assert transfer.lost and not transfer.ended and not transfer.failed
    assert agent.released == []  # releasing it would not stop its writes: kept until the last reference goes
