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
from kvcopy.ids import BlockIds, as_ids, check_lengths, require_host
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
    src_table: torch.Tensor, src_ids: torch.Tensor, dst_table: torch.Tensor, dst_ids: torch.Tensor
) -> list[tuple[int, int, int]]:
    """(source address, destination address, bytes) of each contiguous range a copy between two plane tables
    becomes (the ids' values checked by the caller, against its caches): kvcopy's range planner
    (csrc/include/kvcopy/copy_ranges.h), which merges runs of adjacent blocks and side-by-side planes; without the
    compiled extension one range per block and plane. The tables' addresses need not be this process's: a
    peer's pool (kvcopy.remote) or offsets into a file (kvcopy.storage) plan the same way.

    The planner reads the tables and ids at their data pointers, so their form is checked first (a CUDA or
    meta tensor, another dtype or shape would crash the process or read past them): each table a host int64
    ``[planes, 3]`` tensor, both with one plane count; the ids as kvcopy.ids takes them (int32 or int64, made
    contiguous), on the host, of one length. Their values are the caller's to check against its caches."""
    _check_table(src_table, "src_table")
    _check_table(dst_table, "dst_table")
    if src_table.shape[0] != dst_table.shape[0]:
        raise ValueError(
            f"dst_table: expected as many planes as src_table ({src_table.shape[0]}), got {dst_table.shape[0]}"
        )
    src_ids, dst_ids = _host_ids(src_ids, "src_ids"), _host_ids(dst_ids, "dst_ids")
    check_lengths(src_ids, dst_ids, ("src_ids", "dst_ids"))
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


def _check_table(table: object, name: str) -> None:
    if not isinstance(table, torch.Tensor):
        raise TypeError(f"{name}: expected a plane table (an int64 tensor), got {type(table).__name__}")
    if table.dtype != torch.int64:
        raise TypeError(f"{name}: expected an int64 plane table, got dtype {table.dtype}")
    if table.dim() != 2 or table.shape[1] != len(PLANE_TABLE_COLUMNS) or not table.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous [planes, {len(PLANE_TABLE_COLUMNS)}] plane table, got shape "
            f"{list(table.shape)}{'' if table.is_contiguous() else ' (not contiguous)'}"
        )
    if table.device.type != "cpu":
        raise ValueError(f"{name}: expected a plane table on the host (cpu), got one on {table.device}")


def _host_ids(ids: object, name: str) -> torch.Tensor:
    # kvcopy.ids' contract (its values unread: the tables' owners know their block counts)
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{name}: expected a 1-D int64 tensor of block ids, got {type(ids).__name__}")
    tensor = as_ids(ids, name, 0)
    require_host(tensor, name)
    return tensor
