"""kvcopy's mapping of a vLLM job onto host blocks (kvcopy/integrations/vllm/_chunks.py) against vLLM's own
pointer arithmetic (``compute_sub_block_ptrs`` of its CPU worker), for random jobs of several groups."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcopy.integrations.vllm._chunks import job_block_ids

pytestmark = pytest.mark.vllm

gpu_worker = pytest.importorskip("vllm.v1.kv_offload.cpu.gpu_worker", reason="vLLM is not installed")
torch = pytest.importorskip("torch")

NUM_CHUNKS = 64


def vllm_host_rows(chunk_ids, blocks_per_chunk, count, skip) -> list[int]:
    """The host sub-block rows vLLM's worker addresses: pointers into a (chunks, bpc * page) tensor, as rows."""
    page = 8
    host = torch.empty((NUM_CHUNKS, blocks_per_chunk * page), dtype=torch.int8)
    out = np.empty(count, dtype=np.uint64)
    gpu_worker.compute_sub_block_ptrs(np.asarray(chunk_ids), blocks_per_chunk, out, host, skip_count=skip)
    return ((out - np.uint64(host.data_ptr())) // np.uint64(page)).astype(int).tolist()


@st.composite
def jobs(draw):
    bpc = draw(st.sampled_from([1, 2, 4, 8]))
    groups = draw(st.integers(1, 3))
    sizes = [draw(st.integers(0, 12)) for _ in range(groups)]
    indices = [draw(st.integers(0, 20)) for _ in range(groups)]
    chunks_per_group = [-(-(n + i % bpc) // bpc) if n else 0 for n, i in zip(sizes, indices, strict=True)]
    chunk_ids = draw(st.permutations(range(NUM_CHUNKS)))[: sum(chunks_per_group)]
    device = draw(st.permutations(range(200)))[: sum(sizes)]
    return bpc, sizes, indices, chunk_ids, device, chunks_per_group


@settings(max_examples=200, deadline=None)
@given(jobs())
def test_host_blocks_match_vllms_own_addressing(job):
    bpc, sizes, indices, chunk_ids, device, chunks_per_group = job
    got_device, got_host = job_block_ids(device, sizes, indices, chunk_ids, bpc)
    expected, at = [], 0
    for size, index, n in zip(sizes, indices, chunks_per_group, strict=True):
        if size:
            expected += vllm_host_rows(chunk_ids[at : at + n], bpc, size, index % bpc)
        at += n
    assert got_device == list(device)
    assert got_host == [c * bpc + j for c, j in ((h // bpc, h % bpc) for h in expected)] == expected


def test_counts_that_do_not_add_up_are_value_errors_naming_them():
    with pytest.raises(ValueError, match="group_sizes: expected them to sum to the 3 block_ids, got 2"):
        job_block_ids([1, 2, 3], [2], [0], [0, 1], 2)
    with pytest.raises(ValueError, match="block_indices: expected one per group"):
        job_block_ids([1, 2], [2], [0, 0], [0], 2)
    with pytest.raises(ValueError, match="chunk_ids: expected at least 2 chunks, got 1"):
        job_block_ids([1, 2, 3], [3], [0], [0], 2)
    with pytest.raises(ValueError, match="chunk_ids: expected 1 chunks for these groups, got 2"):
        job_block_ids([1, 2], [2], [0], [0, 1], 2)
    with pytest.raises(TypeError, match="block_ids: expected a 1-d sequence of integer ids"):
        job_block_ids([[1, 2]], [2], [0], [0], 2)
