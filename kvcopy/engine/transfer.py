"""Transfer: the handle of one asynchronous offload or reload.

A transfer completes through *signals*: one for the whole transfer and, for a
layer-wise reload, one per layer. On CUDA a signal is an event recorded on the
engine's copy stream; on CPU it is set by the worker thread that did the copy.
"""

from __future__ import annotations

import logging
import numbers
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from kvcopy._checks import timeout_argument
from kvcopy._version import warn_renamed
from kvcopy.dispatch import check_stream

__all__ = ["CudaSignal", "ThreadSignal", "Transfer", "TransferSignal", "wait_until"]

# Waiting on something that can only be polled: poll without sleeping for this long (a small transfer takes
# tens of microseconds, less than one sleep), then sleep between polls for a pause that grows with the time
# waited, _POLL_LATE_FRACTION of it, so a transfer is seen done at most ~2% of its duration late (a fixed
# back-off to 5 ms saw a 10 ms disk read up to 50% late), between the shortest sleep worth making and the longest.
_SPIN_SECONDS = 1e-3
_POLL_MIN_SECONDS, _POLL_MAX_SECONDS = 5e-5, 5e-3
_POLL_LATE_FRACTION = 0.02

logger = logging.getLogger(__name__)

# Seconds of a transfer's life as the engine stamps it: (submitted, started, ended). On CUDA, events: the first
# is recorded on the caller's stream at submission (so it fires when the caller's queued work, which the copy
# must follow anyway, is done), the others on the copy stream around the copy. On a CPU, perf_counter stamps
# the submitting thread and the worker fill in.
Timer = tuple[torch.cuda.Event, torch.cuda.Event, torch.cuda.Event] | list[float]


def wait_until(done: Callable[[], bool], timeout: float | None, timed_out: Callable[[], BaseException]) -> None:
    """kvcopy's one wait loop: polls ``done()`` until it is true, and raises ``timed_out()`` once ``timeout``
    seconds (None: never) have passed without it (to within one poll). ``done()``'s own errors propagate. A
    timeout that is not None or seconds >= 0 is a TypeError / ValueError naming it, before ``done()`` is asked."""
    timeout = timeout_argument("timeout", timeout)
    started = time.monotonic()
    deadline = None if timeout is None else started + timeout
    while not done():
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise timed_out()
        if now - started < _SPIN_SECONDS:
            continue
        pause = min(_POLL_MAX_SECONDS, max(_POLL_MIN_SECONDS, (now - started) * _POLL_LATE_FRACTION))
        time.sleep(pause if deadline is None else max(0.0, min(pause, deadline - now)))


class TransferSignal(Protocol):
    """What a Transfer needs of a completion signal."""

    def query(self) -> bool: ...

    def wait(self, timeout: float | None) -> None: ...

    def wait_stream(self, stream: torch.cuda.Stream | None) -> None: ...


class CudaSignal:
    """An event recorded on a copy stream after the work it signals.

    ``unsafe``: a (weak) callable saying that querying the event now would invalidate a CUDA
    graph capture in progress (global capture mode forbids event queries from every thread);
    then ``query`` answers False and ``wait`` waits for the capture to end first.
    """

    def __init__(self, event: torch.cuda.Event, unsafe: Callable[[], Callable[[], bool] | None] | None = None) -> None:
        self.event = event
        self._unsafe = unsafe

    def _query_is_unsafe(self) -> bool:
        check = self._unsafe() if self._unsafe is not None else None
        return check is not None and check()

    def query(self) -> bool:
        return not self._query_is_unsafe() and self.event.query()

    def wait(self, timeout: float | None) -> None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "wait(): this thread's stream is capturing a CUDA graph, which a host wait would "
                "invalidate (or, for a capture of this engine's transfers, never see end); use "
                "wait_stream() inside a capture"
            )
        started = time.monotonic()
        wait_until(
            lambda: not self._query_is_unsafe(),
            timeout,
            lambda: TimeoutError(
                f"transfer not known to be done after {timeout} s (a CUDA graph capture of its "
                f"engine's transfers is in progress)"
            ),
        )
        if timeout is None:
            self.event.synchronize()  # raises what the device reported, if anything
            return
        left = max(0.0, timeout - (time.monotonic() - started))
        wait_until(self.event.query, left, lambda: TimeoutError(f"transfer not done after {timeout} s"))

    def wait_stream(self, stream: torch.cuda.Stream | None) -> None:
        (stream or torch.cuda.current_stream(self.event.device)).wait_event(self.event)


class ThreadSignal:
    """Set by a CPU worker when its copy (or one layer of it) is done, with the error if it failed."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def set(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"transfer not done after {timeout} s")
        if self.error is not None:
            raise self.error

    def wait_stream(self, stream: torch.cuda.Stream | None) -> None:
        del stream  # no device: the calling thread itself waits
        self.wait(None)


class Transfer:
    """One offload (device pages -> host) or reload (host -> device pages), in flight or done.

    ``done()`` never blocks; ``wait()`` blocks the host and re-raises an error
    of the transfer; ``wait_stream()`` / ``wait_layer()`` make a CUDA stream
    wait on the device without blocking the host (on CPU they block the caller).
    ``direction``: "offload" or "reload"; ``method``: the copy method that ran
    it; ``profile_direction``: its direction in a Profile's terms ("d2h",
    "h2d" or "h2h"), as OnlineProfile.observe_copy takes it; ``lane``: the
    engine's queue it ran on ("offload", "reload" or "expedited").
    """

    def __init__(
        self,
        direction: str,
        num_blocks: int,
        nbytes: int,
        done: TransferSignal,
        layers: Sequence[TransferSignal] | None = None,
        timer: Timer | None = None,
        keepalive: tuple[object, ...] = (),
        *,
        method: str = "",
        profile_direction: str = "",
        observer: Callable[[Transfer], None] | None = None,
        lane: str | None = None,
    ) -> None:
        self.direction = direction
        self.lane = direction if lane is None else lane  # the engine queue it ran on (TransferEngine: LANES)
        self.num_blocks = num_blocks
        self.nbytes = nbytes
        self.method = method
        self.profile_direction = profile_direction
        self._done = done
        self._layers = layers
        self._timer = timer
        self._keepalive = keepalive  # what the copy reads or writes must outlive it (caches, pinned pools, ids)
        self.joined: set[int] = set()  # streams made to wait for the whole transfer (wait_stream)
        self._observer = observer
        self._report_once = threading.Lock()  # taken (never waited for) by whoever reports the transfer first

    @property
    def link(self) -> str:
        """Deprecated: :attr:`profile_direction`."""
        warn_renamed("Transfer.link", "Transfer.profile_direction")
        return self.profile_direction

    @property
    def layerwise(self) -> bool:
        return self._layers is not None

    def done(self) -> bool:
        """True once every byte has landed (or the transfer failed; ``wait()`` says which)."""
        finished = self._done.query()
        if finished:
            self.report()
        return finished

    def wait(self, timeout: float | None = None) -> None:
        """Blocks until done; re-raises the transfer's error (on every call: a failed transfer never reads as
        done well); TimeoutError after ``timeout`` seconds, the transfer still in flight. A ``timeout`` that is
        not None or seconds >= 0 is a TypeError / ValueError that changes nothing: a later wait() finishes it."""
        timeout = timeout_argument("timeout", timeout)
        self._done.wait(timeout)
        self.report()

    def report(self) -> None:
        """Hands the finished transfer to its engine's observer, once: on a CPU the worker that ran the copy does,
        before it signals done (so ``wait()`` returns after the observer ran); on CUDA whoever first finds the
        transfer done. A failed, unfinished or untimed transfer reports nothing (yet); an observer's error is
        logged. Never blocks."""
        if self._observer is None or getattr(self._done, "error", None) is not None or self.turnaround is None:
            return
        if not self._report_once.acquire(blocking=False):
            return
        try:
            self._observer(self)
        except Exception:  # an observer must never break a copy
            logger.exception("kvcopy: the transfer observer failed on %r", self)

    def wait_stream(self, stream: torch.cuda.Stream | None = None) -> None:
        """Work queued on ``stream`` (default: current) after this call runs after the transfer."""
        check_stream(stream)
        self._done.wait_stream(stream)
        if isinstance(self._done, CudaSignal):  # debug mode: that stream's later work is ordered after this one
            self.joined.add((stream or torch.cuda.current_stream(self._done.event.device)).cuda_stream)

    def wait_layer(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Like :meth:`wait_stream`, for one layer of a layer-wise reload."""
        if self._layers is None:
            raise ValueError("wait_layer: this transfer is not a layer-wise reload (use reload(..., layerwise=True))")
        if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
            raise TypeError(f"layer: expected a layer index (int), got {type(layer).__name__} {layer!r:.40}")
        check_stream(stream)
        if not 0 <= layer < len(self._layers):
            raise IndexError(f"layer: expected a layer in [0, {len(self._layers)}), got {layer}")
        self._layers[layer].wait_stream(stream)

    def _seconds_between(self, first: int, last: int) -> float | None:
        timer = self._timer
        if timer is None:
            return None
        if isinstance(timer, tuple):  # CUDA events: read once the copy stream has passed them
            return timer[first].elapsed_time(timer[last]) / 1e3 if self._done.query() else None
        return timer[last] - timer[first] if len(timer) == 3 else None  # the worker stamps the end when done

    @property
    def elapsed(self) -> float | None:
        """Seconds from the copy's start to its end on the copy stream / worker; None until done (and inside a
        CUDA graph capture, which records no timing)."""
        return self._seconds_between(1, 2)

    @property
    def queued(self) -> float | None:
        """Seconds the transfer waited, once submitted, behind other transfers before its copy started (on
        CUDA: from the moment the caller's stream reached the submission); None until done."""
        seconds = self._seconds_between(0, 1)
        return None if seconds is None else max(seconds, 0.0)

    @property
    def turnaround(self) -> float | None:
        """Seconds from the submission until done: ``queued`` plus ``elapsed``; None until done."""
        seconds = self._seconds_between(0, 2)
        return None if seconds is None else max(seconds, 0.0)

    def __repr__(self) -> str:
        state = "done" if self.done() else "in flight"
        return f"Transfer({self.direction}, num_blocks={self.num_blocks}, nbytes={self.nbytes}, {state})"
