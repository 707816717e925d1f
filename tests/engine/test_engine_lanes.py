"""Expedited reloads (a step waits for them) have a queue of their own: they never wait behind prefetch
reloads, and still run after any transfer that touches their blocks. On CUDA that queue is a stream of the
greatest priority; its choice is tested here with stand-ins for torch's stream factory (issue #33, finding 11).
Closed engines hand their dedicated streams on, never destroying them (finding 15)."""

from __future__ import annotations

import threading

import pytest
import torch

import kvcopy
from kvcopy.engine import streams

from helpers.copies import assert_same_bytes, dst_bytes, fill_random_, make_layout, reference_copy


def _setup():
    gen = torch.Generator().manual_seed(0)
    kv = make_layout("vllm", 8, torch.bfloat16, gen, num_layers=2)
    pool = kvcopy.HostKVPool(kv, 6, pin_memory=False)
    fill_random_(pool, gen)
    return kv, pool


def _hold_first_copy():
    """A Gate predicate holding only the first copy the workers reach: the prefetch reload in flight."""
    seen = []
    lock = threading.Lock()

    def hold(src, dst) -> bool:
        with lock:
            seen.append(1)
            return len(seen) == 1

    return hold


def test_an_expedited_reload_overtakes_a_prefetch_reload_in_flight(engines, monkeypatch):
    kv, pool = _setup()
    eng = engines(kv, pool)
    gate = engines.gate(monkeypatch, _hold_first_copy())
    expected = reference_copy(pool, [0, 1], kv, [0, 1])
    prefetch = eng.reload([0], [0])
    gate.wait_held()  # the prefetch reload holds the reload queue
    urgent = eng.reload([1], [1], expedited=True)  # other blocks: nothing to wait for
    urgent.wait(timeout=30)
    assert urgent.lane == "expedited" and prefetch.lane == "reload"
    assert not prefetch.done()
    gate.open()
    prefetch.wait()
    assert_same_bytes(dst_bytes(kv), expected)


def test_an_expedited_reload_of_a_block_a_prefetch_writes_runs_after_it(engines, monkeypatch):
    kv, pool = _setup()
    eng = engines(kv, pool)
    gate = engines.gate(monkeypatch, _hold_first_copy())
    expected = reference_copy(pool, [3], kv, [2])  # the later reload's bytes win
    prefetch = eng.reload([1], [2])
    gate.wait_held()
    urgent = eng.reload([3], [2], expedited=True)  # writes the block the prefetch writes
    with pytest.raises(TimeoutError):
        urgent.wait(timeout=0.2)  # it waits for the prefetch (a bound on waiting, not on speed)
    gate.open()
    urgent.wait()
    assert prefetch.done()
    assert_same_bytes(dst_bytes(kv), expected)


def test_expedited_must_be_a_bool(engines):
    kv, pool = _setup()
    with pytest.raises(TypeError, match="expedited"):
        engines(kv, pool).reload([0], [0], expedited="yes")


def test_the_expedited_stream_has_the_greatest_priority_torch_gives(monkeypatch):
    made = []

    class FakeStream:
        @staticmethod
        def priority_range():
            return (0, -5)  # CUDA's (least, greatest) on a recent GPU

        def __init__(self, device=None, priority=0):
            made.append(priority)

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    streams.new_expedited_stream(torch.device("cuda", 0))
    assert made == [-5]
    assert streams.greatest_priority() < streams.COPY_STREAM_PRIORITY  # it outranks the copy streams


class _FakeExtension:
    """The compiled module's stream calls: counts the streams made; destroying one is an error here."""

    def __init__(self) -> None:
        self.created = 0

    def create_copy_stream(self, device: int) -> int:
        self.created += 1
        return 1000 + self.created

    def destroy_stream(self, handle: int) -> None:
        raise AssertionError(f"stream {handle} destroyed: an allocator event recorded on it later would fail")


def test_a_closed_engines_copy_streams_are_handed_on_not_destroyed(monkeypatch):
    fake = _FakeExtension()
    monkeypatch.setattr(streams._ext, "extension", lambda: fake)
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda handle, device=None: handle)
    monkeypatch.setattr(torch.cuda, "device", lambda device: _NullContext())
    monkeypatch.setattr(streams, "_idle_streams", {})
    device = torch.device("cuda", 0)
    first = [streams.new_copy_stream(device) for _ in range(2)]
    assert fake.created == 2
    streams.release_streams(0, list(first))  # an engine closed; ids it recorded may be freed later
    again = [streams.new_copy_stream(device) for _ in range(3)]
    assert sorted(again[:2]) == sorted(first) and fake.created == 3  # reused, never destroyed; one more made
    assert streams.new_copy_stream(torch.device("cuda", 1)) not in first  # another device's streams are its own


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info: object) -> None:
        return None
