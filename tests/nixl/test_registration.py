"""What a cache registers with NIXL (kvcopy/nixl/registration.py), without NIXL: each byte once, and never one
region across two allocations. An engine allocates its per-layer KV tensors back to back, and UCX and cuFile
register GPU memory per allocation (cudaMalloc), so a region across two of them does not register."""

from __future__ import annotations

import pytest
import torch

import kvcopy
from kvcopy.nixl.registration import merge_spans, registration_of

BLOCKS, BLOCK_BYTES = 8, 512
PLANE_BYTES = BLOCKS * BLOCK_BYTES


def _planes_back_to_back(count: int) -> tuple[bytearray, list[torch.Tensor]]:
    """``count`` planes that are separate allocations (each its own storage) placed back to back in memory, as
    per-layer cudaMalloc'd tensors often are: views of one bytearray, each wrapped by its own storage."""
    memory = bytearray(count * PLANE_BYTES)
    view = memoryview(memory)
    planes = [
        torch.frombuffer(view[i * PLANE_BYTES : (i + 1) * PLANE_BYTES], dtype=torch.uint8).view(BLOCKS, BLOCK_BYTES)
        for i in range(count)
    ]
    return memory, planes  # the bytearray keeps the memory alive


def test_separate_allocations_back_to_back_are_registered_apart():
    _memory, planes = _planes_back_to_back(2)  # the planes are views of _memory
    assert planes[1].data_ptr() == planes[0].data_ptr() + PLANE_BYTES  # they touch...
    assert planes[0].untyped_storage().data_ptr() != planes[1].untyped_storage().data_ptr()  # ...as two storages
    regions = registration_of(kvcopy.PagedKV.from_planes(planes)).regions
    assert regions == tuple((p.data_ptr(), PLANE_BYTES, 0, "") for p in planes)


def test_touching_views_of_one_allocation_are_one_region():
    halves = torch.zeros(2, BLOCKS, BLOCK_BYTES, dtype=torch.uint8)  # K and V as the halves of one tensor
    regions = registration_of(kvcopy.PagedKV.from_planes([halves[0], halves[1]])).regions
    assert regions == ((halves.data_ptr(), halves.nbytes, 0, ""),)


def test_interleaved_views_are_one_region_and_a_gap_splits_them():
    memory = torch.zeros(3, BLOCKS, 2, BLOCK_BYTES, dtype=torch.uint8)  # K and V interleaved per block
    first, third = memory[0], memory[2]
    kv = kvcopy.PagedKV.from_planes([first[:, 0], first[:, 1], third[:, 0], third[:, 1]], planes_per_layer=2)
    assert registration_of(kv).regions == (
        (first.data_ptr(), first.nbytes, 0, ""),
        (third.data_ptr(), third.nbytes, 0, ""),
    )


@pytest.mark.parametrize(
    ("spans", "regions"),
    [
        ([(0, 10, 1), (10, 20, 2)], [(0, 10), (10, 20)]),  # touching, two allocations: apart
        ([(10, 20, 1), (0, 10, 1)], [(0, 20)]),  # touching, one allocation: one region, in address order
        ([(0, 12, 1), (10, 20, 2)], [(0, 20)]),  # overlapping: the same bytes, whatever the key
        ([(0, 10, 1), (5, 15, 2), (15, 25, 2)], [(0, 25)]),  # the overlap joined them: one allocation
        ([(0, 10, 1), (10, 20, 2), (20, 30, 1)], [(0, 10), (10, 20), (20, 30)]),
        ([(0, 10, 1), (11, 20, 1)], [(0, 10), (11, 20)]),  # a gap
        ([(0, 30, 1), (10, 20, 1)], [(0, 30)]),  # contained
    ],
)
def test_merge_spans(spans, regions):
    assert merge_spans(spans) == regions
