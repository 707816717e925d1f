"""The disk store's block checksums (kvcopy/storage/_checksums.py): the compiled XXH3-64, hashed across threads
without the GIL, equals python-xxhash's on every block, for every block size and id order, and the store's
checks agree with it whichever path hashed them."""

from __future__ import annotations

import pytest
import torch
import xxhash

from kvcopy import _ext
from kvcopy.storage._checksums import block_checksums

compiled = pytest.mark.skipif(not _ext.has_cpu_kernels(), reason="needs the compiled extension (its checksums)")


def reference(buffer: torch.Tensor, block_bytes: int, ids: list[int]) -> list[int]:
    """Each block's bytes copied out and hashed alone."""
    return [xxhash.xxh3_64(buffer[i * block_bytes : (i + 1) * block_bytes].numpy().tobytes()).intdigest() for i in ids]


@compiled
@pytest.mark.parametrize(
    ("block_bytes", "num_blocks"),
    # a byte; XXH3's short-input paths (<= 16, <= 128, <= 240 bytes); an fp8 block with scales (4352); blocks
    # past the size at which threads share the work (1 MiB a call), with ids in a random order
    [(1, 5), (13, 9), (100, 7), (240, 4), (4352, 33), (64 << 10, 40), ((1 << 20) + 8, 5)],
)
def test_the_compiled_checksums_equal_python_xxhash(block_bytes, num_blocks):
    assert hasattr(_ext.extension(), "block_checksums")  # the compiled path is the one under test
    gen = torch.Generator().manual_seed(block_bytes)
    buffer = torch.randint(0, 256, (block_bytes * num_blocks,), dtype=torch.uint8, generator=gen)
    ids = torch.randperm(num_blocks, generator=gen)[: max(1, num_blocks - 2)]
    got = block_checksums(buffer, block_bytes, ids)
    assert got == reference(buffer, block_bytes, ids.tolist())
    assert got == block_checksums(buffer, block_bytes, ids, compiled=False)  # the path without the extension
    assert len(set(got)) == len(got)  # random blocks: distinct hashes, so a swap of two would show


@compiled
def test_a_changed_byte_changes_only_its_blocks_checksum():
    buffer = torch.randint(0, 256, (64 * 4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    ids = torch.arange(64)
    before = block_checksums(buffer, 4096, ids)
    buffer[17 * 4096 + 4095] ^= 1  # the last byte of block 17
    after = block_checksums(buffer, 4096, ids)
    assert [i for i in range(64) if before[i] != after[i]] == [17]


def test_no_blocks_no_checksums():
    assert block_checksums(torch.zeros(8, dtype=torch.uint8), 4, torch.empty(0, dtype=torch.int64)) == []
    assert (
        block_checksums(torch.zeros(8, dtype=torch.uint8), 4, torch.empty(0, dtype=torch.int64), compiled=False) == []
    )
