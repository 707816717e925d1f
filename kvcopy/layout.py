"""PagedKV: a paged KV cache seen as planes, and adapters for engine layouts.

A *plane* is a tensor whose first dimension indexes blocks and whose block
``plane[i]`` is one contiguous run of bytes. Every engine layout reduces to a
list of planes with the same block count on one device (docs/architecture.md).

The compiled code sees a PagedKV through its *plane table*: one int64 row per
plane with the columns PLANE_TABLE_COLUMNS (csrc/include/kvcopy/plane_table.h
names the same columns for C++).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kvcopy._version import warn_renamed

__all__ = ["PLANE_TABLE_COLUMNS", "HostMemory", "PagedKV"]

# The plane table's columns, in order: block 0's address, bytes from one block to the next, bytes of one block.
PLANE_TABLE_COLUMNS = ("address", "block_stride", "block_nbytes")
PLANE_ADDRESS, PLANE_BLOCK_STRIDE, PLANE_BLOCK_BYTES = range(len(PLANE_TABLE_COLUMNS))


class HostMemory(Protocol):
    """The host allocation a PagedKV's planes view (kvcopy.host.memory.HostRegion): whether it is pinned now."""

    @property
    def pinned(self) -> bool: ...


def _block_numel(plane: torch.Tensor) -> int:
    numel = 1
    for size in plane.shape[1:]:
        numel *= size
    return numel


def _check_plane(index: int, plane: object, first: torch.Tensor | None) -> None:
    if not isinstance(plane, torch.Tensor):
        raise TypeError(f"planes[{index}]: expected a torch.Tensor, got {type(plane).__name__}")
    if plane.dim() < 1:
        raise ValueError(f"planes[{index}]: expected at least 1 dimension (blocks first), got a 0-d tensor")
    block_numel = _block_numel(plane)
    # A block is contiguous when its inner dims are laid out densely (size-1 dims may have any stride).
    expected = 1
    for size, stride in reversed(list(zip(plane.shape[1:], plane.stride()[1:], strict=True))):
        if size != 1 and stride != expected:
            raise ValueError(
                f"planes[{index}]: each block must be one contiguous run of bytes; block shape "
                f"{tuple(plane.shape[1:])} has strides {tuple(plane.stride()[1:])}, expected contiguous strides"
            )
        expected *= size
    if plane.shape[0] > 1 and plane.stride(0) < block_numel:
        raise ValueError(
            f"planes[{index}]: blocks overlap (block stride {plane.stride(0)} elements < block size "
            f"{block_numel} elements)"
        )
    if first is None:
        return
    if plane.device != first.device:
        raise ValueError(f"planes[{index}]: expected device {first.device} like planes[0], got {plane.device}")
    if plane.shape[0] != first.shape[0]:
        raise ValueError(f"planes[{index}]: expected {first.shape[0]} blocks like planes[0], got {plane.shape[0]}")


class PagedKV:
    """A paged KV cache as a list of planes on one device.

    Build it from an engine's own tensors (no copy is made: the planes are
    views of them) with :meth:`from_planes`, :meth:`from_vllm`,
    :meth:`from_flashinfer` or :meth:`from_mla`.

    Parameters:

    - ``planes``: the planes, each ``[num_blocks, ...]`` with block ``i`` at ``plane[i]``, all on one device
      with one block count.
    - ``planes_per_layer``: how many consecutive planes make one layer (2 for K and V), for a layer-wise
      reload; it must divide the plane count.
    - ``memory``: the host memory the planes are views of, kept alive with them (a HostKVPool's).
    """

    def __init__(
        self, planes: Sequence[torch.Tensor], *, planes_per_layer: int = 1, memory: HostMemory | None = None
    ) -> None:
        planes = tuple(planes)
        if not planes:
            raise ValueError("planes: expected at least one plane, got none")
        for i, plane in enumerate(planes):
            _check_plane(i, plane, planes[0] if i else None)
        if planes_per_layer < 1 or len(planes) % planes_per_layer:
            raise ValueError(
                f"planes_per_layer: expected a divisor of the plane count {len(planes)}, got {planes_per_layer}"
            )
        self._planes = planes
        self.planes_per_layer = planes_per_layer
        self._device = planes[0].device
        # Derived once: the hot path and torch.compile read plain attributes.
        self._plane_block_nbytes = tuple(_block_numel(p) * p.element_size() for p in planes)
        self._dtypes = tuple(p.dtype for p in planes)
        self._plane_table = torch.tensor(
            [
                [p.data_ptr(), p.stride(0) * p.element_size(), n]
                for p, n in zip(planes, self._plane_block_nbytes, strict=True)
            ],
            dtype=torch.int64,
        )
        self._plane_tables_on: dict[torch.device, torch.Tensor] = {}
        if self.device.type == "cuda":  # for the Triton kernel; a one-time synchronous copy, here and not in a copy
            self._plane_tables_on[self.device] = self._plane_table.to(self.device)
        low_bits = 16  # the largest power of two (<= 16) dividing every address, stride and block size
        for value in self._plane_table.view(-1).tolist():
            low_bits |= value
        self._alignment = low_bits & -low_bits
        self._memory = memory  # the allocation the planes view, when kvcopy made it: it says whether it is pinned
        self._pinned: bool | None = None
        self._layers: list[PagedKV] | None = None

    @classmethod
    def from_planes(cls, planes: Sequence[torch.Tensor], *, planes_per_layer: int = 1) -> PagedKV:
        """Any list of planes (blocks first, each block contiguous).

        ``planes_per_layer`` says how many consecutive planes form one engine
        layer (used by layer-wise transfers); fp8 scale planes go here too.
        """
        return cls(planes, planes_per_layer=planes_per_layer)

    @classmethod
    def from_vllm(cls, kv_caches: Sequence[torch.Tensor]) -> PagedKV:
        """vLLM flash-attn layout: each layer ``[2, num_blocks, block_size, num_kv_heads, head_size]``.

        Planes are ``kv[0]`` (keys) and ``kv[1]`` (values) of each layer, in layer order.
        """
        planes: list[torch.Tensor] = []
        for i, kv in enumerate(_layers(kv_caches)):
            if kv.dim() != 5 or kv.shape[0] != 2:
                raise ValueError(
                    f"kv_caches[{i}]: expected vLLM shape [2, num_blocks, block_size, num_kv_heads, head_size], "
                    f"got {list(kv.shape)}"
                )
            planes += [kv[0], kv[1]]
        return cls(planes, planes_per_layer=2)

    @classmethod
    def from_flashinfer(cls, kv_caches: Sequence[torch.Tensor]) -> PagedKV:
        """FlashInfer layout: each layer ``[num_blocks, 2, block_size, num_kv_heads, head_size]``.

        Planes are ``kv[:, 0]`` and ``kv[:, 1]`` (strided: K and V of a block are adjacent).
        """
        planes: list[torch.Tensor] = []
        for i, kv in enumerate(_layers(kv_caches)):
            if kv.dim() != 5 or kv.shape[1] != 2:
                raise ValueError(
                    f"kv_caches[{i}]: expected FlashInfer shape [num_blocks, 2, block_size, num_kv_heads, "
                    f"head_size], got {list(kv.shape)}"
                )
            planes += [kv[:, 0], kv[:, 1]]
        return cls(planes, planes_per_layer=2)

    @classmethod
    def from_mla(cls, kv_caches: Sequence[torch.Tensor]) -> PagedKV:
        """MLA layout: each layer ``[num_blocks, block_size, kv_lora_rank + rope_dim]``, one plane."""
        planes: list[torch.Tensor] = []
        for i, kv in enumerate(_layers(kv_caches)):
            if kv.dim() != 3:
                raise ValueError(
                    f"kv_caches[{i}]: expected MLA shape [num_blocks, block_size, head_size], got {list(kv.shape)}"
                )
            planes.append(kv)
        return cls(planes, planes_per_layer=1)

    @property
    def planes(self) -> tuple[torch.Tensor, ...]:
        """The plane tensors (views of the caller's tensors)."""
        return self._planes

    @property
    def num_planes(self) -> int:
        return len(self._planes)

    @property
    def num_layers(self) -> int:
        """Engine layers: ``num_planes // planes_per_layer``."""
        return len(self._planes) // self.planes_per_layer

    def layer(self, index: int) -> PagedKV:
        """The planes of engine layer ``index`` as their own PagedKV (made once, then cached)."""
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer: expected a layer in [0, {self.num_layers}), got {index}")
        if self._layers is None:
            ppl = self.planes_per_layer
            self._layers = [
                PagedKV(self._planes[i * ppl : (i + 1) * ppl], planes_per_layer=ppl, memory=self._memory)
                for i in range(self.num_layers)
            ]
            for i, layer in enumerate(self._layers):  # share what the whole cache already knows
                layer._pinned = self._pinned
                layer._plane_tables_on.update({d: t[i * ppl : (i + 1) * ppl] for d, t in self._plane_tables_on.items()})
        return self._layers[index]

    @property
    def num_blocks(self) -> int:
        return self._planes[0].shape[0]

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def plane_block_nbytes(self) -> tuple[int, ...]:
        """Bytes of one plane-block of each plane (one block of that plane; docs/glossary.md)."""
        return self._plane_block_nbytes

    @property
    def block_nbytes(self) -> tuple[int, ...]:
        """Deprecated: :attr:`plane_block_nbytes` (``ModelSpec.block_nbytes`` is a whole block's bytes)."""
        warn_renamed("PagedKV.block_nbytes", "PagedKV.plane_block_nbytes")
        return self._plane_block_nbytes

    @property
    def nbytes_per_block(self) -> int:
        """Bytes of one block across all planes."""
        return sum(self._plane_block_nbytes)

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return self._dtypes

    @property
    def plane_table(self) -> torch.Tensor:
        """Host int64 ``[num_planes, len(PLANE_TABLE_COLUMNS)]``: block-0 address, block stride, block bytes.

        What the compiled kernels read. Computed at construction: planes must
        not be resized or re-pointed (``set_``) while this PagedKV is in use.
        """
        return self._plane_table

    @property
    def alignment(self) -> int:
        """The largest power of two, at most 16, dividing every block address, stride and size (bytes)."""
        return self._alignment

    def plane_table_on(self, device: torch.device) -> torch.Tensor:
        """:attr:`plane_table` on ``device`` (for the Triton kernel).

        Made at construction for a cache's own GPU, and by HostKVPool for the
        GPU of the cache it mirrors; any other device is copied once on first use.
        """
        if device not in self._plane_tables_on:
            self._plane_tables_on[device] = self._plane_table.to(device)
        return self._plane_tables_on[device]

    @property
    def is_pinned(self) -> bool:
        """True when every plane is in page-locked host memory (False on a GPU); asked once, or of the
        allocation kvcopy made for the planes (a HostKVPool's, False once the pool is closed)."""
        if self._memory is not None:
            return self._memory.pinned
        if self._pinned is None:
            on_host = self.device.type == "cpu" and torch.cuda.is_available()
            self._pinned = on_host and all(p.is_pinned() for p in self._planes)
        return self._pinned

    def __repr__(self) -> str:
        return (
            f"PagedKV(num_planes={self.num_planes}, num_blocks={self.num_blocks}, device={self.device}, "
            f"nbytes_per_block={self.nbytes_per_block})"
        )


def _layers(kv_caches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(kv_caches, torch.Tensor):
        raise TypeError("kv_caches: expected a sequence of per-layer tensors, got a single tensor")
    layers = list(kv_caches)
    for i, kv in enumerate(layers):
        if not isinstance(kv, torch.Tensor):
            raise TypeError(f"kv_caches[{i}]: expected a torch.Tensor, got {type(kv).__name__}")
    return layers
