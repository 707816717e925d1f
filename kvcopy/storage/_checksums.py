"""The XXH3-64 checksums a disk store keeps, one per block, over its page-first bytes.

Where kvcopy's extension is built, the blocks are hashed in compiled code
(csrc/cpu/block_checksum_cpu.cpp, xxHash 0.8.4 header-only) across
``torch.get_num_threads()`` threads, without the GIL: a get's verification
runs at the memory's speed on every core instead of about 10 GB/s on one, and
a put's hashing beside its NIXL write leaves the interpreter free. Without the
extension, python-xxhash hashes them one block at a time (it holds the GIL).
Both give the same values, bit for bit (tests/test_storage_checksums.py).
"""

from __future__ import annotations

import numpy as np
import torch
import xxhash

from .. import _ext

__all__ = ["block_checksums"]


def block_checksums(buffer: torch.Tensor, block_bytes: int, ids: torch.Tensor, *, compiled: bool = True) -> list[int]:
    """The XXH3-64 (seed 0) of blocks ``ids`` of ``buffer`` (a contiguous uint8 host tensor, block i at byte
    ``i * block_bytes``; ids checked by the caller), in the order of ``ids``. ``compiled=False``: python-xxhash
    even where the extension is built."""
    module = _ext.extension() if compiled else None
    if module is None:
        view = buffer.numpy()
        return [xxhash.xxh3_64_intdigest(view[i * block_bytes : (i + 1) * block_bytes]) for i in ids.tolist()]
    ids = ids.to(torch.int64).contiguous()
    out = np.empty(ids.numel(), dtype=np.uint64)
    module.block_checksums(
        buffer.data_ptr(), block_bytes, ids.data_ptr(), ids.numel(), out.ctypes.data, torch.get_num_threads()
    )
    return out.tolist()
