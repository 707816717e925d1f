"""TransferEngine and Transfer on CPU: ordering, round trips, layer-wise reloads, threads, errors, close, leaks.

On CPU the engine runs one worker thread per direction. To hold transfers in
flight deterministically the tests wrap ``kvcopy.dispatch.run`` (what the workers
call for each copy) with a gate (tests/helpers/engines.py).
"""

from __future__ import annotations

import gc
import os
import threading
import time
import tracemalloc

import numpy as np
import pytest
import torch

import kvcopy

from helpers import CPU_METHODS, HANG_TIMEOUT_S
from helpers.copies import (
    assert_same_bytes,
    byte_rows,
    dst_bytes,
    fill_random_,
    make_flashinfer,
    make_layout,
    make_mla,
    make_vllm,
    reference_copy,
    snapshot,
)
from helpers.engines import Engines, run_in_thread, run_threads, writes_into

ENGINE_METHODS = ("auto", *CPU_METHODS)
LAYOUTS = ("vllm", "flashinfer", "mla")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _setup(
    layout="vllm",
    dtype=torch.bfloat16,
    *,
    num_blocks=12,
    host_blocks=10,
    host_layout="page_first",
    num_layers=2,
    seed=0,
):
    """A small random cache and a random pool shaped like it."""
    gen = _gen(seed)
    kv = make_layout(layout, num_blocks, dtype, gen, num_layers=num_layers)
    pool = kvcopy.HostKVPool(kv, host_blocks, layout=host_layout, pin_memory=False)
    fill_random_(pool, gen)
    return kv, pool


def _block(kv, block: int) -> list[torch.Tensor]:
    """The bytes of one block of every plane (clones)."""
    return [byte_rows(p)[block].clone() for p in kv.planes]


# --------------------------------------------------------------------------- construction


def test_engine_rejects_bad_arguments(engines):
    kv, pool = _setup()
    with pytest.raises(TypeError, match="kv"):
        kvcopy.TransferEngine(pool, pool)
    with pytest.raises(TypeError, match="host"):
        kvcopy.TransferEngine(kv, kv)
    other = make_layout("mla", 4, torch.bfloat16, _gen(1))
    with pytest.raises(ValueError):
        kvcopy.TransferEngine(other, pool)
    with pytest.raises(ValueError, match="method"):
        kvcopy.TransferEngine(kv, pool, method="nope")
    with pytest.raises(ValueError, match="method"):
        kvcopy.TransferEngine(kv, pool, method="copy_engine")  # cannot run on CPU: refused up front


def test_engine_defaults(engines, monkeypatch):
    monkeypatch.delenv("KVCOPY_DEBUG", raising=False)
    kv, pool = _setup()
    eng = engines(kv, pool)
    assert eng.kv is kv
    assert eng.host is pool
    assert eng.debug is False
    assert eng.num_in_flight == 0


# --------------------------------------------------------------------------- PagedKV.layer


def test_layer_of_vllm_cache_is_its_k_and_v():
    kv, layers = make_vllm(3, 5, 2, 1, 4, torch.float16, _gen())
    assert kv.num_layers == 3
    for i, t in enumerate(layers):
        layer = kv.layer(i)
        assert isinstance(layer, kvcopy.PagedKV)
        assert layer.num_planes == 2 and layer.num_layers == 1
        for plane, expected in zip(layer.planes, (t[0], t[1]), strict=True):
            assert plane.data_ptr() == expected.data_ptr()
            assert plane.shape == expected.shape and plane.stride() == expected.stride()
        layer.planes[1].fill_(i + 1)
        assert torch.all(t[1] == i + 1)  # views, not copies
    assert kv.layer(1) is kv.layer(1)


def test_layer_of_flashinfer_and_mla_caches():
    fi, fi_layers = make_flashinfer(2, 4, 2, 1, 4, torch.float16, _gen())
    for i, t in enumerate(fi_layers):
        planes = fi.layer(i).planes
        assert [p.data_ptr() for p in planes] == [t[:, 0].data_ptr(), t[:, 1].data_ptr()]
        assert [p.stride() for p in planes] == [t[:, 0].stride(), t[:, 1].stride()]
    mla, mla_layers = make_mla(3, 4, 2, 6, torch.float16, _gen())
    for i, t in enumerate(mla_layers):
        (plane,) = mla.layer(i).planes
        assert plane.data_ptr() == t.data_ptr() and plane.shape == t.shape


def test_layer_of_planes_with_planes_per_layer():
    planes = [torch.full((3, 4), float(p)) for p in range(6)]
    kv = kvcopy.PagedKV.from_planes(planes, planes_per_layer=3)
    assert kv.num_layers == 2
    assert [int(p[0, 0]) for p in kv.layer(1).planes] == [3, 4, 5]


@pytest.mark.parametrize("index", [2, -1, 100])
def test_layer_out_of_range_is_an_index_error(index):
    kv, _ = make_vllm(2, 4, 2, 1, 4, torch.float16, _gen())
    with pytest.raises(IndexError, match="layer"):
        kv.layer(index)


# --------------------------------------------------------------------------- ordering


def test_offload_sees_the_producers_finished_writes(engines):
    kv, pool = _setup()
    eng = engines(kv, pool)
    for value in (11, 22, 33):
        for plane in kv.planes:  # the "producer" writes block 4
            byte_rows(plane)[4].fill_(value)
        t = eng.offload([4], [value % pool.num_blocks])
        t.wait()
        for plane in pool.paged.planes:
            assert torch.all(byte_rows(plane)[value % pool.num_blocks] == value)


@pytest.mark.parametrize("how", ["wait", "wait_stream", "wait_layer"])
def test_consumer_after_wait_sees_reloaded_data(engines, how):
    kv, pool = _setup(num_layers=3)
    eng = engines(kv, pool)
    host_ids, block_ids = [3, 8], [5, 0]
    expected = reference_copy(pool, host_ids, kv, block_ids)
    t = eng.reload(host_ids, block_ids, layerwise=how == "wait_layer")
    if how == "wait":
        t.wait()
    elif how == "wait_stream":
        t.wait_stream()  # on CPU: blocks the caller until done
    else:
        for layer in range(kv.num_layers):
            t.wait_layer(layer)
    # The consumer reads right away: every byte has landed.
    assert_same_bytes(dst_bytes(kv), expected)
    assert t.done()


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("layout", (*LAYOUTS, "planes"))
@pytest.mark.parametrize("method", ENGINE_METHODS)
def test_round_trip_matches_reference(engines, method, layout, host_layout):
    dtype = torch.float8_e4m3fn if layout == "flashinfer" else torch.bfloat16
    kv, pool = _setup(layout, dtype, host_layout=host_layout, seed=3)
    eng = engines(kv, pool, method=method)
    original = snapshot(kv)
    block_ids, host_ids = [7, 0, 3, 3, 11], [1, 4, 0, 9, 6]  # a repeated source block is fine
    expected_host = reference_copy(kv, block_ids, pool, host_ids)
    t = eng.offload(block_ids, host_ids)
    assert isinstance(t, kvcopy.Transfer)
    t.wait()
    assert t.done()
    assert_same_bytes(dst_bytes(pool), expected_host)
    assert_same_bytes(snapshot(kv), original)  # the source is never written

    targets = [2, 5, 8, 10, 1]
    expected_dev = reference_copy(pool, host_ids, kv, targets)
    t = eng.reload(host_ids, targets)
    t.wait()
    assert_same_bytes(dst_bytes(kv), expected_dev)
    for src, dst in zip(block_ids, targets, strict=True):  # bitwise round trip
        for p, plane in enumerate(kv.planes):
            assert torch.equal(byte_rows(plane)[dst], original[p][src])


@pytest.mark.parametrize("kind", ["list", "tuple", "range", "int64", "int32", "numpy64", "numpy32"])
def test_id_forms(engines, kind):
    kv, pool = _setup()
    eng = engines(kv, pool)

    def ids(values):
        if kind == "list":
            return list(values)
        if kind == "tuple":
            return tuple(values)
        if kind == "range":
            return range(values[0], values[-1] + 1)
        if kind.startswith("numpy"):
            return np.array(values, dtype=np.int64 if kind == "numpy64" else np.int32)
        return torch.tensor(values, dtype=torch.int64 if kind == "int64" else torch.int32)

    expected = reference_copy(kv, [2, 3, 4], pool, [5, 6, 7])
    eng.offload(ids([2, 3, 4]), ids([5, 6, 7])).wait()
    assert_same_bytes(dst_bytes(pool), expected)
    expected = reference_copy(pool, [5, 6, 7], kv, [8, 9, 10])
    eng.reload(ids([5, 6, 7]), ids([8, 9, 10])).wait()
    assert_same_bytes(dst_bytes(kv), expected)


def test_empty_transfer(engines):
    kv, pool = _setup()
    eng = engines(kv, pool)
    before_kv, before_pool = snapshot(kv), snapshot(pool)
    for t in (eng.offload([], []), eng.reload([], []), eng.reload([], [], layerwise=True)):
        t.wait()
        assert t.done()
        assert t.num_blocks == 0 and t.nbytes == 0
    assert_same_bytes(snapshot(kv), before_kv)
    assert_same_bytes(snapshot(pool), before_pool)


def test_ids_are_taken_at_submit(engines, monkeypatch):
    """Reusing the id buffers right after offload()/reload() returns does not change what is copied."""
    kv, pool = _setup()
    eng = engines(kv, pool)
    gate = engines.gate(monkeypatch)
    block_ids = torch.tensor([1, 2], dtype=torch.int64)
    host_ids = torch.tensor([3, 4], dtype=torch.int64)
    expected = reference_copy(kv, [1, 2], pool, [3, 4])
    t = eng.offload(block_ids, host_ids)
    block_ids.copy_(torch.tensor([5, 6]))  # the caller reuses its buffers for the next step
    host_ids.copy_(torch.tensor([7, 8]))
    gate.open()
    t.wait()
    assert_same_bytes(dst_bytes(pool), expected)


# --------------------------------------------------------------------------- layer-wise reloads


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("method", ENGINE_METHODS)
def test_layerwise_reload_each_layer_exact_after_wait_layer(engines, method, layout):
    kv, pool = _setup(layout, torch.float16, num_layers=3, seed=5)
    eng = engines(kv, pool, method=method)
    host_ids, block_ids = [9, 0, 4, 4], [1, 2, 11, 6]
    expected = reference_copy(pool, host_ids, kv, block_ids)
    t = eng.reload(host_ids, block_ids, layerwise=True)
    ppl = kv.planes_per_layer
    for layer in range(kv.num_layers):
        t.wait_layer(layer)
        got = [byte_rows(p).clone() for p in kv.layer(layer).planes]
        assert_same_bytes(got, expected[layer * ppl : (layer + 1) * ppl])
    t.wait()
    assert_same_bytes(dst_bytes(kv), expected)
    assert t.num_blocks == 4 and t.nbytes == 4 * kv.nbytes_per_block


def test_layer_signals_arrive_in_order(engines, monkeypatch):
    """Layer l is signalled once its planes have landed, after every earlier layer, before any later one."""
    kv, pool = _setup("vllm", torch.float16, num_layers=3, seed=6)
    eng = engines(kv, pool)
    gate = engines.gate(monkeypatch)
    host_ids, block_ids = [2, 3], [7, 8]
    expected = reference_copy(pool, host_ids, kv, block_ids)
    before = dst_bytes(kv)
    t = eng.reload(host_ids, block_ids, layerwise=True)
    ppl = kv.planes_per_layer
    order: list[int] = []
    order_lock = threading.Lock()

    def waiter(layer: int) -> None:
        t.wait_layer(layer)
        with order_lock:
            order.append(layer)

    waiters = [run_in_thread(waiter, layer) for layer in range(kv.num_layers)]
    for layer in range(kv.num_layers):
        gate.wait_held(1)  # the worker is holding the copy of this layer
        time.sleep(0.02)
        with order_lock:
            assert order == list(range(layer)), f"layer signals before layer {layer} copied: {order}"
        assert not t.done()
        gate.release(1)
        thread, out = waiters[layer]
        thread.join(timeout=HANG_TIMEOUT_S)
        assert not thread.is_alive(), f"wait_layer({layer}) did not return after its layer was copied"
        assert "error" not in out, out.get("error")
        # This layer and all earlier ones are exact; later ones are untouched.
        now = dst_bytes(kv)
        for other in range(kv.num_layers):
            span = slice(other * ppl, (other + 1) * ppl)
            assert_same_bytes(now[span], (expected if other <= layer else before)[span])
    t.wait()
    assert order == list(range(kv.num_layers))
    for thread, _ in waiters:
        thread.join(timeout=HANG_TIMEOUT_S)


def test_wait_layer_errors(engines):
    kv, pool = _setup(num_layers=2)
    eng = engines(kv, pool)
    whole = eng.reload([0], [0])
    with pytest.raises(ValueError):
        whole.wait_layer(0)
    offload = eng.offload([1], [1])
    with pytest.raises(ValueError):
        offload.wait_layer(0)
    layered = eng.reload([2], [2], layerwise=True)
    for bad in (2, -1, 100):
        with pytest.raises(IndexError):
            layered.wait_layer(bad)
    for t in (whole, offload, layered):
        t.wait()


# --------------------------------------------------------------------------- FIFO per direction


def test_each_direction_is_fifo(engines, monkeypatch):
    """Two offloads to the same host block (debug off): the later one lands last."""
    kv, pool = _setup()
    eng = engines(kv, pool)
    gate = engines.gate(monkeypatch)
    first = eng.offload([1], [3])
    gate.wait_held(1)
    second = eng.offload([2], [3])
    time.sleep(0.02)
    assert not first.done() and not second.done()
    assert gate.num_calls == 1  # the second waits behind the first on the one offload worker
    gate.open()
    second.wait()
    assert first.done()
    assert_same_bytes([byte_rows(p)[3] for p in pool.paged.planes], _block(kv, 2))


def test_directions_run_on_separate_workers(engines, monkeypatch):
    """An offload held in flight does not hold up a reload."""
    kv, pool = _setup()
    eng = engines(kv, pool)
    gate = engines.gate(monkeypatch, hold=writes_into(pool))  # holds offloads only
    offload = eng.offload([1], [3])
    gate.wait_held(1)
    expected = reference_copy(pool, [5], kv, [6])
    reload = eng.reload([5], [6])
    reload.wait(timeout=10)
    assert_same_bytes(dst_bytes(kv), expected)
    assert not offload.done()
    gate.open()
    offload.wait()


# --------------------------------------------------------------------------- threads


@pytest.mark.parametrize("debug", [False, True])
def test_many_transfers_in_flight_from_threads(engines, debug):
    """4 threads, each with its own blocks, queue offloads and reloads without waiting, then wait all."""
    num_threads, rounds, n = 4, 6, 3
    per_thread = rounds * 2 * n
    kv, pool = _setup(
        "flashinfer", torch.bfloat16, num_blocks=num_threads * per_thread, host_blocks=num_threads * per_thread, seed=7
    )
    eng = engines(kv, pool, debug=debug)
    dev0, host0 = snapshot(kv)[: kv.num_planes], snapshot(pool)[: kv.num_planes]
    errors: list[BaseException] = []
    start = threading.Barrier(num_threads)
    expected_host = [p.clone() for p in host0]
    expected_dev = [p.clone() for p in dev0]
    plan = []
    for i in range(num_threads):
        for r in range(rounds):
            base = i * per_thread + r * 2 * n
            off = list(range(base, base + n))  # offload device off -> host off
            rel = list(range(base + n, base + 2 * n))  # reload host rel -> device rel[::-1]
            plan.append((i, off, rel))
            for p in range(kv.num_planes):
                expected_host[p][off] = dev0[p][off]
                expected_dev[p][rel[::-1]] = host0[p][rel]

    def worker(index: int) -> None:
        try:
            start.wait()
            transfers = []
            for i, off, rel in plan:
                if i == index:
                    transfers.append(eng.offload(off, off))
                    transfers.append(eng.reload(rel, rel[::-1]))
            for t in transfers:
                t.wait(timeout=30)
        except BaseException as err:
            errors.append(err)

    run_threads(worker, num_threads)
    assert not errors, errors[0]
    assert_same_bytes(dst_bytes(pool), expected_host)
    assert_same_bytes(dst_bytes(kv), expected_dev)
    assert eng.num_in_flight == 0


def test_num_in_flight_counts_transfers_from_threads(engines, monkeypatch):
    """Transfers submitted concurrently from 4 threads are all counted while held in flight."""
    kv, pool = _setup(num_blocks=64, host_blocks=64)
    eng = engines(kv, pool)
    gate = engines.gate(monkeypatch)
    num_threads, per_thread = 4, 150
    start = threading.Barrier(num_threads)
    transfers: list[kvcopy.Transfer] = []
    lock = threading.Lock()

    def worker(index: int) -> None:
        start.wait()
        mine = []
        for j in range(per_thread):
            block = (index * per_thread + j) % 64
            mine.append(eng.offload([block], [block]) if j % 2 else eng.reload([block], [block]))
        with lock:
            transfers.extend(mine)

    run_threads(
        worker, num_threads, timeout=HANG_TIMEOUT_S, interleave=True
    )  # interleave the submissions as much as possible
    assert len(transfers) == num_threads * per_thread
    assert not any(t.done() for t in transfers)
    # Fails when concurrent submissions drop each other's entry from the in-flight list (a lost update).
    assert eng.num_in_flight == num_threads * per_thread
    gate.open()
    eng.close()
    assert all(t.done() for t in transfers)
    assert eng.num_in_flight == 0


# --------------------------------------------------------------------------- errors


def test_worker_error_surfaces_at_wait(engines, monkeypatch):
    kv, pool = _setup()
    eng = engines(kv, pool)
    gate = engines.gate(monkeypatch, hold=lambda src, dst: False)
    marked = {"fail": True}

    def fail(src, dst):
        if marked["fail"]:
            marked["fail"] = False
            return RuntimeError("boom from the copy")
        return None

    gate.fail = fail
    before = dst_bytes(pool)
    t = eng.offload([1, 2], [3, 4])
    with pytest.raises(RuntimeError, match="boom from the copy"):
        t.wait()
    assert t.done()
    with pytest.raises(RuntimeError, match="boom"):
        t.wait()  # every wait re-raises
    with pytest.raises(RuntimeError, match="boom"):
        t.wait_stream()
    assert_same_bytes(dst_bytes(pool), before)
    # The engine keeps working.
    expected = reference_copy(kv, [1, 2], pool, [3, 4])
    t2 = eng.offload([1, 2], [3, 4])
    t2.wait()
    assert_same_bytes(dst_bytes(pool), expected)
    expected = reference_copy(pool, [3], kv, [0])
    eng.reload([3], [0]).wait()
    assert_same_bytes(dst_bytes(kv), expected)
    assert eng.num_in_flight == 0


def test_layerwise_worker_error_surfaces(engines, monkeypatch):
    kv, pool = _setup(num_layers=3)
    eng = engines(kv, pool)
    gate = engines.gate(monkeypatch, hold=lambda src, dst: False)
    gate.fail = lambda src, dst: ValueError("layer copy failed") if gate.num_calls == 2 else None
    t = eng.reload([1], [2], layerwise=True)
    t.wait_layer(0)  # the first layer arrived
    with pytest.raises(ValueError, match="layer copy failed"):
        t.wait_layer(1)
    with pytest.raises(ValueError, match="layer copy failed"):
        t.wait_layer(2)  # never copied: it reports the failure rather than hang
    with pytest.raises(ValueError, match="layer copy failed"):
        t.wait()
    assert t.done()
    gate.fail = None
    eng.reload([1], [2], layerwise=True).wait()  # the engine keeps working


def test_wait_timeout(engines, monkeypatch):
    kv, pool = _setup()
    eng = engines(kv, pool)
    gate = engines.gate(monkeypatch)
    t = eng.offload([0], [0])
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        t.wait(timeout=0.05)
    assert time.monotonic() - started >= 0.04
    assert not t.done()
    assert t.elapsed is None
    gate.open()
    t.wait(timeout=10)
    assert t.done()


# --------------------------------------------------------------------------- close


def test_close_waits_for_transfers_in_flight(engines, monkeypatch):
    kv, pool = _setup()
    eng = engines(kv, pool)
    gate = engines.gate(monkeypatch)
    expected_host = reference_copy(kv, [0, 1, 2], pool, [0, 1, 2])
    transfers = [eng.offload([i], [i]) for i in range(3)]
    expected_dev = reference_copy(pool, [5, 6], kv, [8, 9])
    transfers += [eng.reload([5], [8]), eng.reload([6], [9], layerwise=True)]
    closer, out = run_in_thread(eng.close)
    closer.join(timeout=0.1)
    assert closer.is_alive(), "close() returned with transfers in flight"
    gate.open()
    closer.join(timeout=HANG_TIMEOUT_S)
    assert not closer.is_alive() and "error" not in out
    assert all(t.done() for t in transfers)
    assert_same_bytes(dst_bytes(pool), expected_host)
    assert_same_bytes(dst_bytes(kv), expected_dev)
    assert eng.num_in_flight == 0


def test_close_keeps_transfer_errors_with_their_handles(engines, monkeypatch):
    kv, pool = _setup()
    eng = engines(kv, pool)
    gate = engines.gate(monkeypatch, hold=lambda src, dst: False)
    gate.fail = lambda src, dst: RuntimeError("broken copy")
    t = eng.offload([0], [0])
    eng.close()  # does not raise
    assert t.done()
    with pytest.raises(RuntimeError, match="broken copy"):
        t.wait()


def test_engine_after_close_raises(engines):
    kv, pool = _setup()
    eng = engines(kv, pool)
    eng.offload([0], [0]).wait()
    eng.close()
    eng.close()  # twice is fine
    before_kv, before_pool = snapshot(kv), snapshot(pool)
    with pytest.raises(RuntimeError):
        eng.offload([1], [1])
    with pytest.raises(RuntimeError):
        eng.reload([1], [1])
    with pytest.raises(RuntimeError):
        eng.reload([1], [1], layerwise=True)
    assert_same_bytes(snapshot(kv), before_kv)
    assert_same_bytes(snapshot(pool), before_pool)


def test_context_manager(monkeypatch):
    kv, pool = _setup()
    made = Engines()
    gate = made.gate(monkeypatch)
    expected = reference_copy(kv, [3], pool, [4])
    with kvcopy.TransferEngine(kv, pool) as eng:
        assert isinstance(eng, kvcopy.TransferEngine)
        t = eng.offload([3], [4])
        threading.Timer(0.05, gate.open).start()
    assert t.done()  # leaving the block waited for it
    assert_same_bytes(dst_bytes(pool), expected)
    with pytest.raises(RuntimeError):
        eng.offload([3], [4])


def test_context_manager_closes_on_error():
    kv, pool = _setup()
    with pytest.raises(KeyError), kvcopy.TransferEngine(kv, pool) as eng:
        t = eng.offload([3], [4])
        raise KeyError("caller error")
    assert t.done()
    with pytest.raises(RuntimeError):
        eng.reload([4], [3])


# --------------------------------------------------------------------------- bad ids


BAD_OFFLOADS = [
    # (block_ids, host_ids, error, argument named)
    pytest.param([0, 12], [0, 1], IndexError, "block_ids", id="device-id-out-of-range"),
    pytest.param([-1], [0], IndexError, "block_ids", id="device-id-negative"),
    pytest.param([0], [10], IndexError, "host_ids", id="host-id-out-of-range"),
    pytest.param([0, 1], [-3, 1], IndexError, "host_ids", id="host-id-negative"),
    pytest.param([0, 1], [2, 2], ValueError, "host_ids", id="repeated-destination"),
    pytest.param([0, 1], [2], ValueError, "host_ids", id="length-mismatch"),
    pytest.param(torch.tensor([0.0]), [1], TypeError, "block_ids", id="float-tensor"),
    pytest.param([0.5], [1], TypeError, "block_ids", id="float-in-list"),
    pytest.param([0], np.array([1.0]), TypeError, "host_ids", id="float-numpy"),
    pytest.param([0], "1", TypeError, "host_ids", id="string"),
    pytest.param(None, [1], TypeError, "block_ids", id="none"),
    pytest.param(torch.zeros(1, 2, dtype=torch.int64), [1, 2], ValueError, "block_ids", id="2-d"),
    pytest.param([[0, 1]], [1, 2], ValueError, "block_ids", id="nested-list"),
]

BAD_RELOADS = [
    # (host_ids, block_ids, error, argument named)
    pytest.param([0, 10], [0, 1], IndexError, "host_ids", id="host-id-out-of-range"),
    pytest.param([0], [12], IndexError, "block_ids", id="device-id-out-of-range"),
    pytest.param([0, 1], [5, 5], ValueError, "block_ids", id="repeated-destination"),
    pytest.param([0], [1, 2], ValueError, "block_ids", id="length-mismatch"),
    pytest.param([0], torch.tensor([1], dtype=torch.int16), TypeError, "block_ids", id="int16"),
    pytest.param(torch.zeros(2, 1, dtype=torch.int64), [1, 2], ValueError, "host_ids", id="2-d"),
]


@pytest.mark.parametrize(("block_ids", "host_ids", "error", "name"), BAD_OFFLOADS)
def test_bad_offload_ids_raise_at_submit(engines, monkeypatch, block_ids, host_ids, error, name):
    kv, pool = _setup()
    eng = engines(kv, pool)
    gate = engines.gate(monkeypatch)
    before = snapshot(pool)
    with pytest.raises(error, match=name):
        eng.offload(block_ids, host_ids)
    assert eng.num_in_flight == 0
    gate.open()
    eng.close()
    assert gate.num_calls == 0, "a refused transfer was queued"
    assert_same_bytes(snapshot(pool), before)


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize(("host_ids", "block_ids", "error", "name"), BAD_RELOADS)
def test_bad_reload_ids_raise_at_submit(engines, monkeypatch, host_ids, block_ids, error, name, layerwise):
    kv, pool = _setup()
    eng = engines(kv, pool)
    gate = engines.gate(monkeypatch)
    before = snapshot(kv)
    with pytest.raises(error, match=name):
        eng.reload(host_ids, block_ids, layerwise=layerwise)
    assert eng.num_in_flight == 0
    gate.open()
    eng.close()
    assert gate.num_calls == 0, "a refused transfer was queued"
    assert_same_bytes(snapshot(kv), before)


def test_repeated_source_ids_are_allowed(engines):
    kv, pool = _setup()
    eng = engines(kv, pool)
    expected = reference_copy(kv, [4, 4, 4], pool, [0, 1, 2])
    eng.offload([4, 4, 4], [0, 1, 2]).wait()
    assert_same_bytes(dst_bytes(pool), expected)
    expected = reference_copy(pool, [1, 1], kv, [9, 10])
    eng.reload([1, 1], [9, 10]).wait()
    assert_same_bytes(dst_bytes(kv), expected)


# --------------------------------------------------------------------------- handle attributes


def test_nbytes_num_blocks_and_elapsed(engines, monkeypatch):
    kv, pool = _setup()
    eng = engines(kv, pool)
    gate = engines.gate(monkeypatch)
    t = eng.offload([0, 1, 2], [3, 4, 5])
    r = eng.reload([6], [7], layerwise=True)
    assert t.num_blocks == 3 and t.nbytes == 3 * kv.nbytes_per_block
    assert r.num_blocks == 1 and r.nbytes == kv.nbytes_per_block
    assert t.elapsed is None and r.elapsed is None  # not done yet
    assert not t.done() and not r.done()
    assert eng.num_in_flight == 2
    time.sleep(0.02)
    gate.open()
    t.wait()
    r.wait()
    for x in (t, r):
        assert isinstance(x.elapsed, float)
        assert 0 <= x.elapsed < 10
    assert t.elapsed >= 0.01  # the copy was held at the gate after it started
    assert eng.num_in_flight == 0
    assert "offload" in repr(t)


# --------------------------------------------------------------------------- no growth over many cycles


@pytest.mark.slow
def test_10000_cycles_do_not_grow():
    """10,000 offload/reload cycles, each waited: no transfers, memory, threads or fds pile up."""
    kv = kvcopy.PagedKV.from_mla([torch.zeros(4, 1, 4, dtype=torch.float16)])
    pool = kvcopy.HostKVPool(kv, 4, pin_memory=False)
    kv.planes[0][0].fill_(1.5)
    block0, host1, block2 = [0], [1], [2]

    with kvcopy.TransferEngine(kv, pool) as eng:

        def cycles(n: int) -> None:
            for _ in range(n):
                eng.offload(block0, host1).wait()
                eng.reload(host1, block2).wait()
                assert eng.num_in_flight == 0

        cycles(100)  # workers started, caches warm
        gc.collect()
        tracemalloc.start()
        try:
            cycles(1_000)
            gc.collect()
            warm, _ = tracemalloc.get_traced_memory()
            threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
            cycles(8_900)
            gc.collect()
            after, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert after - warm < 256 * 1024, f"traced memory grew by {after - warm} bytes over 8,900 cycles"
        assert threading.active_count() == threads
        assert len(os.listdir("/proc/self/fd")) == fds
        assert eng.num_in_flight == 0
    assert torch.all(kv.planes[0][2] == 1.5)
