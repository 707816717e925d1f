"""A disk store's put or get as rounds of NIXL transfers (kvcopy.storage.staging plans them), one after
another as the transfer is polled: what a DiskTransfer (kvcopy.storage.transfer) waits on. The store
(kvcopy.storage.store) keeps the room rounds take (the requests NIXL has in flight, its staging buffers) and
posts each round; :class:`Rounds` moves one put's or get's rounds through their stages."""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from kvcopy._checks import timeout_argument
from kvcopy.engine.transfer import wait_until
from kvcopy.host.pool import HostKVPool, as_paged
from kvcopy.layout import PagedKV
from kvcopy.nixl.transfer import NixlTransfer, RemoteTransferTimeout, WrittenBlocks
from kvcopy.ops import copy_blocks
from kvcopy.storage.staging import Round, Staging

__all__ = ["RoundHost", "Rounds"]


class RoundHost(Protocol):
    """What rounds ask of their store (kvcopy.storage.store.DiskKVStore): room for a round, its posting to NIXL,
    and that it ended."""

    def _reserve(self, moving: Rounds, round_: Round) -> None: ...

    def _post(self, moving: Rounds, round_: Round) -> NixlTransfer: ...

    def _round_ended(self, moving: Rounds, round_: Round) -> None: ...


def _stream_event(device: torch.device) -> torch.cuda.Event | None:
    """On a GPU, an event recorded on the current stream, after the kvcopy copy just queued there (to or from a
    staging buffer): GDS's DMA follows no stream, so a round waits for it, by polling, never by blocking the
    host. None on the host, where kvcopy's copies are done when they return."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _passed(event: torch.cuda.Event | None, block: bool) -> bool:
    """Whether the stream has passed ``event`` (None: nothing to wait for); ``block``: wait until it has."""
    if event is None:
        return True
    if block:
        event.synchronize()
        return True
    return bool(event.query())


class Rounds:
    """A put's or get's rounds (kvcopy.storage.staging.Round), one NIXL transfer each, one after another as it
    is polled: what a DiskTransfer waits on, as it would on one NixlTransfer (``done``, ``wait``,
    ``num_descriptors``, ``nbytes``), and ``abandon``. A round in flight is in one stage: "gather" (a staged
    put's blocks copied into the staging buffer on the current stream; posted to NIXL once the stream passed
    the copy), "nixl" (NIXL moves it), "scatter" (a staged get's blocks copied out of the buffer on the
    current stream; it ends once the stream passed the copy). Polls never block the host; ``settle`` and
    ``wait`` do. An error ends it: no further round is started."""

    def __init__(
        self,
        store: RoundHost,
        op: str,
        pool: HostKVPool | PagedKV,
        rounds: list[Round],
        staging: Staging | None,
        written: WrittenBlocks,
    ) -> None:
        self.op, self.pool, self.staging, self.written = op, pool, staging, written
        self.paged = as_paged(pool, "pool")
        self._store = store
        self.num_descriptors = sum(len(r.ranges) for r in rounds)
        self.nbytes = sum(n for r in rounds for *_, n in r.ranges)
        self._pending = list(rounds)
        self._current: Round | None = None
        self._stage = ""
        self._event: torch.cuda.Event | None = None
        self._nixl: NixlTransfer | None = None
        self._error: BaseException | None = None  # a round's, found by settle (for another's round)
        self._start_next()

    def _start_next(self) -> None:
        """Reserves the next round, and starts it: a staged put's gather queued, anything else posted."""
        round_ = self._pending.pop(0)
        self._store._reserve(self, round_)
        self._current, self._stage, self._event, self._nixl = round_, "gather", None, None
        try:
            if self.staging is not None and self.op == "WRITE":
                rows = torch.arange(round_.ids.numel(), dtype=torch.int64)
                copy_blocks(self.paged, round_.ids, self.staging.paged, rows)
                self._event = _stream_event(self.paged.device)
            self._step(block=False)
        except BaseException:
            self._fail()
            raise

    def _step(self, block: bool) -> bool:
        """Advances the round in flight as far as it goes without waiting (``block``: to its end); True once it
        ended well (its requests and staging buffer free). Its errors propagate."""
        assert self._current is not None
        round_ = self._current
        if self._stage == "gather":
            if not _passed(self._event, block):
                return False
            self._nixl, self._stage = self._store._post(self, round_), "nixl"
        if self._stage == "nixl":
            assert self._nixl is not None
            if block:
                self._nixl.wait()
            elif not self._nixl.done():
                return False
            self._event, self._stage = None, "scatter"
            if self.staging is not None and self.op == "READ":
                rows = torch.arange(round_.ids.numel(), dtype=torch.int64)
                copy_blocks(self.staging.paged, rows, self.paged, round_.ids)
                self._event = _stream_event(self.paged.device)
        if not _passed(self._event, block):  # the scatter: the next round reads into the buffer after it
            return False
        self._current = None
        self._store._round_ended(self, round_)
        return True

    def _fail(self) -> None:
        """The round in flight failed (or is abandoned): its requests and staging buffer free, nothing more."""
        self._pending.clear()
        if self._current is not None:
            round_, self._current = self._current, None
            self._store._round_ended(self, round_)

    def settle(self) -> None:
        """Waits for the round in flight to end, for another transfer's round to start; starts nothing (the
        next round starts when this transfer is polled). Its error, if any, is raised by the next poll."""
        if self._current is None:
            return
        try:
            self._step(block=True)
        except Exception as err:  # NIXL reported it failed, or a copy did
            self._error = err
            self._fail()

    def done(self) -> bool:
        while True:
            if self._error is not None:
                raise self._error
            if self._current is None:  # (its round may have ended while another waited: see settle)
                if not self._pending:
                    return True
                self._start_next()
                continue
            try:
                if not self._step(block=False):
                    return False
            except BaseException:
                self._fail()
                raise

    def wait(self, timeout: float | None = None) -> None:
        seconds = timeout_argument("timeout", timeout)
        wait_until(
            self.done,
            seconds,
            lambda: RemoteTransferTimeout(
                f"{self.op.lower()}: not done after {seconds} s; {self.written} hold no valid data until it is",
                self.written,
            ),
        )

    def abandon(self) -> None:
        """Waits for NIXL to end the round it moves, and starts no more (its error, if any, is dropped)."""
        self._pending.clear()
        if self._current is not None:
            with contextlib.suppress(Exception):
                if self._stage == "nixl" and self._nixl is not None:
                    self._nixl.wait()
                elif self._event is not None:  # a copy to or from the staging buffer still queued
                    self._event.synchronize()
        self._fail()
