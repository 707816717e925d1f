"""HostKVPool: byte layout of page_first and layer_first pools, buffer, pinning, bad arguments."""

from __future__ import annotations

import pytest
import torch

import kvcopy

from helpers import HAS_CUDA
from helpers.copies import byte_rows, make_flashinfer, make_vllm, random_bytes, random_tensor


def _like(gen) -> kvcopy.PagedKV:
    """Planes of different block sizes (uniform dtype, so any byte offset is aligned)."""
    planes = [
        random_tensor((5, 3, 5), torch.float16, gen),  # 30 B
        random_tensor((5, 7), torch.float16, gen),  # 14 B
        random_tensor((5,), torch.float16, gen),  # 2 B
        random_tensor((5, 2, 3, 2), torch.float16, gen),  # 24 B
    ]
    return kvcopy.PagedKV.from_planes(planes, planes_per_layer=2)


def _pattern(block: int, plane: int, nbytes: int) -> torch.Tensor:
    """Distinct bytes for every (block, plane) pair."""
    return ((torch.arange(nbytes, dtype=torch.int64) * 7 + block * 31 + plane * 101) % 251).to(torch.uint8)


def _write_patterns(pool: kvcopy.HostKVPool) -> None:
    for p, plane in enumerate(pool.paged.planes):
        rows = byte_rows(plane)
        for i in range(pool.paged.num_blocks):
            rows[i] = _pattern(i, p, rows.shape[1])


# --------------------------------------------------------------------------- page_first


@pytest.mark.parametrize("num_blocks", [1, 3, 8])
def test_page_first_byte_layout(gen, num_blocks):
    like = _like(gen)
    pool = kvcopy.HostKVPool(like, num_blocks, layout="page_first", pin_memory=False)
    assert pool.layout == "page_first"
    pool.buffer.fill_(0)
    _write_patterns(pool)
    npb = like.nbytes_per_block
    assert npb == 30 + 14 + 2 + 24
    assert pool.nbytes_per_block == npb
    expected = torch.empty(num_blocks * npb, dtype=torch.uint8)
    for i in range(num_blocks):
        offset = i * npb
        for p, nbytes in enumerate(like.plane_block_nbytes):
            expected[offset : offset + nbytes] = _pattern(i, p, nbytes)
            offset += nbytes
        assert offset == (i + 1) * npb  # no padding
        assert torch.equal(pool.block_bytes(i), expected[i * npb : (i + 1) * npb])
    assert torch.equal(pool.buffer, expected)


def test_page_first_buffer_writes_show_through_planes(gen):
    like = _like(gen)
    pool = kvcopy.HostKVPool(like, 4, layout="page_first", pin_memory=False)
    data = random_bytes(pool.buffer.numel(), gen)
    pool.buffer.copy_(data)
    npb = like.nbytes_per_block
    for p, plane in enumerate(pool.paged.planes):
        offset = sum(like.plane_block_nbytes[:p])
        for i in range(4):
            start = i * npb + offset
            assert torch.equal(byte_rows(plane)[i], data[start : start + like.plane_block_nbytes[p]])


def test_page_first_planes_match_like(gen):
    like, _ = make_flashinfer(2, 6, 3, 1, 5, torch.bfloat16, gen)
    pool = kvcopy.HostKVPool(like, 10, pin_memory=False)
    assert pool.layout == "page_first"  # the default
    assert pool.paged.num_planes == like.num_planes
    assert pool.paged.num_blocks == 10
    assert pool.num_blocks == 10
    assert pool.paged.plane_block_nbytes == like.plane_block_nbytes
    assert pool.paged.planes_per_layer == like.planes_per_layer
    for hp, lp in zip(pool.paged.planes, like.planes, strict=True):
        assert hp.dtype == lp.dtype
        assert hp.shape[1:] == lp.shape[1:]
        assert hp.device == torch.device("cpu")
        assert hp.untyped_storage().data_ptr() == pool.buffer.untyped_storage().data_ptr()


# --------------------------------------------------------------------------- layer_first


@pytest.mark.parametrize("num_blocks", [1, 5])
def test_layer_first_byte_layout(gen, num_blocks):
    like = _like(gen)
    pool = kvcopy.HostKVPool(like, num_blocks, layout="layer_first", pin_memory=False)
    assert pool.layout == "layer_first"
    pool.buffer.fill_(0)
    _write_patterns(pool)
    expected = torch.empty(num_blocks * like.nbytes_per_block, dtype=torch.uint8)
    offset = 0
    for p, nbytes in enumerate(like.plane_block_nbytes):
        for i in range(num_blocks):
            expected[offset + i * nbytes : offset + (i + 1) * nbytes] = _pattern(i, p, nbytes)
        offset += num_blocks * nbytes
    assert offset == pool.buffer.numel()
    assert torch.equal(pool.buffer, expected)
    for plane in pool.paged.planes:
        assert plane.is_contiguous()  # a layer-first plane holds all its blocks contiguously


def test_layer_first_has_no_block_bytes(gen):
    pool = kvcopy.HostKVPool(_like(gen), 3, layout="layer_first", pin_memory=False)
    with pytest.raises(ValueError):
        pool.block_bytes(0)


# --------------------------------------------------------------------------- buffer


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_buffer_is_one_contiguous_uint8_region(gen, layout):
    like, _ = make_vllm(3, 4, 3, 2, 5, torch.float8_e4m3fn, gen)
    pool = kvcopy.HostKVPool(like, 7, layout=layout, pin_memory=False)
    buf = pool.buffer
    assert buf.dtype == torch.uint8
    assert buf.dim() == 1
    assert buf.is_contiguous()
    assert buf.device == torch.device("cpu")
    assert buf.numel() == 7 * like.nbytes_per_block
    assert pool.nbytes == buf.numel()
    start, end = buf.data_ptr(), buf.data_ptr() + buf.numel()
    for plane in pool.paged.planes:
        first = plane.data_ptr()
        last = plane[-1].data_ptr() + plane[-1].numel() * plane.element_size()
        assert start <= first and last <= end


def test_block_bytes_range(gen):
    pool = kvcopy.HostKVPool(_like(gen), 3, pin_memory=False)
    with pytest.raises(IndexError):
        pool.block_bytes(3)
    with pytest.raises(IndexError):
        pool.block_bytes(-1)


def test_misaligned_page_first_layout_is_a_value_error():
    # A 3-byte uint8 plane then a float32 plane: a float32 block cannot start at byte 3 with no padding.
    like = kvcopy.PagedKV.from_planes([torch.zeros(4, 3, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.float32)])
    with pytest.raises(ValueError):
        kvcopy.HostKVPool(like, 4, layout="page_first", pin_memory=False)


# --------------------------------------------------------------------------- pinning and arguments


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-CUDA error")
def test_pin_memory_true_without_cuda_raises(gen):
    with pytest.raises(RuntimeError):
        kvcopy.HostKVPool(_like(gen), 2, pin_memory=True)


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-CUDA default")
def test_pin_memory_default_without_cuda_is_unpinned(gen):
    pool = kvcopy.HostKVPool(_like(gen), 2)
    assert pool.pinned is False
    assert pool.paged.is_pinned is False


@pytest.mark.parametrize("num_blocks", [0, -1, 2.0, True, "3", None])
def test_bad_num_blocks(gen, num_blocks):
    with pytest.raises((ValueError, TypeError)):
        kvcopy.HostKVPool(_like(gen), num_blocks, pin_memory=False)


def test_bad_layout(gen):
    with pytest.raises(ValueError, match="layout"):
        kvcopy.HostKVPool(_like(gen), 2, layout="block_first", pin_memory=False)


def test_like_must_be_paged_kv():
    with pytest.raises(TypeError):
        kvcopy.HostKVPool(torch.zeros(4, 3), 2, pin_memory=False)
