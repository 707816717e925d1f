"""Coalescing, observed: how many byte ranges a copy becomes (kvcopy.copy_ranges).

A regression that stops merging runs of adjacent ids, or side-by-side planes,
fails here; so does one that lets a copy-engine range cross a pinned-memory
registration chunk.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import kvcopy
from kvcopy import _ext
from kvcopy.host.memory import MAX_REGISTER_BYTES, registration_chunks
from kvcopy.ranges import plan_table_ranges

from helpers.copies import make_layout

pytestmark = pytest.mark.skipif(not _ext.has_cpu_kernels(), reason="needs the compiled extension (the planner)")

NUM_LAYERS, NUM_BLOCKS = 3, 16
GiB = 1 << 30


def _pair(kind: str, host_layout: str):
    kv = make_layout(kind, NUM_BLOCKS, torch.bfloat16, torch.Generator().manual_seed(0), num_layers=NUM_LAYERS)
    return kv, kvcopy.HostKVPool(kv, NUM_BLOCKS, layout=host_layout, pin_memory=False)


@pytest.mark.parametrize("method", ["cpu", "copy_engine"])
def test_runs_of_adjacent_ids_are_one_range_per_dense_plane(method):
    kv, pool = _pair("vllm", "layer_first")  # every plane dense on both sides
    ids, slots = [2, 3, 4, 5, 9, 10, 14], [0, 1, 2, 3, 7, 8, 15]  # runs: 4, 2, 1
    ranges = kvcopy.copy_ranges(kv, ids, pool, slots, method=method)
    assert len(ranges) == 3 * kv.num_planes
    assert sorted({r.nbytes for r in ranges}) == sorted({n * kv.plane_block_nbytes[0] for n in (1, 2, 4)})
    assert sum(r.nbytes for r in ranges) == len(ids) * kv.nbytes_per_block


def test_flashinfer_k_and_v_merge_into_a_page_first_block():
    kv, pool = _pair("flashinfer", "page_first")  # K and V of a layer side by side on both sides
    ranges = kvcopy.copy_ranges(kv, [1, 7], pool, [0, 5])
    assert len(ranges) == 2 * NUM_LAYERS  # one range per (block, layer), not per (block, plane)
    assert all(r.nbytes == 2 * kv.plane_block_nbytes[0] for r in ranges)


def test_vllm_planes_into_page_first_blocks_do_not_merge():
    kv, pool = _pair("vllm", "page_first")  # K and V are separate tensors on the device: nothing adjacent
    assert len(kvcopy.copy_ranges(kv, [1, 2], pool, [0, 1])) == 2 * kv.num_planes


def test_ranges_are_validated_like_a_copy():
    kv, pool = _pair("vllm", "layer_first")
    with pytest.raises(IndexError, match="dst_ids"):
        kvcopy.copy_ranges(kv, [1], pool, [NUM_BLOCKS])
    with pytest.raises(ValueError, match="method"):
        kvcopy.copy_ranges(kv, [1], pool, [0], method="cuda")


def test_copy_engine_ranges_never_cross_a_registration_chunk():
    """One plane of 8 blocks of 1 MiB on each side, the source straddling a 64 GiB address: the cpu plan is one
    range for the run; the copy-engine plan splits it where the registration chunk ends."""
    block = 1 << 20
    src_base = MAX_REGISTER_BYTES - 3 * block - 4096  # block 3 crosses the chunk boundary
    src_table = torch.tensor([[src_base, block, block]], dtype=torch.int64)
    dst_table = torch.tensor([[8 * GiB, block, block]], dtype=torch.int64)
    ids = torch.arange(8, dtype=torch.int64)
    module = _ext.extension()
    plan = lambda for_dma: module.plan_copy_ranges(  # noqa: E731
        src_table.data_ptr(), dst_table.data_ptr(), 1, ids.data_ptr(), ids.data_ptr(), 8, for_dma
    )
    assert plan(False) == [(src_base, 8 * GiB, 8 * block)]
    dma = plan(True)
    assert [r[2] for r in dma] == [3 * block + 4096, 5 * block - 4096]
    assert dma[1][0] == MAX_REGISTER_BYTES and dma[1][1] == 8 * GiB + 3 * block + 4096


@pytest.mark.parametrize(
    ("address", "nbytes"),
    [
        (4096, 100 * GiB),
        (MAX_REGISTER_BYTES - 4096, 130 * GiB),
        (3 * MAX_REGISTER_BYTES, MAX_REGISTER_BYTES),
        (12288, 4096),
    ],
)
def test_registration_chunks_end_at_multiples_of_the_chunk_size(address, nbytes):
    chunks = registration_chunks(address, nbytes)
    assert chunks[0][0] == address and sum(length for _, length in chunks) == nbytes
    for (start, length), (following, _) in itertools.pairwise(chunks):
        assert start + length == following and following % MAX_REGISTER_BYTES == 0
    assert all(0 < length <= MAX_REGISTER_BYTES for _, length in chunks)


# --------------------------------------------------------------------------- plan_table_ranges: its inputs

_TABLE = torch.tensor([[0, 64, 64], [4096, 64, 32]], dtype=torch.int64)
_IDS = torch.tensor([0, 1], dtype=torch.int64)


@pytest.mark.parametrize(
    ("change", "error", "name"),
    [
        # ids a store's get or a peer's read could hand it: never read off the host (a meta tensor segfaulted)
        pytest.param({"src_ids": torch.tensor([0, 1], device="meta")}, ValueError, "src_ids", id="meta-ids"),
        pytest.param({"dst_ids": torch.tensor([0.0, 1.0])}, TypeError, "dst_ids", id="float-ids"),
        pytest.param({"src_ids": torch.tensor([0, 1], dtype=torch.int32)}, TypeError, "src_ids", id="int32-ids"),
        pytest.param({"src_ids": [0, 1]}, TypeError, "src_ids", id="list-ids"),
        pytest.param({"src_ids": torch.tensor([[0, 1]])}, ValueError, "src_ids", id="2-d-ids"),
        pytest.param({"dst_ids": torch.arange(4)[::2]}, ValueError, "dst_ids", id="strided-ids"),
        pytest.param({"dst_ids": torch.tensor([0])}, ValueError, "dst_ids", id="lengths"),
        pytest.param({"src_table": _TABLE.to(torch.int32)}, TypeError, "src_table", id="int32-table"),
        pytest.param({"dst_table": _TABLE[:, :2].contiguous()}, ValueError, "dst_table", id="two-columns"),
        pytest.param({"dst_table": _TABLE[:1]}, ValueError, "dst_table", id="plane-counts"),
        pytest.param({"src_table": _TABLE.t().contiguous().t()}, ValueError, "src_table", id="strided-table"),
        pytest.param({"src_table": _TABLE.to("meta")}, ValueError, "src_table", id="meta-table"),
        pytest.param({"src_table": _TABLE.tolist()}, TypeError, "src_table", id="list-table"),
        pytest.param({"src_ids": torch.tensor([0, 9]), "src_blocks": 4}, IndexError, "src_ids", id="range"),
        pytest.param({"dst_ids": torch.tensor([-1, 0]), "dst_blocks": 4}, IndexError, "dst_ids", id="negative"),
    ],
)
def test_plan_table_ranges_checks_what_the_planner_reads(change, error, name):
    args = {"src_table": _TABLE, "src_ids": _IDS, "dst_table": _TABLE, "dst_ids": _IDS, **change}
    with pytest.raises(error, match=f"^{name}"):
        plan_table_ranges(**args)


def test_plan_table_ranges_plans_good_inputs():
    ranges = plan_table_ranges(_TABLE, _IDS, _TABLE, torch.tensor([2, 3]), src_blocks=4, dst_blocks=4)
    # plane 0 is dense (64-byte blocks 64 apart): its run of two blocks is one range; plane 1's are not
    assert sorted(ranges) == [(0, 128, 128), (4096, 4224, 32), (4160, 4288, 32)]
