"""What a KVPeer registers with NIXL: a HostKVPool's one buffer, or the memory under a PagedKV's planes.

A host pool is one allocation (page-first or layer-first). An engine's cache (a PagedKV) is planes anywhere,
often views into one tensor per layer (K and V interleaved, say): each plane's blocks span
``[address, address + (blocks - 1) * stride + block bytes)``. Spans are merged where they overlap, so NIXL sees
each byte once, and where they touch only within one allocation (one tensor storage): an engine allocates its
per-layer tensors back to back, and UCX and cuFile register GPU memory per allocation (``cudaMalloc``), so a
region across two of them would not register. On a GPU the memory is NIXL's ``VRAM`` on that device (GPU-to-GPU
between nodes goes over GPUDirect where UCX supports it); in host memory it is ``DRAM``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvcopy.host.pool import HostKVPool
from kvcopy.layout import PLANE_ADDRESS, PLANE_BLOCK_BYTES, PLANE_BLOCK_STRIDE, PagedKV

__all__ = ["DEVICE_LAYOUT", "Registration", "merge_spans", "registration_of"]

# The layout kind a PagedKV (an engine's cache, planes anywhere) is described as: a peer exchanges blocks only
# with a peer of the same kind (two host pools alike, or two engine caches).
DEVICE_LAYOUT = "paged"
# NIXL's memory kinds: host memory, and GPU memory (with the GPU's index as the descriptor's device id).
DRAM, VRAM = "DRAM", "VRAM"


@dataclass(frozen=True)
class Registration:
    """The KV a peer serves: ``paged`` (its planes and plane table), its layout kind, NIXL memory kind and
    device id, and the regions to register as ``(address, bytes, device id, "")``."""

    paged: PagedKV
    layout: str
    memory: str
    device_id: int
    regions: tuple[tuple[int, int, int, str], ...]


def registration_of(kv: object) -> Registration:
    """The registration of a HostKVPool or a PagedKV; TypeError for anything else, ValueError for a device NIXL
    does not register (only host memory and CUDA GPUs)."""
    if isinstance(kv, HostKVPool):
        buffer = kv.buffer
        return Registration(kv.paged, kv.layout, DRAM, 0, ((buffer.data_ptr(), buffer.nbytes, 0, ""),))
    if not isinstance(kv, PagedKV):
        raise TypeError(f"pool: expected a HostKVPool or a PagedKV, got {type(kv).__name__}")
    device = kv.device
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"pool: NIXL registers host memory and CUDA GPUs, got a PagedKV on {device}")
    device_id = 0 if device.type == "cpu" else _cuda_index(device)
    memory = DRAM if device.type == "cpu" else VRAM
    spans = (
        (
            row[PLANE_ADDRESS],
            row[PLANE_ADDRESS] + (kv.num_blocks - 1) * row[PLANE_BLOCK_STRIDE] + row[PLANE_BLOCK_BYTES],
            plane.untyped_storage().data_ptr(),
        )
        for row, plane in zip(kv.plane_table.tolist(), kv.planes, strict=True)
    )
    regions = tuple((start, end - start, device_id, "") for start, end in merge_spans(spans))
    return Registration(kv, DEVICE_LAYOUT, memory, device_id, regions)


def merge_spans(spans: Iterable[tuple[int, int, int]]) -> list[tuple[int, int]]:
    """The regions to register for byte spans ``(start, end, allocation)``, sorted by address: spans that
    overlap are merged (the same bytes, hence one allocation), and spans that only touch are merged only when
    they are of the same ``allocation`` (any key naming one, such as a storage's base address)."""
    merged: list[list[int]] = []  # [start, end] of each region
    allocations: list[set[int]] = []  # the allocations each region covers
    for start, end, allocation in sorted(spans):
        if merged and (start < merged[-1][1] or (start == merged[-1][1] and allocation in allocations[-1])):
            merged[-1][1] = max(merged[-1][1], end)
            allocations[-1].add(allocation)
        else:
            merged.append([start, end])
            allocations.append({allocation})
    return [(start, end) for start, end in merged]


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()
