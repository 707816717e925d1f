"""The byte ranges a copy becomes: kvcopy's coalescing, made observable.

The "cpu" and "copy_engine" methods plan every copy as byte ranges before
moving anything (csrc/include/kvcopy/copy_ranges.h): a run of adjacent ids is
one range in a plane that is dense on both sides, and planes that sit side by
side in both layouts merge (FlashInfer's K and V of a layer into a page-first
host block). The copy-engine plan is also split where a range would cross a
pinned-memory registration chunk (every 64 GiB of address). Fewer ranges
means fewer memcpys and DMA descriptors: that is what merging buys.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from kvcopy import _ext
from kvcopy.dispatch import KVLike, as_paged, check_pair, prepare_pair
from kvcopy.ids import BlockIds, check_lengths, check_side
from kvcopy.layout import PLANE_TABLE_COLUMNS

__all__ = ["ByteRange", "copy_ranges", "plan_table_ranges"]


class ByteRange(NamedTuple):
    """One contiguous copy: ``nbytes`` from address ``src`` to address ``dst``."""

    src: int
    dst: int
    nbytes: int


def copy_ranges(
    src: KVLike,
    src_ids: BlockIds,
    dst: KVLike,
    dst_ids: BlockIds,
    *,
    method: Literal["cpu", "copy_engine"] = "copy_engine",
) -> list[ByteRange]:
    """The byte ranges ``method`` turns ``copy_blocks(src, src_ids, dst, dst_ids)`` into, in order.

    The "cpu" method takes the ids of a call of 16 MiB or more in ascending order of their source block before
    it plans (csrc/cpu/copy_blocks_cpu.cpp): the ranges here are in the ids' own order.
    Plans only: nothing is read or written, so the caches may be on any device.
    Ids are validated as by copy_blocks and must be on the host (both methods
    read them there). RuntimeError when the compiled extension is not loaded.
    """
    if method not in ("cpu", "copy_engine"):
        raise ValueError(f"method: expected 'cpu' or 'copy_engine' (the methods that plan ranges), got {method!r}")
    src_kv, dst_kv = as_paged(src, "src"), as_paged(dst, "dst")
    check_pair(src_kv, dst_kv)
    src_t, dst_t, host_ids = prepare_pair(src_kv, src_ids, dst_kv, dst_ids)
    if not host_ids:
        raise ValueError("src_ids/dst_ids: expected ids on the host: the planner reads them there")
    module = _ext.extension()
    if module is None:
        error = _ext.build_info()["extension_error"]
        raise RuntimeError(f"copy_ranges: the compiled extension is not loaded ({error})")
    planned = module.plan_copy_ranges(
        src_kv.plane_table.data_ptr(),
        dst_kv.plane_table.data_ptr(),
        src_kv.num_planes,
        src_t.data_ptr(),
        dst_t.data_ptr(),
        src_t.numel(),
        method == "copy_engine",
    )
    return [ByteRange(*r) for r in planned]


def plan_table_ranges(
    src_table: torch.Tensor,
    src_ids: torch.Tensor,
    dst_table: torch.Tensor,
    dst_ids: torch.Tensor,
    *,
    src_blocks: int | None = None,
    dst_blocks: int | None = None,
) -> list[tuple[int, int, int]]:
    """(source address, destination address, bytes) of each contiguous range a copy between two plane tables
    becomes: kvcopy's range planner (csrc/include/kvcopy/copy_ranges.h), which merges runs of adjacent blocks
    and side-by-side planes; without the compiled extension one range per block and plane. The tables' addresses
    need not be this process's: a peer's pool (kvcopy.remote) or offsets into a file (kvcopy.storage) plan the
    same way.

    What the compiled planner reads is checked first, always: the tables host int64 ``[planes, 3]`` tensors
    (kvcopy.layout.PLANE_TABLE_COLUMNS) of one plane count, the ids 1-D int64 tensors on the host, of one length,
    contiguous (TypeError for a wrong type or dtype, ValueError for a shape, a length or a device: ids on a GPU
    or the meta device are refused, never read). With ``src_blocks`` / ``dst_blocks``, ids outside
    ``[0, blocks)`` are an IndexError too; without, the caller has checked them (kvcopy.ids)."""
    _check_plan_inputs(src_table, src_ids, dst_table, dst_ids, src_blocks, dst_blocks)
    compiled = _ext.extension()
    if compiled is not None:
        return compiled.plan_copy_ranges(
            src_table.data_ptr(),
            dst_table.data_ptr(),
            src_table.shape[0],
            src_ids.data_ptr(),
            dst_ids.data_ptr(),
            src_ids.numel(),
            False,
        )
    ranges = []
    for s, d in zip(src_ids.tolist(), dst_ids.tolist(), strict=True):
        for (sa, ss, n), (da, ds, _) in zip(src_table.tolist(), dst_table.tolist(), strict=True):
            ranges.append((sa + s * ss, da + d * ds, n))
    return ranges


def _check_table(name: str, table: object) -> torch.Tensor:
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"{name}: expected a plane table (torch.Tensor), got {type(table).__name__}")
    if table.dtype != torch.int64:
        raise TypeError(f"{name}: expected an int64 plane table, got dtype {table.dtype}")
    columns = len(PLANE_TABLE_COLUMNS)
    if table.layout != torch.strided or table.dim() != 2 or table.shape[1] != columns:
        raise ValueError(f"{name}: expected a [planes, {columns}] plane table, got shape {list(table.shape)}")
    if table.device.type != "cpu":
        raise ValueError(f"{name}: expected a plane table on the host, got one on {table.device}")
    if not table.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous plane table, got a strided view")
    return table


def _check_ids(name: str, ids: object, num_blocks: int | None) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name}: expected a 1-D int64 tensor of block ids, got {type(ids).__name__}")
    if ids.dtype != torch.int64 or ids.layout != torch.strided:
        raise TypeError(f"{name}: expected a dense int64 tensor of block ids, got {ids.dtype} ({ids.layout})")
    if ids.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor of block ids, got shape {list(ids.shape)}")
    if ids.device.type != "cpu":
        raise ValueError(f"{name}: expected ids on the host (the planner reads them there), got ids on {ids.device}")
    if not ids.is_contiguous():
        raise ValueError(f"{name}: expected contiguous ids, got a strided view (stride {ids.stride(0)})")
    if num_blocks is not None:
        check_side(ids, name, num_blocks, unique=False)
    return ids


def _check_plan_inputs(
    src_table: object,
    src_ids: object,
    dst_table: object,
    dst_ids: object,
    src_blocks: int | None,
    dst_blocks: int | None,
) -> None:
    """What plan_table_ranges hands the compiled planner, checked (its docstring says how)."""
    src_t, dst_t = _check_table("src_table", src_table), _check_table("dst_table", dst_table)
    if src_t.shape[0] != dst_t.shape[0]:
        raise ValueError(f"dst_table: expected {src_t.shape[0]} planes like src_table, got {dst_t.shape[0]}")
    src_i, dst_i = _check_ids("src_ids", src_ids, src_blocks), _check_ids("dst_ids", dst_ids, dst_blocks)
    check_lengths(src_i, dst_i, ("src_ids", "dst_ids"))
