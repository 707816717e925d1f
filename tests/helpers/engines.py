"""Helpers for the TransferEngine tests on CPU: a gate that holds the engine's worker threads.

The engine's CPU workers call ``kvcopy.dispatch.run`` for every copy (once per
transfer, or once per layer of a layer-wise reload). :class:`Gate` replaces it
with a wrapper that records each call and, for the calls it is told to hold,
waits until the test releases them: transfers are then "in flight"
deterministically, for as long as the test wants.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import pytest

import kvcopy

from helpers import HANG_TIMEOUT_S

# A held call gives up after this long (the transfer then fails) rather than hang the suite.
GATE_TIMEOUT_S = HANG_TIMEOUT_S


def writes_into(region_owner) -> Callable:
    """A predicate on (src, dst): True when ``dst``'s first plane lies in ``region_owner``'s host buffer."""
    lo = region_owner.buffer.data_ptr()
    hi = lo + region_owner.nbytes

    def check(src, dst) -> bool:
        del src
        return lo <= dst.planes[0].data_ptr() < hi

    return check


class Gate:
    """Wraps kvcopy.dispatch.run: records calls; the calls ``hold`` selects wait until released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, hold: Callable | None = None) -> None:
        self.calls: list[tuple] = []  # (src, dst), in the order the workers reached them
        self.finished = 0  # calls that returned from the real copy
        self._hold = hold or (lambda src, dst: True)
        self._cond = threading.Condition()
        self._budget = 0  # held calls allowed through by release(n)
        self._open = False
        self._waiting = 0
        self.fail: Callable | None = None  # (src, dst) -> exception to raise instead of copying, or None
        real = kvcopy.dispatch.run

        def run(method, src, src_ids, dst, dst_ids, num_ctas=None):
            with self._cond:
                self.calls.append((src, dst))
            if self._hold(src, dst):
                with self._cond:
                    self._waiting += 1
                    self._cond.notify_all()
                    ok = self._cond.wait_for(lambda: self._open or self._budget > 0, GATE_TIMEOUT_S)
                    self._waiting -= 1
                    if not ok:
                        raise TimeoutError("test gate was never released")
                    if not self._open:
                        self._budget -= 1
            if self.fail is not None:
                err = self.fail(src, dst)
                if err is not None:
                    raise err
            real(method, src, src_ids, dst, dst_ids, num_ctas)
            with self._cond:
                self.finished += 1
                self._cond.notify_all()

        monkeypatch.setattr(kvcopy.dispatch, "run", run)

    def release(self, n: int = 1) -> None:
        """Lets ``n`` more held calls through."""
        with self._cond:
            self._budget += n
            self._cond.notify_all()

    def open(self) -> None:
        """Lets every held call through, now and later."""
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def wait_held(self, n: int = 1, timeout: float = HANG_TIMEOUT_S) -> None:
        """Blocks until at least ``n`` calls are waiting at the gate."""
        with self._cond:
            assert self._cond.wait_for(lambda: self._waiting >= n, timeout), (
                f"expected {n} calls held at the gate, {self._waiting} are"
            )

    def wait_finished(self, n: int, timeout: float = HANG_TIMEOUT_S) -> None:
        """Blocks until ``n`` calls have finished their copy."""
        with self._cond:
            assert self._cond.wait_for(lambda: self.finished >= n, timeout), (
                f"expected {n} finished copies, {self.finished} are"
            )

    @property
    def num_calls(self) -> int:
        with self._cond:
            return len(self.calls)


class Engines:
    """Makes TransferEngines and closes them at teardown (after opening the gate, if any)."""

    def __init__(self) -> None:
        self.engines: list[kvcopy.TransferEngine] = []
        self.gates: list[Gate] = []

    def __call__(self, kv, host, **kw) -> kvcopy.TransferEngine:
        engine = kvcopy.TransferEngine(kv, host, **kw)
        self.engines.append(engine)
        return engine

    def gate(self, monkeypatch: pytest.MonkeyPatch, hold: Callable | None = None) -> Gate:
        gate = Gate(monkeypatch, hold)
        self.gates.append(gate)
        return gate

    def close_all(self) -> None:
        for gate in self.gates:
            gate.open()
        for engine in self.engines:
            engine.close()


def run_in_thread(fn: Callable, *args) -> tuple[threading.Thread, dict]:
    """Starts ``fn(*args)`` in a thread; the dict gets "result" or "error" when it ends."""
    out: dict = {}

    def target() -> None:
        try:
            out["result"] = fn(*args)
        except BaseException as err:  # inspected by the test
            out["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, out


def run_threads(
    worker: Callable[[int], None], num_threads: int, timeout: float = 60.0, *, interleave: bool = False
) -> None:
    """Runs ``worker(i)`` for i in range(num_threads) on threads of its own and joins them all.

    ``interleave``: switch threads every microsecond meanwhile, so that
    unlocked read-modify-write sequences in the code under test would interleave.
    """
    old_interval = sys.getswitchinterval()
    if interleave:
        sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(num_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=timeout)
            assert not t.is_alive(), "a worker thread did not finish in time"
    finally:
        sys.setswitchinterval(old_interval)
