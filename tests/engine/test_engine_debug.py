"""TransferEngine: its own transfers are ordered per block; debug mode reports the caller's conflicting work.

The first transfer is held in flight by the gate (tests/helpers/engines.py).
A second transfer touching one of its blocks is accepted and runs after it,
so the result is that of running the two in submission order; one touching
none runs beside it. In debug mode, the caller's own ``copy_blocks`` on the
engine's cache or pool, or ``HostKVPool.free``, touching a block in flight is
a TransferConflictError raised before anything is written.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import kvcopy

from helpers import HANG_TIMEOUT_S
from helpers.copies import assert_same_bytes, dst_bytes, fill_random_, make_layout, reference_copy, snapshot
from helpers.engines import run_threads

NUM_BLOCKS, HOST_BLOCKS = 12, 10


def _setup(seed=0, layout="vllm"):
    gen = torch.Generator().manual_seed(seed)
    kv = make_layout(layout, NUM_BLOCKS, torch.bfloat16, gen, num_layers=2)
    pool = kvcopy.HostKVPool(kv, HOST_BLOCKS, pin_memory=False)
    fill_random_(pool, gen)
    return kv, pool


def _submit(eng, op):
    """op: ("offload", block_ids, host_ids) or ("reload", host_ids, block_ids[, layerwise])."""
    if op[0] == "offload":
        return eng.offload(op[1], op[2])
    return eng.reload(op[1], op[2], layerwise=len(op) > 3 and op[3])


# (first, second, side, block): the second would touch `block` on `side` while the first is unfinished.
CONFLICTS = [
    pytest.param(("offload", [1], [3]), ("offload", [2], [3]), "host", 3, id="waw-host"),
    pytest.param(("offload", [2], [0]), ("reload", [5], [2]), "device", 2, id="war-device"),
    pytest.param(("offload", [0], [4]), ("reload", [4], [6]), "host", 4, id="raw-host"),
    pytest.param(("reload", [1], [5]), ("offload", [5], [2]), "device", 5, id="raw-device"),
    pytest.param(("reload", [1], [5]), ("reload", [2], [5]), "device", 5, id="waw-device"),
    pytest.param(("reload", [3], [7]), ("offload", [8], [3]), "host", 3, id="war-host"),
    pytest.param(("reload", [1, 2, 3], [5, 6, 7], True), ("reload", [4], [7]), "device", 7, id="waw-device-layerwise"),
    pytest.param(
        ("offload", [0, 1, 2], [4, 5, 6]), ("reload", [9, 6], [10, 11], True), "host", 6, id="raw-host-layerwise-second"
    ),
    pytest.param(("offload", [2, 3], [0, 1]), ("offload", [4, 5], [8, 0]), "host", 0, id="waw-host-one-of-many"),
]

# Pairs that share no written block: accepted while the first is unfinished.
NO_CONFLICTS = [
    pytest.param(("offload", [1], [3]), ("offload", [2], [4]), id="disjoint-offloads"),
    pytest.param(("offload", [1], [3]), ("offload", [1], [4]), id="same-device-source"),  # read/read
    pytest.param(("reload", [3], [1]), ("reload", [3], [2]), id="same-host-source"),  # read/read
    pytest.param(("offload", [1], [3]), ("reload", [4], [2]), id="disjoint-both-ways"),
    pytest.param(("reload", [1], [5], True), ("offload", [6], [2]), id="layerwise-disjoint"),
]


def _in_order(seed, ops, engines):
    """Bytes of the cache and the pool after running ``ops`` one at a time, each waited for."""
    kv, pool = _setup(seed)
    eng = engines(kv, pool)
    for op in ops:
        _submit(eng, op).wait()
    return snapshot(kv), snapshot(pool)


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize(("first", "second", "side", "block"), CONFLICTS)
def test_a_conflicting_transfer_runs_after_the_first(engines, monkeypatch, debug, first, second, side, block):
    del side, block
    expected_kv, expected_pool = _in_order(7, [first, second], engines)
    kv, pool = _setup(7)
    eng = engines(kv, pool, debug=debug)
    gate = engines.gate(monkeypatch)
    t1 = _submit(eng, first)
    gate.wait_held(1)  # the first transfer is in flight: its worker holds its (first) copy
    t2 = _submit(eng, second)  # accepted, in debug mode too: the engine orders its own transfers
    if first[0] != second[0]:  # another worker: it must not start before the first is done
        with pytest.raises(TimeoutError):
            t2.wait(timeout=0.2)
        assert gate.num_calls == 1, "the second transfer started while the first was in flight"
    gate.open()
    t1.wait()
    t2.wait()
    assert_same_bytes(snapshot(kv), expected_kv)
    assert_same_bytes(snapshot(pool), expected_pool)


def test_ordering_holds_when_the_first_copy_is_slow(engines, monkeypatch):
    """A reload of a host block right after the offload into it reads the offloaded bytes, not stale ones."""
    import time

    kv, pool = _setup(8)
    eng = engines(kv, pool)
    real = kvcopy.dispatch.run

    def slow(method, src, src_ids, dst, dst_ids, num_ctas=None):
        if src is eng.kv:
            time.sleep(0.2)  # the offload is slow; the reload worker is idle and would run first
        real(method, src, src_ids, dst, dst_ids, num_ctas)

    monkeypatch.setattr(kvcopy.dispatch, "run", slow)
    expected = reference_copy(kv, [4, 5], kv, [9, 10])  # blocks 4, 5 land in 9, 10 through host blocks 0, 1
    out = eng.offload([4, 5], [0, 1])
    back = eng.reload([0, 1], [9, 10])
    back.wait()
    assert out.done()
    assert_same_bytes(dst_bytes(kv), expected)


# How long the test gives an unordered reload to run (and so read the wrong bytes) while B is held: it
# only needs to be long enough to catch the bug most of the time; the right ordering passes whatever it is.
UNORDERED_GRACE_S = 0.3


def test_a_later_writer_of_a_host_block_is_waited_for_after_an_earlier_one_finishes(engines, monkeypatch):
    """Offload A into host 3, then B into host 3 (held); once A is done, a reload of host 3 still waits for
    B, and reads B's bytes."""
    gen = torch.Generator().manual_seed(3)
    kv = make_layout("vllm", 12, torch.bfloat16, gen, num_layers=2)
    pool = kvcopy.HostKVPool(kv, 8, pin_memory=False)
    fill_random_(pool, gen)
    eng = engines(kv, pool)
    gate = engines.gate(monkeypatch, hold=lambda src, dst: src is eng.kv)  # offloads wait at the gate
    expected = reference_copy(kv, [5], kv, [9])  # device 5 reaches device 9 through host 3
    a = eng.offload([4], [3])
    b = eng.offload([5], [3])  # write after write: runs after A
    gate.release(1)  # A only
    a.wait()
    gate.wait_held(1)  # B is at the gate: A finished, B still writes host 3 (the case under test)
    back = eng.reload([3], [9])
    deadline = time.monotonic() + UNORDERED_GRACE_S
    while not back.done() and time.monotonic() < deadline:  # a reload that forgot B would finish now
        time.sleep(0.01)
    assert not b.done()
    gate.open()
    back.wait()
    assert b.done()
    assert_same_bytes(dst_bytes(kv), expected)


def reference_after(kv, pool, op):
    """Expected destination plane bytes after op (on the current contents)."""
    if op[0] == "offload":
        return reference_copy(kv, op[1], pool, op[2])
    return reference_copy(pool, op[1], kv, op[2])


@pytest.mark.parametrize(("first", "second", "side", "block"), CONFLICTS)
def test_same_transfer_is_accepted_once_the_first_is_done(engines, first, second, side, block):
    kv, pool = _setup(seed=1)
    eng = engines(kv, pool, debug=True)
    _submit(eng, first).wait()
    expected = reference_after(kv, pool, second)
    _submit(eng, second).wait()
    dst = pool if second[0] == "offload" else kv
    assert_same_bytes(dst_bytes(dst), expected)


@pytest.mark.parametrize(("first", "second"), NO_CONFLICTS)
def test_disjoint_transfers_are_accepted_while_in_flight(engines, monkeypatch, first, second):
    kv, pool = _setup(seed=2)
    eng = engines(kv, pool, debug=True)
    gate = engines.gate(monkeypatch)
    t1 = _submit(eng, first)
    gate.wait_held(1)
    t2 = _submit(eng, second)
    assert not t1.done()
    gate.open()
    t1.wait()
    t2.wait()


# --------------------------------------------------------------------------- debug mode: the caller's own work


# Only the engine's workers wait at the gate: the caller's own copies run on the test's thread.
def engine_workers_only(src, dst) -> bool:
    del src, dst
    return threading.current_thread().name.startswith("kvcopy-")


# (transfer in flight, the caller's copy_blocks(src, src_ids, dst, dst_ids) by name, what the error says)
CALLER_CONFLICTS = [
    pytest.param(
        ("offload", [2], [3]),
        ("pool", [5], "pool", [3]),
        "would write host block 3, which an unfinished offload still writes",
        id="copy-into-host-block-being-written",
    ),
    pytest.param(
        ("offload", [2], [3]),
        ("pool", [3], "kv", [9]),
        "would read host block 3, which an unfinished offload still writes",
        id="copy-from-host-block-being-written",
    ),
    pytest.param(
        ("offload", [2], [3]),
        ("pool", [5], "kv", [2]),
        "would write device block 2, which an unfinished offload still reads",
        id="copy-into-block-being-read",
    ),
    pytest.param(
        ("reload", [4], [6]),
        ("kv", [6], "pool", [8]),
        "would read device block 6, which an unfinished reload still writes",
        id="copy-from-block-being-reloaded",
    ),
    pytest.param(
        ("reload", [4], [6], True),
        ("kv", [1], "kv", [6]),
        "would write device block 6, which an unfinished reload still writes",
        id="copy-into-layerwise-reload",
    ),
]


def _caller_copy(kv, pool, op):
    names = {"kv": kv, "pool": pool}
    kvcopy.copy_blocks(names[op[0]], op[1], names[op[2]], op[3])


@pytest.mark.parametrize(("first", "caller", "message"), CALLER_CONFLICTS)
def test_debug_reports_the_callers_conflicting_copy_before_writing(engines, monkeypatch, first, caller, message):
    kv, pool = _setup()
    eng = engines(kv, pool, debug=True)
    assert eng.debug is True
    gate = engines.gate(monkeypatch, hold=engine_workers_only)
    t1 = _submit(eng, first)
    gate.wait_held(1)
    dst = kv if caller[2] == "kv" else pool
    expected = snapshot(dst)
    with pytest.raises(kvcopy.TransferConflictError, match=f"copy_blocks {message}; wait for that transfer"):
        _caller_copy(kv, pool, caller)
    assert gate.num_calls == 1  # the refused copy never reached a kernel
    gate.open()
    t1.wait()
    if (first[0] == "offload") != (caller[2] == "pool"):  # the transfer wrote the other side: dst is as it was
        assert_same_bytes(snapshot(dst), expected)
    _caller_copy(kv, pool, caller)  # once the transfer is done, the same copy is fine


def test_debug_reports_freeing_a_host_block_in_flight(engines, monkeypatch):
    kv, pool = _setup()
    eng = engines(kv, pool, debug=True)
    gate = engines.gate(monkeypatch)
    slots = pool.allocate(3)
    t1 = eng.offload([1, 2, 3], slots)
    gate.wait_held(1)
    with pytest.raises(kvcopy.TransferConflictError, match=rf"HostKVPool.free would write host block {int(slots[1])}"):
        pool.free(slots[1:2])
    assert pool.num_free == HOST_BLOCKS - 3  # nothing was freed
    gate.open()
    t1.wait()
    pool.free(slots)


@pytest.mark.parametrize(("first", "second"), NO_CONFLICTS)
def test_debug_accepts_the_callers_disjoint_copy(engines, monkeypatch, first, second):
    del second
    kv, pool = _setup(seed=2)
    eng = engines(kv, pool, debug=True)
    gate = engines.gate(monkeypatch, hold=engine_workers_only)
    t1 = _submit(eng, first)
    gate.wait_held(1)
    kvcopy.copy_blocks(kv, [11], pool, [9])  # touches no block of the transfer in flight
    kvcopy.copy_blocks(pool, [8], kv, [10])
    assert not t1.done()
    gate.open()
    t1.wait()


def test_failed_transfer_no_longer_blocks_its_blocks(engines, monkeypatch):
    kv, pool = _setup(seed=3)
    eng = engines(kv, pool, debug=True)
    gate = engines.gate(monkeypatch, hold=lambda src, dst: False)
    gate.fail = lambda src, dst: RuntimeError("copy failed")
    t = eng.offload([1], [3])
    with pytest.raises(RuntimeError, match="copy failed"):
        t.wait()
    gate.fail = None
    kvcopy.copy_blocks(kv, [2], pool, [3])  # not a conflict: the failed transfer is finished
    eng.reload([3], [4]).wait()  # and later transfers do not wait for it forever


def test_ids_are_checked_before_conflicts(engines, monkeypatch):
    """Bad ids are the usual errors in debug mode too, and are not recorded as in flight."""
    kv, pool = _setup(seed=4)
    eng = engines(kv, pool, debug=True)
    gate = engines.gate(monkeypatch)
    with pytest.raises(IndexError, match="host_ids"):
        eng.offload([1], [HOST_BLOCKS])
    with pytest.raises(ValueError, match="host_ids"):
        eng.offload([1, 2], [3, 3])
    with pytest.raises(IndexError, match="dst_ids"):
        kvcopy.copy_blocks(kv, [1], pool, [HOST_BLOCKS])
    t = eng.offload([1], [3])  # nothing was left behind by the refused calls
    gate.open()
    t.wait()
    kvcopy.copy_blocks(kv, [2], pool, [3])


# --------------------------------------------------------------------------- switching debug mode


def _caller_conflict(eng, gate, pool):
    """A transfer held in flight, and the caller's copy into its host block."""
    t1 = eng.offload([1], [3])
    gate.wait_held(1)
    return t1, lambda: kvcopy.copy_blocks(eng.kv, [2], pool, [3])


def test_env_var_turns_debug_on(engines, monkeypatch):
    monkeypatch.setenv("KVCOPY_DEBUG", "1")
    kv, pool = _setup()
    eng = engines(kv, pool)
    assert eng.debug is True
    gate = engines.gate(monkeypatch)
    _, caller = _caller_conflict(eng, gate, pool)
    with pytest.raises(kvcopy.TransferConflictError):
        caller()


@pytest.mark.parametrize("value", [None, "0", ""])
def test_debug_is_off_without_the_env_var(engines, monkeypatch, value):
    if value is None:
        monkeypatch.delenv("KVCOPY_DEBUG", raising=False)
    else:
        monkeypatch.setenv("KVCOPY_DEBUG", value)
    kv, pool = _setup()
    eng = engines(kv, pool)
    assert eng.debug is False
    gate = engines.gate(monkeypatch, hold=engine_workers_only)
    t1, caller = _caller_conflict(eng, gate, pool)
    caller()  # not checked
    gate.open()
    t1.wait()


def test_env_var_is_read_at_construction(engines, monkeypatch):
    monkeypatch.delenv("KVCOPY_DEBUG", raising=False)
    kv, pool = _setup()
    eng = engines(kv, pool)
    monkeypatch.setenv("KVCOPY_DEBUG", "1")  # too late for this engine
    assert eng.debug is False
    gate = engines.gate(monkeypatch, hold=engine_workers_only)
    t1, caller = _caller_conflict(eng, gate, pool)
    caller()
    gate.open()
    t1.wait()


def test_debug_false_overrides_the_env_var(engines, monkeypatch):
    monkeypatch.setenv("KVCOPY_DEBUG", "1")
    kv, pool = _setup()
    eng = engines(kv, pool, debug=False)
    assert eng.debug is False
    gate = engines.gate(monkeypatch, hold=engine_workers_only)
    t1, caller = _caller_conflict(eng, gate, pool)
    caller()  # no TransferConflictError
    gate.open()
    t1.wait()


def test_debug_true_overrides_an_unset_env_var(engines, monkeypatch):
    monkeypatch.delenv("KVCOPY_DEBUG", raising=False)
    kv, pool = _setup()
    eng = engines(kv, pool, debug=True)
    gate = engines.gate(monkeypatch)
    _, caller = _caller_conflict(eng, gate, pool)
    with pytest.raises(kvcopy.TransferConflictError):
        caller()


# --------------------------------------------------------------------------- threads


def test_transfers_submitted_from_threads_are_all_tracked(engines, monkeypatch):
    """Offloads submitted concurrently from 4 threads are all recorded: the caller's copy from any of their
    host blocks is caught, and a reload of each runs after its offload."""
    kv = make_layout("mla", 512, torch.bfloat16, torch.Generator().manual_seed(5), num_layers=1)
    pool = kvcopy.HostKVPool(kv, 512, pin_memory=False)
    eng = engines(kv, pool, debug=True)
    gate = engines.gate(monkeypatch)
    num_threads, per_thread = 4, 128
    start = threading.Barrier(num_threads)

    def worker(index: int) -> None:
        start.wait()
        for j in range(per_thread):
            block = index * per_thread + j
            eng.offload([block], [block])  # distinct blocks: no conflicts among these

    run_threads(
        worker, num_threads, timeout=HANG_TIMEOUT_S, interleave=True
    )  # interleave the submissions as much as possible
    missed = []
    for block in range(num_threads * per_thread):
        try:
            kvcopy.copy_blocks(pool, [block], kv, [block])  # reads a host block an unfinished offload writes
            missed.append(block)
        except kvcopy.TransferConflictError:
            pass
    gate.open()
    assert not missed, f"conflicts not caught for host blocks {missed}: their offloads were not tracked"
