"""A GPU cache's blocks as a disk store sees them: their page-first bytes, for the checksum a store keeps.

A disk store keeps each block's XXH3-64 over its page-first bytes (its plane-blocks in plane order), whatever
memory the block was written from, so a block written from a GPU through GPUDirect Storage and one written
from a host pool check alike, and either reads back into the other. For a PagedKV (on a GPU, or anywhere) the
bytes are gathered on its device, one index_select per plane, and copied to the host in one transfer: the
bus carries the blocks once more (a GPU's host link is faster than a disk), and the host hashes them as
fast as its memory reads.
"""

from __future__ import annotations

import torch
import xxhash

from kvcopy.layout import PagedKV

__all__ = ["paged_block_bytes", "paged_checksums"]


def paged_block_bytes(paged: PagedKV, ids: torch.Tensor) -> torch.Tensor:
    """``[len(ids), paged.nbytes_per_block]`` uint8 on the host: row i is block ``ids[i]``'s plane-blocks in
    plane order, the bytes a page-first host block of it holds."""
    index = ids.to(device=paged.device, dtype=torch.int64)
    parts = [plane.index_select(0, index).reshape(index.numel(), -1).view(torch.uint8) for plane in paged.planes]
    return torch.cat(parts, dim=1).cpu()


def paged_checksums(paged: PagedKV, ids: torch.Tensor) -> list[int]:
    """The XXH3-64 of each block's page-first bytes (as DiskKVStore keeps it)."""
    rows = paged_block_bytes(paged, ids).numpy()
    return [xxhash.xxh3_64_intdigest(row) for row in rows]
