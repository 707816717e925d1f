"""BlockAllocator: hands out and takes back block ids of a pool, lowest free ids first."""

from __future__ import annotations

import heapq
import threading

import numpy as np
import torch

from kvcopy._checks import non_negative_int
from kvcopy.ids import BlockIds, prepare_ids

__all__ = ["BlockAllocator"]


class BlockAllocator:
    """Free-list of ids ``0 .. num_blocks-1``; thread-safe.

    Lowest ids go out first, so blocks allocated together tend to be adjacent
    and copy as coalesced runs. Errors are ValueError: asking for more blocks
    than are free, freeing an id that is not allocated (double free), an id
    outside the pool (foreign), or the same id twice in one call.

    Parameters:

    - ``num_blocks``: the ids it hands out are ``0 .. num_blocks - 1``.
    """

    def __init__(self, num_blocks: int) -> None:
        self._num_blocks = num_blocks
        self._allocated = np.zeros(num_blocks, dtype=bool)
        self._free_heap = list(range(num_blocks))  # already a heap
        self._lock = threading.Lock()

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free_heap)

    def allocate(self, n: int) -> torch.Tensor:
        """``n`` free ids as a 1-D int64 tensor, marked allocated."""
        n = non_negative_int("n", n)
        with self._lock:
            if n > len(self._free_heap):
                raise ValueError(f"n: asked for {n} blocks, only {len(self._free_heap)} of {self._num_blocks} are free")
            ids = [heapq.heappop(self._free_heap) for _ in range(n)]
            self._allocated[ids] = True
        return torch.tensor(ids, dtype=torch.int64)

    def checked_ids(self, ids: BlockIds) -> torch.Tensor:
        """``ids`` as a host int64 tensor of distinct ids of this pool: TypeError for a wrong type, ValueError for
        a wrong shape, a repeat, ids off the host or outside the pool (foreign). Reads no allocation state."""
        try:
            tensor = prepare_ids(ids, "ids", self._num_blocks, unique=True)
        except IndexError as err:  # an id this pool never handed out
            raise ValueError(f"{err} (not an id of this pool)") from None
        if tensor.device.type != "cpu":
            raise ValueError(f"ids: expected host ids, got ids on {tensor.device}")
        return tensor

    def free(self, ids: BlockIds) -> None:
        """Returns allocated ids to the free list; all or nothing."""
        values = self.checked_ids(ids).numpy()
        with self._lock:
            not_allocated = values[~self._allocated[values]]
            if not_allocated.size:
                raise ValueError(f"ids: block {int(not_allocated[0])} is not allocated (double free?)")
            self._allocated[values] = False
            for value in values.tolist():
                heapq.heappush(self._free_heap, value)
