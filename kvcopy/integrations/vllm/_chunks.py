"""How vLLM's load/store specs map onto kvcopy's copies: one host block per device block.

vLLM's offloading connector hands a job as device block ids per KV cache group
(``GPULoadStoreSpec``: ``block_ids`` ordered by group, ``group_sizes``,
``block_indices``) and host chunk ids (``CPULoadStoreSpec.block_ids``), where one
chunk holds ``blocks_per_chunk`` consecutive device blocks and a group's first
chunk skips the ``block_indices[g] % blocks_per_chunk`` sub-blocks before the
first device block. kvcopy's host pool holds one host block per sub-block:
sub-block ``j`` of chunk ``c`` is host block ``c * blocks_per_chunk + j``, so a
page-first pool keeps each chunk contiguous. The result is one pair of id lists
for one TransferEngine submission (every group's blocks in it).

Pure numpy, no vLLM: the same arithmetic as vLLM's own worker
(``compute_sub_block_ptrs``), checked against vLLM in tests/integrations/test_vllm_chunks.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["job_block_ids"]


def _ids(name: str, values: object) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise TypeError(f"{name}: expected a 1-d sequence of integer ids, got {array.dtype} of shape {array.shape}")
    return array.astype(np.int64, copy=False)


def job_block_ids(
    device_block_ids: Sequence[int] | np.ndarray,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    chunk_ids: Sequence[int] | np.ndarray,
    blocks_per_chunk: int,
) -> tuple[list[int], list[int]]:
    """(device block ids, host block ids), pairwise, for one job of every group.

    A spec whose counts do not add up (``group_sizes`` against the device ids, the chunks each group needs
    against ``chunk_ids``) is a ValueError naming both counts, raised before anything is copied.
    """
    device = _ids("block_ids", device_block_ids)
    chunks = _ids("chunk_ids", chunk_ids)
    if len(group_sizes) != len(block_indices):
        raise ValueError(
            f"block_indices: expected one per group ({len(group_sizes)} group_sizes), got {len(block_indices)}"
        )
    if sum(group_sizes) != len(device):
        raise ValueError(f"group_sizes: expected them to sum to the {len(device)} block_ids, got {sum(group_sizes)}")
    sub_blocks = np.arange(blocks_per_chunk, dtype=np.int64)
    host: list[np.ndarray] = []
    chunk_at = 0
    for size, first_index in zip(group_sizes, block_indices, strict=True):
        if size == 0:
            continue
        skip = first_index % blocks_per_chunk
        needed = -(-(size + skip) // blocks_per_chunk)
        group_chunks = chunks[chunk_at : chunk_at + needed]
        if len(group_chunks) != needed:
            raise ValueError(f"chunk_ids: expected at least {chunk_at + needed} chunks, got {len(chunks)}")
        chunk_at += needed
        flat = (group_chunks[:, None] * blocks_per_chunk + sub_blocks[None, :]).reshape(-1)
        host.append(flat[skip : skip + size])
    if chunk_at != len(chunks):
        raise ValueError(f"chunk_ids: expected {chunk_at} chunks for these groups, got {len(chunks)}")
    host_ids = np.concatenate(host) if host else np.empty(0, dtype=np.int64)
    return device.tolist(), host_ids.tolist()
