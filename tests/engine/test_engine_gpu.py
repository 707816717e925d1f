"""TransferEngine on CUDA: round trips per method, stream ordering, overlap, layer-wise reloads, threads,
bounded resources, CUDA graph capture, debug mode.

Every test here needs a CUDA GPU and is skipped without one. Sleeps queued
with ``torch.cuda._sleep`` stand in for long compute kernels: work queued
behind them cannot have run while the host checks.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import tracemalloc

import pytest
import torch

import kvcopy

from helpers import HANG_TIMEOUT_S, gpu, requires_gpu
from helpers.copies import assert_same_bytes, byte_rows, dst_bytes, fill_random_, make_layout, reference_copy, snapshot
from helpers.engines import run_threads

pytestmark = [gpu, requires_gpu]

# What a CUDA engine runs. Not "torch", whose copy to the device blocks the submitting thread: a CUDA engine
# refuses it (test_a_cuda_engine_refuses_the_host_blocking_torch_method).
ENGINE_METHODS = ("cuda", "copy_engine", "triton", "auto")
CAPTURE_METHODS = ("auto", "cuda", "triton")
LAYOUT_DTYPES = [("vllm", torch.bfloat16), ("flashinfer", torch.float8_e4m3fn), ("mla", torch.float16)]
# ~100 ms of GPU time at ~2 GHz: far longer than the host work between queueing it and the checks.
SLEEP_CYCLES = int(0.1 * 2e9)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class Resources:
    """Makes caches, pinned pools and engines; closes engines, then pools, at teardown."""

    def __init__(self) -> None:
        self.engines: list[kvcopy.TransferEngine] = []
        self.pools: list[kvcopy.HostKVPool] = []

    def setup(
        self,
        layout="vllm",
        dtype=torch.bfloat16,
        *,
        num_blocks=16,
        host_blocks=12,
        num_layers=2,
        seed=0,
        host_layout="page_first",
        **sizes,
    ):
        gen = _gen(seed)
        kv = make_layout(layout, num_blocks, dtype, gen, device="cuda", num_layers=num_layers, **sizes)
        pool = self.pool(kv, host_blocks, layout=host_layout)
        fill_random_(pool, gen)
        torch.cuda.synchronize()
        return kv, pool

    def pool(self, kv, host_blocks, **kw) -> kvcopy.HostKVPool:
        pool = kvcopy.HostKVPool(kv, host_blocks, pin_memory=True, **kw)
        self.pools.append(pool)
        return pool

    def engine(self, kv, pool, **kw) -> kvcopy.TransferEngine:
        eng = kvcopy.TransferEngine(kv, pool, **kw)
        self.engines.append(eng)
        return eng

    def close(self) -> None:
        torch.cuda.synchronize()
        for eng in self.engines:
            eng.close()
        torch.cuda.synchronize()
        for pool in self.pools:
            pool.close()


@pytest.fixture
def res():
    made = Resources()
    yield made
    made.close()


def _zero_vllm(num_layers, num_blocks, block_size, heads, head_dim, dtype=torch.bfloat16):
    """A vLLM cache of zeros on the GPU (the PagedKV and the per-layer tensors)."""
    layers = [
        torch.zeros(2, num_blocks, block_size, heads, head_dim, dtype=dtype, device="cuda") for _ in range(num_layers)
    ]
    return kvcopy.PagedKV.from_vllm(layers), layers


def _fill_randn_(pool: kvcopy.HostKVPool, gen: torch.Generator) -> None:
    """Finite random values in every host plane (attention on random bytes would meet NaNs)."""
    for plane in pool.paged.planes:
        plane.copy_(torch.randn(plane.shape, generator=gen).to(plane.dtype))


def _warm_up_producer(kv: kvcopy.PagedKV) -> None:
    """Launches once the kernels a test's producer queues behind a sleep: the sleep, and a fill of every
    plane's bytes. CUDA loads a kernel at its first launch (lazy loading, the default since CUDA 12.2), and a
    load may wait for the work already on the device: a first fill queued behind the sleep could hold the host
    until the sleep had ended, and the transfer after it would be done when the test asks (the likely cause of
    the one parametrization that failed so on an H200, 2026-12-04: the first to fill bytes after a sleep)."""
    torch.cuda._sleep(1)
    for plane in kv.planes:
        byte_rows(plane).fill_(0)


def _attention(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor) -> torch.Tensor:
    """A stand-in for paged attention over some blocks: [n, block_size, heads, d] K and V -> [q_len, d]."""
    d = k_blocks.shape[-1]
    k = k_blocks.float().reshape(-1, d)
    v = v_blocks.float().reshape(-1, d)
    return torch.softmax(q @ k.T / d**0.5, dim=-1) @ v


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(("layout", "dtype"), LAYOUT_DTYPES, ids=[name for name, _ in LAYOUT_DTYPES])
@pytest.mark.parametrize("method", ENGINE_METHODS)
def test_round_trip_per_method(res, method, layout, dtype):
    kv, pool = res.setup(layout, dtype, seed=1)
    assert pool.pinned
    eng = res.engine(kv, pool, method=method)
    original = snapshot(kv)
    block_ids, host_ids = [7, 0, 3, 3, 15], [1, 4, 0, 9, 11]
    expected_host = reference_copy(kv, block_ids, pool, host_ids)
    t = eng.offload(block_ids, host_ids)
    t.wait()
    assert t.done()
    assert t.num_blocks == 5 and t.nbytes == 5 * kv.nbytes_per_block
    assert isinstance(t.elapsed, float) and t.elapsed >= 0
    assert_same_bytes(dst_bytes(pool), expected_host)
    assert_same_bytes(snapshot(kv), original)

    targets = [2, 5, 8, 10, 1]
    expected_dev = reference_copy(pool, host_ids, kv, targets)
    t = eng.reload(host_ids, targets)
    t.wait_stream()  # no host wait: dst_bytes reads on the current stream, after the transfer
    assert_same_bytes(dst_bytes(kv), expected_dev)
    for src, dst in zip(block_ids, targets, strict=True):
        for p, plane in enumerate(kv.planes):
            assert torch.equal(byte_rows(plane)[dst].cpu(), original[p][src])


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("method", ENGINE_METHODS)
def test_layer_first_pool_round_trip(res, method, host_layout):
    kv, pool = res.setup("flashinfer", torch.bfloat16, seed=2, host_layout=host_layout)
    eng = res.engine(kv, pool, method=method)
    expected = reference_copy(kv, [1, 2, 3], pool, [9, 8, 7])
    eng.offload([1, 2, 3], [9, 8, 7]).wait()
    assert_same_bytes(dst_bytes(pool), expected)
    expected = reference_copy(pool, [9, 8, 7], kv, [13, 14, 15])
    eng.reload([9, 8, 7], [13, 14, 15], layerwise=True).wait()
    assert_same_bytes(dst_bytes(kv), expected)


@pytest.mark.parametrize("method", ["auto", "cuda", "triton"])
def test_device_resident_ids(res, method):
    kv, pool = res.setup(seed=3)
    eng = res.engine(kv, pool, method=method)
    b = torch.tensor([4, 5, 6], device="cuda")
    h = torch.tensor([0, 10, 2], dtype=torch.int32, device="cuda")
    expected = reference_copy(kv, [4, 5, 6], pool, [0, 10, 2])
    eng.offload(b, h).wait()
    assert_same_bytes(dst_bytes(pool), expected)
    expected = reference_copy(pool, [0, 10, 2], kv, [11, 12, 13])
    eng.reload(h, torch.tensor([11, 12, 13], device="cuda")).wait()
    assert_same_bytes(dst_bytes(kv), expected)


def test_copy_engine_refuses_device_ids(res):
    kv, pool = res.setup(seed=4)
    eng = res.engine(kv, pool, method="copy_engine")
    before = snapshot(kv)
    with pytest.raises(ValueError, match="copy_engine"):
        eng.reload(torch.tensor([0], device="cuda"), torch.tensor([1], device="cuda"))
    assert eng.num_in_flight == 0
    torch.cuda.synchronize()
    assert_same_bytes(snapshot(kv), before)


def test_a_cuda_engine_refuses_the_host_blocking_torch_method(res):
    """A CUDA engine never runs "torch", whose copy to the device waits for the caller's queued work: asked
    for, it is a ValueError naming the method; "auto" runs another method; and where only "torch" could copy
    (an unpinned pool), "auto" is a ValueError too. Nothing is written by a refused engine."""
    kv, pool = res.setup(seed=27)
    before = snapshot(pool)
    with pytest.raises(ValueError, match=r"method: 'torch' cannot run in a CUDA TransferEngine: .*blocks"):
        kvcopy.TransferEngine(kv, pool, method="torch")
    unpinned = kvcopy.HostKVPool(kv, 4, pin_memory=False)
    assert kvcopy.available_methods(kv, unpinned) == ["torch"]
    with pytest.raises(ValueError, match=r"method: 'auto' found no copy method for a CUDA TransferEngine but"):
        kvcopy.TransferEngine(kv, unpinned)
    torch.cuda.synchronize()
    assert_same_bytes(snapshot(pool), before)
    eng = res.engine(kv, pool)  # "auto"
    expected = reference_copy(kv, [1, 2], pool, [3, 4])
    t = eng.offload([1, 2], [3, 4])
    t.wait()
    assert t.method in ENGINE_METHODS
    assert_same_bytes(dst_bytes(pool), expected)


def test_pinned_pool_defaults_on_a_gpu(res):
    kv, _ = res.setup(seed=5)
    pool = kvcopy.HostKVPool(kv, 7)  # pin_memory=None pins when CUDA is available
    res.pools.append(pool)
    assert pool.pinned and pool.paged.is_pinned
    assert pool.buffer.numel() == 7 * kv.nbytes_per_block
    assert pool.alloc_seconds >= 0
    assert pool.numa_node == kvcopy.host.memory.gpu_numa_node(kv.device)
    pool.close()
    assert not pool.pinned


def test_pinned_pools_dropped_without_close_do_not_break_new_ones(res):
    """A pinned pool garbage-collected without close(): new pools (often mapped at the same address) still pin."""
    kv, _ = res.setup(seed=24)
    addresses = []
    for _ in range(4):
        pool = kvcopy.HostKVPool(kv, 4096, pin_memory=True)
        assert pool.pinned
        addresses.append(pool.buffer.data_ptr())
        fill_random_(pool, _gen(240))
        kvcopy.scatter(pool, [0, 1], kv, [2, 3], method="cuda")
        torch.cuda.synchronize()
        del pool
        gc.collect()
    kept = kvcopy.HostKVPool(kv, 4096, pin_memory=True)
    res.pools.append(kept)
    assert kept.pinned


# --------------------------------------------------------------------------- ordering with the caller's stream


@pytest.mark.parametrize("method", ENGINE_METHODS)
def test_observer_gets_each_cuda_transfer_once_with_its_timings(res, method):
    """The observer on CUDA: called by whoever first finds a transfer done, once, with event timings."""
    kv, pool = res.setup(seed=11)
    seen: list[kvcopy.Transfer] = []
    eng = res.engine(kv, pool, method=method, observer=seen.append)
    block_ids, host_ids = [3, 9, 12], [0, 5, 11]
    expected = reference_copy(kv, block_ids, pool, host_ids)
    out = eng.offload(block_ids, host_ids)
    out.wait()
    assert_same_bytes(dst_bytes(pool), expected)
    back = eng.reload(host_ids, [1, 2, 4])
    deadline = time.monotonic() + 60  # against a hang only
    while not back.done():  # found done by done(), not wait()
        assert time.monotonic() < deadline, "the reload never read as done"
        time.sleep(1e-3)
    out.done(), back.wait(), back.done()  # seen done again: not reported again
    assert seen == [out, back]
    assert [(t.profile_direction, t.method) for t in seen] == [("d2h", out.method), ("h2d", back.method)]
    assert all(t.method for t in seen)
    for t in seen:
        assert t.turnaround >= t.elapsed >= 0 and t.queued >= 0
        assert t.turnaround == pytest.approx(t.queued + t.elapsed, abs=1e-5)


@pytest.mark.parametrize("method", ENGINE_METHODS)
def test_offload_reads_after_the_producer_on_the_current_stream(res, method):
    kv, pool = res.setup(seed=6)
    eng = res.engine(kv, pool, method=method)
    block_ids, host_ids = [3, 9, 12], [0, 5, 11]
    eng.offload(block_ids, host_ids).wait()  # warm-up: compiles, caches, staging buffers
    _warm_up_producer(kv)
    torch.cuda.synchronize()
    for value in (0x5A, 0xA5):
        torch.cuda._sleep(SLEEP_CYCLES)  # a slow producer...
        for plane in kv.planes:
            byte_rows(plane).fill_(value)  # ...that then writes every block, on the current stream
        t = eng.offload(block_ids, host_ids)  # right away, no synchronisation
        assert not t.done(), "the offload finished before the producer it must wait for"
        t.wait()
        for plane in pool.paged.planes:
            rows = byte_rows(plane)[host_ids]
            assert torch.all(rows == value), f"the offload read the blocks before the producer wrote {value:#x}"


@pytest.mark.parametrize("method", ENGINE_METHODS)
def test_reload_writes_after_readers_of_the_old_contents(res, method):
    kv, pool = res.setup(seed=7)
    eng = res.engine(kv, pool, method=method)
    host_ids, block_ids = [2, 7, 8], [4, 11, 0]
    ids = torch.tensor(block_ids, device="cuda")
    eng.reload(host_ids, block_ids).wait()  # warm-up
    fill_random_(kv, _gen(70))
    torch.cuda.synchronize()
    old = [byte_rows(p).index_select(0, ids).cpu() for p in kv.planes]
    expected = reference_copy(pool, host_ids, kv, block_ids)
    torch.cuda._sleep(SLEEP_CYCLES)
    readers = [byte_rows(p).index_select(0, ids) for p in kv.planes]  # the consumer, queued behind the sleep
    t = eng.reload(host_ids, block_ids)
    assert not t.done()
    t.wait_stream()
    after = [byte_rows(p).clone() for p in kv.planes]  # on the current stream, after wait_stream
    torch.cuda.current_stream().synchronize()
    for p, (r, o) in enumerate(zip(readers, old, strict=True)):
        assert torch.equal(r.cpu(), o), f"plane {p}: the reload overwrote blocks before their reader ran"
    assert_same_bytes([a.cpu() for a in after], expected)


@pytest.mark.parametrize("direction", ["offload", "reload"])
@pytest.mark.parametrize("method", ENGINE_METHODS)
def test_copies_run_on_their_own_streams(res, method, direction):
    kv, pool = res.setup(seed=8)
    eng = res.engine(kv, pool, method=method)

    def submit():
        return eng.offload([1, 2], [3, 4]) if direction == "offload" else eng.reload([5, 6], [7, 8])

    submit().wait()  # warm-up
    torch.cuda.synchronize()
    # Behind the caller's queued work: returns at once, done only once that work is.
    torch.cuda._sleep(SLEEP_CYCLES)
    started = time.perf_counter()
    t = submit()
    assert time.perf_counter() - started < 0.05, "submission blocked the host"
    assert not t.done()
    assert not torch.cuda.current_stream().query()
    t.wait()
    assert t.done()
    torch.cuda.synchronize()
    # Work the caller queues after the transfer does not hold it up: the copy overlaps it.
    t = submit()
    torch.cuda._sleep(SLEEP_CYCLES)
    t.wait(timeout=5)
    assert not torch.cuda.current_stream().query(), "the copy waited for later work: it ran on the caller's stream"
    torch.cuda.synchronize()


@pytest.mark.parametrize("method", ENGINE_METHODS)
def test_offload_and_reload_streams_are_independent(res, method):
    kv, pool = res.setup(seed=9)
    eng = res.engine(kv, pool, method=method)
    eng.offload([1], [2]).wait()
    eng.reload([5], [6]).wait()
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        off = eng.offload([1], [2])  # waits behind the sleep on `side`
    expected = reference_copy(pool, [5], kv, [6])
    rel = eng.reload([5], [6])  # from the idle current stream
    rel.wait(timeout=5)
    assert not off.done(), "the reload waited for the offload: both directions share one stream"
    assert_same_bytes(dst_bytes(kv), expected)
    off.wait()


@pytest.mark.parametrize("method", ENGINE_METHODS)
def test_host_ids_are_taken_at_submit(res, method):
    """Reusing the host id buffers right after offload() returns does not change what is copied."""
    kv, pool = res.setup(seed=23)
    eng = res.engine(kv, pool, method=method)
    block_ids = torch.tensor([1, 2], dtype=torch.int64)
    host_ids = torch.tensor([3, 4], dtype=torch.int64)
    eng.offload(block_ids, host_ids).wait()  # warm-up
    fill_random_(kv, _gen(230))
    torch.cuda.synchronize()
    expected = reference_copy(kv, [1, 2], pool, [3, 4])
    torch.cuda._sleep(SLEEP_CYCLES)
    t = eng.offload(block_ids, host_ids)
    block_ids.copy_(torch.tensor([5, 6]))  # the caller reuses its buffers for the next step
    host_ids.copy_(torch.tensor([7, 8]))
    assert not t.done()
    t.wait()
    assert_same_bytes(dst_bytes(pool), expected)


def test_wait_timeout_and_elapsed(res):
    kv, pool = res.setup(seed=10)
    eng = res.engine(kv, pool)
    eng.offload([0], [0]).wait()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t = eng.offload([1, 2], [3, 4])
    assert t.elapsed is None
    with pytest.raises(TimeoutError):
        t.wait(timeout=0.01)
    assert not t.done()
    t.wait()
    assert isinstance(t.elapsed, float)
    assert 0 <= t.elapsed < SLEEP_CYCLES / 2e9, "elapsed counts the wait for the caller's work"


# --------------------------------------------------------------------------- layer-wise reloads


@pytest.mark.parametrize("consumer_stream", ["current", "side"])
@pytest.mark.parametrize("method", ENGINE_METHODS)
def test_layerwise_reload_with_attention_per_layer(res, method, consumer_stream):
    num_layers, head_dim = 4, 64
    gen = _gen(11)
    kv, layers = _zero_vllm(num_layers, 16, 16, 2, head_dim)
    pool = res.pool(kv, 8)
    _fill_randn_(pool, gen)
    eng = res.engine(kv, pool, method=method)
    host_ids, block_ids = [5, 1, 6], [9, 2, 14]
    ids = torch.tensor(block_ids, device="cuda")
    q = torch.randn(4, head_dim, generator=gen).cuda()
    h = torch.tensor(host_ids)
    expected = [
        _attention(q, pool.paged.planes[2 * layer][h].cuda(), pool.paged.planes[2 * layer + 1][h].cuda())
        for layer in range(num_layers)
    ]
    expected_bytes = reference_copy(pool, host_ids, kv, block_ids)
    eng.reload(host_ids, block_ids, layerwise=True).wait()  # warm-up
    for t in layers:
        t.zero_()  # old contents: attention over them gives zeros, far from `expected`
    torch.cuda.synchronize()

    torch.cuda._sleep(SLEEP_CYCLES)  # the copy starts only after this
    t = eng.reload(host_ids, block_ids, layerwise=True)
    # A fresh side stream has no tie to the sleep: only wait_layer keeps its consumers after the copy.
    stream = torch.cuda.current_stream() if consumer_stream == "current" else torch.cuda.Stream()
    outs = []
    with torch.cuda.stream(stream):
        for layer in range(num_layers):
            t.wait_layer(layer, None if consumer_stream == "current" else stream)
            outs.append(_attention(q, layers[layer][0].index_select(0, ids), layers[layer][1].index_select(0, ids)))
    stream.synchronize()
    for layer, (out, exp) in enumerate(zip(outs, expected, strict=True)):
        torch.testing.assert_close(out, exp, rtol=1e-5, atol=1e-5, msg=lambda m, layer=layer: f"layer {layer}: {m}")
    t.wait()
    assert_same_bytes(dst_bytes(kv), expected_bytes)


def test_wait_layer_errors_on_gpu(res):
    kv, pool = res.setup(seed=12)
    eng = res.engine(kv, pool)
    whole = eng.reload([0], [0])
    with pytest.raises(ValueError):
        whole.wait_layer(0)
    with pytest.raises(ValueError):
        eng.offload([1], [1]).wait_layer(0)
    layered = eng.reload([2], [2], layerwise=True)
    for bad in (kv.num_layers, -1):
        with pytest.raises(IndexError):
            layered.wait_layer(bad)
    layered.wait()
    whole.wait()


# --------------------------------------------------------------------------- threads, close


@pytest.mark.parametrize("method", ENGINE_METHODS)
def test_many_transfers_in_flight_from_threads(res, method):
    num_threads, rounds, n = 4, 8, 3
    per_thread = rounds * 2 * n
    kv, pool = res.setup(
        "flashinfer", torch.bfloat16, num_blocks=num_threads * per_thread, host_blocks=num_threads * per_thread, seed=13
    )
    eng = res.engine(kv, pool, method=method)
    eng.offload([0], [0]).wait()  # warm-up
    fill_random_(kv, _gen(130))
    torch.cuda.synchronize()
    dev0, host0 = dst_bytes(kv), dst_bytes(pool)
    expected_host = [p.clone() for p in host0]
    expected_dev = [p.clone() for p in dev0]
    plan = []
    for i in range(num_threads):
        for r in range(rounds):
            base = i * per_thread + r * 2 * n
            off, rel = list(range(base, base + n)), list(range(base + n, base + 2 * n))
            plan.append((i, off, rel))
            for p in range(kv.num_planes):
                expected_host[p][off] = dev0[p][off]
                expected_dev[p][rel[::-1]] = host0[p][rel]
    errors: list[BaseException] = []
    start = threading.Barrier(num_threads)

    def worker(index: int) -> None:
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
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
    assert not errors, repr(errors[0])
    assert_same_bytes(dst_bytes(pool), expected_host)
    assert_same_bytes(dst_bytes(kv), expected_dev)
    assert eng.num_in_flight == 0


def test_close_waits_for_transfers_from_threads(res):
    """Transfers queued from 4 threads behind a long sleep: close() returns only when all are done."""
    kv, pool = res.setup(num_blocks=64, host_blocks=64, seed=14)
    eng = kvcopy.TransferEngine(kv, pool)
    eng.offload([0], [0]).wait()
    eng.reload([0], [0]).wait()
    torch.cuda.synchronize()
    num_threads, per_thread = 4, 32
    transfers: list[kvcopy.Transfer] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    torch.cuda._sleep(10 * SLEEP_CYCLES)  # the legacy default stream: every thread's transfers wait behind it
    start = threading.Barrier(num_threads)

    def worker(index: int) -> None:
        start.wait()
        mine = []
        try:
            for j in range(per_thread):
                block = (index * per_thread + j) % 64
                mine.append(eng.offload([block], [block]) if j % 2 else eng.reload([block], [block]))
        except BaseException as err:
            errors.append(err)
        with lock:
            transfers.extend(mine)

    run_threads(worker, num_threads, timeout=HANG_TIMEOUT_S, interleave=True)
    assert not errors, repr(errors[0])  # e.g. a race in the engine's shared state
    assert len(transfers) == num_threads * per_thread
    counted = eng.num_in_flight
    assert not torch.cuda.current_stream().query(), "the sleep ended before the count: make it longer"
    assert counted == num_threads * per_thread, "transfers submitted from threads went untracked"
    eng.close()
    assert all(t.done() for t in transfers), "close() returned before every transfer was done"
    with pytest.raises(RuntimeError):
        eng.offload([1], [1])


def test_close_and_context_manager_on_gpu(res):
    kv, pool = res.setup(seed=15)
    expected = reference_copy(pool, [3, 4], kv, [5, 6])
    with kvcopy.TransferEngine(kv, pool) as eng:
        eng.offload([0], [0]).wait()
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        transfers = [eng.offload([1], [1]), eng.reload([3, 4], [5, 6]), eng.reload([2], [7], layerwise=True)]
        assert not any(t.done() for t in transfers)
    assert all(t.done() for t in transfers)
    got = dst_bytes(kv)
    for p in range(kv.num_planes):
        assert torch.equal(got[p][[5, 6]], expected[p][[5, 6]])
    with pytest.raises(RuntimeError):
        eng.reload([1], [1])


def test_2000_cycles_bounded_resources(res):
    kv = kvcopy.PagedKV.from_mla([torch.zeros(4, 1, 4, dtype=torch.float16, device="cuda")])
    pool = res.pool(kv, 4)
    kv.planes[0][0].fill_(1.5)
    eng = res.engine(kv, pool)
    block0, host1, block2 = [0], [1], [2]

    def cycles(n: int) -> None:
        for _ in range(n):
            eng.offload(block0, host1).wait()
            eng.reload(host1, block2).wait()
            assert eng.num_in_flight == 0

    cycles(200)
    torch.cuda.synchronize()
    gc.collect()
    tracemalloc.start()
    try:
        cycles(300)
        gc.collect()
        warm, _ = tracemalloc.get_traced_memory()
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        threads, fds = threading.active_count(), len(os.listdir("/proc/self/fd"))
        cycles(1_500)
        torch.cuda.synchronize()
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert torch.cuda.memory_allocated() == allocated
    assert torch.cuda.memory_reserved() == reserved
    assert after - warm < 256 * 1024, f"traced memory grew by {after - warm} bytes over 1,500 cycles"
    assert threading.active_count() == threads
    assert len(os.listdir("/proc/self/fd")) == fds
    assert torch.all(kv.planes[0][2] == 1.5)


# --------------------------------------------------------------------------- CUDA graphs


def _warm_up_on_side_stream(fn) -> None:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


@pytest.mark.parametrize("method", CAPTURE_METHODS)
def test_captured_reload_replays_with_new_ids_and_data(res, method):
    kv, pool = res.setup(seed=16)
    eng = res.engine(kv, pool, method=method)
    dev_host_ids = torch.tensor([0, 1, 2], device="cuda")
    dev_block_ids = torch.tensor([3, 4, 5], device="cuda")
    _warm_up_on_side_stream(lambda: eng.reload(dev_host_ids, dev_block_ids).wait_stream())

    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        t = eng.reload(dev_host_ids, dev_block_ids)
        t.wait_stream()
    torch.cuda.synchronize()

    for step, (h, b) in enumerate([([5, 6, 7], [9, 10, 11]), ([11, 0, 4], [0, 15, 7]), ([1, 1, 2], [6, 2, 3])]):
        fill_random_(pool, _gen(160 + step))
        fill_random_(kv, _gen(170 + step))
        dev_host_ids.copy_(torch.tensor(h))
        dev_block_ids.copy_(torch.tensor(b))
        torch.cuda.synchronize()
        expected = reference_copy(pool, h, kv, b)
        g.replay()
        torch.cuda.synchronize()
        assert_same_bytes(dst_bytes(kv), expected)


@pytest.mark.parametrize("method", CAPTURE_METHODS)
def test_engine_keeps_working_after_a_capture(res, method):
    """After capturing a transfer, eager transfers, num_in_flight and close() still work."""
    kv, pool = res.setup(seed=17)
    eng = res.engine(kv, pool, method=method)
    dev_h, dev_b = torch.tensor([0, 1], device="cuda"), torch.tensor([2, 3], device="cuda")
    _warm_up_on_side_stream(lambda: eng.reload(dev_h, dev_b).wait_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        eng.reload(dev_h, dev_b).wait_stream()
    g.replay()
    torch.cuda.synchronize()
    assert isinstance(eng.num_in_flight, int)
    expected = reference_copy(kv, [4, 5], pool, [6, 7])
    eng.offload([4, 5], [6, 7]).wait()
    assert_same_bytes(dst_bytes(pool), expected)
    expected = reference_copy(pool, [6], kv, [8])
    eng.reload([6], [8]).wait()
    assert_same_bytes(dst_bytes(kv), expected)
    eng.close()


def test_two_transfers_in_one_capture(res):
    kv, pool = res.setup(seed=18)
    eng = res.engine(kv, pool)
    off_b, off_h = torch.tensor([0, 1], device="cuda"), torch.tensor([8, 9], device="cuda")
    rel_h, rel_b = torch.tensor([2, 3], device="cuda"), torch.tensor([10, 11], device="cuda")

    def both():
        o = eng.offload(off_b, off_h)
        r = eng.reload(rel_h, rel_b)
        o.wait_stream()
        r.wait_stream()

    _warm_up_on_side_stream(both)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        both()
    fill_random_(pool, _gen(180))
    fill_random_(kv, _gen(181))
    torch.cuda.synchronize()
    expected_host = reference_copy(kv, [0, 1], pool, [8, 9])
    expected_dev = reference_copy(pool, [2, 3], kv, [10, 11])
    g.replay()
    torch.cuda.synchronize()
    assert_same_bytes(dst_bytes(pool), expected_host)
    assert_same_bytes(dst_bytes(kv), expected_dev)


def test_capture_refuses_host_ids_and_copy_engine(res):
    kv, pool = res.setup(seed=19)
    eng = res.engine(kv, pool)
    dma = res.engine(kv, pool, method="copy_engine")
    dev_h, dev_b = torch.tensor([0, 1], device="cuda"), torch.tensor([2, 3], device="cuda")
    _warm_up_on_side_stream(lambda: (eng.reload(dev_h, dev_b).wait_stream(), dma.reload([0], [1]).wait_stream()))
    x = torch.zeros(4, device="cuda")
    before = snapshot(kv)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x.add_(1)
        with pytest.raises(ValueError):
            eng.reload([0, 1], [2, 3])  # host ids would be frozen into the graph
        with pytest.raises(ValueError):
            eng.offload([0], [1])
        with pytest.raises(ValueError):
            eng.reload([0], [1], layerwise=True)
        with pytest.raises(ValueError, match="copy_engine"):
            dma.reload(dev_h, dev_b)
        with pytest.raises(ValueError):
            dma.reload([0], [1])
    # The refused calls queued nothing: the capture ended cleanly and holds only x.add_(1).
    g.replay()
    torch.cuda.synchronize()
    assert torch.all(x == 1)
    assert_same_bytes(snapshot(kv), before)


@pytest.mark.parametrize("method", CAPTURE_METHODS)
def test_captured_layerwise_reload_with_consumers(res, method):
    num_layers, head_dim = 3, 64
    gen = _gen(20)
    kv, layers = _zero_vllm(num_layers, 16, 16, 2, head_dim)
    pool = res.pool(kv, 10)
    _fill_randn_(pool, gen)
    eng = res.engine(kv, pool, method=method)
    dev_h = torch.tensor([0, 1, 2], device="cuda")
    dev_b = torch.tensor([3, 4, 5], device="cuda")
    q = torch.randn(4, head_dim, generator=gen).cuda()
    torch.cuda.synchronize()

    def step():
        t = eng.reload(dev_h, dev_b, layerwise=True)
        outs = []
        for layer in range(num_layers):
            t.wait_layer(layer)
            outs.append(_attention(q, layers[layer][0].index_select(0, dev_b), layers[layer][1].index_select(0, dev_b)))
        return outs

    _warm_up_on_side_stream(step)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step()

    for i, (h, b) in enumerate([([7, 8, 9], [10, 11, 12]), ([2, 5, 2], [15, 0, 6])]):
        _fill_randn_(pool, _gen(200 + i))
        for t in layers:
            t.zero_()
        dev_h.copy_(torch.tensor(h))
        dev_b.copy_(torch.tensor(b))
        torch.cuda.synchronize()
        hh = torch.tensor(h)
        expected = [
            _attention(q, pool.paged.planes[2 * layer][hh].cuda(), pool.paged.planes[2 * layer + 1][hh].cuda())
            for layer in range(num_layers)
        ]
        expected_bytes = reference_copy(pool, h, kv, b)
        g.replay()
        torch.cuda.synchronize()
        for layer, (out, exp) in enumerate(zip(outs, expected, strict=True)):
            torch.testing.assert_close(
                out, exp, rtol=1e-5, atol=1e-5, msg=lambda m, i=i, layer=layer: f"replay {i}, layer {layer}: {m}"
            )
        assert_same_bytes(dst_bytes(kv), expected_bytes)


# --------------------------------------------------------------------------- debug mode


def test_engine_orders_its_own_transfers_on_the_gpu(res):
    kv, pool = res.setup(seed=21)
    eng = res.engine(kv, pool)
    eng.offload([1], [2]).wait()  # warm-up
    torch.cuda.synchronize()
    first = [p[1].clone() for p in dst_bytes(kv)]  # device block 1 as the offload will read it
    # Made before the sleep: a tensor made on the GPU from a list copies from pageable memory and waits for the
    # current stream, so made after it, it would wait out the sleep.
    opaque_host, opaque_block = torch.tensor([3], device="cuda"), torch.tensor([6], device="cuda")
    torch.cuda._sleep(SLEEP_CYCLES)
    t = eng.offload([1], [3])  # unfinished: its copy waits behind the sleep
    assert not t.done()
    back = eng.reload([3], [5])  # reads host block 3: must see what the offload writes
    over = eng.reload([0], [1])  # writes device block 1: only after the offload has read it
    opaque = eng.reload(opaque_host, opaque_block)  # ids it cannot read
    assert not t.done(), "the sleep ended before the submissions"
    for transfer in (t, back, over, opaque):
        transfer.wait()
    for plane, expected in zip(dst_bytes(kv), first, strict=True):
        assert torch.equal(plane[5], expected) and torch.equal(plane[6], expected)
    for plane, expected in zip(dst_bytes(pool), first, strict=True):
        assert torch.equal(plane[3], expected)


def test_debug_mode_reports_the_callers_copy_on_the_gpu(res, monkeypatch):
    monkeypatch.setenv("KVCOPY_DEBUG", "1")
    kv, pool = res.setup(seed=22)
    eng = res.engine(kv, pool)
    assert eng.debug is True
    eng.reload([0], [1]).wait()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t = eng.reload([0], [1])
    with pytest.raises(kvcopy.TransferConflictError, match="copy_blocks would write device block 1"):
        kvcopy.copy_blocks(pool, [2], kv, [1])  # WAW device
    with pytest.raises(kvcopy.TransferConflictError, match="copy_blocks would read device block 1"):
        kvcopy.copy_blocks(kv, [1], pool, [5])  # RAW device
    kvcopy.copy_blocks(kv, [2], pool, [5])  # disjoint: fine
    t.wait()


# --------------------------------------------------------------------------- captures beside eager work


def test_eager_transfers_from_another_thread_during_a_capture_run_and_leave_it_valid(res):
    """Global capture mode forbids event queries from any thread: while one thread captures a reload, another
    thread's eager offload must run on the shared copy stream (not join the graph), its done() must not query
    the event, and the capture must still succeed."""
    kv, pool = res.setup(seed=23)
    eng = res.engine(kv, pool)
    eng.reload([0], [1]).wait()  # warm-up: streams, events, plane tables
    torch.cuda.synchronize()
    expected_pool = reference_copy(kv, [2], pool, [3])
    host_ids = torch.tensor([0], device="cuda")
    block_ids = torch.tensor([5], device="cuda")
    seen: dict = {}

    def eager_offload() -> None:
        with torch.cuda.stream(torch.cuda.Stream()):
            transfer = eng.offload([2], [3])
            seen["done_during_capture"] = transfer.done()
            seen["in_flight"] = eng.num_in_flight
            seen["transfer"] = transfer

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # capture_error_mode="global"
        captured = eng.reload(host_ids, block_ids)
        captured.wait_stream()
        thread = threading.Thread(target=eager_offload)
        thread.start()
        thread.join()
    assert seen["done_during_capture"] is False
    # Its host ids were not staged through torch's pinned-memory allocator, whose event queries the capture
    # forbids: the copy engines took them as they were.
    assert seen["transfer"].method == "copy_engine"
    seen["transfer"].wait()  # ran eagerly, outside the graph
    assert_same_bytes([p[3] for p in dst_bytes(pool)], [p[3] for p in expected_pool])
    expected_kv = reference_copy(pool, [0], kv, [5])
    graph.replay()
    torch.cuda.synchronize()
    assert_same_bytes(dst_bytes(kv), expected_kv)


def test_close_waits_for_replays_of_captured_transfers(res):
    """A replay runs on the replaying stream, not the engine's: close() must not return (and let the pool be
    unpinned) while a replay queued before it may still read the pool."""
    kv, pool = res.setup(seed=24)
    eng = res.engine(kv, pool)
    eng.reload([0], [1]).wait()
    # Made outside the capture: inside one, torch refuses their copy from pageable memory.
    host_ids, block_ids = torch.tensor([0], device="cuda"), torch.tensor([6], device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        eng.reload(host_ids, block_ids).wait_stream()
    replay_stream = torch.cuda.Stream()
    with torch.cuda.stream(replay_stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        graph.replay()
    assert not replay_stream.query()
    eng.close()
    assert replay_stream.query(), "close() returned while a replay of a captured transfer was still queued"
    pool.close()


def test_debug_mode_accepts_the_callers_copy_after_wait_stream(res):
    kv, pool = res.setup(seed=25)
    eng = res.engine(kv, pool, debug=True)
    eng.reload([0], [1]).wait()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t = eng.reload([0], [1])
    t.wait_stream()  # the caller's stream now runs after the reload: its own copy is ordered
    kvcopy.copy_blocks(pool, [2], kv, [1])
    expected = reference_copy(pool, [2], kv, [1])
    torch.cuda.synchronize()
    assert_same_bytes(dst_bytes(kv), expected)


def test_a_host_wait_inside_a_capture_is_refused(res):
    kv, pool = res.setup(seed=26)
    eng = res.engine(kv, pool)
    eng.reload([0], [1]).wait()
    # Made outside the capture: inside one, torch refuses their copy from pageable memory.
    host_ids, block_ids = torch.tensor([0], device="cuda"), torch.tensor([2], device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        t = eng.reload(host_ids, block_ids)
        with pytest.raises(RuntimeError, match="use wait_stream"):
            t.wait()
        t.wait_stream()
