"""The eager host fast path (kvcopy.dispatch.host_fast_path): the same results, the same errors with
the same messages, and nothing written on an error, as the general path it short-cuts; and the Python
fallback of the id checks (a build without the extension) says the same as the compiled check."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import kvcopy
from kvcopy import _ext, dispatch, layout
from kvcopy import ids as _ids

from helpers.copies import assert_same_bytes, dst_bytes, fill_random_, make_layout, reference_copy, snapshot

pytestmark = pytest.mark.skipif(not _ext.has_cpu_kernels(), reason="the fast path runs the compiled CPU copy")


def _pair(seed: int = 0, num_blocks: int = 40, host_blocks: int = 30):
    gen = torch.Generator().manual_seed(seed)
    kv = make_layout("vllm", num_blocks, torch.float16, gen, num_layers=3)
    pool = kvcopy.HostKVPool(kv, host_blocks, pin_memory=False)
    fill_random_(pool, gen)
    return kv, pool


@pytest.fixture
def general_path_calls(monkeypatch):
    """The copies that took the general path (kvcopy.dispatch.run); the fast path never calls it."""
    calls = []
    real = dispatch.run

    def run(method, src, src_ids, dst, dst_ids, num_ctas=None):
        calls.append(method.name)
        real(method, src, src_ids, dst, dst_ids, num_ctas)

    monkeypatch.setattr(dispatch, "run", run)
    return calls


@pytest.mark.parametrize("num_ids", [1, 5, 16, 17, 30])
def test_fast_path_copies_bitwise(general_path_calls, num_ids):
    kv, pool = _pair(num_ids)
    g = torch.Generator().manual_seed(num_ids)
    src_ids = torch.randperm(kv.num_blocks, generator=g)[:num_ids]
    dst_ids = torch.randperm(pool.num_blocks, generator=g)[:num_ids]
    for method in ("auto", "cpu"):
        expected = reference_copy(kv, src_ids, pool, dst_ids)
        kvcopy.gather(kv, src_ids, pool, dst_ids, method=method)
        assert_same_bytes(dst_bytes(pool), expected)
        expected = reference_copy(pool, dst_ids, kv, src_ids)
        kvcopy.scatter(pool, dst_ids, kv, src_ids, method=method)
        assert_same_bytes(dst_bytes(kv), expected)
    assert general_path_calls == []  # every copy above took the fast path


def test_fast_path_within_one_cache(general_path_calls):
    kv, _ = _pair(7)
    expected = reference_copy(kv, [1, 2, 3], kv, [10, 11, 12])
    kvcopy.copy_blocks(kv, torch.tensor([1, 2, 3]), kv, torch.tensor([10, 11, 12]))
    assert_same_bytes(dst_bytes(kv), expected)
    assert general_path_calls == []


def _without_extension(src_blocks, dst_blocks, src_ids, dst_ids, *, same_cache):
    """kvcopy.ids' checks as a build without the compiled extension runs them (its Python fallback)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_ext, "extension", lambda: None)
        src_t = _ids.as_ids(src_ids, "src_ids", src_blocks)
        dst_t = _ids.as_ids(dst_ids, "dst_ids", dst_blocks)
        _ids.check_host_pair(src_t, dst_t, src_blocks, dst_blocks, same_cache=same_cache)


# Each bad call, once as int64 tensors (fast path, checked in C++) and once as Python lists (general path,
# checked in Python): the same error type and message, nothing written.
BAD_CALLS = [
    pytest.param([0, 40], [1, 2], IndexError, id="src out of range"),
    pytest.param([-3, 1, 50], [1, 2, 3], IndexError, id="src negative and too large"),
    pytest.param([0, 1], [2, 30], IndexError, id="dst out of range"),
    pytest.param([0, 1, 2], [5, 6, 5], ValueError, id="dst repeated (few)"),
    pytest.param(list(range(20)), [*range(19), 3], ValueError, id="dst repeated (many)"),
    pytest.param([0, 1, 2], [5, 6], ValueError, id="length mismatch"),
    pytest.param([50, 1, 2], [5, 6], IndexError, id="range before length"),
]


@pytest.mark.parametrize(("src_ids", "dst_ids", "error"), BAD_CALLS)
def test_errors_match_the_general_path(src_ids, dst_ids, error, general_path_calls):
    kv, pool = _pair(1)
    before = snapshot(pool)
    with pytest.raises(error) as fast:
        kvcopy.copy_blocks(kv, torch.tensor(src_ids), pool, torch.tensor(dst_ids))
    with pytest.raises(error) as general:
        kvcopy.copy_blocks(kv, src_ids, pool, dst_ids)
    assert str(fast.value) == str(general.value)
    assert_same_bytes(snapshot(pool), before)
    with pytest.raises(error) as fallback:  # the Python checks of a build without the extension
        _without_extension(kv.num_blocks, pool.num_blocks, src_ids, dst_ids, same_cache=False)
    assert str(fallback.value) == str(general.value)
    if len(src_ids) == len(dst_ids):  # the op that torch.compile graphs keep says the same
        with pytest.raises(error) as op:
            torch.ops.kvcopy.check_block_ids(
                torch.tensor(src_ids), torch.tensor(dst_ids), kv.num_blocks, pool.num_blocks
            )
        assert str(op.value).splitlines()[0] == str(general.value)


@pytest.mark.parametrize("count", [3, 20])
def test_read_and_written_within_one_cache_matches(count):
    kv, _ = _pair(2)
    src_ids = list(range(count))
    dst_ids = [*range(count, 2 * count - 1), count // 2]  # the last destination is also a source
    before = snapshot(kv)
    with pytest.raises(ValueError) as fast:
        kvcopy.copy_blocks(kv, torch.tensor(src_ids), kv, torch.tensor(dst_ids))
    with pytest.raises(ValueError) as general:
        kvcopy.copy_blocks(kv, src_ids, kv, dst_ids)
    assert str(fast.value) == str(general.value) and "both a source and a destination" in str(fast.value)
    assert_same_bytes(snapshot(kv), before)
    with pytest.raises(ValueError) as fallback:
        _without_extension(kv.num_blocks, kv.num_blocks, src_ids, dst_ids, same_cache=True)
    assert str(fallback.value) == str(general.value)


def test_other_ids_take_the_general_path(general_path_calls):
    kv, pool = _pair(3)
    for src_ids, dst_ids in (
        ([1, 2], [3, 4]),  # lists
        (torch.tensor([1, 2], dtype=torch.int32), torch.tensor([3, 4], dtype=torch.int32)),
        (torch.tensor([1, 0, 2])[::2], torch.tensor([3, 4])),  # not contiguous
    ):
        expected = reference_copy(kv, src_ids, pool, dst_ids)
        kvcopy.copy_blocks(kv, src_ids, pool, dst_ids)
        assert_same_bytes(dst_bytes(pool), expected)
    assert general_path_calls == ["cpu"] * 3


def test_a_new_default_profile_changes_the_cached_choice(general_path_calls):
    from helpers.profiles import synthetic_profile

    kv, pool = _pair(4)
    ids = torch.tensor([1, 2])
    kvcopy.copy_blocks(kv, ids, pool, ids)
    assert general_path_calls == []
    kvcopy.set_default_profile(synthetic_profile("torch"))
    try:
        expected = reference_copy(kv, ids, pool, ids + 3)
        kvcopy.copy_blocks(kv, ids, pool, ids + 3)
        assert_same_bytes(dst_bytes(pool), expected)
        assert general_path_calls == ["torch"]
    finally:
        kvcopy.set_default_profile(None)
    kvcopy.copy_blocks(kv, ids, pool, ids)
    assert general_path_calls == ["torch"]


@pytest.mark.slow
def test_cached_plans_never_outlive_their_caches():
    """New caches made in a loop (the same ids may come back for new objects) are copied right each time."""
    for seed in range(8):
        kv, pool = _pair(seed, num_blocks=4 + seed, host_blocks=3 + seed)
        last = kv.num_blocks - 1
        expected = reference_copy(kv, [last], pool, [pool.num_blocks - 1])
        kvcopy.gather(kv, torch.tensor([last]), pool, torch.tensor([pool.num_blocks - 1]))
        assert_same_bytes(dst_bytes(pool), expected)
        with pytest.raises(IndexError, match=rf"expected ids in \[0, {kv.num_blocks}\)"):
            kvcopy.gather(kv, torch.tensor([kv.num_blocks]), pool, torch.tensor([0]))
        del kv, pool
        gc.collect()


@pytest.mark.parametrize("method", ["auto", "cpu"])
def test_cached_plans_keep_no_cache_alive(method):
    """A pool of many GB must be freed when its owner drops it, whatever the fast path cached about it."""
    kv, pool = _pair(9)
    kvcopy.gather(kv, torch.tensor([1]), pool, torch.tensor([2]), method=method)
    kvcopy.scatter(pool, torch.tensor([2]), kv, torch.tensor([3]), method=method)
    refs = [weakref.ref(kv), weakref.ref(pool), weakref.ref(pool.paged), weakref.ref(pool.buffer)]
    del kv, pool
    gc.collect()
    assert [ref() for ref in refs] == [None] * len(refs)


def test_plane_table_columns_agree_with_the_compiled_code():
    assert len(layout.PLANE_TABLE_COLUMNS) == _ext.extension().PLANE_TABLE_COLUMNS
    kv, _ = _pair(5)
    table = kv.plane_table
    assert table.shape == (kv.num_planes, len(layout.PLANE_TABLE_COLUMNS))
    plane = kv.planes[1]
    assert table[1, layout.PLANE_ADDRESS] == plane.data_ptr()
    assert table[1, layout.PLANE_BLOCK_STRIDE] == plane.stride(0) * plane.element_size()
    assert table[1, layout.PLANE_BLOCK_BYTES] == plane[0].numel() * plane.element_size()


@pytest.mark.parametrize(("ids", "reported"), [([0, 2**70], 2**70), ([-1, 2**70], -1), ([-(2**70), 3], -(2**70))])
def test_list_ids_beyond_int64_are_the_range_error(ids, reported):
    kv, pool = _pair(20)
    before = snapshot(pool)
    with pytest.raises(IndexError, match=rf"src_ids: expected ids in \[0, {kv.num_blocks}\), got {reported}$"):
        kvcopy.copy_blocks(kv, ids, pool, [0, 1])
    assert_same_bytes(snapshot(pool), before)
