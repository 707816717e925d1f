"""PagedKV: a paged KV cache seen as planes, and adapters for engine layouts.

A *plane* is a tensor whose first dimension indexes blocks and whose block
``plane[i]`` is one contiguous run of bytes. Every engine layout reduces to a
list of planes with the same block count on one device (docs/architecture.md).

The compiled code sees a PagedKV through its *plane table*: one int64 row per
plane with the columns PLANE_TABLE_COLUMNS (csrc/include/kvcopy/plane_table.h
names the same columns for C++).
"""

from __future__ import annotations

import math
import numbers
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvcopy._checks import positive_int
from kvcopy._version import warn_renamed

__all__ = [
    "PLANE_TABLE_COLUMNS",
    "HostMemory",
    "MemoryOverlap",
    "PagedKV",
    "block_for_block",
    "layout_difference",
    "memory_overlap",
    "page_first_planes",
    "plane_over",
    "shares_memory",
]

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
    if plane.layout != torch.strided:  # a sparse or nested tensor has no plain block-by-block bytes to copy
        raise TypeError(f"planes[{index}]: expected a dense (strided) tensor, got layout {plane.layout}")
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
        if isinstance(planes, torch.Tensor) or not isinstance(planes, Iterable) or isinstance(planes, (str, bytes)):
            # a tensor iterates over its rows, which would each become a plane
            raise TypeError(f"planes: expected a sequence of plane tensors, got {type(planes).__name__}")
        planes = tuple(planes)
        if not planes:
            raise ValueError("planes: expected at least one plane, got none")
        for i, plane in enumerate(planes):
            _check_plane(i, plane, planes[0] if i else None)
        planes_per_layer = positive_int("planes_per_layer", planes_per_layer)
        if len(planes) % planes_per_layer:
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
        # What the same-memory check (memory_overlap) reads: the table as numpy, the address range of the planes'
        # blocks (None for a device with no memory, or no bytes), how this cache's blocks overlap themselves, and
        # how they overlap other caches over the same memory (found once per pair).
        self._rows = np.array(self._plane_table.tolist(), dtype=np.int64).reshape(-1, len(PLANE_TABLE_COLUMNS))
        self._hull = _hull(self._rows, self.num_blocks, self._device)
        self._overlaps: weakref.WeakKeyDictionary[PagedKV, MemoryOverlap | None] = weakref.WeakKeyDictionary()
        if self._hull is not None:
            _check_planes_apart(self._rows, self.num_blocks)
        # A cache's blocks share memory with its own block for block, and no other way (its planes are apart).
        self._self_overlap = None if self._hull is None else _BLOCK_FOR_BLOCK
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
        shape = "vLLM shape [2, num_blocks, block_size, num_kv_heads, head_size]"
        return cls(_key_value_planes(kv_caches, 0, shape), planes_per_layer=2)

    @classmethod
    def from_flashinfer(cls, kv_caches: Sequence[torch.Tensor]) -> PagedKV:
        """FlashInfer layout: each layer ``[num_blocks, 2, block_size, num_kv_heads, head_size]``.

        Planes are ``kv[:, 0]`` and ``kv[:, 1]`` (strided: K and V of a block are adjacent).
        """
        shape = "FlashInfer shape [num_blocks, 2, block_size, num_kv_heads, head_size]"
        return cls(_key_value_planes(kv_caches, 1, shape), planes_per_layer=2)

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
        if isinstance(index, bool) or not isinstance(index, numbers.Integral):
            raise TypeError(f"layer: expected a layer index (int), got {type(index).__name__} {index!r:.40}")
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


def _key_value_planes(kv_caches: Sequence[torch.Tensor], kv_dim: int, shape: str) -> list[torch.Tensor]:
    """The K and V planes of each layer, in layer order: index 0 and 1 of dimension ``kv_dim`` of a 5-d
    tensor whose ``kv_dim`` has size 2 (the engine's ``shape``); ValueError naming the layer otherwise."""
    planes: list[torch.Tensor] = []
    for i, kv in enumerate(_layers(kv_caches)):
        if kv.dim() != 5 or kv.shape[kv_dim] != 2:
            raise ValueError(f"kv_caches[{i}]: expected {shape}, got {list(kv.shape)}")
        planes += [kv.select(kv_dim, 0), kv.select(kv_dim, 1)]
    return planes


# ----------------------------------------------------------------------------- shared memory


@dataclass(frozen=True)
class MemoryOverlap:
    """Which blocks of a source and a destination cache share bytes (:func:`memory_overlap`).

    Source block ``s`` and destination block ``d`` overlap when ``s - d`` lies in one of ``shifts`` (inclusive
    ranges, found for plane pairs of one block stride: ``((0, 0),)`` for one cache, or two PagedKVs over one
    cache; ``((1, 1),)`` for a destination that is the source shifted by one block), or when, for one of the
    ``strided`` plane pairs (whose block strides differ), their byte ranges meet.
    """

    shifts: tuple[tuple[int, int], ...]
    # One row per plane pair of different strides: source (address, block stride, block bytes), then destination.
    strided: tuple[tuple[int, int, int, int, int, int], ...] = ()

    @property
    def block_for_block(self) -> bool:
        """Whether blocks overlap only where their ids are equal (what the compiled check of one cache tests)."""
        return self.shifts == ((0, 0),) and not self.strided

    def first_overlap(self, src_ids: np.ndarray, dst_ids: np.ndarray) -> tuple[int, int] | None:
        """(source id, destination id) for the first source id, in order, whose block shares a byte with a
        destination block; None when none does. Both int64 arrays of ids in range. O(n log n)."""
        if not src_ids.size or not dst_ids.size:
            return None
        found: tuple[int, int] | None = None  # (position in src_ids, destination id)
        sorted_dst = np.sort(dst_ids)
        for low, high in self.shifts:  # s - d in [low, high]: some d in [s - high, s - low]
            first = np.searchsorted(sorted_dst, src_ids - high, side="left")
            last = np.searchsorted(sorted_dst, src_ids - low, side="right")
            found = _earliest(found, first < last, sorted_dst, first)
        for src_address, src_stride, src_bytes, dst_address, dst_stride, dst_bytes in self.strided:
            order = np.argsort(dst_ids, kind="stable")
            writes = dst_address + dst_ids[order] * dst_stride  # sorted: the stride is positive
            reads = src_address + src_ids * src_stride
            # Written [w, w + dst_bytes) meets read [r, r + src_bytes) when r - dst_bytes < w < r + src_bytes.
            first = np.searchsorted(writes, reads - dst_bytes, side="right")
            last = np.searchsorted(writes, reads + src_bytes, side="left")
            found = _earliest(found, first < last, dst_ids[order], first)
        return None if found is None else (int(src_ids[found[0]]), found[1])


def _earliest(
    found: tuple[int, int] | None, hits: np.ndarray, candidates: np.ndarray, first: np.ndarray
) -> tuple[int, int] | None:
    """The earlier of ``found`` and the first hit (position in the source ids, the destination id it meets)."""
    positions = np.flatnonzero(hits)
    if not positions.size or (found is not None and found[0] <= positions[0]):
        return found
    position = int(positions[0])
    return position, int(candidates[first[position]])


# One cache's blocks overlap themselves block for block, and no other way (PagedKV checks its planes are apart).
_BLOCK_FOR_BLOCK = MemoryOverlap(shifts=((0, 0),))


def _ends(rows: np.ndarray, num_blocks: int) -> np.ndarray:
    """The end address of each plane's last block (its first byte's address + block bytes for an empty plane)."""
    return rows[:, PLANE_ADDRESS] + max(num_blocks - 1, 0) * rows[:, PLANE_BLOCK_STRIDE] + rows[:, PLANE_BLOCK_BYTES]


def _hull(rows: np.ndarray, num_blocks: int, device: torch.device) -> tuple[int, int] | None:
    """[lowest, highest) address of any block byte, or None when there is none to share (no blocks, empty
    blocks, or a device without memory such as meta)."""
    live = rows[:, PLANE_BLOCK_BYTES] > 0
    if device.type == "meta" or num_blocks == 0 or not live.any():
        return None
    return int(rows[live, PLANE_ADDRESS].min()), int(_ends(rows, num_blocks)[live].max())


def _check_planes_apart(rows: np.ndarray, num_blocks: int) -> None:
    """ValueError naming two planes of one cache that share a byte (a copy into the cache would write it twice,
    from two sources). Free for planes over address ranges of their own; array arithmetic on the plane pairs
    for interleaved ones (a page_first pool's, FlashInfer's K and V), per block only for planes that meet with
    different strides."""
    live = rows[rows[:, PLANE_BLOCK_BYTES] > 0]
    if num_blocks == 0 or len(live) < 2:
        return
    order = np.argsort(live[:, PLANE_ADDRESS], kind="stable")
    if bool((_ends(live[order], num_blocks)[:-1] <= live[order[1:], PLANE_ADDRESS]).all()):
        return
    blocks = np.arange(num_blocks, dtype=np.int64)
    if not _shared(_overlap_of(rows, num_blocks, rows, num_blocks, other_planes_only=True), blocks):
        return
    for later in range(1, len(rows)):  # an error: find the first two planes to name
        for earlier in range(later):
            pair = _overlap_of(rows[[earlier]], num_blocks, rows[[later]], num_blocks)
            if _shared(pair, blocks):
                raise ValueError(
                    f"planes[{later}]: shares memory with planes[{earlier}]; each plane must have memory of its "
                    "own (a copy into the cache would write those bytes twice)"
                )


def _shared(overlap: MemoryOverlap | None, blocks: np.ndarray) -> bool:
    """Whether some block pair of ``overlap`` shares a byte, among ``blocks`` on both sides."""
    return overlap is not None and (bool(overlap.shifts) or overlap.first_overlap(blocks, blocks) is not None)


def _overlap_of(
    src: np.ndarray, src_blocks: int, dst: np.ndarray, dst_blocks: int, *, other_planes_only: bool = False
) -> MemoryOverlap | None:
    """Which blocks of two caches (plane tables as numpy rows, block counts) share bytes: O(planes^2) array
    arithmetic on the plane pairs whose address ranges meet, nothing per block. ``other_planes_only``: of one
    cache, its planes against each other (not each against itself)."""
    src_end, dst_end = _ends(src, src_blocks), _ends(dst, dst_blocks)
    meet = (
        (src[:, None, PLANE_ADDRESS] < dst_end[None, :])
        & (dst[None, :, PLANE_ADDRESS] < src_end[:, None])
        & (src[:, None, PLANE_BLOCK_BYTES] > 0)
        & (dst[None, :, PLANE_BLOCK_BYTES] > 0)
    )
    if other_planes_only:
        np.fill_diagonal(meet, False)
    if src_blocks == 0 or dst_blocks == 0 or not meet.any():
        return None
    src_plane, dst_plane = np.nonzero(meet)
    src_address, src_stride, src_bytes = (src[src_plane, c] for c in range(len(PLANE_TABLE_COLUMNS)))
    dst_address, dst_stride, dst_bytes = (dst[dst_plane, c] for c in range(len(PLANE_TABLE_COLUMNS)))
    # Only block 0 of a one-block plane exists, so its stride is moot: the other side's (or any positive one).
    if src_blocks == 1 and dst_blocks == 1:
        src_stride = dst_stride = np.maximum(src_bytes, dst_bytes)
    elif src_blocks == 1:
        src_stride = dst_stride
    elif dst_blocks == 1:
        dst_stride = src_stride
    same = src_stride == dst_stride
    # Same stride S: block s at a + sS and block d at b + dS share a byte when -src_bytes < (a - b) + (s - d)S <
    # dst_bytes, i.e. for s - d in [low, high]; clipped to the differences the block counts allow.
    stride = np.where(same, src_stride, 1)
    delta = src_address - dst_address
    low = np.maximum((-src_bytes - delta) // stride + 1, -(dst_blocks - 1))
    high = np.minimum(-((delta - dst_bytes) // stride) - 1, src_blocks - 1)
    keep = same & (low <= high)
    shifts: list[tuple[int, int]] = []
    for lo, hi in sorted(set(zip(low[keep].tolist(), high[keep].tolist(), strict=True))):
        if shifts and lo <= shifts[-1][1] + 1:
            shifts[-1] = (shifts[-1][0], max(shifts[-1][1], hi))
        else:
            shifts.append((lo, hi))
    strided = sorted(
        set(
            zip(
                *(column[~same].tolist() for column in (src_address, src_stride, src_bytes)),
                *(column[~same].tolist() for column in (dst_address, dst_stride, dst_bytes)),
                strict=True,
            )
        )
    )
    if not shifts and not strided:
        return None
    return MemoryOverlap(tuple(shifts), tuple(strided))


def memory_overlap(src: PagedKV, dst: PagedKV) -> MemoryOverlap | None:
    """Which blocks of ``src`` share bytes with blocks of ``dst``, by the planes' memory (not by which objects
    they are): None when no byte is shared, the common case, found from two address ranges. Two PagedKVs over
    one cache's tensors, a view of a cache, or a cache shifted by a block share memory; caches on different
    devices, or on the meta device, never do. Found once per pair of caches, then remembered."""
    if src is dst:
        return src._self_overlap
    src_hull, dst_hull = src._hull, dst._hull
    if src_hull is None or dst_hull is None or src_hull[1] <= dst_hull[0] or dst_hull[1] <= src_hull[0]:
        return None
    if src.device != dst.device:
        return None
    try:
        return src._overlaps[dst]
    except KeyError:
        found = src._overlaps[dst] = _overlap_of(src._rows, src.num_blocks, dst._rows, dst.num_blocks)
        return found


# Both answers depend only on the two caches, which torch.compile guards on: it takes them as constants when it
# traces a copy (no array code of the analysis in the graph).
@torch.compiler.assume_constant_result
def shares_memory(src: PagedKV, dst: PagedKV) -> bool:
    """Whether a block of ``src`` shares a byte with a block of ``dst`` (:func:`memory_overlap`)."""
    return memory_overlap(src, dst) is not None


@torch.compiler.assume_constant_result
def block_for_block(src: PagedKV, dst: PagedKV) -> bool:
    """Whether ``src`` and ``dst`` share memory block for block only, so that kvcopy's compiled id check of "one
    cache" (a block both read and written) is the whole same-memory check: it indexes the written blocks by
    source id, so ``src`` must not have more blocks than ``dst``. False for caches that share no memory."""
    overlap = memory_overlap(src, dst)
    return overlap is not None and overlap.block_for_block and src.num_blocks <= dst.num_blocks


# ----------------------------------------------------------------------------- comparing layouts


def layout_difference(expected: object, got: object, at: str = "") -> str | None:
    """The first difference between two layouts (nested mappings, sequences and values, as a store's header or
    a pool's descriptor holds them) as "<field>: expected X, got Y", or None when they are the same, type
    included (1 and 1.0, a list and a tuple of equal items are the same; True and 1 are not). For messages that
    say what differs rather than print two layouts that look alike."""
    where = at or "layout"
    if isinstance(expected, Mapping) and isinstance(got, Mapping):
        for key in [*expected, *(k for k in got if k not in expected)]:
            if key not in got:
                return f"{where}: expected a field {key!r} (= {expected[key]!r:.60}), got none"
            if key not in expected:
                return f"{where}: expected no field {key!r}, got {got[key]!r:.60}"
            found = layout_difference(expected[key], got[key], f"{at}.{key}" if at else str(key))
            if found is not None:
                return found
        return None
    sequences = (list, tuple)
    if isinstance(expected, sequences) and isinstance(got, sequences):
        if len(expected) != len(got):
            return f"{where}: expected {len(expected)} entries, got {len(got)}"
        for i, (a, b) in enumerate(zip(expected, got, strict=True)):
            found = layout_difference(a, b, f"{where}[{i}]")
            if found is not None:
                return found
        return None
    if isinstance(expected, bool) != isinstance(got, bool) or expected != got:
        return f"{where}: expected {expected!r:.60}, got {got!r:.60}"
    return None


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def plane_over(
    buffer: torch.Tensor, like: torch.Tensor, index: int, num_blocks: int, offset: int, stride: int
) -> torch.Tensor:
    """A tensor shaped like ``like`` ([num_blocks, *block]) over ``buffer``'s storage.

    Block b starts at byte ``offset + b * stride``. Made with ``set_`` rather
    than a chain of views so that every plane is a plain alias of the storage:
    torch.compile can then trace one op mutating several planes of one pool.
    ValueError when the blocks would reach outside the storage (``set_`` would
    grow it, moving it from under every other view) or start unaligned for
    their dtype; ``index`` names the plane (``like.planes[index]``) in it.
    """
    itemsize = like.element_size()
    block_nbytes = math.prod(like.shape[1:]) * itemsize
    end = offset + (num_blocks - 1) * stride + block_nbytes if num_blocks else offset
    if offset < 0 or stride < 0 or end > buffer.untyped_storage().nbytes():
        raise ValueError(
            f"buffer: expected room for like.planes[{index}]'s {num_blocks} blocks of {block_nbytes} bytes from byte "
            f"{offset} every {stride}, up to byte {end}; got {buffer.untyped_storage().nbytes()} bytes"
        )
    empty_blocks = block_nbytes == 0  # nothing to align
    if not empty_blocks and (offset % itemsize or stride % itemsize):
        raise ValueError(
            f"like.planes[{index}]: its {like.dtype} blocks would start at byte offset {offset} with stride {stride}, "
            f"not multiples of its {itemsize}-byte elements, in an unpadded layout; order the planes by "
            f"decreasing element size"
        )
    block_shape = tuple(like.shape[1:])
    plane = torch.empty(0, dtype=like.dtype)
    return plane.set_(
        buffer.untyped_storage(),
        offset // itemsize,
        (num_blocks, *block_shape),
        (stride // itemsize, *_contiguous_strides(block_shape)),
    )


def page_first_planes(buffer: torch.Tensor, like: PagedKV, num_blocks: int, start: int = 0) -> list[torch.Tensor]:
    """``like``'s planes for ``num_blocks`` blocks over ``buffer``'s storage, page-first from byte ``start``: block
    b's planes back to back at ``start + b * like.nbytes_per_block`` (a host pool's layout, a disk row's)."""
    planes, offset = [], start
    for index, (plane, nbytes) in enumerate(zip(like.planes, like.plane_block_nbytes, strict=True)):
        planes.append(plane_over(buffer, plane, index, num_blocks, offset, like.nbytes_per_block))
        offset += nbytes
    return planes
