"""HostKVPool.over: a pool over host memory another owner allocated (vLLM's shared offload region, say).

What is checked: a pool over an owner's buffer lays its blocks out where a pool of its own would (page_first:
block i at bytes [i * block, (i + 1) * block) of the owner's memory), so what kvcopy copies into it is in the
owner's memory, bitwise; only its first ``num_blocks`` blocks are the pool's; bad memory is refused by name
before anything is made; and once the pool and its views are dropped, the owner can unmap its memory.
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

import kvcopy

from helpers import HAS_CUDA

BLOCK_ELEMENTS = (2, 3, 4)  # a plane block of 24 float32 = 96 bytes
NUM_BLOCKS = 5


def _like() -> kvcopy.PagedKV:
    planes = [torch.zeros((NUM_BLOCKS, *BLOCK_ELEMENTS), dtype=torch.float32) for _ in range(2)]
    return kvcopy.PagedKV.from_planes(planes, planes_per_layer=2)


def _cache() -> kvcopy.PagedKV:
    generator = torch.Generator().manual_seed(3)
    planes = [torch.randn((NUM_BLOCKS, *BLOCK_ELEMENTS), generator=generator) for _ in range(2)]
    return kvcopy.PagedKV.from_planes(planes, planes_per_layer=2)


def test_a_pool_over_an_owners_memory_holds_its_blocks_where_a_page_first_pool_does():
    cache = _cache()
    block = cache.nbytes_per_block
    owner = bytearray(block * (NUM_BLOCKS + 2))  # more than the pool's blocks: the rest stays the owner's
    pool = kvcopy.HostKVPool.over(memoryview(owner), cache, NUM_BLOCKS, pin_memory=False)
    assert (pool.num_blocks, pool.nbytes, pool.layout, pool.pinned) == (
        NUM_BLOCKS,
        block * NUM_BLOCKS,
        "page_first",
        False,
    )
    kvcopy.gather(cache, [0, 3, 4], pool, [4, 0, 2])
    got = np.frombuffer(owner, dtype=np.uint8)
    for src, dst in ((0, 4), (3, 0), (4, 2)):
        expected = torch.cat([plane[src].reshape(-1).view(torch.uint8) for plane in cache.planes]).numpy()
        assert np.array_equal(got[dst * block : (dst + 1) * block], expected), (src, dst)
    assert not got[NUM_BLOCKS * block :].any()  # beyond the pool's blocks: untouched


def test_a_pool_over_an_int8_row_view_as_vllm_gives_one():
    rows, row_bytes = 4, 4096
    owner = mmap.mmap(-1, rows * row_bytes)
    view = memoryview(owner).cast("b", (rows, row_bytes))  # as vLLM's primary_kv_view
    like = kvcopy.PagedKV.from_planes([torch.zeros((rows, row_bytes), dtype=torch.uint8)])
    pool = kvcopy.HostKVPool.over(view, like, rows, pin_memory=False)
    pool.block_bytes(2)[:] = 7
    assert owner[2 * row_bytes : 3 * row_bytes] == b"\x07" * row_bytes
    assert owner[: 2 * row_bytes] == bytes(2 * row_bytes)
    pool.close()
    del pool
    view.release()
    owner.close()  # nothing of kvcopy's holds the memory any more (else: BufferError, exported pointers exist)


def test_memory_that_cannot_be_a_pool_is_refused_by_name():
    like = _like()
    block = like.nbytes_per_block
    with pytest.raises(TypeError, match="memory: expected a writable buffer"):
        kvcopy.HostKVPool.over([0] * block * NUM_BLOCKS, like, NUM_BLOCKS, pin_memory=False)
    with pytest.raises(ValueError, match="memory: expected a writable buffer, got a read-only one"):
        kvcopy.HostKVPool.over(bytes(block * NUM_BLOCKS), like, NUM_BLOCKS, pin_memory=False)
    strided = np.zeros(2 * block * NUM_BLOCKS, dtype=np.uint8)[::2]
    with pytest.raises(ValueError, match="memory: expected a C-contiguous buffer"):
        kvcopy.HostKVPool.over(strided, like, NUM_BLOCKS, pin_memory=False)
    with pytest.raises(ValueError, match=rf"memory: expected at least {block * NUM_BLOCKS} bytes, got {block}"):
        kvcopy.HostKVPool.over(bytearray(block), like, NUM_BLOCKS, pin_memory=False)
    with pytest.raises(TypeError, match="like: expected a PagedKV"):
        kvcopy.HostKVPool.over(bytearray(block), object(), 1, pin_memory=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layout: expected one of"):
        kvcopy.HostKVPool.over(bytearray(block), like, 1, layout="rows", pin_memory=False)  # type: ignore[arg-type]


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal to pin without CUDA")
def test_pinning_an_owners_memory_without_cuda_is_refused():
    like = _like()
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        kvcopy.HostKVPool.over(bytearray(like.nbytes_per_block), like, 1, pin_memory=True)


def test_placed_planes_hold_each_block_at_the_owners_offset():
    """vLLM's primary region: a row per chunk, in it plane t's sub-blocks side by side ([t0: j0 j1 | t1: j0 j1]),
    padded. Pool j places plane t's block c at row c, sub-block j."""
    cache = _cache()
    page = cache.plane_block_nbytes[0]
    per_chunk, row = 2, 2 * 2 * page + 64  # two planes of two sub-blocks, and padding
    owner = bytearray(row * NUM_BLOCKS)
    pools = [
        kvcopy.HostKVPool.over(
            memoryview(owner),
            cache,
            NUM_BLOCKS,
            pin_memory=False,
            plane_offsets=[t * per_chunk * page + j * page for t in range(2)],
            block_stride=row,
        )
        for j in range(per_chunk)
    ]
    assert [p.layout for p in pools] == ["placed", "placed"]
    kvcopy.gather(cache, [1, 2], pools[0], [3, 0])  # sub-block 0 of chunks 3 and 0
    kvcopy.gather(cache, [4], pools[1], [3])  # sub-block 1 of chunk 3
    got = np.frombuffer(owner, dtype=np.uint8)
    for src, chunk, j in ((1, 3, 0), (2, 0, 0), (4, 3, 1)):
        for t, plane in enumerate(cache.planes):
            at = chunk * row + t * per_chunk * page + j * page
            assert np.array_equal(got[at : at + page], plane[src].reshape(-1).view(torch.uint8).numpy()), (src, t)
    written = {(c * row + t * per_chunk * page + j * page) for c, j in ((3, 0), (0, 0), (3, 1)) for t in range(2)}
    untouched = np.ones(len(owner), dtype=bool)
    for at in written:
        untouched[at : at + page] = False
    assert not got[untouched].any()


def test_placed_planes_that_overlap_or_do_not_fit_are_refused():
    like = _like()
    page = like.plane_block_nbytes[0]
    owner = bytearray(4 * page * NUM_BLOCKS)
    with pytest.raises(ValueError, match="shares memory"):
        kvcopy.HostKVPool.over(
            owner, like, NUM_BLOCKS, pin_memory=False, plane_offsets=[0, page // 2], block_stride=2 * page
        )
    with pytest.raises(ValueError, match="plane_offsets: expected one per plane"):
        kvcopy.HostKVPool.over(owner, like, NUM_BLOCKS, pin_memory=False, plane_offsets=[0], block_stride=2 * page)
    with pytest.raises(ValueError, match="give both"):
        kvcopy.HostKVPool.over(owner, like, NUM_BLOCKS, pin_memory=False, plane_offsets=[0, page])
    with pytest.raises(ValueError, match="memory: expected at least"):
        kvcopy.HostKVPool.over(
            owner, like, NUM_BLOCKS, pin_memory=False, plane_offsets=[0, page], block_stride=8 * page
        )
    with pytest.raises(ValueError, match="block_stride: expected at least a plane's block"):
        kvcopy.HostKVPool.over(
            owner, like, NUM_BLOCKS, pin_memory=False, plane_offsets=[0, page], block_stride=page - 1
        )


def test_pools_over_one_region_share_its_pinning():
    from kvcopy.host.memory import HostRegion

    like = _like()
    owner = bytearray(2 * like.nbytes_per_block * NUM_BLOCKS)
    region = HostRegion.over(owner, len(owner), pin=False)
    first = kvcopy.HostKVPool.over(region, like, NUM_BLOCKS)
    second = kvcopy.HostKVPool.over(
        region, like, NUM_BLOCKS, plane_offsets=[0, like.plane_block_nbytes[0]], block_stride=2 * like.nbytes_per_block
    )
    assert first.buffer.data_ptr() == second.buffer.data_ptr() == np.frombuffer(owner, dtype=np.uint8).ctypes.data
    with pytest.raises(ValueError, match="memory: expected at least"):
        kvcopy.HostKVPool.over(region, like, 3 * NUM_BLOCKS)
