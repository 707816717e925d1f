"""Caches that share memory: a block read and a block written that share a byte is a ValueError naming the ids,
before anything is written, whatever objects the caches are (issue #32: "aliasing lost by copy_blocks").

The reference is independent of kvcopy: which bytes each block of each plane covers, from torch's own
``plane[i].data_ptr()``, compared pair by pair; and the expected bytes after a copy, computed on a clone of the
one buffer every view here is cut from.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcopy
from kvcopy.layout import memory_overlap

from helpers import CPU_METHODS

METHODS = (*CPU_METHODS, "auto")
ID_KINDS = {
    "list": list,
    "int64": lambda v: torch.tensor(v, dtype=torch.int64),  # the host fast path's ids
    "int32": lambda v: torch.tensor(v, dtype=torch.int32),
    "numpy": lambda v: np.array(v, dtype=np.int64),
}
BLOCK_ELEMENTS = 8  # float32 elements of one block in the hand-made cases: 32 bytes


def _buffer(num_elements: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        -(2**31), 2**31 - 1, (num_elements,), dtype=torch.int32, generator=torch.Generator().manual_seed(seed)
    ).view(torch.float32)


def _view(base: torch.Tensor, offset: int, num_blocks: int, stride: int, block: int) -> torch.Tensor:
    """``num_blocks`` blocks of ``block`` elements, ``stride`` elements apart, from element ``offset`` of ``base``."""
    return base.as_strided((num_blocks, block), (stride, 1), offset)


def _block_bytes(plane: torch.Tensor, block: int) -> tuple[int, int]:
    start = plane[block].data_ptr()
    return start, start + plane[block].numel() * plane.element_size()


def _shares_a_byte(src: kvcopy.PagedKV, src_ids: list[int], dst: kvcopy.PagedKV, dst_ids: list[int]) -> bool:
    """Brute force: does any block read share a byte with any block written, in any pair of planes."""
    for src_plane in src.planes:
        for dst_plane in dst.planes:
            for s in src_ids:
                read = _block_bytes(src_plane, s)
                for d in dst_ids:
                    written = _block_bytes(dst_plane, d)
                    if read[0] < written[1] and written[0] < read[1] and read[0] < read[1] and written[0] < written[1]:
                        return True
    return False


def _planes_meet(planes: list[torch.Tensor]) -> bool:
    """Brute force: do two planes of one cache share a byte (any of their blocks)."""
    one = [kvcopy.PagedKV.from_planes([plane]) for plane in planes]
    blocks = list(range(planes[0].shape[0]))
    return any(
        _shares_a_byte(one[i], blocks, one[j], blocks) for i in range(len(one)) for j in range(len(one)) if i < j
    )


def _expected(base: torch.Tensor, src, src_ids, dst, dst_ids) -> torch.Tensor:
    """``base``'s bytes after the copy, for a copy whose reads and writes share no byte (so order is moot)."""
    before = base.reshape(-1).view(torch.uint8).clone()
    after = before.clone()
    origin = base.data_ptr()
    for src_plane, dst_plane in zip(src.planes, dst.planes, strict=True):
        for s, d in zip(src_ids, dst_ids, strict=True):
            (rs, re), (ws, we) = _block_bytes(src_plane, s), _block_bytes(dst_plane, d)
            after[ws - origin : we - origin] = before[rs - origin : re - origin]
    return after


def _refused_and_untouched(base, src, src_ids, dst, dst_ids, method, kind="list") -> None:
    before = base.view(torch.uint8).clone()
    convert = ID_KINDS[kind]
    with pytest.raises(ValueError, match="dst_ids") as info:
        kvcopy.copy_blocks(src, convert(src_ids), dst, convert(dst_ids), method=method)
    assert "src_ids" in str(info.value) or "one cache" in str(info.value), info.value
    assert torch.equal(base.view(torch.uint8), before), "bytes were written before the error"


def _copied(base, src, src_ids, dst, dst_ids, method, kind="list") -> None:
    expected = _expected(base, src, src_ids, dst, dst_ids)
    convert = ID_KINDS[kind]
    kvcopy.copy_blocks(src, convert(src_ids), dst, convert(dst_ids), method=method)
    assert torch.equal(base.reshape(-1).view(torch.uint8), expected)


# --------------------------------------------------------------------------- the two cases of the issue


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", list(ID_KINDS))
def test_a_swap_between_two_paged_kvs_over_one_cache_is_refused(method, kind):
    """Two PagedKVs over the same tensors are one cache in memory: swapping blocks 1 and 2 would lose one."""
    keys, values = (
        _buffer(6 * BLOCK_ELEMENTS).view(6, BLOCK_ELEMENTS),
        _buffer(6 * BLOCK_ELEMENTS, 1).view(6, BLOCK_ELEMENTS),
    )
    first = kvcopy.PagedKV.from_planes([keys, values])
    second = kvcopy.PagedKV.from_planes([keys, values])
    assert _shares_a_byte(first, [1, 2], second, [2, 1])
    before = [keys.clone(), values.clone()]
    with pytest.raises(ValueError, match="dst_ids"):
        kvcopy.copy_blocks(first, ID_KINDS[kind]([1, 2]), second, ID_KINDS[kind]([2, 1]), method=method)
    assert torch.equal(keys, before[0]) and torch.equal(values, before[1])
    # Blocks that are not both read and written still copy.
    kvcopy.copy_blocks(first, ID_KINDS[kind]([1, 2]), second, ID_KINDS[kind]([4, 5]), method=method)
    assert torch.equal(keys[[4, 5]], before[0][[1, 2]]) and torch.equal(values[[4, 5]], before[1][[1, 2]])


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", list(ID_KINDS))
def test_a_view_shifted_by_one_block(method, kind):
    """dst = src shifted by one block: src block s is dst block s - 1 in memory."""
    base = _buffer(7 * BLOCK_ELEMENTS)
    src = kvcopy.PagedKV.from_planes([_view(base, 0, 6, BLOCK_ELEMENTS, BLOCK_ELEMENTS)])
    dst = kvcopy.PagedKV.from_planes([_view(base, BLOCK_ELEMENTS, 6, BLOCK_ELEMENTS, BLOCK_ELEMENTS)])
    for src_ids, dst_ids in (([1, 2], [1, 0]), ([3], [2]), ([0, 5], [3, 4])):  # a swap, one block, the last
        assert _shares_a_byte(src, src_ids, dst, dst_ids)
        _refused_and_untouched(base, src, src_ids, dst, dst_ids, method, kind)
    for src_ids, dst_ids in (([1, 2], [2, 3]), ([3, 0], [0, 3]), ([5], [5])):  # no read block is written
        assert not _shares_a_byte(src, src_ids, dst, dst_ids)
        _copied(base, src, src_ids, dst, dst_ids, method, kind)


@pytest.mark.parametrize("method", METHODS)
def test_a_shifted_view_asked_both_ways_after_the_first_answer_is_remembered(method):
    """``a`` and ``b``, ``b`` shifted by one block: a's block s is b's block s - 1, so a -> b overlaps at
    s - d = 1 and b -> a at s - d = -1. Each direction is its own answer: asked a -> b first (remembered), then
    b -> a, both agree with the reference, and so do the copies refused and made."""
    base = _buffer(7 * BLOCK_ELEMENTS)
    a = kvcopy.PagedKV.from_planes([_view(base, 0, 6, BLOCK_ELEMENTS, BLOCK_ELEMENTS)])
    b = kvcopy.PagedKV.from_planes([_view(base, BLOCK_ELEMENTS, 6, BLOCK_ELEMENTS, BLOCK_ELEMENTS)])
    blocks = list(range(6))
    for src, dst, shift in ((a, b, 1), (b, a, -1), (a, b, 1)):  # the first answer remembered, then the other
        overlap = memory_overlap(src, dst)
        assert overlap is not None and overlap.shifts == ((shift, shift),) and not overlap.strided
        for s in blocks:
            for d in blocks:
                ids = np.array([s]), np.array([d])
                assert (overlap.first_overlap(*ids) is not None) == _shares_a_byte(src, [s], dst, [d]), (s, d)
    # b -> a: b's block 1 is a's block 2 (refused); b's block 2 into a's block 1 reads no byte it writes
    assert _shares_a_byte(b, [1], a, [2]) and not _shares_a_byte(b, [2], a, [1])
    _refused_and_untouched(base, b, [1], a, [2], method)
    _copied(base, b, [2], a, [1], method)


# --------------------------------------------------------------------------- partial overlaps


@pytest.mark.parametrize("method", METHODS)
def test_a_view_shifted_by_half_a_block(method):
    """Every dst block overlaps two src blocks by half: s - d in {0, 1}."""
    half = BLOCK_ELEMENTS // 2
    base = _buffer(7 * BLOCK_ELEMENTS)
    src = kvcopy.PagedKV.from_planes([_view(base, 0, 6, BLOCK_ELEMENTS, BLOCK_ELEMENTS)])
    dst = kvcopy.PagedKV.from_planes([_view(base, half, 6, BLOCK_ELEMENTS, BLOCK_ELEMENTS)])
    for src_ids, dst_ids in (([2], [2]), ([3], [2]), ([0, 4], [5, 3])):
        _refused_and_untouched(base, src, src_ids, dst, dst_ids, method)
    for src_ids, dst_ids in (([4], [2]), ([1], [2]), ([0, 5], [2, 3])):
        assert not _shares_a_byte(src, src_ids, dst, dst_ids)
        _copied(base, src, src_ids, dst, dst_ids, method)


@pytest.mark.parametrize("method", METHODS)
def test_views_of_different_strides(method):
    """One buffer as [6, 2 * 4] and as [12, 4] float32 (with 8 extra bytes on each side of the small blocks):
    src block s covers dst blocks 2s and 2s + 1. Copies of one block size only: the planes of src and dst must
    match, so both sides are cut to blocks of 4 elements, src's 2 * 4 elements apart."""
    base = _buffer(12 * 4 + 8)
    src = kvcopy.PagedKV.from_planes([_view(base, 0, 6, 8, 4)])  # the first half of each 8-element row
    dst = kvcopy.PagedKV.from_planes([_view(base, 2, 12, 4, 4)])  # 4-element rows, from element 2
    # src block s = elements [8s, 8s + 4); dst block d = [2 + 4d, 6 + 4d): they meet for d in {2s - 1, 2s}
    _refused_and_untouched(base, src, [1], dst, [2], method)
    _refused_and_untouched(base, src, [1], dst, [1], method)
    _refused_and_untouched(base, src, [0, 3], dst, [9, 5], method)
    assert not _shares_a_byte(src, [1], dst, [3])
    _copied(base, src, [1], dst, [3], method)
    _copied(base, src, [0, 5], dst, [3, 4], method)


def test_a_layer_of_a_cache_and_the_cache_are_one_memory():
    kv = kvcopy.PagedKV.from_planes([_buffer(5 * 4).view(5, 4), _buffer(5 * 4, 1).view(5, 4)], planes_per_layer=1)
    before = kv.planes[0].clone()
    with pytest.raises(ValueError, match="dst_ids"):
        kvcopy.copy_blocks(kv.layer(0), [1, 2], kv.layer(0).layer(0), [2, 1])
    with pytest.raises(ValueError, match="dst_ids"):
        kvcopy.copy_blocks(kvcopy.PagedKV.from_planes([kv.planes[0]]), [3], kv.layer(0), [3], method="cpu")
    assert torch.equal(kv.planes[0], before)
    # The second plane is other memory: a copy from it into the first is fine.
    kvcopy.copy_blocks(kv.layer(1), [1, 2], kv.layer(0), [2, 1], method="cpu")
    assert torch.equal(kv.planes[0][[2, 1]], kv.planes[1][[1, 2]])


# --------------------------------------------------------------------------- what shares no memory


@pytest.mark.parametrize("method", METHODS)
def test_caches_over_different_memory_copy_any_ids(method):
    """Adjacent slices of one tensor share no byte, nor do caches over different tensors, however their
    allocations interleave: any ids copy, a swap of the same ids included."""
    base = _buffer(8 * BLOCK_ELEMENTS).view(8, BLOCK_ELEMENTS)
    left, right = kvcopy.PagedKV.from_planes([base[:4]]), kvcopy.PagedKV.from_planes([base[4:]])
    assert memory_overlap(left, right) is None and memory_overlap(right, left) is None
    _copied(base, left, [1, 2], right, [2, 1], method)
    planes = [_buffer(4 * BLOCK_ELEMENTS, seed).view(4, BLOCK_ELEMENTS) for seed in range(4)]
    first, second = kvcopy.PagedKV.from_planes(planes[0::2]), kvcopy.PagedKV.from_planes(planes[1::2])
    expected = [planes[0][[2, 1]].clone(), planes[2][[2, 1]].clone()]
    kvcopy.copy_blocks(first, [2, 1], second, [1, 2], method=method)
    assert torch.equal(planes[1][[1, 2]], expected[0]) and torch.equal(planes[3][[1, 2]], expected[1])


def test_interleaved_planes_of_one_pool_are_not_one_block():
    """A page_first pool's planes interleave block by block without sharing a byte: within the pool only a
    block both read and written is refused, not its neighbours."""
    kv = kvcopy.PagedKV.from_planes([_buffer(4 * 6).view(4, 6), _buffer(4 * 2, 1).view(4, 2)])
    pool = kvcopy.HostKVPool(kv, 4, pin_memory=False)
    pool.buffer.copy_(torch.randint(0, 256, (pool.nbytes,), dtype=torch.uint8, generator=torch.Generator()))
    assert memory_overlap(pool.paged, pool.paged).block_for_block
    before = pool.buffer.clone()
    kvcopy.copy_blocks(pool, [0, 1], pool, [2, 3], method="cpu")
    row = pool.nbytes_per_block
    assert torch.equal(pool.buffer[2 * row : 4 * row], before[0 : 2 * row])
    with pytest.raises(ValueError, match="dst_ids"):
        kvcopy.copy_blocks(pool, [0, 1], pool, [1, 3], method="cpu")


# --------------------------------------------------------------------------- every way in


def test_the_engine_refuses_a_pool_and_a_cache_over_one_memory():
    """TransferEngine goes through the same pipeline: a cache that is its own pool's memory is checked too."""
    like = kvcopy.PagedKV.from_planes([_buffer(4 * 6).view(4, 6)])
    pool = kvcopy.HostKVPool(like, 4, pin_memory=False)
    over_the_pool = kvcopy.PagedKV.from_planes(pool.paged.planes)
    before = pool.buffer.clone()
    with kvcopy.TransferEngine(over_the_pool, pool, method="cpu") as engine:
        with pytest.raises(ValueError, match="host_ids"):
            engine.offload([1, 2], [2, 1])
        with pytest.raises(ValueError, match="block_ids"):
            engine.reload([0], [0])
        assert torch.equal(pool.buffer, before)
        engine.offload([0], [3]).wait()  # other blocks: fine
    assert torch.equal(pool.buffer[3 * 24 : 4 * 24], before[0:24])


def test_copy_ranges_refuses_a_plan_over_shared_memory():
    base = _buffer(7 * BLOCK_ELEMENTS)
    src = kvcopy.PagedKV.from_planes([_view(base, 0, 6, BLOCK_ELEMENTS, BLOCK_ELEMENTS)])
    dst = kvcopy.PagedKV.from_planes([_view(base, BLOCK_ELEMENTS, 6, BLOCK_ELEMENTS, BLOCK_ELEMENTS)])
    with pytest.raises(ValueError, match="dst_ids"):
        kvcopy.copy_ranges(src, [2], dst, [1], method="cpu")
    assert len(kvcopy.copy_ranges(src, [2], dst, [2], method="cpu")) == 1


@pytest.mark.parametrize("shifted", [False, True])
def test_torch_compile_sees_shared_memory(shifted):
    """Traced copies check ids in the graph (block for block), or refuse to trace what only Python can check."""
    torch._dynamo.reset()
    base = _buffer(7 * BLOCK_ELEMENTS)
    src = kvcopy.PagedKV.from_planes([_view(base, 0, 6, BLOCK_ELEMENTS, BLOCK_ELEMENTS)])
    offset = BLOCK_ELEMENTS if shifted else 0
    dst = kvcopy.PagedKV.from_planes([_view(base, offset, 6, BLOCK_ELEMENTS, BLOCK_ELEMENTS)])

    def copy(s, d):
        kvcopy.copy_blocks(src, s, dst, d, method="cpu")

    compiled = torch.compile(copy, fullgraph=True, backend="eager")
    before = base.clone()
    if not shifted:  # block for block: the graph's own check raises at run time
        with pytest.raises(ValueError, match="dst_ids"):
            compiled(torch.tensor([1, 2]), torch.tensor([2, 1]))
    else:  # refused while tracing (fullgraph: torch wraps the ValueError, whose words it keeps)
        with pytest.raises(Exception, match="share memory"):
            compiled(torch.tensor([1, 2]), torch.tensor([1, 0]))
    assert torch.equal(base, before)


# --------------------------------------------------------------------------- any two views of one buffer


def _views(draw, base_elements: int, num_planes: int, block: int):
    planes = []
    for _ in range(num_planes):
        num_blocks = draw(st.integers(1, 6))
        stride = draw(st.integers(block, 3 * block))
        offset = draw(st.integers(0, base_elements - ((num_blocks - 1) * stride + block)))
        planes.append((offset, num_blocks, stride))
    count = min(n for _, n, _ in planes)
    return [(offset, count, stride) for offset, _, stride in planes]


@st.composite
def _shared_copies(draw):
    block = draw(st.integers(1, 6))
    base_elements = 20 * block
    num_planes = draw(st.integers(1, 2))
    src_views = _views(draw, base_elements, num_planes, block)
    dst_views = _views(draw, base_elements, num_planes, block)
    src_blocks, dst_blocks = src_views[0][1], dst_views[0][1]
    n = draw(st.integers(0, min(src_blocks, dst_blocks)))
    src_ids = draw(st.lists(st.integers(0, src_blocks - 1), min_size=n, max_size=n))
    dst_ids = draw(st.permutations(range(dst_blocks)))[:n]
    return (
        block,
        base_elements,
        src_views,
        dst_views,
        src_ids,
        list(dst_ids),
        draw(st.sampled_from(("cpu", "torch", "auto"))),
    )


@settings(max_examples=300, deadline=None)
@given(_shared_copies())
def test_any_two_views_of_one_buffer(case):
    """Whatever two caches cut from one buffer (offsets, strides, plane counts): refused exactly when a read
    block shares a byte with a written one, with nothing written; else copied as the reference says."""
    block, base_elements, src_views, dst_views, src_ids, dst_ids, method = case
    base = _buffer(base_elements)
    caches = []
    for views in (src_views, dst_views):
        planes = [_view(base, o, n, s, block) for o, n, s in views]
        if _planes_meet(planes):  # a cache whose own planes share a byte is refused when it is made
            with pytest.raises(ValueError, match=r"planes\[1\]: shares memory with planes\[0\]"):
                kvcopy.PagedKV.from_planes(planes)
            return
        caches.append(kvcopy.PagedKV.from_planes(planes))
    src, dst = caches
    if _shares_a_byte(src, src_ids, dst, dst_ids):
        _refused_and_untouched(base, src, src_ids, dst, dst_ids, method, "int64")
    else:
        _copied(base, src, src_ids, dst, dst_ids, method, "int64")
