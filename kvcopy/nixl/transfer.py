"""NixlTransfer: one NIXL transfer in flight (a KVPeer's read or write, or a disk store's put or get), and
the errors that name the blocks it leaves without valid data."""

from __future__ import annotations

import contextlib
import weakref
from typing import Protocol

import torch

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


class NixlTransfer:
    """One NIXL transfer in flight. ``done()`` polls; ``wait(timeout)`` blocks; both raise RemoteTransferError
    when it failed. ``num_descriptors``: the contiguous ranges it moves (adjacent blocks merged); ``nbytes``:
    their bytes."""

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
        """Whether NIXL reported it ended (done or failed) at the last poll; polls never raise here."""
        return self._poll() != "PROC"

    @property
    def failed(self) -> bool:
        """Whether NIXL reported it failed; never raises."""
        return self._poll() == "ERR"

    def done(self) -> bool:
        if self._poll() == "ERR":
            raise RemoteTransferError(
                f"{self.direction} failed; {self._written} hold no valid data", self._written
            ) from self._cause
        return self._state == "DONE"

    def wait(self, timeout: float | None = None) -> None:
        """Returns once the transfer is done; RemoteTransferTimeout (a TimeoutError) after ``timeout`` seconds
        (the transfer may still land later). The deadline holds to within one NIXL poll."""
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                raise TypeError(f"timeout: expected seconds (a number) or None, got {type(timeout).__name__}")
            if not timeout >= 0:  # also NaN
                raise ValueError(f"timeout: expected seconds >= 0 or None, got {timeout}")
        wait_until(
            self.done,
            timeout,
            lambda: RemoteTransferTimeout(
                f"{self.direction}: not done after {timeout} s; {self._written} hold no valid data until it is",
                self._written,
            ),
        )

    def _poll(self) -> str:
        """NIXL's state of it, "PROC", "DONE" or "ERR"; the handle released once it ended."""
        if self._state == "PROC":
            try:
                state = self._agent.check_xfer_state(self._handle)
            except Exception as err:  # NIXL's errors are its own classes
                state, self._cause = "ERR", err
            if state in ("DONE", "ERR"):
                self._release()
                self._state = state
        return self._state


def _release_handle(agent: XferAgent, handle: object) -> None:
    # a handle of a vanished peer, or one NIXL could not abort: nothing to free
    with contextlib.suppress(Exception):
        agent.release_xfer_handle(handle)
