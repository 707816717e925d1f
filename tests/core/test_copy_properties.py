"""Property tests: random layouts and id sets agree bytewise with the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcopy

from helpers import DTYPES, TRITON_ON_CPU
from helpers.copies import assert_same_bytes, check_copy, dst_bytes, random_bytes, reference_copy

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

plane_specs = st.lists(
    st.tuples(
        st.sampled_from(DTYPES),
        st.lists(st.integers(1, 5), min_size=0, max_size=3),  # block shape (odd sizes included)
        st.integers(0, 3),  # src: extra elements between blocks (0 = dense plane, > 0 = strided plane)
        st.integers(0, 3),  # dst: the same, drawn independently (strides may differ between sides)
    ),
    min_size=1,
    max_size=6,
)


def _build(specs, num_blocks, seed, side=0):
    """A PagedKV from (dtype, block shape, src pad, dst pad) specs, filled with random bytes."""
    gen = torch.Generator().manual_seed(seed)
    planes = []
    for dtype, shape, *pads in specs:
        pad = pads[side]
        numel = int(np.prod(shape)) if shape else 1
        itemsize = torch.empty((), dtype=dtype).element_size()
        rows = random_bytes(num_blocks * (numel + pad) * itemsize, gen).view(dtype).view(num_blocks, numel + pad)
        planes.append(rows[:, :numel].view(num_blocks, *shape) if shape else rows[:, 0])
    return kvcopy.PagedKV.from_planes(planes)


@st.composite
def copy_cases(draw):
    specs = draw(plane_specs)
    src_blocks = draw(st.integers(1, 9))
    dst_blocks = draw(st.integers(1, 9))
    n = draw(st.integers(0, dst_blocks))
    dst_ids = draw(st.permutations(range(dst_blocks)))[:n]
    src_ids = draw(st.lists(st.integers(0, src_blocks - 1), min_size=n, max_size=n))  # repeats allowed
    kind = draw(st.sampled_from(["list", "int64", "int32", "numpy"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return specs, src_blocks, dst_blocks, src_ids, list(dst_ids), kind, seed


def _convert(ids, kind):
    if kind == "list":
        return list(ids)
    if kind == "numpy":
        return np.array(ids, dtype=np.int64)
    return torch.tensor(ids, dtype=torch.int64 if kind == "int64" else torch.int32)


@settings(max_examples=50, **SETTINGS)
@given(case=copy_cases(), method=st.sampled_from(["torch", "cpu"]))
def test_paged_to_paged_matches_reference(case, method):
    specs, src_blocks, dst_blocks, src_ids, dst_ids, kind, seed = case
    src = _build(specs, src_blocks, seed)
    dst = _build(specs, dst_blocks, seed + 1, side=1)
    check_copy(src, _convert(src_ids, kind), dst, _convert(dst_ids, kind), method=method)


@pytest.mark.skipif(not TRITON_ON_CPU, reason="triton on CPU tensors needs TRITON_INTERPRET=1")
@settings(max_examples=10, **SETTINGS)
@given(case=copy_cases())
def test_triton_matches_reference(case):
    specs, src_blocks, dst_blocks, src_ids, dst_ids, kind, seed = case
    src = _build(specs[:3], src_blocks, seed)
    dst = _build(specs[:3], dst_blocks, seed + 1, side=1)
    check_copy(src, _convert(src_ids, kind), dst, _convert(dst_ids, kind), method="triton")


def _aligned(like: kvcopy.PagedKV, num_blocks: int, layout: str) -> bool:
    """Whether an unpadded host layout can place every plane at an offset aligned to its element size."""
    offset = 0
    for plane, nbytes in zip(like.planes, like.plane_block_nbytes, strict=True):
        itemsize = plane.element_size()
        if offset % itemsize:
            return False
        if layout == "page_first":
            if like.nbytes_per_block % itemsize:
                return False
            offset += nbytes
        else:
            offset += num_blocks * nbytes
    return True


@settings(max_examples=50, **SETTINGS)
@given(
    case=copy_cases(),
    method=st.sampled_from(["torch", "cpu", "auto"]),
    layout=st.sampled_from(["page_first", "layer_first"]),
)
def test_gather_scatter_round_trip(case, method, layout):
    specs, src_blocks, dst_blocks, src_ids, dst_ids, kind, seed = case
    kv = _build(specs, src_blocks, seed)
    if not _aligned(kv, dst_blocks, layout):
        with pytest.raises(ValueError):
            kvcopy.HostKVPool(kv, dst_blocks, layout=layout, pin_memory=False)
        return
    pool = kvcopy.HostKVPool(kv, dst_blocks, layout=layout, pin_memory=False)
    pool.buffer.copy_(random_bytes(pool.buffer.numel(), torch.Generator().manual_seed(seed + 2)))
    s, d = _convert(src_ids, kind), _convert(dst_ids, kind)
    expected = reference_copy(kv, src_ids, pool, dst_ids)
    kvcopy.gather(kv, s, pool, d, method=method)
    assert_same_bytes(dst_bytes(pool), expected)
    # Scatter the gathered host blocks into a fresh cache: each lands exactly.
    fresh = _build(specs, dst_blocks, seed + 3, side=1)
    expected = reference_copy(pool, dst_ids, fresh, dst_ids)
    kvcopy.scatter(pool, d, fresh, d, method=method)
    assert_same_bytes(dst_bytes(fresh), expected)
