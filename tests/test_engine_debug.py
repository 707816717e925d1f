"""TransferEngine debug mode: conflicts between a new transfer and unfinished ones raise TransferConflictError.

The first transfer is held in flight by the gate (tests/engine_helpers.py);
the second would touch one of its blocks. A refused transfer must be refused
before anything is queued: after the gate opens and the engine is closed, only
the first transfer's copy ran and the second one's destination is unchanged.
"""

from __future__ import annotations

import threading

import pytest
import torch

import kvcopy
from conftest import assert_same_bytes, byte_rows, dst_bytes, fill_random_, make_layout, reference_copy, snapshot
from engine_helpers import run_threads

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
    pytest.param(("offload", [0, 1, 2], [4, 5, 6]), ("reload", [9, 6], [10, 11], True), "host", 6,
                 id="raw-host-layerwise-second"),
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


@pytest.mark.parametrize(("first", "second", "side", "block"), CONFLICTS)
def test_conflict_is_refused_before_anything_is_queued(engines, monkeypatch, first, second, side, block):
    kv, pool = _setup()
    eng = engines(kv, pool, debug=True)
    assert eng.debug is True
    gate = engines.gate(monkeypatch)
    t1 = _submit(eng, first)
    gate.wait_held(1)  # the first transfer is in flight: its worker holds its (first) copy
    assert not t1.done()
    dst = pool if second[0] == "offload" else kv
    dst_before = snapshot(dst)
    expected_first = reference_after(kv, pool, first)
    with pytest.raises(kvcopy.TransferConflictError) as info:
        _submit(eng, second)
    message = str(info.value)
    assert f"{side} block {block}" in message, message
    assert eng.num_in_flight == 1
    gate.open()
    t1.wait()
    eng.close()
    copies_of_first = kv.num_layers if len(first) > 3 and first[3] else 1
    assert gate.num_calls == copies_of_first, "the refused transfer was queued"
    # The refused transfer wrote nothing: its destination holds only what the first transfer wrote.
    if dst is (pool if first[0] == "offload" else kv):
        assert_same_bytes(dst_bytes(dst), expected_first)
    else:
        assert_same_bytes(snapshot(dst), dst_before)


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


def test_conflict_check_after_a_failed_transfer(engines, monkeypatch):
    """A failed transfer is finished: it no longer blocks its blocks."""
    kv, pool = _setup(seed=3)
    eng = engines(kv, pool, debug=True)
    gate = engines.gate(monkeypatch, hold=lambda src, dst: False)
    gate.fail = lambda src, dst: RuntimeError("copy failed")
    t = eng.offload([1], [3])
    with pytest.raises(RuntimeError, match="copy failed"):
        t.wait()
    gate.fail = None
    eng.offload([2], [3]).wait()


def test_ids_are_checked_before_conflicts(engines, monkeypatch):
    """Bad ids are the usual errors in debug mode too, and are not recorded as in flight."""
    kv, pool = _setup(seed=4)
    eng = engines(kv, pool, debug=True)
    gate = engines.gate(monkeypatch)
    with pytest.raises(IndexError, match="host_ids"):
        eng.offload([1], [HOST_BLOCKS])
    with pytest.raises(ValueError, match="host_ids"):
        eng.offload([1, 2], [3, 3])
    t = eng.offload([1], [3])  # nothing was left behind by the refused calls
    gate.open()
    t.wait()


# --------------------------------------------------------------------------- switching debug mode


def _conflict_pair(eng, gate):
    t1 = eng.offload([1], [3])
    gate.wait_held(1)
    return t1, lambda: eng.offload([2], [3])


def test_env_var_turns_debug_on(engines, monkeypatch):
    monkeypatch.setenv("KVCOPY_DEBUG", "1")
    kv, pool = _setup()
    eng = engines(kv, pool)
    assert eng.debug is True
    gate = engines.gate(monkeypatch)
    _, second = _conflict_pair(eng, gate)
    with pytest.raises(kvcopy.TransferConflictError):
        second()


@pytest.mark.parametrize("value", [None, "0", ""])
def test_debug_is_off_without_the_env_var(engines, monkeypatch, value):
    if value is None:
        monkeypatch.delenv("KVCOPY_DEBUG", raising=False)
    else:
        monkeypatch.setenv("KVCOPY_DEBUG", value)
    kv, pool = _setup()
    eng = engines(kv, pool)
    assert eng.debug is False
    gate = engines.gate(monkeypatch)
    t1, second = _conflict_pair(eng, gate)
    t2 = second()  # not checked
    gate.open()
    t1.wait()
    t2.wait()


def test_env_var_is_read_at_construction(engines, monkeypatch):
    monkeypatch.delenv("KVCOPY_DEBUG", raising=False)
    kv, pool = _setup()
    eng = engines(kv, pool)
    monkeypatch.setenv("KVCOPY_DEBUG", "1")  # too late for this engine
    assert eng.debug is False
    gate = engines.gate(monkeypatch)
    t1, second = _conflict_pair(eng, gate)
    t2 = second()
    gate.open()
    t1.wait()
    t2.wait()


def test_debug_false_overrides_the_env_var(engines, monkeypatch):
    monkeypatch.setenv("KVCOPY_DEBUG", "1")
    kv, pool = _setup()
    eng = engines(kv, pool, debug=False)
    assert eng.debug is False
    gate = engines.gate(monkeypatch)
    t1, second = _conflict_pair(eng, gate)
    t2 = second()  # no TransferConflictError
    gate.open()
    t1.wait()
    t2.wait()
    # FIFO on the offload worker: the later offload wins the shared host block.
    for hp, dp in zip(pool.paged.planes, kv.planes):
        assert torch.equal(byte_rows(hp)[3], byte_rows(dp)[2])


def test_debug_true_overrides_an_unset_env_var(engines, monkeypatch):
    monkeypatch.delenv("KVCOPY_DEBUG", raising=False)
    kv, pool = _setup()
    eng = engines(kv, pool, debug=True)
    gate = engines.gate(monkeypatch)
    _, second = _conflict_pair(eng, gate)
    with pytest.raises(kvcopy.TransferConflictError):
        second()


# --------------------------------------------------------------------------- threads


def test_conflicts_with_transfers_submitted_from_threads(engines, monkeypatch):
    """Transfers submitted concurrently from 4 threads are all tracked: each later conflict is caught."""
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

    run_threads(worker, num_threads, timeout=30, interleave=True)  # interleave the submissions as much as possible
    missed = []
    for block in range(num_threads * per_thread):
        try:
            eng.reload([block], [block])  # reads a host block an unfinished offload writes
            missed.append(block)
        except kvcopy.TransferConflictError:
            pass
    gate.open()
    assert not missed, f"conflicts not caught for host blocks {missed}: their offloads were not tracked"
