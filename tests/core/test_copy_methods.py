"""copy_blocks / gather / scatter with every method that runs on CPU, checked bytewise against the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvcopy
from kvcopy import _ext

from helpers import CPU_METHODS, DTYPES, TRITON_ON_CPU
from helpers.copies import (
    LAYOUTS,
    assert_same_bytes,
    byte_rows,
    check_copy,
    dst_bytes,
    empty_like_kv,
    fill_random_,
    make_layout,
    paged,
    random_bytes,
    random_tensor,
    reference_copy,
    snapshot,
)

DEVICE_BLOCKS = 8
HOST_BLOCKS = 6
# Device -> host: a repeated source id (5), a run of adjacent ids on both sides (1,2,3 -> 0,1,2).
GATHER_IDS = ([5, 1, 2, 3, 5, 0], [4, 0, 1, 2, 5, 3])
# Host -> device: a repeated source id (2), a run (3,4 -> 1,2), destinations out of order.
SCATTER_IDS = ([2, 2, 3, 4, 0], [7, 0, 1, 2, 5])


def _method_cases():
    """Every method x layout x dtype (the triton interpreter is fast enough at these sizes)."""
    cases = []
    for method in CPU_METHODS:
        for layout in LAYOUTS:
            for dtype in DTYPES:
                cases.append(pytest.param(method, layout, dtype, id=f"{method}-{layout}-{str(dtype)[6:]}"))
    return cases


def _cache_and_pool(layout, dtype, host_layout, gen):
    kv = make_layout(layout, DEVICE_BLOCKS, dtype, gen)
    pool = kvcopy.HostKVPool(kv, HOST_BLOCKS, layout=host_layout, pin_memory=False)
    fill_random_(pool, gen)
    return kv, pool


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
@pytest.mark.parametrize(("method", "layout", "dtype"), _method_cases())
def test_gather(method, layout, dtype, host_layout, gen):
    kv, pool = _cache_and_pool(layout, dtype, host_layout, gen)
    src_ids, dst_ids = GATHER_IDS
    expected = reference_copy(kv, src_ids, pool, dst_ids)
    buffer_before = pool.buffer.clone()
    kvcopy.gather(kv, src_ids, pool, dst_ids, method=method)
    assert_same_bytes(dst_bytes(pool), expected)
    # Host blocks not named in dst_ids keep their bytes.
    if host_layout == "page_first":
        npb = pool.nbytes_per_block
        untouched = [i for i in range(HOST_BLOCKS) if i not in dst_ids]
        for i in untouched:
            assert torch.equal(pool.buffer[i * npb : (i + 1) * npb], buffer_before[i * npb : (i + 1) * npb])


@pytest.mark.parametrize("host_layout", ["page_first", "layer_first"])
@pytest.mark.parametrize(("method", "layout", "dtype"), _method_cases())
def test_scatter(method, layout, dtype, host_layout, gen):
    kv, pool = _cache_and_pool(layout, dtype, host_layout, gen)
    src_ids, dst_ids = SCATTER_IDS
    expected = reference_copy(pool, src_ids, kv, dst_ids)
    pool_before = pool.buffer.clone()
    kvcopy.scatter(pool, src_ids, kv, dst_ids, method=method)
    assert_same_bytes(dst_bytes(kv), expected)
    assert torch.equal(pool.buffer, pool_before)


@pytest.mark.parametrize("method", CPU_METHODS)
def test_gather_then_scatter_round_trip(method, gen):
    for layout in LAYOUTS:
        kv = make_layout(layout, DEVICE_BLOCKS, torch.bfloat16, gen)
        for host_layout in ("page_first", "layer_first"):
            pool = kvcopy.HostKVPool(kv, HOST_BLOCKS, layout=host_layout, pin_memory=False)
            fill_random_(pool, gen)
            original = [byte_rows(p).clone() for p in kv.planes]
            selected, host_ids = [6, 0, 3, 4], [1, 5, 2, 3]
            kvcopy.gather(kv, selected, pool, host_ids, method=method)
            fresh = empty_like_kv(kv, DEVICE_BLOCKS + 2, gen)
            fresh_before = [byte_rows(p).clone() for p in fresh.planes]
            targets = [9, 1, 2, 8]
            kvcopy.scatter(pool, host_ids, fresh, targets, method=method)
            for p, plane in enumerate(fresh.planes):
                rows = byte_rows(plane)
                for block, target in zip(selected, targets, strict=True):
                    assert torch.equal(rows[target], original[p][block]), (layout, host_layout, p, block)
                for other in set(range(DEVICE_BLOCKS + 2)) - set(targets):
                    assert torch.equal(rows[other], fresh_before[p][other])


# --------------------------------------------------------------------------- ids


ID_PATTERNS = {
    "single": ([3], [0]),
    "all": (list(range(DEVICE_BLOCKS)), list(range(DEVICE_BLOCKS))),
    "all_reversed": (list(range(DEVICE_BLOCKS)), list(range(DEVICE_BLOCKS))[::-1]),
    "same_src_everywhere": ([4] * DEVICE_BLOCKS, list(range(DEVICE_BLOCKS))),
    "adjacent_runs": ([0, 1, 2, 5, 6, 7], [2, 3, 4, 0, 1, 6]),
    "run_src_only": ([1, 2, 3, 4], [7, 5, 3, 1]),
    "run_dst_only": ([6, 2, 7, 0], [3, 4, 5, 6]),
    "runs_broken_by_repeat": ([2, 3, 3, 4], [0, 1, 2, 3]),
    "descending": ([7, 6, 5, 4], [3, 2, 1, 0]),
}


@pytest.mark.parametrize("pattern", list(ID_PATTERNS))
@pytest.mark.parametrize("method", CPU_METHODS)
def test_id_patterns_device_to_device(method, pattern, gen):
    src = make_layout("flashinfer", DEVICE_BLOCKS, torch.float16, gen)
    dst = make_layout("flashinfer", DEVICE_BLOCKS, torch.float16, gen)
    src_ids, dst_ids = ID_PATTERNS[pattern]
    check_copy(src, src_ids, dst, dst_ids, method=method)


@pytest.mark.parametrize("pattern", list(ID_PATTERNS))
@pytest.mark.parametrize("method", ["torch", "cpu"])
def test_id_patterns_to_pool(method, pattern, gen):
    src = make_layout("vllm", DEVICE_BLOCKS, torch.bfloat16, gen)
    pool = kvcopy.HostKVPool(src, DEVICE_BLOCKS, pin_memory=False)
    fill_random_(pool, gen)
    src_ids, dst_ids = ID_PATTERNS[pattern]
    check_copy(src, src_ids, pool, dst_ids, method=method)


ID_KINDS = {
    "list": lambda ids: list(ids),
    "tuple": lambda ids: tuple(ids),
    "int32": lambda ids: torch.tensor(ids, dtype=torch.int32),
    "int64": lambda ids: torch.tensor(ids, dtype=torch.int64),
    "numpy_int64": lambda ids: np.array(ids, dtype=np.int64),
    "numpy_int32": lambda ids: np.array(ids, dtype=np.int32),
    "numpy_scalars": lambda ids: [np.int64(i) for i in ids],
    "non_contiguous_int64": lambda ids: torch.tensor([v for i in ids for v in (i, -99)], dtype=torch.int64)[::2],
}


@pytest.mark.parametrize("kind", list(ID_KINDS))
@pytest.mark.parametrize("method", (*CPU_METHODS, "auto"))
def test_id_kinds(method, kind, gen):
    src = make_layout("mla", DEVICE_BLOCKS, torch.bfloat16, gen)
    pool = kvcopy.HostKVPool(src, HOST_BLOCKS, pin_memory=False)
    fill_random_(pool, gen)
    src_ids, dst_ids = GATHER_IDS
    expected = reference_copy(src, src_ids, pool, dst_ids)
    convert = ID_KINDS[kind]
    s, d = convert(src_ids), convert(dst_ids)
    s_before = s.clone() if isinstance(s, torch.Tensor) else None
    kvcopy.copy_blocks(src, s, pool, d, method=method)
    assert_same_bytes(dst_bytes(pool), expected)
    if s_before is not None:
        assert torch.equal(s, s_before)  # ids are not modified


@pytest.mark.parametrize("method", (*CPU_METHODS, "auto"))
def test_range_ids(method, gen):
    src = make_layout("vllm", DEVICE_BLOCKS, torch.float16, gen)
    pool = kvcopy.HostKVPool(src, HOST_BLOCKS, pin_memory=False)
    fill_random_(pool, gen)
    check_copy(src, range(3, 8), pool, range(0, 5), method=method)


@pytest.mark.parametrize(
    "empty",
    [[], (), torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int32), np.empty(0, dtype=np.int64)],
    ids=["list", "tuple", "int64", "int32", "numpy"],
)
@pytest.mark.parametrize("method", (*CPU_METHODS, "auto"))
def test_empty_ids_change_nothing(method, empty, gen):
    src = make_layout("vllm", DEVICE_BLOCKS, torch.float8_e4m3fn, gen)
    pool = kvcopy.HostKVPool(src, HOST_BLOCKS, pin_memory=False)
    fill_random_(pool, gen)
    before = snapshot(pool)
    kvcopy.gather(src, empty, pool, empty, method=method)
    assert_same_bytes(snapshot(pool), before)
    src_before = snapshot(src)
    kvcopy.scatter(pool, empty, src, empty, method=method)
    assert_same_bytes(snapshot(src), src_before)


# --------------------------------------------------------------------------- other pairs


@pytest.mark.parametrize("method", (*CPU_METHODS, "auto"))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_paged_to_paged_on_cpu(method, layout, gen):
    src = make_layout(layout, DEVICE_BLOCKS, torch.float32, gen)
    dst = make_layout(layout, DEVICE_BLOCKS + 3, torch.float32, gen)
    check_copy(src, [0, 7, 3, 3, 4], dst, [10, 0, 5, 6, 7], method=method)


@pytest.mark.parametrize("method", CPU_METHODS)
def test_between_layouts_with_equal_block_bytes(method, gen):
    # vLLM K/V planes and FlashInfer K/V planes have the same block shapes: copy between them.
    src = make_layout("vllm", DEVICE_BLOCKS, torch.bfloat16, gen)
    dst = make_layout("flashinfer", DEVICE_BLOCKS, torch.bfloat16, gen)
    check_copy(src, [1, 2, 3, 0], dst, [5, 6, 7, 0], method=method)
    check_copy(dst, [5, 6], src, [2, 1], method=method)


@pytest.mark.parametrize("method", CPU_METHODS)
def test_within_one_cache(method, gen):
    # Copy-on-write style: blocks copied to other blocks of the same cache (disjoint ids).
    kv = make_layout("flashinfer", DEVICE_BLOCKS, torch.float16, gen)
    check_copy(kv, [0, 1, 2], kv, [5, 6, 7], method=method)


@pytest.mark.parametrize("method", CPU_METHODS)
def test_pool_to_pool(method, gen):
    like = make_layout("planes", 4, torch.float16, gen)
    a = kvcopy.HostKVPool(like, 5, layout="page_first", pin_memory=False)
    b = kvcopy.HostKVPool(like, 7, layout="layer_first", pin_memory=False)
    fill_random_(a, gen)
    fill_random_(b, gen)
    check_copy(a, [4, 0, 1], b, [6, 1, 2], method=method)
    check_copy(b, [6, 1, 2, 3], a, [0, 1, 2, 4], method=method)


@pytest.mark.parametrize("method", CPU_METHODS)
def test_mixed_dtype_planes(method, gen):
    shapes = [(3, 5), (2, 7), (11,), (), (1, 3)]
    dtypes = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float16, torch.uint8]
    src = kvcopy.PagedKV.from_planes([random_tensor((6, *s), d, gen) for s, d in zip(shapes, dtypes, strict=True)])
    dst = kvcopy.PagedKV.from_planes([random_tensor((9, *s), d, gen) for s, d in zip(shapes, dtypes, strict=True)])
    check_copy(src, [5, 0, 1, 1], dst, [8, 2, 3, 0], method=method)


@pytest.mark.parametrize("method", CPU_METHODS)
def test_single_element_blocks_with_odd_strides(method, gen):
    # Blocks of one element whose size-1 dim has a non-unit stride (a column of a transposed
    # matrix): PagedKV accepts it (each block is trivially contiguous), so every method must copy it.
    base = random_tensor((3, 10), torch.float16, gen)
    plane = base.t()[:, :1]  # shape [10, 1], strides (1, 10)
    src = kvcopy.PagedKV.from_planes([plane])
    dst = kvcopy.PagedKV.from_planes([random_tensor((4, 1), torch.float16, gen)])
    check_copy(src, [9, 0, 4], dst, [0, 3, 1], method=method)


def test_available_methods_on_cpu(gen):
    kv = make_layout("vllm", 4, torch.bfloat16, gen)
    pool = kvcopy.HostKVPool(kv, 4, pin_memory=False)
    methods = kvcopy.available_methods(kv, pool)
    assert methods[0] == "torch"
    assert set(methods) == ({"torch", "cpu", "triton"} if TRITON_ON_CPU else {"torch", "cpu"})
    assert kvcopy.available_methods(pool, kv) == methods
    assert kvcopy.available_methods(kv, kv) == methods
    assert set(kvcopy.METHODS) == {"torch", "cpu", "triton", "cuda", "copy_engine"}


# --------------------------------------------------------------------------- large: threaded CPU path


def _big_planes(num_planes, num_blocks, block_bytes, *, strided):
    """Planes of random-ish bytes, cheap to fill: int64 arange hashed per plane."""
    words = block_bytes // 8
    planes = []
    layer = None
    for p in range(num_planes):
        if strided and p % 2 == 0:
            layer = torch.empty(num_blocks, 2, words, dtype=torch.int64)
            flat = layer.view(-1)
            flat.copy_(torch.arange(flat.numel(), dtype=torch.int64) * 0x1E3779B9 + p * 0x232BE59B)
        if strided:
            planes.append(layer[:, p % 2])
        else:
            t = torch.arange(num_blocks * words, dtype=torch.int64) * 0x1E3779B9 + p * 0x232BE59B
            planes.append(t.view(num_blocks, words))
    return kvcopy.PagedKV.from_planes(planes)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ids", "strided"),
    [("random", False), ("sequential", False), ("random", True)],
)
def test_cpu_method_above_one_mib(ids, strided):
    # 64 planes x 32 KiB blocks x 40 blocks = 80 MiB: well above the threaded-copy threshold.
    num_planes, block_bytes, num_ids = 64, 32 * 1024, 40
    src = _big_planes(num_planes, 48, block_bytes, strided=strided)
    pool = kvcopy.HostKVPool(src, 44, pin_memory=False)
    pool.buffer.fill_(0x5A)
    rng = np.random.default_rng(7)
    if ids == "random":
        src_ids = rng.choice(48, size=num_ids, replace=True)
        dst_ids = rng.permutation(44)[:num_ids]
    else:
        src_ids = np.arange(3, 3 + num_ids)
        dst_ids = np.arange(2, 2 + num_ids)
    expected = reference_copy(src, src_ids, pool, dst_ids)
    kvcopy.gather(src, src_ids, pool, dst_ids, method="cpu")
    assert_same_bytes(dst_bytes(pool), expected)
    # And back into a zeroed cache through scatter.
    back = kvcopy.PagedKV.from_planes([torch.zeros_like(p) for p in src.planes])
    expected = reference_copy(pool, dst_ids, back, src_ids if ids == "sequential" else np.arange(num_ids))
    kvcopy.scatter(pool, dst_ids, back, src_ids if ids == "sequential" else np.arange(num_ids), method="cpu")
    assert_same_bytes(dst_bytes(back), expected)


# --------------------------------------------------------------------------- the reference itself


def test_reference_copy_by_hand():
    src = kvcopy.PagedKV.from_planes([torch.arange(12, dtype=torch.int16).view(4, 3)])
    dst = kvcopy.PagedKV.from_planes([torch.full((3, 3), -1, dtype=torch.int16)])
    (expected,) = reference_copy(src, [3, 0], dst, [0, 2])
    want = torch.tensor([[9, 10, 11], [-1, -1, -1], [0, 1, 2]], dtype=torch.int16)
    assert torch.equal(expected, want.view(torch.uint8).view(3, 6))
    assert torch.equal(dst.planes[0], torch.full((3, 3), -1, dtype=torch.int16))  # works on a clone


def test_cpu_method_streaming_stores_with_unaligned_blocks(gen):
    # 8 planes x 64 blocks x 33,001 B = 16.9 MB: above the 16 MiB non-temporal-store threshold, with block
    # sizes and page_first offsets that are not multiples of 16, so every piece has an unaligned head and tail.
    num_planes, num_blocks, block_bytes = 8, 64, 33_001
    src = kvcopy.PagedKV.from_planes(
        [random_bytes(num_blocks * block_bytes, gen).view(num_blocks, block_bytes) for _ in range(num_planes)]
    )
    pool = kvcopy.HostKVPool(src, num_blocks, pin_memory=False)
    pool.buffer.fill_(0xA5)
    src_ids = torch.randperm(num_blocks, generator=gen)
    dst_ids = torch.randperm(num_blocks, generator=gen)
    expected = reference_copy(src, src_ids, pool, dst_ids)
    kvcopy.gather(src, src_ids, pool, dst_ids, method="cpu")
    assert_same_bytes(dst_bytes(pool), expected)


# --------------------------------------------------------------------------- the streaming path's plan

# csrc/cpu/copy_blocks_cpu.cpp, kStreamingMinBytes: calls from this size stream, with their ids in source order.
STREAMING_MIN_BYTES = 16 << 20


def _cpu_plan(src, src_ids, dst, dst_ids, num_threads=2):
    """The plan copy_blocks_cpu follows for these arguments (kvcopy._C.plan_copy_blocks_cpu): pieces as
    (src address, dst address, bytes) in copy order, each thread's first piece, streaming, source order."""
    src_t = torch.as_tensor(src_ids, dtype=torch.int64).contiguous()
    dst_t = torch.as_tensor(dst_ids, dtype=torch.int64).contiguous()
    src_kv, dst_kv = paged(src), paged(dst)
    return _ext.loaded_extension().plan_copy_blocks_cpu(
        src_kv.plane_table.data_ptr(),
        dst_kv.plane_table.data_ptr(),
        src_kv.num_planes,
        src_t.data_ptr(),
        dst_t.data_ptr(),
        src_t.numel(),
        num_threads,
    )


def _block_pairs(pieces, src, dst, plane):
    """(source block, destination block) of each piece of ``plane``, in copy order."""
    s_plane, d_plane = paged(src).planes[plane], paged(dst).planes[plane]
    s_base, d_base = s_plane.data_ptr(), d_plane.data_ptr()
    s_stride = s_plane.stride(0) * s_plane.element_size()
    d_stride = d_plane.stride(0) * d_plane.element_size()
    block_bytes = byte_rows(s_plane).shape[1]
    return [
        ((s - s_base) // s_stride, (d - d_base) // d_stride)
        for s, d, n in pieces
        if 0 <= s - s_base < s_plane.shape[0] * s_stride and n == block_bytes
    ]


@pytest.mark.skipif("cpu" not in CPU_METHODS or not _ext.has_cpu_kernels(), reason="needs the compiled extension")
def test_cpu_streaming_gather_of_random_ids_runs_in_source_order(gen):
    # 8 planes x 32 KiB x 72 blocks = 18 MiB, random ids with a repeated source: the streaming path copies the
    # pairs sorted by source block (stable: a repeated source keeps its destinations' order), and every byte
    # lands where plain indexing puts it.
    num_planes, block_bytes, num_ids = 8, 32 * 1024, 72
    src = _big_planes(num_planes, 96, block_bytes, strided=False)
    pool = kvcopy.HostKVPool(src, num_ids, pin_memory=False)
    pool.buffer.fill_(0x5A)
    src_ids = torch.randperm(96, generator=gen)[:num_ids]
    src_ids[10] = src_ids[40]  # a block gathered twice
    dst_ids = torch.randperm(num_ids, generator=gen)
    assert num_ids * num_planes * block_bytes >= STREAMING_MIN_BYTES

    pieces, first_piece, streaming, source_order = _cpu_plan(src, src_ids, pool, dst_ids)
    assert streaming and source_order
    expected_pairs = sorted(zip(src_ids.tolist(), dst_ids.tolist(), strict=True), key=lambda pair: pair[0])
    for plane in range(num_planes):
        assert _block_pairs(pieces, src, pool, plane) == expected_pairs
    assert first_piece[0] == 0 and first_piece[-1] == len(pieces) and len(first_piece) == 3

    expected = reference_copy(src, src_ids, pool, dst_ids)
    kvcopy.gather(src, src_ids, pool, dst_ids, method="cpu")
    assert_same_bytes(dst_bytes(pool), expected)


@pytest.mark.skipif("cpu" not in CPU_METHODS or not _ext.has_cpu_kernels(), reason="needs the compiled extension")
def test_cpu_plan_keeps_the_given_order_when_sorted_or_below_streaming(gen):
    num_planes, block_bytes = 8, 32 * 1024
    src = _big_planes(num_planes, 96, block_bytes, strided=False)
    pool = kvcopy.HostKVPool(src, 72, pin_memory=False)
    # Streaming-sized, already in source order: nothing to sort.
    src_ids, dst_ids = torch.arange(10, 82), torch.randperm(72, generator=gen)
    pieces, _, streaming, source_order = _cpu_plan(src, src_ids, pool, dst_ids)
    assert streaming and not source_order
    assert _block_pairs(pieces, src, pool, 0) == list(zip(src_ids.tolist(), dst_ids.tolist(), strict=True))
    # Unsorted but small (8 blocks = 2 MiB): ordinary stores, the ids as given.
    src_ids, dst_ids = torch.randperm(96, generator=gen)[:8], torch.randperm(72, generator=gen)[:8]
    pieces, first_piece, streaming, source_order = _cpu_plan(src, src_ids, pool, dst_ids)
    assert not streaming and not source_order and len(first_piece) == 3  # 2 MiB: still two threads
    assert _block_pairs(pieces, src, pool, 0) == list(zip(src_ids.tolist(), dst_ids.tolist(), strict=True))


@pytest.mark.skipif("cpu" not in CPU_METHODS or not _ext.has_cpu_kernels(), reason="needs the compiled extension")
def test_cpu_streaming_lookahead_across_pieces_of_every_size(gen):
    # Planes of 1.25 MiB (cut into a 1 MiB and a 256 KiB piece), 24 KiB, 4 KiB + 8 B, 512 B, 100 B and 8 B: the
    # prefetches run on from one piece into the next whatever their sizes and alignments. 14 blocks = 18.1 MB,
    # streaming; gathered in random order, then scattered back.
    plane_bytes = [1280 * 1024, 24 * 1024, 4096 + 8, 512, 100, 8]
    num_blocks, num_ids = 20, 14
    src = kvcopy.PagedKV.from_planes([random_bytes(num_blocks * n, gen).view(num_blocks, n) for n in plane_bytes])
    pool = kvcopy.HostKVPool(src, num_ids, pin_memory=False)
    pool.buffer.fill_(0xA5)
    src_ids = torch.randperm(num_blocks, generator=gen)[:num_ids]
    dst_ids = torch.randperm(num_ids, generator=gen)
    assert num_ids * sum(plane_bytes) >= STREAMING_MIN_BYTES
    pieces, _, streaming, source_order = _cpu_plan(src, src_ids, pool, dst_ids)
    assert streaming and source_order
    assert {n for _, _, n in pieces} >= {1 << 20, 256 * 1024, 100, 8}

    expected = reference_copy(src, src_ids, pool, dst_ids)
    kvcopy.gather(src, src_ids, pool, dst_ids, method="cpu")
    assert_same_bytes(dst_bytes(pool), expected)

    back = kvcopy.PagedKV.from_planes([torch.zeros_like(p) for p in src.planes])
    back_ids = torch.randperm(num_blocks, generator=gen)[:num_ids]
    expected = reference_copy(pool, dst_ids, back, back_ids)
    kvcopy.scatter(pool, dst_ids, back, back_ids, method="cpu")
    assert_same_bytes(dst_bytes(back), expected)


# --------------------------------------------------------------------------- merged ranges (CPU planner)


# FlashInfer K and V of a block are adjacent on the device and side by side in a page_first host
# block, so the planner merges them into one range per layer (with one layer: a run of adjacent ids
# is one range). Runs of several lengths, a run on one side only, and ids out of order.
FLASHINFER_RUN_IDS = {
    "runs": ([0, 1, 2, 3, 8, 9, 10, 5], [4, 5, 6, 7, 0, 1, 2, 9]),
    "one_long_run": (list(range(2, 12)), list(range(1, 11))),
    "src_gap_dst_run": ([3, 4, 5, 7, 8], [0, 1, 2, 3, 4]),
    "reversed": ([11, 10, 9, 8], [0, 1, 2, 3]),
}


@pytest.mark.parametrize("num_layers", [1, 3])
@pytest.mark.parametrize("ids", list(FLASHINFER_RUN_IDS))
@pytest.mark.parametrize("method", CPU_METHODS)
def test_flashinfer_page_first_merged_ranges(method, ids, num_layers, gen):
    kv = make_layout("flashinfer", 12, torch.bfloat16, gen, block_size=4, heads=2, head_dim=8, num_layers=num_layers)
    pool = kvcopy.HostKVPool(kv, 12, layout="page_first", pin_memory=False)
    fill_random_(pool, gen)
    src_ids, dst_ids = FLASHINFER_RUN_IDS[ids]
    check_copy(kv, src_ids, pool, dst_ids, method=method)  # device -> host
    fill_random_(kv, gen)
    check_copy(pool, dst_ids, kv, src_ids, method=method)  # host -> device
    # Random ids, both directions.
    perm_src = torch.randperm(12, generator=gen)[:9]
    perm_dst = torch.randperm(12, generator=gen)[:9]
    check_copy(kv, perm_src, pool, perm_dst, method=method)
    check_copy(pool, perm_src, kv, perm_dst, method=method)


# --------------------------------------------------------------------------- zero-byte planes


def _with_empty_planes(num_blocks, gen, *, empty_first):
    """Planes of 12 B and 6 B with a zero-byte plane (shape [num_blocks, 0]) among them."""
    planes = [
        random_tensor((num_blocks, 3, 2), torch.bfloat16, gen),
        torch.empty(num_blocks, 0, dtype=torch.bfloat16),
        random_tensor((num_blocks, 6), torch.uint8, gen),
    ]
    if empty_first:
        planes = [torch.empty(num_blocks, 0, dtype=torch.float16), *planes]
    return kvcopy.PagedKV.from_planes(planes)


@pytest.mark.parametrize("empty_first", [False, True])
@pytest.mark.parametrize("method", (*CPU_METHODS, "auto"))
def test_zero_byte_planes(method, empty_first, gen):
    kv = _with_empty_planes(DEVICE_BLOCKS, gen, empty_first=empty_first)
    assert 0 in kv.plane_block_nbytes
    other = _with_empty_planes(DEVICE_BLOCKS + 2, gen, empty_first=empty_first)
    check_copy(kv, [0, 1, 2, 7, 7], other, [3, 4, 5, 0, 9], method=method)
    for host_layout in ("page_first", "layer_first"):
        pool = kvcopy.HostKVPool(kv, HOST_BLOCKS, layout=host_layout, pin_memory=False)
        assert pool.nbytes == HOST_BLOCKS * (12 + 6)
        fill_random_(pool, gen)
        check_copy(kv, [0, 1, 2, 7], pool, [1, 2, 3, 5], method=method)
        check_copy(pool, [5, 1, 2, 3], kv, [3, 4, 5, 6], method=method)
        pool_b = kvcopy.HostKVPool(kv, HOST_BLOCKS, layout="layer_first", pin_memory=False)
        fill_random_(pool_b, gen)
        check_copy(pool, [0, 1, 2], pool_b, [3, 4, 5], method=method)  # layer_first: empty planes have stride 0


@pytest.mark.parametrize("method", (*CPU_METHODS, "auto"))
def test_only_zero_byte_planes(method, gen):
    kv = kvcopy.PagedKV.from_planes([torch.empty(4, 0, dtype=torch.float16), torch.empty(4, 0, dtype=torch.uint8)])
    assert kv.nbytes_per_block == 0
    other = kvcopy.PagedKV.from_planes([torch.empty(5, 0, dtype=torch.float16), torch.empty(5, 0, dtype=torch.uint8)])
    check_copy(kv, [0, 1, 3], other, [4, 0, 1], method=method)
    pool = kvcopy.HostKVPool(kv, 3, pin_memory=False)
    check_copy(kv, [3, 2], pool, [0, 2], method=method)
    check_copy(pool, [0, 2], kv, [1, 0], method=method)
    with pytest.raises(IndexError, match="dst_ids"):  # ids are still checked
        kvcopy.copy_blocks(kv, [0], pool, [3], method=method)
