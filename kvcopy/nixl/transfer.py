"""NixlTransfer: one NIXL transfer in flight (a KVPeer's read or write, or a disk store's put or get), and
the errors that name the blocks it leaves without valid data."""

from __future__ import annotations

import contextlib
import weakref
from typing import Protocol

import torch

from kvcopy._checks import timeout_argument
from kvcopy.engine.transfer import wait_until

__all__ = ["NixlTransfer", "RemoteTransferError", "RemoteTransferTimeout"]


class XferAgent(Protocol):
    """What a transfer asks of its NIXL agent (a ``nixl_agent``)."""

    def check_xfer_state(self, handle: object) -> str: ...

    def release_xfer_handle(self, handle: object) -> None: ...


class WrittenBlocks:
    """The blocks a transfer writes, said in an error (formatted only then: the hot path does not pay for it)."""

    def __init__(self, owner: str, ids: torch.Tensor) -> None:
        self.owner, self.ids = owner, ids

    def __str__(self) -> str:
        where = "local" if self.owner == "local" else f"{self.owner!r}'s"
        return f"{where} blocks {self.ids.tolist()}"


class _InvalidBlocks:
    """What a failed or unfinished transfer leaves without valid data: ``side`` ("local", or the remote agent's
    name) and ``block_ids`` there."""

    side: str
    block_ids: list[int]

    def _name_blocks(self, written: WrittenBlocks) -> None:
        self.side, self.block_ids = written.owner, written.ids.tolist()


class RemoteTransferError(_InvalidBlocks, RuntimeError):
    """A remote transfer failed (the peer disappeared, or NIXL reported an error). ``side`` and ``block_ids``:
    the blocks it was writing ("local" ones for a read, the remote agent's for a write), which hold no valid
    data."""

    def __init__(self, message: str, written: WrittenBlocks) -> None:
        super().__init__(message)
        self._name_blocks(written)


class RemoteTransferTimeout(_InvalidBlocks, TimeoutError):
    """``NixlTransfer.wait`` reached its timeout; ``side`` and ``block_ids``: the blocks the transfer writes,
    without valid data until it is done. It may still land later: a KVPeer keeps those blocks quarantined
    (refuses another transfer that touches them) until NIXL reports the transfer ended."""

    def __init__(self, message: str, written: WrittenBlocks) -> None:
        super().__init__(message)
        self._name_blocks(written)


# NIXL's answer for a handle whose remote agent was removed (or loaded anew) while it ran: NIXL no longer knows
# the transfer, but UCX's operations already in flight go on and may still write its blocks.
_NIXL_NOT_FOUND = ("nixlNotFoundError", "NIXL_ERR_NOT_FOUND")


def _lost_by_nixl(err: Exception) -> bool:
    return type(err).__name__ == _NIXL_NOT_FOUND[0] or _NIXL_NOT_FOUND[1] in str(err)


class NixlTransfer:
    """One NIXL transfer in flight. ``done()`` polls; ``wait(timeout)`` blocks; both raise RemoteTransferError
    when it failed, and again on every later call (a failed transfer never reads as done). ``num_descriptors``:
    the contiguous ranges it moves (adjacent blocks merged); ``nbytes``: their bytes.

    Its states: ``PROC`` (in flight), ``DONE``, ``ERR`` (NIXL reported it failed: it moves nothing more) and
    ``LOST``: NIXL answered that it no longer knows the handle (its remote agent was removed while it ran).
    A lost transfer fails its waits, but it has not ended: UCX's operations in flight may still write its
    blocks, so :attr:`ended` stays false and a KVPeer keeps its blocks quarantined."""

    def __init__(
        self,
        agent: XferAgent,
        handle: object,
        direction: str,
        num_descriptors: int,
        nbytes: int,
        written: WrittenBlocks,
    ) -> None:
        self._agent, self._handle = agent, handle
        self.direction, self.num_descriptors, self.nbytes = direction, num_descriptors, nbytes
        self._written = written  # which blocks are not valid if it fails, for the error
        self._state = "PROC"
        self._cause: Exception | None = None
        # The handle is released once: when NIXL reports the transfer ended, or when the last reference to an
        # unfinished one goes (a KVPeer holds its own until they end: releasing a handle in flight does not
        # stop its writes over a network).
        self._release = weakref.finalize(self, _release_handle, agent, handle)

    @property
    def ended(self) -> bool:
        """Whether NIXL reported it ended (done or failed) at the last poll, so that its blocks can no longer
        change; false for one in flight or lost (see the class). Polls never raise here."""
        return self._poll() in ("DONE", "ERR")

    @property
    def failed(self) -> bool:
        """Whether NIXL reported it failed; never raises."""
        return self._poll() == "ERR"

    @property
    def lost(self) -> bool:
        """Whether NIXL no longer knows it (its remote agent was removed while it ran): never ended; never
        raises."""
        return self._poll() == "LOST"

    def done(self) -> bool:
        state = self._poll()
        if state == "ERR":
            raise RemoteTransferError(
                f"{self.direction} failed; {self._written} hold no valid data", self._written
            ) from self._cause
        if state == "LOST":
            raise RemoteTransferError(
                f"{self.direction}: NIXL lost track of it (its remote agent was removed while it ran); "
                f"{self._written} hold no valid data, and may still be written by it",
                self._written,
            ) from self._cause
        return state == "DONE"

    def wait(self, timeout: float | None = None) -> None:
        """Returns once the transfer is done; RemoteTransferTimeout (a TimeoutError) after ``timeout`` seconds
        (the transfer may still land later). The deadline holds to within one NIXL poll. ``timeout``: None
        (no deadline) or seconds, a finite number >= 0; a wrong one (TypeError, ValueError) changes nothing."""
        timeout = timeout_argument("timeout", timeout)
        wait_until(
            self.done,
            timeout,
            lambda: RemoteTransferTimeout(
                f"{self.direction}: not done after {timeout} s; {self._written} hold no valid data until it is",
                self._written,
            ),
        )

    def _poll(self) -> str:
        """NIXL's state of it, "PROC", "DONE", "ERR" or "LOST"; the handle released once it ended (a lost
        one's is kept until the last reference goes: releasing it would not stop its writes)."""
        if self._state == "PROC":
            try:
                state = self._agent.check_xfer_state(self._handle)
            except Exception as err:  # NIXL's errors are its own classes
                state, self._cause = ("LOST" if _lost_by_nixl(err) else "ERR"), err
            if state in ("DONE", "ERR"):
                self._release()
            if state in ("DONE", "ERR", "LOST"):
                self._state = state
        return self._state


def _release_handle(agent: XferAgent, handle: object) -> None:
    # a handle of a vanished peer, or one NIXL could not abort: nothing to free
    with contextlib.suppress(Exception):
        agent.release_xfer_handle(handle)
