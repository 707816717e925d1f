"""A GPU cache's blocks as a disk store sees them: their page-first bytes, for the checksum a store keeps.

A disk store keeps each block's XXH3-64 over its page-first bytes (its plane-blocks in plane order), whatever
memory the block was written from, so a block written from a GPU through GPUDirect Storage and one written
from a host pool check alike, and either reads back into the other. For a PagedKV (on a GPU, or anywhere)
:func:`paged_checksums` hashes in bounded chunks: a chunk of blocks is gathered on its device into one reused
staging buffer (one ``index_select`` per plane, written in place), copied to one of two reused host buffers
(pinned on a GPU, so the copy is a DMA that overlaps), and hashed there while the next chunk is gathered and
copied. Whatever the put or get moves, it holds no more than one chunk on the device and two on the host
(a chunk is at least one block): never a copy of everything it moves.
"""

from __future__ import annotations

import torch
import xxhash

from kvcopy._checks import positive_int
from kvcopy.layout import PagedKV

__all__ = ["CHECKSUM_CHUNK_BYTES", "paged_block_bytes", "paged_checksums"]

# The bytes of blocks :func:`paged_checksums` gathers at once: large enough that a chunk's copy and the launches
# of its gathers are a small share of its time, small enough to be spare on a serving GPU (2 MiB blocks of a
# 64-plane cache: 16 at once).
CHECKSUM_CHUNK_BYTES = 32 << 20


def paged_block_bytes(paged: PagedKV, ids: torch.Tensor) -> torch.Tensor:
    """``[len(ids), paged.nbytes_per_block]`` uint8 on the host: row i is block ``ids[i]``'s plane-blocks in
    plane order, the bytes a page-first host block of it holds (all of them at once: for tests and small
    reads; :func:`paged_checksums` bounds its memory)."""
    index = ids.to(device=paged.device, dtype=torch.int64)
    parts = [plane.index_select(0, index).reshape(index.numel(), -1).view(torch.uint8) for plane in paged.planes]
    return torch.cat(parts, dim=1).cpu()


def _gather(paged: PagedKV, index: torch.Tensor, staging: torch.Tensor) -> None:
    """Blocks ``index`` into ``staging`` (flat uint8), plane-major: plane p's rows of them, one after another."""
    offset = 0
    for plane, nbytes in zip(paged.planes, paged.plane_block_nbytes, strict=True):
        rows = staging[offset : offset + index.numel() * nbytes].view(plane.dtype).view(index.numel(), *plane.shape[1:])
        torch.index_select(plane, 0, index, out=rows)
        offset += index.numel() * nbytes


def _hash_chunk(paged: PagedKV, count: int, host: torch.Tensor) -> list[int]:
    """The XXH3-64 of each of the ``count`` blocks ``host`` holds plane-major (:func:`_gather`), over its
    plane-blocks in plane order: the hash of its page-first bytes, streamed plane by plane."""
    sizes = paged.plane_block_nbytes
    data = host.numpy().data  # a memoryview: its slices are what xxhash reads
    hashers = [xxhash.xxh3_64() for _ in range(count)]
    offset = 0
    for nbytes in sizes:
        for block, hasher in enumerate(hashers):
            hasher.update(data[offset + block * nbytes : offset + (block + 1) * nbytes])
        offset += count * nbytes
    return [hasher.intdigest() for hasher in hashers]


def paged_checksums(paged: PagedKV, ids: torch.Tensor, *, chunk_bytes: int = CHECKSUM_CHUNK_BYTES) -> list[int]:
    """The XXH3-64 of each block's page-first bytes (as DiskKVStore keeps it), gathered ``chunk_bytes`` at a
    time (at least one block) through reused buffers: the temporaries it holds are one chunk on ``paged``'s
    device and, on a GPU, two pinned chunks on the host, whatever ``len(ids)``. On a GPU it waits for the
    work queued on the current stream (its gathers run there)."""
    chunk_bytes = positive_int("chunk_bytes", chunk_bytes)
    index = ids.to(device=paged.device, dtype=torch.int64)
    if index.numel() == 0:
        return []
    per_chunk = max(1, min(index.numel(), chunk_bytes // paged.nbytes_per_block))
    staging = torch.empty(per_chunk * paged.nbytes_per_block, dtype=torch.uint8, device=paged.device)
    starts = range(0, index.numel(), per_chunk)
    if paged.device.type != "cuda":  # the staging buffer is host memory already: hashed where it is gathered
        checksums: list[int] = []
        for start in starts:
            chunk = index[start : start + per_chunk]
            _gather(paged, chunk, staging)
            checksums += _hash_chunk(paged, chunk.numel(), staging)
        return checksums
    stream = torch.cuda.current_stream(paged.device)
    hosts = [torch.empty(staging.numel(), dtype=torch.uint8, pin_memory=True) for _ in range(min(2, len(starts)))]
    copied = [torch.cuda.Event() for _ in hosts]

    def post(number: int) -> None:  # chunk ``number``: gathered, then copied to its host buffer, on the stream
        chunk = index[starts[number] : starts[number] + per_chunk]
        _gather(paged, chunk, staging)  # after the previous chunk's copy out of it: one stream, in order
        nbytes = chunk.numel() * paged.nbytes_per_block
        hosts[number % 2][:nbytes].copy_(staging[:nbytes], non_blocking=True)
        copied[number % 2].record(stream)

    checksums = []
    post(0)
    for number in range(len(starts)):
        if number + 1 < len(starts):
            post(number + 1)  # into the other host buffer, hashed (number - 1) already: overlaps this hash
        copied[number % 2].synchronize()
        count = min(per_chunk, index.numel() - starts[number])
        checksums += _hash_chunk(paged, count, hosts[number % 2])
    return checksums
