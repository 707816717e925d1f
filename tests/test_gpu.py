"""CUDA methods against the reference: device <-> pinned host, device <-> device, streams, errors.

Every test here needs a CUDA GPU and is skipped without one.
"""

from __future__ import annotations

import pytest
import torch

import kvcopy
from conftest import (
    HAS_CUDA,
    assert_same_bytes,
    byte_rows,
    check_copy,
    dst_bytes,
    fill_random_,
    gpu,
    make_layout,
    random_tensor,
    reference_copy,
    requires_gpu,
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
@pytest.mark.parametrize(("layout", "dtype"), LAYOUT_DTYPES, ids=[l for l, _ in LAYOUT_DTYPES])
@pytest.mark.parametrize("method", GPU_METHODS + ("auto",))
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
        for block, target in zip(selected, targets):
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
@pytest.mark.parametrize("method", GPU_METHODS + ("auto",))
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
        kvcopy.copy_blocks(src, torch.tensor([0.0], device="cuda"), dst, torch.tensor([1], device="cuda"), method=method)
    with pytest.raises(ValueError, match="dst_ids"):
        kvcopy.copy_blocks(src, torch.tensor([0], device="cuda"), dst, torch.tensor([[1]], device="cuda"), method=method)
    with pytest.raises(ValueError, match="dst_ids"):
        kvcopy.copy_blocks(src, torch.tensor([0, 1], device="cuda"), dst, torch.tensor([1], device="cuda"), method=method)
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
        other = kvcopy.PagedKV.from_planes([random_tensor((6, *p.shape[1:]), p.dtype, gen, device="cuda")
                                            for p in dev.planes])
        src, dst = dev, other
    else:
        pool = kvcopy.HostKVPool(dev, 5, layout="page_first", pin_memory=True)
        fill_random_(pool, gen)
        src, dst = (dev, pool) if direction == "d2h" else (pool, dev)
    src_ids, dst_ids = [5, 0, 1, 1], [4, 0, 1, 2]
    check_copy(src, src_ids, dst, dst_ids, method=method)


@pytest.mark.parametrize("method", ["copy_engine", "auto", "cuda"])
def test_large_blocks(method):
    # 256 KiB plane-blocks: "auto" sends these to the copy engines.
    gen = _gen(12)
    dev = kvcopy.PagedKV.from_planes([random_tensor((6, 64 * 1024), torch.float32, gen, device="cuda")
                                      for _ in range(3)])
    pool = kvcopy.HostKVPool(dev, 5, pin_memory=True)
    fill_random_(pool, gen)
    check_copy(dev, [1, 2, 3, 5], pool, [0, 1, 2, 4], method=method)
    check_copy(pool, [4, 0, 1], dev, [0, 2, 3], method=method)


@pytest.mark.parametrize("method", GPU_METHODS)
def test_odd_sizes_and_alignments(method):
    # Block bytes not a multiple of 16 (or even 2), planes at odd offsets of a pinned pool.
    gen = _gen(13)
    dev = kvcopy.PagedKV.from_planes([
        random_tensor((7, 3, 5), torch.uint8, gen, device="cuda"),
        random_tensor((7, 13), torch.float8_e4m3fn, gen, device="cuda"),
        random_tensor((7,), torch.uint8, gen, device="cuda"),
    ])
    pool = kvcopy.HostKVPool(dev, 6, pin_memory=True)
    fill_random_(pool, gen)
    check_copy(dev, [6, 0, 1, 2], pool, [5, 0, 1, 2], method=method)
    check_copy(pool, [5, 0, 1], dev, [0, 4, 5], method=method)
