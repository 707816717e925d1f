"""DiskTransfer: a disk store's put or get in flight (kvcopy.storage.store), around the NIXL transfer that moves
its bytes; what it does once the bytes have moved (a put's commit, a get's check) and what frees its slots."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from kvcopy.nixl.transfer import NixlTransfer

__all__ = ["DiskTransfer"]


class DiskTransfer:
    """One put or get in flight: ``done()`` polls, ``wait(timeout=None)`` blocks (TimeoutError after
    ``timeout``); both raise the transfer's error. A put's blocks match once it is done; a get's pool blocks
    hold the data read once it is done (checked, unless the get said ``verify=False``). ``num_descriptors``:
    the contiguous ranges it moves (0 when it moves nothing: a put of hashes all stored already, a get of no
    slots, done at once)."""

    def __init__(self, transfer: NixlTransfer | None, finish: Callable[[], None], release: Callable[[], None]) -> None:
        self._transfer, self._finish, self._release = transfer, finish, release
        self.num_descriptors = 0 if transfer is None else transfer.num_descriptors
        self.nbytes = 0 if transfer is None else transfer.nbytes
        self._ended = False
        if transfer is None:
            self._end(True)

    def _end(self, ok: bool) -> None:
        if self._ended:
            return
        self._ended = True
        try:
            if ok:
                self._finish()
        finally:
            self._release()  # its slots may be reused (a put's) or evicted (a get's) again

    def _abandon(self) -> None:
        """Waits for NIXL to end the transfer, then frees its slots with nothing committed or verified (for
        a call that failed after posting it: its DMA still reads or writes those slots until it ends)."""
        if self._transfer is not None:
            with contextlib.suppress(Exception):
                self._transfer.wait()
        self._end(False)

    def done(self) -> bool:
        if self._transfer is None:
            return True
        try:
            finished = self._transfer.done()
        except BaseException:
            self._end(False)
            raise
        if finished:
            self._end(True)
        return finished

    def wait(self, timeout: float | None = None) -> None:
        if self._transfer is None:
            return
        try:
            self._transfer.wait(timeout)
        except TimeoutError:
            raise
        except BaseException:
            self._end(False)
            raise
        self._end(True)
