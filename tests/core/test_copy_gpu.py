"""CUDA methods against the reference: device <-> pinned host, device <-> device, streams, errors.

Every test here needs a CUDA GPU and is skipped without one.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import kvcopy
from kvcopy.methods import HOST_MEMORY_CTA_BUDGET

from helpers import HANG_TIMEOUT_S, HAS_CUDA, gpu, requires_gpu
from helpers.copies import (
    as_id_list,
    assert_same_bytes,
    byte_rows,
    check_copy,
    dst_bytes,
    empty_like_kv,
    fill_random_,
    make_flashinfer,
    make_layout,
    make_vllm,
    paged,
    random_bytes,
    random_tensor,
    reference_copy,
    snapshot,
)

pytestmark = [gpu, requires_gpu]

GPU_METHODS = ("cuda", "copy_engine", "triton", "torch")
HOST_BOUND_METHODS = ("cuda", "copy_engine", "triton")  # need pinned host memory
DEVICE_BLOCKS = 10
HOST_BLOCKS = 8
LAYOUT_DTYPES = [("vllm", torch.bfloat16), ("flashinfer", torch.float8_e4m3fn), ("mla", torch.float16)]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _sides(direction, layout, dtype, gen, *, pinned=True, host_layout="page_first"):
    """(src, dst, src_ids, dst_ids) for a direction: d2h, h2d or d2d."""
    kv = make_layout(layout, DEVICE_BLOCKS, dtype, gen, device="cuda")
    if direction == "d2d":
        other = make_layout(layout, DEVICE_BLOCKS, dtype, gen, device="cuda")
        return kv, other, [0, 3, 4, 5, 9, 9], [9, 1, 2, 3, 0, 4]
    pool = kvcopy.HostKVPool(kv, HOST_BLOCKS, layout=host_layout, pin_memory=pinned)
    fill_random_(pool, gen)
    if direction == "d2h":
        return kv, pool, [0, 3, 4, 5, 9, 9], [7, 1, 2, 3, 0, 4]
    return pool, kv, [7, 1, 2, 3, 0, 0], [0, 3, 4, 5, 9, 8]


@pytest.mark.parametrize("stream_kind", ["default", "side"])
@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
@pytest.mark.parametrize(("layout", "dtype"), LAYOUT_DTYPES, ids=[name for name, _ in LAYOUT_DTYPES])
@pytest.mark.parametrize("method", (*GPU_METHODS, "auto"))
def test_gpu_methods_match_reference(method, layout, dtype, direction, stream_kind):
    src, dst, src_ids, dst_ids = _sides(direction, layout, dtype, _gen(1))
    torch.cuda.synchronize()
    expected = reference_copy(src, src_ids, dst, dst_ids)
    src_before = snapshot(src)
    if stream_kind == "default":
        kvcopy.copy_blocks(src, src_ids, dst, dst_ids, method=method)
        torch.cuda.synchronize()
    else:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        kvcopy.copy_blocks(src, src_ids, dst, dst_ids, method=method, stream=stream)
        stream.synchronize()
    assert_same_bytes(dst_bytes(dst), expected)
    assert_same_bytes(snapshot(src), src_before)


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("method", GPU_METHODS)
def test_gather_scatter_round_trip_on_gpu(method, host_layout):
    gen = _gen(2)
    kv = make_layout("flashinfer", DEVICE_BLOCKS, torch.bfloat16, gen, device="cuda")
    pool = kvcopy.HostKVPool(kv, HOST_BLOCKS, layout=host_layout, pin_memory=True)
    fill_random_(pool, gen)
    original = [byte_rows(p).clone() for p in kv.planes]
    selected, host_ids = [8, 1, 2, 3], [0, 5, 6, 7]
    kvcopy.gather(kv, selected, pool, host_ids, method=method)
    torch.cuda.synchronize()
    fresh = make_layout("flashinfer", DEVICE_BLOCKS, torch.bfloat16, gen, device="cuda")
    targets = [4, 5, 6, 0]
    kvcopy.scatter(pool, host_ids, fresh, targets, method=method)
    torch.cuda.synchronize()
    for p, plane in enumerate(fresh.planes):
        for block, target in zip(selected, targets, strict=True):
            assert torch.equal(byte_rows(plane)[target], original[p][block])


@pytest.mark.parametrize("method", GPU_METHODS)
def test_empty_ids_on_gpu(method):
    src, dst, _, _ = _sides("d2h", "vllm", torch.bfloat16, _gen(3))
    before = snapshot(dst)
    kvcopy.copy_blocks(src, [], dst, [], method=method)
    torch.cuda.synchronize()
    assert_same_bytes(snapshot(dst), before)


# --------------------------------------------------------------------------- pinned vs pageable


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("method", HOST_BOUND_METHODS)
def test_unpinned_host_is_rejected(method, direction):
    src, dst, src_ids, dst_ids = _sides(direction, "vllm", torch.bfloat16, _gen(4), pinned=False)
    assert method not in kvcopy.available_methods(src, dst)
    before = snapshot(dst)
    with pytest.raises(ValueError, match="method") as info:
        kvcopy.copy_blocks(src, src_ids, dst, dst_ids, method=method)
    assert "torch" in str(info.value)  # the methods that can run are listed
    torch.cuda.synchronize()
    assert_same_bytes(snapshot(dst), before)


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("method", ["torch", "auto"])
def test_unpinned_host_works_with_torch(method, direction):
    src, dst, src_ids, dst_ids = _sides(direction, "vllm", torch.bfloat16, _gen(5), pinned=False)
    assert "torch" in kvcopy.available_methods(src, dst)
    check_copy(src, src_ids, dst, dst_ids, method=method)


def test_unpinned_plain_tensors_are_not_pinned():
    kv = kvcopy.PagedKV.from_planes([torch.zeros(4, 8)])
    assert not kv.is_pinned
    pinned = kvcopy.PagedKV.from_planes([torch.zeros(4, 8).pin_memory()])
    assert pinned.is_pinned
    gpu_kv = kvcopy.PagedKV.from_planes([torch.zeros(4, 8, device="cuda")])
    assert set(GPU_METHODS) <= set(kvcopy.available_methods(pinned, gpu_kv))
    assert kvcopy.available_methods(kv, gpu_kv) == ["torch"]


def test_pinned_pool_defaults_with_cuda():
    kv = make_layout("vllm", 4, torch.bfloat16, _gen(6), device="cuda")
    pool = kvcopy.HostKVPool(kv, 4)
    assert pool.pinned and pool.buffer.is_pinned()
    assert pool.paged.is_pinned


# --------------------------------------------------------------------------- devices


def test_planes_on_two_devices_are_rejected():
    with pytest.raises(ValueError):
        kvcopy.PagedKV.from_planes([torch.zeros(4, 8, device="cuda"), torch.zeros(4, 8)])


@pytest.mark.skipif(HAS_CUDA and torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("method", (*GPU_METHODS, "auto"))
def test_two_gpus_are_rejected(method):
    gen = _gen(7)
    src = make_layout("vllm", 4, torch.bfloat16, gen, device="cuda:0")
    dst = make_layout("vllm", 4, torch.bfloat16, gen, device="cuda:1")
    before = snapshot(dst)
    with pytest.raises(ValueError):
        kvcopy.copy_blocks(src, [0, 1], dst, [2, 3], method=method)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert_same_bytes(snapshot(dst), before)


# --------------------------------------------------------------------------- ids on the device


@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
@pytest.mark.parametrize("method", ["cuda", "triton", "torch", "auto"])
def test_device_resident_ids(method, direction, id_dtype):
    src, dst, src_ids, dst_ids = _sides(direction, "flashinfer", torch.float16, _gen(8))
    expected = reference_copy(src, src_ids, dst, dst_ids)
    s = torch.tensor(src_ids, dtype=id_dtype, device="cuda")
    d = torch.tensor(dst_ids, dtype=id_dtype, device="cuda")
    kvcopy.copy_blocks(src, s, dst, d, method=method)
    torch.cuda.synchronize()
    assert_same_bytes(dst_bytes(dst), expected)


@pytest.mark.parametrize("method", ["cuda", "triton"])
def test_device_resident_ids_dtype_and_shape_checked(method):
    src, dst, _, _ = _sides("d2d", "vllm", torch.bfloat16, _gen(9))
    before = snapshot(dst)
    with pytest.raises(TypeError, match="src_ids"):
        kvcopy.copy_blocks(
            src, torch.tensor([0.0], device="cuda"), dst, torch.tensor([1], device="cuda"), method=method
        )
    with pytest.raises(ValueError, match="dst_ids"):
        kvcopy.copy_blocks(
            src, torch.tensor([0], device="cuda"), dst, torch.tensor([[1]], device="cuda"), method=method
        )
    with pytest.raises(ValueError, match="dst_ids"):
        kvcopy.copy_blocks(
            src, torch.tensor([0, 1], device="cuda"), dst, torch.tensor([1], device="cuda"), method=method
        )
    torch.cuda.synchronize()
    assert_same_bytes(snapshot(dst), before)


@pytest.mark.parametrize("method", GPU_METHODS)
def test_host_ids_validated_for_gpu_methods(method):
    src, dst, _, _ = _sides("d2h", "vllm", torch.bfloat16, _gen(10))
    before = snapshot(dst)
    with pytest.raises(IndexError, match="src_ids"):
        kvcopy.copy_blocks(src, [0, DEVICE_BLOCKS], dst, [0, 1], method=method)
    with pytest.raises(IndexError, match="dst_ids"):
        kvcopy.copy_blocks(src, [0, 1], dst, [0, HOST_BLOCKS], method=method)
    with pytest.raises(ValueError, match="dst_ids"):
        kvcopy.copy_blocks(src, [0, 1], dst, [2, 2], method=method)
    torch.cuda.synchronize()
    assert_same_bytes(snapshot(dst), before)


# --------------------------------------------------------------------------- many planes, big blocks


@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
@pytest.mark.parametrize("method", GPU_METHODS)
def test_more_than_256_planes(method, direction):
    # The SM kernel passes at most 256 planes per launch: 300 planes need two launches.
    gen = _gen(11)
    num_planes = 300
    dev = kvcopy.PagedKV.from_planes(
        [random_tensor((6, 3 + p % 5), torch.bfloat16, gen, device="cuda") for p in range(num_planes)]
    )
    if direction == "d2d":
        other = kvcopy.PagedKV.from_planes(
            [random_tensor((6, *p.shape[1:]), p.dtype, gen, device="cuda") for p in dev.planes]
        )
        src, dst = dev, other
    else:
        pool = kvcopy.HostKVPool(dev, 6, layout="page_first", pin_memory=True)
        fill_random_(pool, gen)
        src, dst = (dev, pool) if direction == "d2h" else (pool, dev)
    src_ids, dst_ids = [5, 0, 1, 1], [4, 0, 1, 2]
    check_copy(src, src_ids, dst, dst_ids, method=method)


@pytest.mark.parametrize("method", ["copy_engine", "auto", "cuda"])
def test_large_blocks(method):
    # 256 KiB plane-blocks: "auto" sends these to the copy engines.
    gen = _gen(12)
    dev = kvcopy.PagedKV.from_planes(
        [random_tensor((6, 64 * 1024), torch.float32, gen, device="cuda") for _ in range(3)]
    )
    pool = kvcopy.HostKVPool(dev, 5, pin_memory=True)
    fill_random_(pool, gen)
    available = kvcopy.methods.available_methods(dev, pool.paged)
    assert kvcopy.methods.choose_method(dev, pool.paged, available, host_ids=True) == "copy_engine"
    assert kvcopy.methods.choose_method(pool.paged, dev, available, host_ids=True) == "copy_engine"
    check_copy(dev, [1, 2, 3, 5], pool, [0, 1, 2, 4], method=method)
    check_copy(pool, [4, 0, 1], dev, [0, 2, 3], method=method)


@pytest.mark.parametrize("method", GPU_METHODS)
def test_odd_sizes_and_alignments(method):
    # Block bytes not a multiple of 16 (or even 2), planes at odd offsets of a pinned pool.
    gen = _gen(13)
    dev = kvcopy.PagedKV.from_planes(
        [
            random_tensor((7, 3, 5), torch.uint8, gen, device="cuda"),
            random_tensor((7, 13), torch.float8_e4m3fn, gen, device="cuda"),
            random_tensor((7,), torch.uint8, gen, device="cuda"),
        ]
    )
    pool = kvcopy.HostKVPool(dev, 6, pin_memory=True)
    fill_random_(pool, gen)
    check_copy(dev, [6, 0, 1, 2], pool, [5, 0, 1, 2], method=method)
    check_copy(pool, [5, 0, 1], dev, [0, 4, 5], method=method)


# --------------------------------------------------------------------------- the ops' CUDA launchers
# Eager copy_blocks enters the kernels through csrc/python/module.cpp; calling the registered ops
# directly (as compiled graphs do) goes through csrc/ops/launch_cuda.cpp instead.


def _cuda_ids(ids):
    return torch.tensor(ids, dtype=torch.int64, device="cuda")


def _cpu_ids(ids):
    return torch.tensor(ids, dtype=torch.int64)


@pytest.mark.parametrize("num_ctas", [0, 1, HOST_MEMORY_CTA_BUDGET])
@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
def test_copy_blocks_op_on_cuda(direction, num_ctas):
    src, dst, src_ids, dst_ids = _sides(direction, "flashinfer", torch.bfloat16, _gen(20))
    torch.cuda.synchronize()
    expected = reference_copy(src, src_ids, dst, dst_ids)
    src_before = snapshot(src)
    torch.ops.kvcopy.copy_blocks(
        list(paged(src).planes), _cuda_ids(src_ids), list(paged(dst).planes), _cuda_ids(dst_ids), num_ctas
    )
    torch.cuda.synchronize()
    assert_same_bytes(dst_bytes(dst), expected)
    assert_same_bytes(snapshot(src), src_before)


@pytest.mark.parametrize("stream_kind", ["default", "side"])
@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
def test_copy_blocks_dma_op_on_cuda(direction, stream_kind):
    src, dst, src_ids, dst_ids = _sides(direction, "flashinfer", torch.bfloat16, _gen(21))
    torch.cuda.synchronize()
    expected = reference_copy(src, src_ids, dst, dst_ids)
    src_before = snapshot(src)
    args = (list(paged(src).planes), _cpu_ids(src_ids), list(paged(dst).planes), _cpu_ids(dst_ids))
    if stream_kind == "default":
        torch.ops.kvcopy.copy_blocks_dma(*args)
        torch.cuda.current_stream().synchronize()  # the batch's side stream is ordered back onto this one
    else:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.ops.kvcopy.copy_blocks_dma(*args)
        stream.synchronize()
    assert_same_bytes(dst_bytes(dst), expected)
    assert_same_bytes(snapshot(src), src_before)


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_ops_on_cuda_reject_bad_ids(direction):
    src, dst, _, _ = _sides(direction, "vllm", torch.bfloat16, _gen(22))
    torch.cuda.synchronize()
    before = snapshot(dst)
    src_planes, dst_planes = list(paged(src).planes), list(paged(dst).planes)
    n_src = paged(src).num_blocks
    with pytest.raises(IndexError, match="src_ids"):
        torch.ops.kvcopy.copy_blocks_dma(src_planes, _cpu_ids([0, n_src]), dst_planes, _cpu_ids([0, 1]))
    with pytest.raises(IndexError, match="dst_ids"):
        torch.ops.kvcopy.copy_blocks_dma(src_planes, _cpu_ids([0, 1]), dst_planes, _cpu_ids([-1, 1]))
    with pytest.raises(ValueError, match="dst_ids"):
        torch.ops.kvcopy.copy_blocks_dma(src_planes, _cpu_ids([0, 1]), dst_planes, _cpu_ids([2, 2]))
    with pytest.raises(RuntimeError):  # the SM kernel reads its ids on the device
        torch.ops.kvcopy.copy_blocks(src_planes, _cpu_ids([0, 1]), dst_planes, _cpu_ids([2, 3]), 0)
    with pytest.raises(RuntimeError):  # int64 only
        torch.ops.kvcopy.copy_blocks(src_planes, _cuda_ids([0, 1]).int(), dst_planes, _cuda_ids([2, 3]).int(), 0)
    torch.cuda.synchronize()
    assert_same_bytes(snapshot(dst), before)


@pytest.mark.parametrize("layout", ["planes", "flashinfer"])
@pytest.mark.parametrize("name", ["copy_blocks", "copy_blocks_dma"])
def test_opcheck_on_cuda(name, layout):
    gen = _gen(23)
    src_kv = make_layout(layout, 6, torch.bfloat16, gen, device="cuda")
    dst_kv = make_layout(layout, 7, torch.bfloat16, gen, device="cuda")
    ids_device = "cuda" if name == "copy_blocks" else "cpu"  # the copy engines read ids on the host
    src_ids = torch.tensor([5, 0, 1, 1], dtype=torch.int64, device=ids_device)
    dst_ids = torch.tensor([6, 2, 3, 0], dtype=torch.int64, device=ids_device)
    args = (list(src_kv.planes), src_ids, list(dst_kv.planes), dst_ids)
    if name == "copy_blocks":
        args += (0,)
    result = torch.library.opcheck(getattr(torch.ops.kvcopy, name).default, args, raise_exception=False)
    failures = {test: outcome for test, outcome in result.items() if outcome != "SUCCESS"}
    assert not failures, failures


# --------------------------------------------------------------------------- torch.compile on the GPU
# Python lists are not traceable inputs: host ids are CPU int64 tensors.

COMPILE_CASES = [
    ("cuda", "d2h", "aot_eager"),
    ("cuda", "h2d", "aot_eager"),
    ("cuda", "d2d", "aot_eager"),
    ("copy_engine", "d2h", "aot_eager"),
    ("copy_engine", "h2d", "aot_eager"),
    ("copy_engine", "d2d", "aot_eager"),
    ("cuda", "h2d", "inductor"),
    ("copy_engine", "d2h", "inductor"),
]


@pytest.mark.parametrize(("method", "direction", "backend"), COMPILE_CASES)
def test_torch_compile_on_gpu_with_host_ids(method, direction, backend):
    torch._dynamo.reset()
    src, dst, src_ids, dst_ids = _sides(direction, "vllm", torch.bfloat16, _gen(30))
    torch.cuda.synchronize()

    def copy(s, d):
        kvcopy.copy_blocks(src, s, dst, d, method=method)

    compiled = torch.compile(copy, fullgraph=True, backend=backend)
    for s_ids, d_ids in ((src_ids, dst_ids), ([1, 2, 3], [2, 3, 4]), ([6], [7])):
        s, d = _cpu_ids(s_ids), _cpu_ids(d_ids)
        expected = reference_copy(src, s, dst, d)
        compiled(s, d)
        torch.cuda.synchronize()
        assert_same_bytes(dst_bytes(dst), expected)


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize(
    ("method", "backend"), [("cuda", "aot_eager"), ("cuda", "inductor"), ("copy_engine", "aot_eager")]
)
def test_torch_compile_on_gpu_validates_host_ids(method, backend, direction):
    """ "cuda" checks host ids with torch.ops.kvcopy.check_block_ids inside the graph; the DMA op checks its own."""
    torch._dynamo.reset()
    src, dst, _, _ = _sides(direction, "vllm", torch.bfloat16, _gen(31))
    n_src, n_dst = paged(src).num_blocks, paged(dst).num_blocks

    def copy(s, d):
        kvcopy.copy_blocks(src, s, dst, d, method=method)

    compiled = torch.compile(copy, fullgraph=True, backend=backend)
    compiled(_cpu_ids([0, 1]), _cpu_ids([2, 3]))  # a valid call first: the same graph runs the bad ones
    torch.cuda.synchronize()
    before = snapshot(dst)
    bad_cases = [
        ([0, n_src], [1, 2], IndexError, "src_ids"),
        ([-1, 0], [1, 2], IndexError, "src_ids"),
        ([0, 1], [1, n_dst], IndexError, "dst_ids"),
        ([0, 1], [2, 2], ValueError, "dst_ids"),
    ]
    for bad_src, bad_dst, exc, name in bad_cases:
        with pytest.raises(exc, match=name):
            compiled(_cpu_ids(bad_src), _cpu_ids(bad_dst))
        torch.cuda.synchronize()
        assert_same_bytes(snapshot(dst), before)


# --------------------------------------------------------------------------- streams
# ~200 ms of GPU time at 2 GHz: far longer than the host work between enqueueing it and the checks.
SLEEP_CYCLES = int(0.2 * 2e9)


def _scribble(num_ids):
    """Allocates and overwrites device (default stream) and pinned buffers of the sizes a copy stages ids in.

    Had a delayed copy staged its ids on the default stream, or released pinned staging memory still
    in use, these would reuse and overwrite that memory before the copy reads it. Keep the result alive.
    """
    junk = []
    for numel in (num_ids, 2 * num_ids):
        junk += [torch.full((numel,), -1, dtype=torch.int64, device="cuda") for _ in range(4)]
        junk += [torch.full((numel,), -1, dtype=torch.int64).pin_memory() for _ in range(4)]
    return junk


def _check_copy_waits_on_stream(src, src_ids, dst, dst_ids, method):
    """Queues a long sleep on a side stream, then the copy with stream=; checks the copy waits behind it."""
    stream = torch.cuda.Stream()
    num_ids = len(as_id_list(src_ids))
    # Warm-up on the same pair: compiles the Triton kernel, caches plane tables and allocator blocks,
    # so nothing below has a reason to block the host.
    kvcopy.copy_blocks(src, src_ids, dst, dst_ids, method=method, stream=stream)
    _scribble(num_ids)  # fills the allocators' caches with blocks of these sizes
    stream.synchronize()
    fill_random_(dst, _gen(45))
    torch.cuda.synchronize()
    expected = reference_copy(src, src_ids, dst, dst_ids)
    before = dst_bytes(dst)

    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    kvcopy.copy_blocks(src, src_ids, dst, dst_ids, method=method, stream=stream)
    junk = _scribble(num_ids)
    time.sleep(0.02)  # any work not queued behind the sleep has finished by now
    assert torch.cuda.current_stream().query(), "work was queued on the default stream behind the side stream"
    now = dst_bytes(dst)  # reads on the default stream, without waiting for `stream`
    assert not stream.query(), "the sleep ended before the checks: the host blocked on the stream, or sleep too short"
    assert_same_bytes(now, before)  # nothing written yet: the copy is queued behind the sleep on `stream`
    stream.synchronize()
    assert_same_bytes(dst_bytes(dst), expected)
    del junk


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("method", HOST_BOUND_METHODS)
def test_copy_is_queued_on_the_given_stream(method, direction):
    src, dst, src_ids, dst_ids = _sides(direction, "flashinfer", torch.bfloat16, _gen(40))
    _check_copy_waits_on_stream(src, src_ids, dst, dst_ids, method)


@pytest.mark.parametrize("direction", ["d2h", "h2d", "d2d"])
@pytest.mark.parametrize("method", ["cuda", "triton"])
def test_int32_device_ids_on_a_side_stream(method, direction):
    # int32 ids are converted to int64 on the GPU, on the copy's stream.
    src, dst, src_ids, dst_ids = _sides(direction, "flashinfer", torch.bfloat16, _gen(41))
    s = torch.tensor(src_ids, dtype=torch.int32, device="cuda")
    d = torch.tensor(dst_ids, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    _check_copy_waits_on_stream(src, s, dst, d, method)


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("method", HOST_BOUND_METHODS)
def test_copy_is_ordered_on_the_default_stream(method, direction):
    """On torch's default (legacy) stream, a copy sees earlier work on it and later work sees the copy
    ("copy_engine" submits its batch from a side stream there, ordered with events both ways)."""
    gen = _gen(44)
    src, dst, src_ids, dst_ids = _sides(direction, "flashinfer", torch.bfloat16, gen)
    kvcopy.copy_blocks(src, src_ids, dst, dst_ids, method=method)  # warm-up
    torch.cuda.synchronize()
    fill_random_(dst, gen)
    torch.cuda.synchronize()
    if direction == "d2h":
        # The device source is rewritten on the default stream behind a sleep: the copy must read the new bytes.
        new_rows = []
        for plane in src.planes:
            rows = byte_rows(plane)
            new_rows.append(random_bytes(rows.numel(), gen).view(rows.shape).to("cuda"))
        torch.cuda.synchronize()
        s, d = torch.tensor(src_ids), torch.tensor(dst_ids)
        expected = []
        for old, new in zip(dst_bytes(dst), new_rows, strict=True):
            old[d] = new.cpu()[s]
            expected.append(old)
        torch.cuda._sleep(SLEEP_CYCLES // 4)
        for plane, new in zip(src.planes, new_rows, strict=True):
            byte_rows(plane).copy_(new)
        kvcopy.copy_blocks(src, src_ids, dst, dst_ids, method=method)
        torch.cuda.current_stream().synchronize()
        assert_same_bytes(dst_bytes(dst), expected)
    else:
        # The copy waits behind a sleep; the device destination is then read on the default stream.
        expected = reference_copy(src, src_ids, dst, dst_ids)
        torch.cuda._sleep(SLEEP_CYCLES // 4)
        kvcopy.copy_blocks(src, src_ids, dst, dst_ids, method=method)
        assert_same_bytes(dst_bytes(dst), expected)


@pytest.mark.skipif(HAS_CUDA and torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("method", (*GPU_METHODS, "auto"))
def test_stream_on_another_device_is_rejected(method):
    src, dst, src_ids, dst_ids = _sides("d2h", "vllm", torch.bfloat16, _gen(43))
    torch.cuda.synchronize()
    before = snapshot(dst)
    with pytest.raises(ValueError, match="stream"):
        kvcopy.copy_blocks(src, src_ids, dst, dst_ids, method=method, stream=torch.cuda.Stream(device=1))
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert_same_bytes(snapshot(dst), before)


# --------------------------------------------------------------------------- device ids outside the cache


def _guarded_kv(num_blocks, spare, gen):
    """A device cache whose planes are the middle blocks of larger tensors, so a write through an id
    outside the cache lands in memory we own (and check) rather than elsewhere on the device."""
    bases = [
        random_tensor((num_blocks + 2 * spare, 4, 8), torch.bfloat16, gen, device="cuda"),
        random_tensor((num_blocks + 2 * spare, 5), torch.uint8, gen, device="cuda"),
    ]
    return kvcopy.PagedKV.from_planes([b[spare : spare + num_blocks] for b in bases]), bases


@pytest.mark.parametrize("direction", ["d2d", "d2h", "h2d"])
@pytest.mark.parametrize("method", ["cuda", "triton"])
def test_device_ids_outside_the_cache_are_skipped(method, direction):
    """Documented: the kernels skip device-resident ids out of range; valid pairs in the same call are copied."""
    gen, spare = _gen(50), 3
    kv, bases = _guarded_kv(DEVICE_BLOCKS, spare, gen)
    guards = list(bases)
    if direction == "d2d":
        other, other_bases = _guarded_kv(DEVICE_BLOCKS, spare, gen)
        src, dst = kv, other
        guards += other_bases
    else:
        # Layer-first: the cache's 69-byte blocks (a bf16 plane, then 5 bytes) cannot be laid out page-first
        # without padding, which a pool refuses (a bf16 plane would start at odd byte offsets).
        pool = kvcopy.HostKVPool(kv, HOST_BLOCKS, layout="layer_first", pin_memory=True)
        fill_random_(pool, gen)
        src, dst = (kv, pool) if direction == "d2h" else (pool, kv)
    n_src, n_dst = paged(src).num_blocks, paged(dst).num_blocks
    pairs = [(-1, 2), (1, n_dst), (4, 5), (n_src, 0), (-(2**40), 1), (2, 2**40), (0, 3), (3, -1), (2**62, 6)]
    valid = [(s, d) for s, d in pairs if 0 <= s < n_src and 0 <= d < n_dst]
    assert valid == [(4, 5), (0, 3)]
    torch.cuda.synchronize()
    expected = reference_copy(src, [s for s, _ in valid], dst, [d for _, d in valid])
    src_before = snapshot(src)
    guards_before = [byte_rows(b).clone() for b in guards]
    kvcopy.copy_blocks(src, _cuda_ids([s for s, _ in pairs]), dst, _cuda_ids([d for _, d in pairs]), method=method)
    torch.cuda.synchronize()
    assert_same_bytes(dst_bytes(dst), expected)
    assert_same_bytes(snapshot(src), src_before)
    for b, before in zip(guards, guards_before, strict=True):  # the spare blocks around every plane are untouched
        rows = byte_rows(b)
        assert torch.equal(rows[:spare], before[:spare]) and torch.equal(rows[-spare:], before[-spare:])


# --------------------------------------------------------------------------- vector widths and chunks

WIDTH_BLOCKS = 6
WIDTH_IDS = ([5, 0, 1, 2, 2], [1, 2, 3, 4, 0])  # a run (0,1,2 -> 2,3,4), a repeated source


def _width_case(case, gen):
    """(device cache, host layout) whose blocks allow words of one width in the SM kernel."""
    if case == "16B_vllm":  # 16 tokens x 8 heads x 128 dims bf16: 32 KiB plane-blocks
        return make_vllm(2, WIDTH_BLOCKS, 16, 8, 128, torch.bfloat16, gen, device="cuda")[0], "page_first"
    if case == "8B":  # 24-byte blocks: 8-byte words, never 16
        planes = [random_tensor((WIDTH_BLOCKS, 3), torch.int64, gen, device="cuda") for _ in range(2)]
        return kvcopy.PagedKV.from_planes(planes), "layer_first"
    if case == "4B":  # 12-byte fp32 blocks
        planes = [random_tensor((WIDTH_BLOCKS, 3), torch.float32, gen, device="cuda") for _ in range(2)]
        return kvcopy.PagedKV.from_planes(planes), "layer_first"
    if case == "mixed":  # page_first host blocks of 32 KiB + 6 B: host-side alignment varies per block
        planes = [
            random_tensor((WIDTH_BLOCKS, 16384), torch.bfloat16, gen, device="cuda"),
            random_tensor((WIDTH_BLOCKS, 3), torch.bfloat16, gen, device="cuda"),
        ]
        return kvcopy.PagedKV.from_planes(planes), "page_first"
    raise ValueError(case)


def _pair_for(kv, direction, num_blocks, host_layout, gen):
    if direction == "d2d":
        return kv, empty_like_kv(kv, num_blocks, gen)
    pool = kvcopy.HostKVPool(kv, num_blocks, layout=host_layout, pin_memory=True)
    fill_random_(pool, gen)
    return (kv, pool) if direction == "d2h" else (pool, kv)


@pytest.mark.parametrize("direction", ["d2d", "d2h", "h2d"])
@pytest.mark.parametrize("case", ["16B_vllm", "8B", "4B", "mixed"])
@pytest.mark.parametrize("method", HOST_BOUND_METHODS)
def test_vector_widths(method, case, direction):
    gen = _gen(60)
    kv, host_layout = _width_case(case, gen)
    src, dst = _pair_for(kv, direction, WIDTH_BLOCKS, host_layout, gen)
    torch.cuda.synchronize()
    check_copy(src, WIDTH_IDS[0], dst, WIDTH_IDS[1], method=method)


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("direction", ["d2d", "d2h", "h2d"])
@pytest.mark.parametrize("method", HOST_BOUND_METHODS)
def test_blocks_larger_than_one_chunk(method, direction, host_layout):
    # The SM kernel splits plane-blocks into 32 KiB chunks: 100,000 B is 3 full chunks and 1,696 B;
    # 100,003 B is odd (byte words, odd page_first offsets); 41 B has one partial chunk and skips the rest.
    gen = _gen(61)
    kv = kvcopy.PagedKV.from_planes(
        [
            random_tensor((5, 25_000), torch.float32, gen, device="cuda"),
            random_tensor((5, 100_003), torch.uint8, gen, device="cuda"),
            random_tensor((5, 41), torch.uint8, gen, device="cuda"),
        ]
    )
    assert kv.plane_block_nbytes == (100_000, 100_003, 41)
    src, dst = _pair_for(kv, direction, 5, host_layout, gen)
    torch.cuda.synchronize()
    check_copy(src, [4, 0, 1, 3], dst, [0, 2, 3, 4], method=method)


@pytest.mark.parametrize("direction", ["d2d", "d2h", "h2d"])
@pytest.mark.parametrize(("plane_bytes", "expected"), [(256 * 1024, "copy_engine"), (32 * 1024, "cuda")])
def test_auto_choice_by_block_size(plane_bytes, expected, direction):
    gen = _gen(62)
    kv = kvcopy.PagedKV.from_planes(
        [random_tensor((5, plane_bytes // 4), torch.float32, gen, device="cuda") for _ in range(3)]
    )
    src, dst = _pair_for(kv, direction, 5, "page_first", gen)
    src_kv, dst_kv = paged(src), paged(dst)
    available = kvcopy.methods.available_methods(src_kv, dst_kv)
    assert kvcopy.methods.choose_method(src_kv, dst_kv, available, host_ids=True) == expected
    assert kvcopy.methods.choose_method(src_kv, dst_kv, available, host_ids=False) == "cuda"  # device ids
    torch.cuda.synchronize()
    check_copy(src, [1, 2, 4], dst, [0, 1, 3], method="auto")


# --------------------------------------------------------------------------- FlashInfer <-> page_first

FLASHINFER_IDS = {
    "runs": ([0, 1, 2, 3, 8, 9, 10, 5], [4, 5, 6, 7, 0, 1, 2, 9]),
    "one_long_run": (list(range(2, 12)), list(range(1, 11))),
    "reversed": ([11, 10, 9, 8], [0, 1, 2, 3]),
}


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("ids", [*FLASHINFER_IDS, "random"])
@pytest.mark.parametrize("method", HOST_BOUND_METHODS)
def test_flashinfer_page_first_on_gpu(method, ids, num_layers):
    # K and V of a FlashInfer layer are adjacent in both layouts: the DMA planner merges them (and,
    # with one layer, whole runs of adjacent ids) into single ranges.
    gen = _gen(70)
    kv = make_flashinfer(num_layers, 12, 16, 2, 64, torch.bfloat16, gen, device="cuda")[0]
    pool = kvcopy.HostKVPool(kv, 12, layout="page_first", pin_memory=True)
    fill_random_(pool, gen)
    if ids == "random":
        src_ids = torch.randperm(12, generator=gen)[:9].tolist()
        dst_ids = torch.randperm(12, generator=gen)[:9].tolist()
    else:
        src_ids, dst_ids = FLASHINFER_IDS[ids]
    torch.cuda.synchronize()
    check_copy(kv, src_ids, pool, dst_ids, method=method)
    fill_random_(kv, gen)
    check_copy(pool, dst_ids, kv, src_ids, method=method)


@pytest.mark.parametrize("direction", ["d2d", "d2h", "h2d"])
def test_copy_engine_single_range(direction):
    # One MLA layer: a single id, or a run of adjacent ids on a plane dense on both sides, is one
    # range, submitted with a plain cudaMemcpyAsync rather than a batch.
    gen = _gen(71)
    kv = make_layout("mla", 8, torch.float16, gen, device="cuda", num_layers=1)
    src, dst = _pair_for(kv, direction, 8, "page_first", gen)
    torch.cuda.synchronize()
    check_copy(src, [3], dst, [1], method="copy_engine")
    check_copy(src, [2, 3, 4, 5], dst, [0, 1, 2, 3], method="copy_engine")


# --------------------------------------------------------------------------- one cache, zero-byte planes


@pytest.mark.parametrize("method", (*GPU_METHODS, "auto"))
def test_same_cache_on_gpu(method):
    gen = _gen(80)
    kv = make_layout("flashinfer", DEVICE_BLOCKS, torch.bfloat16, gen, device="cuda")
    torch.cuda.synchronize()
    check_copy(kv, [0, 1, 2], kv, [5, 6, 7], method=method)
    check_copy(kv, [9, 9, 3], kv, [0, 1, 2], method=method)
    before = snapshot(kv)
    for src_ids, dst_ids in (([0, 1], [1, 2]), ([4], [4]), ([2, 8], [8, 2])):
        for convert in (list, _cpu_ids):
            with pytest.raises(ValueError, match="dst_ids"):
                kvcopy.copy_blocks(kv, convert(src_ids), kv, convert(dst_ids), method=method)
    torch.cuda.synchronize()
    assert_same_bytes(snapshot(kv), before)


@pytest.mark.parametrize("direction", ["d2d", "d2h", "h2d"])
@pytest.mark.parametrize("method", GPU_METHODS)
def test_zero_byte_plane_on_gpu(method, direction):
    gen = _gen(90)
    kv = kvcopy.PagedKV.from_planes(
        [
            random_tensor((6, 3, 8), torch.bfloat16, gen, device="cuda"),
            torch.empty(6, 0, dtype=torch.bfloat16, device="cuda"),
            random_tensor((6, 6), torch.uint8, gen, device="cuda"),
        ]
    )
    src, dst = _pair_for(kv, direction, 6, "page_first", gen)
    torch.cuda.synchronize()
    check_copy(src, [5, 0, 1, 1], dst, [4, 0, 1, 2], method=method)


@pytest.mark.parametrize("method", ["cuda", "triton"])
def test_callers_gpu_ids_dropped_at_once_stay_valid_for_the_copy(method):
    """GPU ids made on the default stream, used on a side stream and dropped as copy_blocks returns: the
    caching allocator must not hand their memory to new tensors before the side stream read them."""
    src, dst, src_ids, dst_ids = _sides("h2d", "vllm", torch.bfloat16, _gen(46))
    expected = reference_copy(src, src_ids, dst, dst_ids)
    stream = torch.cuda.Stream()
    s = torch.tensor(src_ids, dtype=torch.int64, device="cuda")
    d = torch.tensor(dst_ids, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    kvcopy.copy_blocks(src, s, dst, d, method=method, stream=stream)
    del s, d
    reused = [torch.zeros(len(src_ids), dtype=torch.int64, device="cuda") for _ in range(2)]  # would take their memory
    stream.synchronize()
    assert_same_bytes(dst_bytes(dst), expected)
    del reused


@pytest.mark.parametrize("method", ["cuda", "triton"])
def test_callers_pinned_ids_changed_after_the_call_do_not_change_the_copy(method):
    src, dst, src_ids, dst_ids = _sides("h2d", "vllm", torch.bfloat16, _gen(47))
    expected = reference_copy(src, src_ids, dst, dst_ids)
    stream = torch.cuda.Stream()
    s = torch.tensor(src_ids, dtype=torch.int64).pin_memory()
    d = torch.tensor(dst_ids, dtype=torch.int64).pin_memory()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    kvcopy.copy_blocks(src, s, dst, d, method=method, stream=stream)
    s.copy_(s.flip(0))  # the caller reuses its buffers before the queued copy has read them
    d.copy_(d.flip(0))
    stream.synchronize()
    assert_same_bytes(dst_bytes(dst), expected)


def test_a_failed_submission_leaves_no_cuda_error_behind():
    """A copy-engine submission the runtime refuses (a null destination) raises, and the next unrelated torch
    op does not report kvcopy's error as its own."""
    fast = kvcopy._ext.extension()
    table = torch.tensor([[0, 64, 64]], dtype=torch.int64)  # block 0 at address 0: an invalid copy
    ids = torch.zeros(1, dtype=torch.int64)
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(RuntimeError, match="copy-engine submission failed"):
        fast.copy_blocks_dma(
            table.data_ptr(),
            table.data_ptr(),
            1,
            ids.data_ptr(),
            ids.data_ptr(),
            1,
            stream,
            torch.cuda.current_device(),
        )
    assert torch.ones(4, device="cuda").sum().item() == 4.0
    torch.cuda.synchronize()


def test_sm_kernel_grid_is_one_wave_of_resident_ctas():
    """The grid comes from the kernel's occupancy (its registers allow one 1024-thread CTA per SM on current
    GPUs), not a fixed two per SM that would run as two waves."""
    fast = kvcopy._ext.extension()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    big = 10**7
    for planes in (2, 64, 256):
        grid = fast.sm_kernel_grid(big, planes, 0)
        assert 1 <= grid <= 2 * num_sms and grid % num_sms == 0
        assert grid == num_sms, f"{grid} CTAs for {num_sms} SMs: more than one wave of 1024-thread CTAs"
    assert fast.sm_kernel_grid(big, 2, HOST_MEMORY_CTA_BUDGET) == HOST_MEMORY_CTA_BUDGET
    assert fast.sm_kernel_grid(40, 2, 0) == 2  # small work: only the CTAs it needs (32 warps each)


def test_other_python_threads_run_while_a_large_copy_is_planned():
    """The fast path releases the GIL while it plans and submits (2048 blocks x 64 planes into a page-first
    pool: 131k ranges): a Python thread keeps running meanwhile."""
    gen = _gen(48)
    # 256-byte plane-blocks (1 token x 1 head x 128 bf16): the ranges to plan are as many as at any block size,
    # without 4 GiB of random bytes to make and pin.
    kv, _ = make_vllm(32, 2048, 1, 1, 128, torch.bfloat16, gen, device="cuda")
    pool = kvcopy.HostKVPool(kv, 2048)
    ids = torch.randperm(2048).tolist()
    ticks, stop = [0], threading.Event()

    def count() -> None:
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0)  # hands the GIL back at once: the test's thread never waits long for it

    import sys

    interval = sys.getswitchinterval()
    sys.setswitchinterval(10.0)  # no switch forced while this thread runs Python: only a released GIL lets `count` in
    thread = threading.Thread(target=count)
    thread.start()
    try:
        time.sleep(0.01)  # a sleep releases the GIL: the counter starts
        before = ticks[0]
        kvcopy.copy_blocks(kv, ids, pool, list(range(2048)), method="copy_engine")
        during = ticks[0] - before
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        thread.join()
    torch.cuda.synchronize()
    assert during > 0


def test_the_side_stream_of_a_thread_is_freed_when_the_thread_exits():
    """copy_engine on torch's legacy default stream submits from a side stream of the calling thread; a thread
    that exits must not leave its stream and events behind."""
    fast = kvcopy._ext.extension()
    src, dst, src_ids, dst_ids = _sides("h2d", "vllm", torch.bfloat16, _gen(49))
    before = fast.dma_side_streams_alive()

    native_ids: list[int] = []

    def copy_on_the_default_stream() -> None:
        native_ids.append(threading.get_native_id())
        kvcopy.copy_blocks(src, src_ids, dst, dst_ids, method="copy_engine")
        torch.cuda.synchronize()

    threads = [threading.Thread(target=copy_on_the_default_stream) for _ in range(3)]
    for thread in threads:
        thread.start()
        thread.join()
    for native_id in native_ids:
        _wait_until_the_thread_has_exited(native_id)
    assert fast.dma_side_streams_alive() == before


def _wait_until_the_thread_has_exited(native_id: int) -> None:
    """Until the OS thread ``native_id`` of this process is gone. Thread.join() can return before that (Python
    3.12, the GPU machine's, as 3.11): it waits for the thread's Python state to be deleted, and the thread's
    C++ thread_local destructors, which free its side stream, run after that, as the OS thread exits. Tried on
    3.11 with a thread_local whose destructor sleeps: still alive after join(), gone once the thread was."""
    task = f"/proc/self/task/{native_id}"
    deadline = time.monotonic() + HANG_TIMEOUT_S  # against a hang only
    while os.path.exists(task):
        assert time.monotonic() < deadline, f"thread {native_id} did not exit"
        time.sleep(1e-3)
