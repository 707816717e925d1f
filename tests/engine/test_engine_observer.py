"""TransferEngine's observer on CPU, and the timings a Transfer reports: method, link, queued, elapsed, turnaround.

What is checked: the observer gets each finished transfer exactly once (offload, reload, layer-wise reload),
with its timings, labels and sizes set; it runs in the engine's worker thread; a failed transfer is not
observed, and a failing observer is logged and breaks nothing; waits behind other transfers show in
``queued`` and not in ``elapsed``; an OnlineProfile fed through the observer counts every transfer.

Waits are forced by the test (a copy held until the test lets it go, then slept for SLOW_COPY_S) and only
their lower bounds are asserted, so a busy machine cannot fail a test.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import pytest
import torch

import kvcopy
from kvcopy.engine.transfer import ThreadSignal

from helpers import CPU_METHODS, HANG_TIMEOUT_S
from helpers.copies import assert_same_bytes, dst_bytes, reference_copy

NUM_BLOCKS = 16
HOST_BLOCKS = 16
NUM_PLANES = 4  # one plane per layer
PLANE_WIDTH = 1024  # float32 values per block of a plane
BLOCK_NBYTES = NUM_PLANES * PLANE_WIDTH * 4
OBSERVED_METHODS = ("torch", "cpu")

# The slow copy's sleep, and how much of it a wait it forces must show (most of it: sleeps never end early,
# this leaves room for clock granularity only).
SLOW_COPY_S = 0.1
MIN_FORCED_WAIT_S = 0.08
# How long a worker "is preempted" between signalling a transfer done and reporting it.
REPORT_DELAY_S = 0.2
# Against hangs only: a held copy gives up, a test stops waiting for an observer.
# queued + elapsed is turnaround up to float rounding of perf_counter differences.
ROUNDING_S = 1e-9

OBSERVER_ERROR = "observer failed on purpose"
COPY_ERROR = "copy failed on purpose"
FAILING_HOST_BLOCK = 3  # an offload into this host block (first) fails


def _cache(seed: int = 0) -> tuple[kvcopy.PagedKV, kvcopy.HostKVPool]:
    gen = torch.Generator().manual_seed(seed)
    kv = kvcopy.PagedKV.from_planes([torch.randn(NUM_BLOCKS, PLANE_WIDTH, generator=gen) for _ in range(NUM_PLANES)])
    host = kvcopy.HostKVPool(kv, HOST_BLOCKS, pin_memory=False)
    host.buffer.copy_(torch.randint(0, 256, (host.buffer.numel(),), dtype=torch.uint8, generator=gen))
    return kv, host


@dataclass(frozen=True)
class Call:
    """One observer call: the transfer, the thread it ran in, and the transfer's timings at that moment."""

    transfer: kvcopy.Transfer
    thread: str
    queued: float | None
    elapsed: float | None
    turnaround: float | None


class Recorder:
    """An observer recording each call (``fail``: then raising)."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[Call] = []
        self.fail = fail
        self._cond = threading.Condition()

    def __call__(self, transfer: kvcopy.Transfer) -> None:
        call = Call(transfer, threading.current_thread().name, transfer.queued, transfer.elapsed, transfer.turnaround)
        with self._cond:
            self.calls.append(call)
            self._cond.notify_all()
        if self.fail:
            raise RuntimeError(OBSERVER_ERROR)

    def wait_for(self, n: int) -> list[Call]:
        """The calls, once there are at least ``n`` (without asking any transfer whether it is done)."""
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.calls) >= n, HANG_TIMEOUT_S), f"{len(self.calls)} calls"
            return list(self.calls)


def _assert_timings(transfer: kvcopy.Transfer) -> None:
    assert transfer.queued >= 0
    assert transfer.elapsed >= 0
    assert transfer.turnaround >= transfer.elapsed
    assert transfer.turnaround == pytest.approx(transfer.queued + transfer.elapsed, abs=ROUNDING_S)


# --------------------------------------------------------------------------- each finished transfer, once


@pytest.mark.parametrize("method", OBSERVED_METHODS)
def test_observer_gets_each_finished_transfer_once_with_its_labels_and_timings(engines, method):
    kv, host = _cache()
    recorder = Recorder()
    engine = engines(kv, host, method=method, observer=recorder)
    offload = engine.offload([0, 1, 2], [5, 6, 7])
    reload = engine.reload([5, 6, 7], [8, 9, 10])
    layerwise = engine.reload([5, 6], [11, 12], layerwise=True)
    transfers = [offload, reload, layerwise]
    engine.close()  # every worker, and so every report, is done
    calls = recorder.calls
    assert sorted(id(c.transfer) for c in calls) == sorted(id(t) for t in transfers)
    for call in calls:
        t = call.transfer
        assert t.method == method
        assert t.profile_direction == "h2h"
        assert (call.queued, call.elapsed, call.turnaround) == (t.queued, t.elapsed, t.turnaround)
        _assert_timings(t)
    assert [(t.direction, t.num_blocks, t.nbytes) for t in transfers] == [
        ("offload", 3, 3 * BLOCK_NBYTES),
        ("reload", 3, 3 * BLOCK_NBYTES),
        ("reload", 2, 2 * BLOCK_NBYTES),
    ]
    for t in transfers:
        assert t.done()
        t.wait()
        t.report()
    assert len(recorder.calls) == len(transfers)


def test_auto_method_is_reported_by_the_name_it_resolved_to(engines):
    kv, host = _cache()
    recorder = Recorder()
    engine = engines(kv, host, observer=recorder)
    engine.offload([0, 1], [0, 1])
    engine.close()
    (call,) = recorder.calls
    assert call.transfer.method in CPU_METHODS


def test_copies_stay_bitwise_right_with_an_observer(engines):
    kv, host = _cache()
    engine = engines(kv, host, observer=Recorder())
    offload_src, offload_dst = [3, 0, 9], [1, 14, 2]
    expected_host = reference_copy(kv, offload_src, host, offload_dst)
    engine.offload(offload_src, offload_dst).wait()
    assert_same_bytes(dst_bytes(host), expected_host)
    for layerwise in (False, True):
        reload_src, reload_dst = [14, 7, 1], [4, 12, 5] if layerwise else [6, 2, 15]
        expected_kv = reference_copy(host, reload_src, kv, reload_dst)
        engine.reload(reload_src, reload_dst, layerwise=layerwise).wait()
        assert_same_bytes(dst_bytes(kv), expected_kv)


# --------------------------------------------------------------------------- the thread it runs in


def test_observer_runs_in_the_worker_that_copied(engines):
    kv, host = _cache()
    recorder = Recorder()
    engine = engines(kv, host, observer=recorder)
    offload = engine.offload([0, 1], [0, 1])
    reload = engine.reload([4, 5], [6, 7])  # no block in common: neither waits for the other
    threads = {id(c.transfer): c.thread for c in recorder.wait_for(2)}
    assert threads[id(offload)].startswith("kvcopy-offload")
    assert threads[id(reload)].startswith("kvcopy-reload")


def _delay_reports(monkeypatch) -> None:
    """A worker that has just signalled a transfer done is held up (as if preempted) before it reports it."""
    real_set = ThreadSignal.set

    def set_then_stall(self, error=None):
        real_set(self, error)
        if threading.current_thread().name.startswith("kvcopy-"):
            time.sleep(REPORT_DELAY_S)

    monkeypatch.setattr(ThreadSignal, "set", set_then_stall)


def test_observer_runs_in_the_worker_even_when_the_caller_waits_first(engines, monkeypatch):
    _delay_reports(monkeypatch)
    kv, host = _cache()
    recorder = Recorder()
    engine = engines(kv, host, observer=recorder)
    offload = engine.offload([0, 1], [0, 1])
    offload.wait()  # returns while the worker is held up between signalling and reporting
    (call,) = recorder.wait_for(1)
    assert call.transfer is offload
    assert call.thread.startswith("kvcopy-offload"), f"observed in {call.thread}"


def test_offload_is_observed_in_its_own_worker_when_a_reload_waits_for_it(engines, monkeypatch):
    _delay_reports(monkeypatch)
    real_copy = kvcopy.TransferEngine._copy
    let_go = threading.Event()

    def copy(self, method, src, src_ids, dst, dst_ids, layer):
        if src is self.kv:  # the offload: held until the reload that waits for it is submitted
            assert let_go.wait(HANG_TIMEOUT_S)
        real_copy(self, method, src, src_ids, dst, dst_ids, layer)

    monkeypatch.setattr(kvcopy.TransferEngine, "_copy", copy)
    kv, host = _cache()
    recorder = Recorder()
    engine = engines(kv, host, observer=recorder)
    offload = engine.offload([0, 1], [0, 1])
    engine.reload([0, 1], [4, 5])  # reads the host blocks the offload writes: its worker waits for the offload
    let_go.set()
    threads = {id(c.transfer): c.thread for c in recorder.wait_for(2)}
    assert threads[id(offload)].startswith("kvcopy-offload"), f"offload observed in {threads[id(offload)]}"


# --------------------------------------------------------------------------- failures


def test_failed_transfer_is_not_observed_and_the_engine_keeps_working(engines, monkeypatch):
    real_copy = kvcopy.TransferEngine._copy

    def copy(self, method, src, src_ids, dst, dst_ids, layer):
        if src is self.kv and int(dst_ids[0]) == FAILING_HOST_BLOCK:
            raise RuntimeError(COPY_ERROR)
        real_copy(self, method, src, src_ids, dst, dst_ids, layer)

    monkeypatch.setattr(kvcopy.TransferEngine, "_copy", copy)
    kv, host = _cache()
    recorder = Recorder()
    engine = engines(kv, host, observer=recorder)
    failed = engine.offload([0, 1], [FAILING_HOST_BLOCK, 4])
    with pytest.raises(RuntimeError, match=COPY_ERROR):
        failed.wait()
    assert failed.done()
    failed.report()
    with pytest.raises(RuntimeError, match=COPY_ERROR):
        failed.wait()
    host_block, kv_block = [rows[8].clone() for rows in dst_bytes(host)], [rows[2].clone() for rows in dst_bytes(kv)]
    later = [engine.offload([2], [5]), engine.reload([8], [9]), engine.reload([5], [10], layerwise=True)]
    engine.close()
    assert sorted(id(c.transfer) for c in recorder.calls) == sorted(id(t) for t in later)
    for rows, from_host, from_kv in zip(dst_bytes(kv), host_block, kv_block, strict=True):
        assert torch.equal(rows[9], from_host) and torch.equal(rows[10], from_kv)


def test_failing_observer_is_logged_and_breaks_no_copy(engines, caplog):
    kv, host = _cache()
    recorder = Recorder(fail=True)
    engine = engines(kv, host, observer=recorder)
    with caplog.at_level(logging.ERROR, logger="kvcopy.engine.transfer"):
        expected_host = reference_copy(kv, [0, 1], host, [2, 3])
        engine.offload([0, 1], [2, 3]).wait()
        assert_same_bytes(dst_bytes(host), expected_host)
        for layerwise in (False, True):
            expected_kv = reference_copy(host, [2, 3], kv, [6, 7] if layerwise else [8, 9])
            engine.reload([2, 3], [6, 7] if layerwise else [8, 9], layerwise=layerwise).wait()
            assert_same_bytes(dst_bytes(kv), expected_kv)
        engine.close()
    assert len(recorder.calls) == 3  # every transfer was observed: the first failure stopped nothing
    logged = [r for r in caplog.records if r.name == "kvcopy.engine.transfer"]
    assert len(logged) == 3
    for record in logged:
        assert record.levelno == logging.ERROR
        assert record.exc_info is not None and OBSERVER_ERROR in str(record.exc_info[1])


# --------------------------------------------------------------------------- waits show in queued


def test_waits_behind_a_slow_offload_show_in_queued_not_in_elapsed(engines, monkeypatch):
    real_copy = kvcopy.TransferEngine._copy
    let_go = threading.Event()
    slow_copy_ended: list[float] = []

    def copy(self, method, src, src_ids, dst, dst_ids, layer):
        held = src is self.kv and int(dst_ids[0]) == 0
        if held:  # the first offload: held until everything is submitted, then slow
            assert let_go.wait(HANG_TIMEOUT_S)
            time.sleep(SLOW_COPY_S)
        real_copy(self, method, src, src_ids, dst, dst_ids, layer)
        if held:
            slow_copy_ended.append(time.perf_counter())

    monkeypatch.setattr(kvcopy.TransferEngine, "_copy", copy)
    kv, host = _cache()
    recorder = Recorder()
    engine = engines(kv, host, observer=recorder)
    expected_host = reference_copy(kv, [0, 1], host, [0, 1])
    slow = engine.offload([0, 1], [0, 1])
    reload = engine.reload([0, 1], [8, 9])  # reads what the slow offload writes: ordered after it
    behind = engine.offload([2, 3], [2, 3])  # no block in common, but the same (FIFO) offload worker
    let_go.set()
    reload.wait()
    reload_seen = time.perf_counter()
    behind.wait()
    behind_seen = time.perf_counter()
    slow.wait()

    assert slow.elapsed >= MIN_FORCED_WAIT_S  # the delay inside a copy is the copy's own time
    for waiter, seen in ((reload, reload_seen), (behind, behind_seen)):
        assert waiter.queued >= MIN_FORCED_WAIT_S
        _assert_timings(waiter)
        # Its copy started once the slow one had ended, and had ended when the test saw it done.
        assert waiter.elapsed <= seen - slow_copy_ended[0]
    engine.close()
    assert {id(c.transfer): c.queued for c in recorder.calls} == {id(t): t.queued for t in (slow, reload, behind)}
    assert_same_bytes([rows[[0, 1]] for rows in dst_bytes(host)], [rows[[0, 1]] for rows in expected_host])
    for rows in dst_bytes(kv):
        assert torch.equal(rows[[8, 9]], rows[[0, 1]])  # the reload read what the slow offload wrote


# --------------------------------------------------------------------------- no observer, bad observer


@pytest.mark.parametrize("observer", [42, "print", [print]])
def test_observer_must_be_callable(observer):
    kv, host = _cache()
    with pytest.raises(TypeError, match="observer"):
        kvcopy.TransferEngine(kv, host, observer=observer)


def test_timings_without_an_observer(engines, monkeypatch):
    gate = engines.gate(monkeypatch)
    kv, host = _cache()
    engine = engines(kv, host)
    assert engine.observer is None
    offload = engine.offload([0, 1], [0, 1])
    gate.wait_held(1)
    assert (offload.queued, offload.elapsed, offload.turnaround) == (None, None, None)  # in flight
    gate.open()
    offload.wait()
    offload.report()  # nobody to report to: a no-op
    reload = engine.reload([0, 1], [4, 5], layerwise=True)
    reload.wait()
    for t in (offload, reload):
        assert t.method in CPU_METHODS and t.profile_direction == "h2h"
        _assert_timings(t)


# --------------------------------------------------------------------------- OnlineProfile through the observer


def test_online_profile_fed_through_the_observer_counts_every_transfer(engines):
    online = kvcopy.OnlineProfile(kvcopy.ModelSpec.preset("llama-3.1-8b"))

    def observe(t: kvcopy.Transfer) -> None:
        online.observe_copy(t.profile_direction, t.method, t.nbytes, t.turnaround, num_blocks=t.num_blocks)

    kv, host = _cache()
    engine = engines(kv, host, method="cpu", observer=observe)
    for i in range(4):
        engine.offload([i, i + 4], [i, i + 4])
    engine.reload([0, 1, 2], [8, 9, 10])
    engine.reload([4, 5], [11, 12], layerwise=True)
    engine.close()
    assert online.num_observations["h2h cpu"] == 6
