"""vLLM's shared primary region as the host side of kvcopy's vLLM worker, under tiered offloading.

With ``secondary_tiers`` the primary tier is vLLM's ``SharedOffloadRegion``, one mapping of ``/dev/shm``
the scheduler's tiers read and write: a row per chunk, every worker's slot side by side in it (padded to the
page). kvcopy's worker maps the same region and copies the GPU's blocks into and out of its own slot, in
vLLM's byte layout, so that vLLM's tiers (``fs``, ``obj``, ``p2p``) and kvcopy's disk tier read and write the
same bytes vLLM's own worker would:

- the worker takes one view of its slot per canonical tensor, in order, as vLLM's worker does
  (``create_next_worker_view``): inside a slot the bytes are tensor-major, ``[t0: j0 j1 ... | t1: j0 j1 ...]``
  for the chunk's sub-blocks j;
- so sub-block j of chunk c, tensor t, is at row c, at tensor t's offset plus j pages: kvcopy keeps one
  placed :class:`~kvcopy.HostKVPool` per sub-block position j (``HostKVPool.over`` with those plane offsets
  and the row as the block stride; host block c of pool j is sub-block j of chunk c), all over one
  :class:`~kvcopy.host.memory.HostRegion` of the region (pinned once, by kvcopy, where CUDA is), and one
  :class:`~kvcopy.TransferEngine` per pool;
- a job's host block ids (``c * blocks_per_chunk + j``, kvcopy.integrations.vllm._chunks) go to engine j as
  chunk c: at one block per chunk (the common case) one engine and one submission, as without tiers.
"""

from __future__ import annotations

import gc
from typing import Any

from kvcopy.engine.engine import TransferEngine
from kvcopy.host.memory import HostRegion
from kvcopy.host.pool import HostKVPool
from kvcopy.layout import PagedKV

__all__ = ["RegionHost"]


class RegionHost:
    """kvcopy's pools and engines over a worker's slot of vLLM's shared region (see the module).

    ``region``: the worker's ``SharedOffloadRegion`` (made with its rank, before any view of it is taken);
    ``kv``: the device cache (a plane per canonical tensor); ``pin``: register the region with CUDA (None:
    where CUDA is). The engines' keywords (method, profile, observer) are passed on.
    """

    def __init__(
        self, region: Any, kv: PagedKV, blocks_per_chunk: int, num_chunks: int, *, pin: bool | None, **engine: Any
    ) -> None:
        self.region = region
        self.blocks_per_chunk = blocks_per_chunk
        views = [region.create_next_worker_view(nbytes * blocks_per_chunk) for nbytes in kv.plane_block_nbytes]
        offsets = [int(view.storage_offset()) for view in views]
        row_stride = int(views[0].stride(0))
        memory = region.mmap_obj
        self._memory = HostRegion.over(memory, len(memory), pin=bool(pin) if pin is not None else _cuda())
        self.pools = [
            HostKVPool.over(
                self._memory,
                kv,
                num_chunks,
                plane_offsets=[
                    offset + j * nbytes for offset, nbytes in zip(offsets, kv.plane_block_nbytes, strict=True)
                ],
                block_stride=row_stride,
            )
            for j in range(blocks_per_chunk)
        ]
        self.engines = [TransferEngine(kv, pool, **engine) for pool in self.pools]

    def route(self, device_ids: list[int], host_ids: list[int]) -> list[tuple[TransferEngine, list[int], list[int]]]:
        """A job's (device, host block) pairs as (engine, device ids, chunk ids) per sub-block position."""
        per_position: dict[int, tuple[list[int], list[int]]] = {}
        for device, host in zip(device_ids, host_ids, strict=True):
            chunk, position = divmod(host, self.blocks_per_chunk)
            devices, chunks = per_position.setdefault(position, ([], []))
            devices.append(device)
            chunks.append(chunk)
        return [(self.engines[j], devices, chunks) for j, (devices, chunks) in sorted(per_position.items())]

    def close(self) -> None:
        """Waits for every copy, unpins, and lets go of the region (vLLM's ``cleanup`` then unmaps it)."""
        while self.engines:
            self.engines.pop().close()
        while self.pools:
            self.pools.pop().close()  # (one region: the first unpins it)
        # An engine and its transfers hold each other: collected now, so that no view of the region is left
        # when vLLM unmaps it (else it keeps the mapping, exported, until the process ends).
        gc.collect()
        self._memory.close()
        self.region.cleanup()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
