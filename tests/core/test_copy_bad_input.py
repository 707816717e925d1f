"""Bad input: the right exception, a message naming the argument, and no byte of dst moved."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvcopy

from helpers import CPU_METHODS
from helpers.copies import assert_same_bytes, check_copy, fill_random_, make_layout, random_tensor, snapshot

METHODS = (*CPU_METHODS, "auto")
NUM_BLOCKS = 6


@pytest.fixture
def pair(gen):
    """A device-side cache (on the CPU here) and a page_first host pool with random bytes."""
    kv = make_layout("vllm", NUM_BLOCKS, torch.bfloat16, gen)
    pool = kvcopy.HostKVPool(kv, NUM_BLOCKS, pin_memory=False)
    fill_random_(pool, gen)
    return kv, pool


def _expect_no_copy(exc, match, src, src_ids, dst, dst_ids, method):
    before = snapshot(dst)
    src_before = snapshot(src)
    with pytest.raises(exc, match=match):
        kvcopy.copy_blocks(src, src_ids, dst, dst_ids, method=method)
    assert_same_bytes(snapshot(dst), before)
    assert_same_bytes(snapshot(src), src_before)


# --------------------------------------------------------------------------- ids: range


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "name"),
    [
        ([0, 1, NUM_BLOCKS], [0, 1, 2], "src_ids"),
        ([0, 1, 2], [0, 1, NUM_BLOCKS], "dst_ids"),
        ([0, -1, 2], [0, 1, 2], "src_ids"),
        ([0, 1, 2], [-1, 1, 2], "dst_ids"),
        ([0, 1, 2], [3, 4, 10**6], "dst_ids"),
    ],
)
@pytest.mark.parametrize("kind", ["list", "int64", "int32", "numpy"])
def test_out_of_range_ids(pair, method, src_ids, dst_ids, name, kind):
    kv, pool = pair
    convert = {
        "list": list,
        "int64": lambda v: torch.tensor(v, dtype=torch.int64),
        "int32": lambda v: torch.tensor(v, dtype=torch.int32),
        "numpy": lambda v: np.array(v, dtype=np.int64),
    }[kind]
    _expect_no_copy(IndexError, name, kv, convert(src_ids), pool, convert(dst_ids), method)
    _expect_no_copy(IndexError, name, pool, convert(src_ids), kv, convert(dst_ids), method)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("huge", [2**63, 2**70, -(2**70)])
def test_ids_beyond_int64(pair, method, huge):
    kv, pool = pair
    _expect_no_copy(IndexError, "src_ids", kv, [huge], pool, [0], method)
    _expect_no_copy(IndexError, "dst_ids", kv, [0], pool, [huge], method)


@pytest.mark.parametrize("method", METHODS)
def test_out_of_range_among_many_ids(pair, method):
    # More than a handful of ids (a vectorised check path): the bad id is the last one.
    big = make_layout("mla", 200, torch.float16, torch.Generator().manual_seed(3))
    big_dst = make_layout("mla", 150, torch.float16, torch.Generator().manual_seed(4))
    src_ids = torch.arange(100, dtype=torch.int64)
    dst_ids = torch.arange(100, dtype=torch.int64)
    dst_ids[-1] = 150
    _expect_no_copy(IndexError, "dst_ids", big, src_ids, big_dst, dst_ids, method)
    src_ids[-1] = -5
    dst_ids[-1] = 149
    _expect_no_copy(IndexError, "src_ids", big, src_ids, big_dst, dst_ids, method)


# --------------------------------------------------------------------------- ids: dtype and shape


NON_INTEGER_IDS = {
    "float_tensor": torch.tensor([0.0, 1.0]),
    "double_tensor": torch.tensor([0.0, 1.0], dtype=torch.float64),
    "bool_tensor": torch.tensor([True, False]),
    "float_list": [0.0, 1.0],
    "bool_list": [True, False],
    "mixed_list": [0, 1.5],
    "float_numpy": np.array([0.0, 1.0]),
    "bool_numpy": np.array([True, False]),
    "string_list": ["0", "1"],
    "none": None,
    "string": "01",
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", list(NON_INTEGER_IDS))
@pytest.mark.parametrize("side", ["src_ids", "dst_ids"])
def test_non_integer_ids(pair, method, kind, side):
    kv, pool = pair
    bad = NON_INTEGER_IDS[kind]
    good = [2, 3]
    src_ids, dst_ids = (bad, good) if side == "src_ids" else (good, bad)
    _expect_no_copy(TypeError, side, kv, src_ids, pool, dst_ids, method)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "bad",
    [
        torch.tensor([[0, 1], [2, 3]]),
        torch.tensor(1),
        np.array([[0, 1], [2, 3]]),
        torch.zeros(2, 0, dtype=torch.int64),
    ],
    ids=["2d_tensor", "0d_tensor", "2d_numpy", "2d_empty"],
)
@pytest.mark.parametrize("side", ["src_ids", "dst_ids"])
def test_ids_not_1d(pair, method, bad, side):
    kv, pool = pair
    good = torch.tensor([0, 1, 2, 3])
    src_ids, dst_ids = (bad, good) if side == "src_ids" else (good, bad)
    _expect_no_copy(ValueError, side, kv, src_ids, pool, dst_ids, method)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(("src_ids", "dst_ids"), [([0, 1, 2], [0, 1]), ([0], [0, 1]), ([], [0]), ([1], [])])
def test_length_mismatch(pair, method, src_ids, dst_ids):
    kv, pool = pair
    _expect_no_copy(ValueError, "ids", kv, src_ids, pool, dst_ids, method)
    _expect_no_copy(
        ValueError,
        "ids",
        kv,
        torch.tensor(src_ids, dtype=torch.int64),
        pool,
        torch.tensor(dst_ids, dtype=torch.int64),
        method,
    )


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", ["list", "int64", "numpy"])
def test_repeated_destination_ids(pair, method, kind):
    kv, pool = pair
    convert = {"list": list, "int64": lambda v: torch.tensor(v), "numpy": np.array}[kind]
    _expect_no_copy(ValueError, "dst_ids", kv, convert([0, 1, 2]), pool, convert([3, 4, 3]), method)


@pytest.mark.parametrize("method", METHODS)
def test_repeated_destination_ids_among_many(method, gen):
    src = make_layout("mla", 300, torch.float16, gen)
    dst = make_layout("mla", 300, torch.float16, gen)
    dst_ids = list(range(299, 99, -1))  # 200 distinct ids ...
    dst_ids[150] = dst_ids[7]  # ... then one repeat far apart
    _expect_no_copy(ValueError, "dst_ids", src, list(range(200)), dst, dst_ids, method)
    _expect_no_copy(ValueError, "dst_ids", src, torch.arange(200), dst, torch.tensor(dst_ids), method)


# --------------------------------------------------------------------------- one cache on both sides


SAME_CACHE_OVERLAPS = {
    "shifted_run": ([0, 1], [1, 2]),
    "block_onto_itself": ([3], [3]),
    "swap": ([2, 4], [4, 2]),
    "last_pair_only": ([0, 1, 2], [3, 4, 0]),
    "repeated_src_read_and_written": ([5, 5], [0, 5]),
}
ID_CONVERTERS = {
    "list": list,
    "int64": lambda v: torch.tensor(v, dtype=torch.int64),
    "int32": lambda v: torch.tensor(v, dtype=torch.int32),
    "numpy": lambda v: np.array(v, dtype=np.int64),
}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("overlap", list(SAME_CACHE_OVERLAPS))
@pytest.mark.parametrize("kind", list(ID_CONVERTERS))
def test_same_cache_overlap_is_rejected(pair, method, overlap, kind):
    """A block both read and written in one cache: the result would depend on copy order."""
    kv, pool = pair
    convert = ID_CONVERTERS[kind]
    src_ids, dst_ids = SAME_CACHE_OVERLAPS[overlap]
    for cache in (kv, pool):
        _expect_no_copy(ValueError, "dst_ids", cache, convert(src_ids), cache, convert(dst_ids), method)


@pytest.mark.parametrize("method", METHODS)
def test_same_cache_overlap_among_many_ids(method, gen):
    kv = make_layout("mla", 300, torch.float16, gen)
    src_ids = list(range(0, 200))
    dst_ids = list(range(299, 199, -1)) + list(range(100))  # 100 unread blocks, then 100 that are also read
    _expect_no_copy(ValueError, "dst_ids", kv, src_ids, kv, dst_ids, method)
    _expect_no_copy(ValueError, "dst_ids", kv, torch.tensor(src_ids), kv, torch.tensor(dst_ids), method)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", list(ID_CONVERTERS))
def test_same_cache_disjoint_copies_work(pair, method, kind):
    kv, pool = pair
    convert = ID_CONVERTERS[kind]
    check_copy(kv, convert([0, 1, 1]), kv, convert([3, 4, 5]), method=method)
    check_copy(pool, convert([5, 4, 0]), pool, convert([1, 2, 3]), method=method)
    check_copy(kv, convert([]), kv, convert([]), method=method)


# --------------------------------------------------------------------------- src/dst mismatch


def _planes(shapes_dtypes, num_blocks, gen):
    return kvcopy.PagedKV.from_planes([random_tensor((num_blocks, *s), d, gen) for s, d in shapes_dtypes])


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    ("src_spec", "dst_spec"),
    [
        # plane counts differ
        ([((3, 5), torch.float16)] * 2, [((3, 5), torch.float16)] * 3),
        ([((3, 5), torch.float16)] * 3, [((3, 5), torch.float16)] * 2),
        # block byte sizes differ
        ([((3, 5), torch.float16)], [((3, 6), torch.float16)]),
        ([((4,), torch.float16), ((3, 5), torch.float16)], [((4,), torch.float16), ((5, 3, 2), torch.float16)]),
        # same bytes, different dtypes
        ([((3, 5), torch.float16)], [((3, 5), torch.bfloat16)]),
        ([((4,), torch.float32)], [((8,), torch.float16)]),
        ([((16,), torch.uint8)], [((16,), torch.float8_e4m3fn)]),
    ],
    ids=["fewer_dst_planes", "more_dst_planes", "bytes", "bytes_second_plane", "fp16_bf16", "fp32_fp16", "u8_fp8"],
)
def test_mismatched_caches(method, src_spec, dst_spec, gen):
    src = _planes(src_spec, 5, gen)
    dst = _planes(dst_spec, 5, gen)
    _expect_no_copy(ValueError, "dst", src, [0, 1], dst, [2, 3], method)


@pytest.mark.parametrize("method", METHODS)
def test_pool_of_another_cache_is_rejected(method, gen):
    kv = make_layout("vllm", 4, torch.bfloat16, gen)
    other = make_layout("vllm", 4, torch.bfloat16, gen, head_dim=6)
    pool = kvcopy.HostKVPool(other, 4, pin_memory=False)
    fill_random_(pool, gen)
    _expect_no_copy(ValueError, "dst", kv, [0], pool, [1], method)


# --------------------------------------------------------------------------- methods


@pytest.mark.parametrize("method", ["fast", "", "CPU", "gpu"])
def test_unknown_method(pair, method):
    kv, pool = pair
    _expect_no_copy(ValueError, "method", kv, [0], pool, [1], method)


@pytest.mark.parametrize("method", ["fast", "cuda", "copy_engine"])
def test_method_error_lists_runnable_methods(pair, method):
    """The contract: an unknown method, or one that cannot run, names the methods that can."""
    kv, pool = pair
    available = kvcopy.available_methods(kv, pool)
    with pytest.raises(ValueError, match="method") as info:
        kvcopy.copy_blocks(kv, [0], pool, [1], method=method)
    assert str(available) in str(info.value), f"{info.value} does not list {available}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU-only availability")
@pytest.mark.parametrize("method", ["cuda", "copy_engine"])
def test_gpu_methods_cannot_run_on_cpu_pairs(pair, method):
    kv, pool = pair
    assert method not in kvcopy.available_methods(kv, pool)
    _expect_no_copy(ValueError, "method", kv, [0], pool, [1], method)
    # Checked even when there is nothing to copy.
    _expect_no_copy(ValueError, "method", kv, [], pool, [], method)


@pytest.mark.parametrize("method", ["fast", "cuda"])
def test_method_checked_with_empty_ids(pair, method):
    kv, pool = pair
    if method in kvcopy.available_methods(kv, pool):
        pytest.skip(f"{method} can run here")
    _expect_no_copy(ValueError, "method", kv, [], pool, [], method)


# --------------------------------------------------------------------------- argument types


@pytest.mark.parametrize("method", METHODS)
def test_src_and_dst_must_be_caches(pair, method):
    kv, pool = pair
    with pytest.raises(TypeError, match="src"):
        kvcopy.copy_blocks(kv.planes[0], [0], pool, [1], method=method)
    before = snapshot(pool)
    with pytest.raises(TypeError, match="dst"):
        kvcopy.copy_blocks(kv, [0], pool.buffer, [1], method=method)
    assert_same_bytes(snapshot(pool), before)


def test_gather_and_scatter_need_a_host_pool(pair):
    kv, _ = pair
    other = make_layout("vllm", NUM_BLOCKS, torch.bfloat16, torch.Generator().manual_seed(5))
    before = snapshot(other)
    with pytest.raises(TypeError, match="host"):
        kvcopy.gather(kv, [0], other, [1])
    with pytest.raises(TypeError, match="host"):
        kvcopy.scatter(other, [0], kv, [1])
    assert_same_bytes(snapshot(other), before)


@pytest.mark.parametrize("method", METHODS)
def test_errors_via_gather_and_scatter(pair, method):
    kv, pool = pair
    before_pool, before_kv = snapshot(pool), snapshot(kv)
    # Each error names the argument as gather and scatter call it (block_ids, host_ids), fast path or not.
    for kind in (list, torch.tensor):
        with pytest.raises(IndexError, match=r"^block_ids"):
            kvcopy.gather(kv, kind([NUM_BLOCKS]), pool, kind([0]), method=method)
        with pytest.raises(ValueError, match=r"^host_ids"):
            kvcopy.gather(kv, kind([0, 1]), pool, kind([2, 2]), method=method)
        with pytest.raises(IndexError, match=r"^block_ids"):
            kvcopy.scatter(pool, kind([0]), kv, kind([NUM_BLOCKS]), method=method)
        with pytest.raises(ValueError, match=r"^block_ids: expected as many ids as host_ids"):
            kvcopy.scatter(pool, kind([0]), kv, kind([1, 2]), method=method)
    with pytest.raises(TypeError, match=r"^host_ids"):
        kvcopy.scatter(pool, [0.5], kv, [1], method=method)
    assert_same_bytes(snapshot(pool), before_pool)
    assert_same_bytes(snapshot(kv), before_kv)
