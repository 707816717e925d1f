"""HostKVPool: host storage shaped like a device PagedKV, page-first or layer-first."""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Sequence
from typing import Literal

import torch

from kvcopy._checks import boolean, non_negative_int, positive_int, sequence_argument
from kvcopy.conflicts import check_caller
from kvcopy.host.allocator import BlockAllocator
from kvcopy.host.memory import HostRegion, gpu_numa_node
from kvcopy.ids import BlockIds
from kvcopy.layout import PagedKV, page_first_planes, plane_over

__all__ = ["HostKVPool", "HostLayout", "KVLike", "PoolLayout", "as_paged"]

HostLayout = Literal["page_first", "layer_first"]
# A pool's layout: one a pool is made with, or "placed" (HostKVPool.over with the owner's plane offsets).
PoolLayout = Literal["page_first", "layer_first", "placed"]
_LAYOUTS = ("page_first", "layer_first")


class HostKVPool:
    """Host blocks for a cache shaped like ``like``, in one contiguous uint8 buffer.

    ``page_first``: host block i is bytes ``[i * nbytes_per_block, (i + 1) * nbytes_per_block)``
    of :attr:`buffer`, its planes in plane order with no padding, so a block is
    one region to spill or send. ``layer_first``: plane p holds all blocks of
    that plane contiguously, mirroring the device.

    Memory (kvcopy.host.memory): one anonymous mapping of exactly the pool's
    bytes (fresh pages, which read as zero), never rounded up, asking for
    transparent huge pages (a DMA into it meets 2 MiB runs).
    A pool that would leave less than 2 GiB of available memory is a
    MemoryError before anything is allocated. :attr:`alloc_seconds` says how
    long allocation and pinning took. :meth:`close` (or ``with``) unpins.

    A block allocator comes with it: :meth:`allocate`, :meth:`free`, :attr:`num_free`.

    Parameters:

    - ``like``: the cache (a PagedKV) whose blocks the pool holds: its planes' block sizes and dtypes.
    - ``num_blocks``: host blocks in the pool.
    - ``layout``: ``"page_first"`` (the default) or ``"layer_first"``, as above.
    - ``pin_memory``: None pins when CUDA is available, registering with CUDA in chunks of at most 64 GiB;
      True without CUDA raises RuntimeError.
    - ``numa_node``: bind the pages to that node; None binds them to the GPU's node when ``like`` is on a
      GPU whose node the system reports.
    """

    def __init__(
        self,
        like: PagedKV,
        num_blocks: int,
        *,
        layout: HostLayout = "page_first",
        pin_memory: bool | None = None,
        numa_node: int | None = None,
    ) -> None:
        if not isinstance(like, PagedKV):
            raise TypeError(f"like: expected a PagedKV, got {type(like).__name__}")
        num_blocks = positive_int("num_blocks", num_blocks)
        _check_layout(layout)
        if numa_node is not None:
            numa_node = non_negative_int("numa_node", numa_node)
        pin = torch.cuda.is_available() if pin_memory is None else boolean("pin_memory", pin_memory)
        node = gpu_numa_node(like.device) if numa_node is None else numa_node
        nbytes = num_blocks * like.nbytes_per_block
        try:
            region = HostRegion(nbytes, pin=pin, numa_node=node)
        except (OSError, ValueError) as err:  # binding refused (e.g. mbind without CAP_SYS_NICE in a container)
            if numa_node is not None or node is None:
                raise  # asked for explicitly: the caller should know
            warnings.warn(
                f"HostKVPool: could not bind to the GPU's NUMA node {node} ({err}); left to the OS", stacklevel=2
            )
            region = HostRegion(nbytes, pin=pin, numa_node=None)
        self._lay_out(region, like, num_blocks, layout)

    @classmethod
    def over(
        cls,
        memory: object,
        like: PagedKV,
        num_blocks: int,
        *,
        layout: HostLayout = "page_first",
        pin_memory: bool | None = None,
        plane_offsets: Sequence[int] | None = None,
        block_stride: int | None = None,
    ) -> HostKVPool:
        """A pool over host memory another owner allocated (vLLM's shared offload region, say), ``num_blocks``
        blocks shaped like ``like``'s.

        ``memory``: a writable C-contiguous buffer (a memoryview, an mmap, a numpy array), or a
        :class:`~kvcopy.host.memory.HostRegion` kvcopy made over one (several pools over one region, pinned
        once). Its blocks are laid out as a pool made with the same ``like``, ``num_blocks`` and ``layout`` is,
        or, with ``plane_offsets`` and ``block_stride`` (both or neither), where the owner keeps them: block b
        of plane p at byte ``plane_offsets[p] + b * block_stride`` (``layout`` is then ``"placed"``: no block
        is one region). kvcopy pins (registers with CUDA) and unpins the bytes the pool spans as it does its
        own pools (``pin_memory`` as there; a HostRegion is pinned already, or not); the memory stays the
        owner's. The pool, its buffer and the views over it hold ``memory``: drop them (and :meth:`close`)
        before the owner unmaps it.

        TypeError for a ``memory`` without the buffer protocol; ValueError for a read-only or non-contiguous
        one, one of fewer bytes than the blocks span, placed planes that overlap, or one offset per plane not
        given.
        """
        if not isinstance(like, PagedKV):
            raise TypeError(f"like: expected a PagedKV, got {type(like).__name__}")
        num_blocks = positive_int("num_blocks", num_blocks)
        _check_layout(layout)
        if (plane_offsets is None) != (block_stride is None):
            raise ValueError("plane_offsets, block_stride: give both (the owner's placement of the blocks) or neither")
        placement = None
        if plane_offsets is not None and block_stride is not None:
            placement = _placement(like, num_blocks, plane_offsets, block_stride)
            nbytes = placement[2]
        else:
            nbytes = num_blocks * like.nbytes_per_block
        if isinstance(memory, HostRegion):
            if memory.nbytes < nbytes:
                raise ValueError(f"memory: expected at least {nbytes} bytes, got a region of {memory.nbytes}")
            region = memory
        else:
            pin = torch.cuda.is_available() if pin_memory is None else boolean("pin_memory", pin_memory)
            region = HostRegion.over(memory, nbytes, pin=pin)
        pool = cls.__new__(cls)
        pool._lay_out(region, like, num_blocks, layout, placement)
        return pool

    def _lay_out(
        self,
        region: HostRegion,
        like: PagedKV,
        num_blocks: int,
        layout: HostLayout,
        placement: tuple[list[int], int, int] | None = None,
    ) -> None:
        """The pool's buffer, allocator and planes over ``region`` (``placement``: the owner's plane offsets and
        block stride, and the bytes they span)."""
        self._region = region
        self.layout: PoolLayout = layout if placement is None else "placed"
        self.buffer: torch.Tensor = region.new_tensor()  # keeps the region alive, and its views do
        self.allocator = BlockAllocator(num_blocks)
        if placement is not None:
            offsets, stride, _ = placement
            planes = [
                plane_over(self.buffer, plane, i, num_blocks, offset, stride)
                for i, (plane, offset) in enumerate(zip(like.planes, offsets, strict=True))
            ]
        elif layout == "page_first":
            planes = page_first_planes(self.buffer, like, num_blocks)
        else:
            planes = _layer_first_planes(self.buffer, like, num_blocks)
        self.paged: PagedKV = PagedKV(planes, planes_per_layer=like.planes_per_layer, memory=region)
        if like.device.type == "cuda":  # the Triton kernel reads the table on the GPU it copies with
            self.paged.plane_table_on(like.device)

    @property
    def pinned(self) -> bool:
        """Whether the pool is registered with CUDA (False after :meth:`close`)."""
        return self._region.pinned

    @property
    def numa_node(self) -> int | None:
        """The NUMA node the pages are bound to, or None."""
        return self._region.numa_node

    @property
    def alloc_seconds(self) -> float:
        """Seconds that allocating (and pinning) the pool took."""
        return self._region.alloc_seconds

    @property
    def num_blocks(self) -> int:
        return self.paged.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks the allocator has not handed out."""
        return self.allocator.num_free

    def allocate(self, n: int) -> torch.Tensor:
        """``n`` free host block ids (int64, lowest first); ValueError if fewer are free."""
        return self.allocator.allocate(n)

    def free(self, ids: BlockIds) -> None:
        """Returns allocated ids; ValueError for a double free or an id not of this pool. With a debug-mode
        TransferEngine on this pool: TransferConflictError for ids an unfinished transfer still uses."""
        checked = self.allocator.checked_ids(ids)  # the ids' errors first, before a debug engine reads them
        check_caller("HostKVPool.free", self.paged, checked, writes=True)
        self.allocator.free(checked)

    def close(self) -> None:
        """Unpins the pool. Wait for transfers that use it first (TransferEngine.close does).

        The memory itself is released when no tensor over it is left.
        """
        self._region.close()

    def __enter__(self) -> HostKVPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def nbytes_per_block(self) -> int:
        return self.paged.nbytes_per_block

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool."""
        return self.buffer.numel()

    def block_bytes(self, block_id: int) -> torch.Tensor:
        """The uint8 bytes of host block ``block_id`` (page_first pools only): one region."""
        if self.layout != "page_first":
            raise ValueError(f"block_bytes: needs a page_first pool, this one is {self.layout}")
        if isinstance(block_id, bool) or not isinstance(block_id, numbers.Integral):
            raise TypeError(f"block_id: expected a block id (int), got {type(block_id).__name__} {block_id!r:.40}")
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block_id: expected an id in [0, {self.num_blocks}), got {block_id}")
        start = block_id * self.nbytes_per_block
        return self.buffer[start : start + self.nbytes_per_block]

    def __repr__(self) -> str:
        return (
            f"HostKVPool(num_blocks={self.num_blocks}, layout={self.layout!r}, pinned={self.pinned}, "
            f"nbytes={self.nbytes})"
        )


def _placement(
    like: PagedKV, num_blocks: int, plane_offsets: Sequence[int], block_stride: int
) -> tuple[list[int], int, int]:
    """(offsets, stride, bytes spanned) of an owner's placement of ``like``'s planes, checked."""
    offsets = list(sequence_argument("plane_offsets", plane_offsets, "byte offsets (ints)"))
    if len(offsets) != len(like.planes):
        raise ValueError(f"plane_offsets: expected one per plane ({len(like.planes)}), got {len(offsets)}")
    offsets = [non_negative_int(f"plane_offsets[{i}]", offset) for i, offset in enumerate(offsets)]
    stride = positive_int("block_stride", block_stride)
    sizes = like.plane_block_nbytes
    if max(sizes, default=0) > stride:
        raise ValueError(f"block_stride: expected at least a plane's block ({max(sizes)} bytes), got {stride}")
    spanned = max((o + (num_blocks - 1) * stride + n for o, n in zip(offsets, sizes, strict=True)), default=0)
    return offsets, stride, spanned


def _check_layout(layout: object) -> None:
    if not isinstance(layout, str):
        raise TypeError(f"layout: expected one of {_LAYOUTS}, got {type(layout).__name__} {layout!r:.40}")
    if layout not in _LAYOUTS:
        raise ValueError(f"layout: expected one of {_LAYOUTS}, got {layout!r}")


def _layer_first_planes(buffer: torch.Tensor, like: PagedKV, num_blocks: int) -> list[torch.Tensor]:
    planes, offset = [], 0
    for index, (plane, nbytes) in enumerate(zip(like.planes, like.plane_block_nbytes, strict=True)):
        planes.append(plane_over(buffer, plane, index, num_blocks, offset, nbytes))
        offset += num_blocks * nbytes
    return planes


KVLike = PagedKV | HostKVPool


def as_paged(kv: object, name: str) -> PagedKV:
    """``kv`` as a PagedKV (a HostKVPool's ``paged``); TypeError naming ``name`` for anything else."""
    if isinstance(kv, PagedKV):
        return kv
    if isinstance(kv, HostKVPool):
        return kv.paged
    raise TypeError(f"{name}: expected a PagedKV or HostKVPool, got {type(kv).__name__}")
