"""DiskTransfer: a disk store's put or get in flight (kvcopy.storage.store), around the NIXL transfer that moves
its bytes; what it does once the bytes have moved (a put's commit, a get's check) and what frees its slots.

A transfer ends once, well or badly. A wait that times out, or whose argument is wrong, ends nothing: the
transfer is as it was, and a later wait carries on. One that ended badly (NIXL's error, a get's block that
does not match its checksum, a put whose commit failed) raises that error again on every later ``wait`` and
``done``: it never reads as done after it failed. (kvcopy.nixl.transfer.NixlTransfer, under it, is shared
with the remote side; nothing here relies on how it treats a second wait.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

from kvcopy._checks import timeout_argument

__all__ = ["DiskTransfer"]


class Moving(Protocol):
    """What a DiskTransfer waits on: a store's rounds of NIXL transfers (kvcopy.storage.rounds), or one."""

    num_descriptors: int
    nbytes: int

    def done(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> None: ...


class DiskTransfer:
    """One put or get in flight: ``done()`` polls, ``wait(timeout=None)`` blocks (TimeoutError after
    ``timeout`` seconds, the transfer still in flight); both raise the transfer's error, and raise it again
    on every later call. A put's blocks match once it is done; a get's pool blocks hold the data read once
    it is done (checked, unless the get said ``verify=False``). ``num_descriptors``: the contiguous ranges it
    moves (0 when it moves nothing: a put of hashes all stored already, a get of no slots, done at once).

    ``explain``: given NIXL's error, the error to raise instead (one that says its cause), or None to raise
    NIXL's own."""

    def __init__(
        self,
        transfer: Moving | None,
        finish: Callable[[], None],
        release: Callable[[], None],
        explain: Callable[[Exception], Exception | None] | None = None,
    ) -> None:
        self._transfer, self._finish, self._release = transfer, finish, release
        self._explain = explain
        self.num_descriptors = 0 if transfer is None else transfer.num_descriptors
        self.nbytes = 0 if transfer is None else transfer.nbytes
        self._ended = False
        self._error: BaseException | None = None  # why it ended badly: raised by every later wait and done
        if transfer is None:
            self._end(None)

    def _end(self, error: BaseException | None) -> None:
        """Ends it once: with ``error`` None its finish (a put's commit, a get's check) runs, and its own error
        becomes the transfer's; the slots come free either way."""
        if self._ended:
            return
        self._ended = True
        self._error = error
        try:
            if error is None:
                self._finish()
        except BaseException as err:
            self._error = err
            raise
        finally:
            self._release()  # its slots may be reused (a put's) or evicted (a get's) again

    def _failed(self, error: Exception) -> BaseException:
        """NIXL reported the transfer failed: ended (nothing committed or verified), with the error to raise."""
        explained = self._explain(error) if self._explain is not None else None
        self._end(explained or error)
        assert self._error is not None
        return self._error

    def _abandon(self) -> None:
        """Waits for NIXL to end the transfer, then frees its slots with nothing committed or verified (for
        a call that failed after posting it: its DMA still reads or writes those slots until it ends)."""
        if self._transfer is not None:
            abandon = getattr(self._transfer, "abandon", None)  # a store's rounds: the one in flight, no more
            with contextlib.suppress(Exception):
                (abandon or self._transfer.wait)()
        self._end(RuntimeError("abandoned: the call that posted it failed"))

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def done(self) -> bool:
        self._raise_if_failed()
        if self._ended:
            return True
        assert self._transfer is not None  # (a transfer of nothing ended when made)
        try:
            finished = self._transfer.done()
        except Exception as err:  # NIXL reported it failed
            failure = self._failed(err)
            if failure is err:
                raise
            raise failure from err
        if finished:
            self._end(None)
        return finished

    def wait(self, timeout: float | None = None) -> None:
        seconds = timeout_argument("timeout", timeout)  # before anything: a wrong argument changes nothing
        self._raise_if_failed()
        if self._ended:
            return
        assert self._transfer is not None
        try:
            self._transfer.wait(seconds)
        except TimeoutError:  # still in flight: a later wait carries on
            raise
        except Exception as err:  # NIXL reported it failed
            failure = self._failed(err)
            if failure is err:
                raise
            raise failure from err
        self._end(None)
