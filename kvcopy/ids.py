"""Block-id normalisation and validation, done before any byte moves.

Host-resident ids (CPU tensors, Python sequences, numpy arrays) are checked in
full: dtype, shape, range and, for destinations, repeats; for a pair, equal
lengths and (within one cache) no block both read and written. Device-resident
ids (CUDA tensors) are checked for dtype and shape only, because reading their
values would synchronise the device; the compiled kernels skip any device id
out of range instead of touching memory outside the cache, and repeated
destination ids among device ids leave which source wins unspecified.

The value checks are one implementation, in C++ (csrc/include/kvcopy/block_ids.h),
used here, by the registered ops and by the eager fast path, with one wording
of each error. The Python checks below run only where the compiled extension
is not loaded; tests/core/test_host_fast_path.py holds them to the same problems and
messages.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import numpy as np
import torch

from kvcopy import _ext
from kvcopy.layout import MemoryOverlap

__all__ = [
    "BlockIds",
    "as_ids",
    "check_host_pair",
    "check_lengths",
    "check_shared_memory",
    "check_side",
    "prepare_host_ids",
    "prepare_ids",
    "require_host",
]

BlockIds = torch.Tensor | Sequence[int] | np.ndarray
_ID_DTYPES = (torch.int32, torch.int64)
# Up to this many ids, plain Python checks beat numpy's per-call overhead (fallback only).
_SMALL_ID_COUNT = 64


def _validate_ints(values: Sequence[int], name: str) -> None:
    if all(type(v) is int for v in values):
        return
    for value in values:
        nested = isinstance(value, (Sequence, np.ndarray, torch.Tensor)) and not isinstance(value, (str, bytes))
        if nested and getattr(value, "ndim", 1) != 0:  # a 0-d array or tensor is a wrong type, not a shape
            raise ValueError(f"{name}: expected a 1-D sequence of block ids, got a nested {type(value).__name__}")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name}: expected integer ids, got {type(value).__name__} {value!r}")


def _as_tensor(ids: BlockIds, name: str) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        return ids
    if isinstance(ids, np.ndarray):
        if ids.dtype not in (np.int32, np.int64):
            raise TypeError(f"{name}: expected dtype int32 or int64, got a numpy array of {ids.dtype}")
        if ids.ndim != 1:  # before ascontiguousarray, which makes a 0-d array 1-d
            raise ValueError(f"{name}: expected a 1-D array of block ids, got shape {list(ids.shape)}")
        return torch.from_numpy(np.ascontiguousarray(ids))
    raise TypeError(f"{name}: expected a 1-D int32/int64 tensor or a sequence of ints, got {type(ids).__name__}")


def as_ids(ids: BlockIds, name: str, num_blocks: int) -> torch.Tensor:
    """``ids`` as a contiguous 1-D int64 tensor on the device they came on; their values unread (but an int
    that no int64 holds is the IndexError of an id out of ``[0, num_blocks)``). TypeError for a non-integer
    dtype or element, ValueError for a shape other than 1-D."""
    if isinstance(ids, (list, tuple, range)):
        _validate_ints(ids, name)
        if not ids:
            return torch.empty(0, dtype=torch.int64)
        try:
            return torch.frombuffer(array.array("q", ids), dtype=torch.int64)  # ~3x faster than torch.tensor
        except OverflowError:  # out of any cache's range: reported as the range check reports it
            low, high = min(ids), max(ids)
            raise _range_error(name, num_blocks, int(low if low < 0 else high)) from None
    tensor = _as_tensor(ids, name)
    if tensor.layout != torch.strided:  # a sparse tensor's values are not its ids in order
        raise TypeError(f"{name}: expected a dense (strided) tensor of block ids, got layout {tensor.layout}")
    if tensor.dtype not in _ID_DTYPES:
        raise TypeError(f"{name}: expected dtype int32 or int64, got {tensor.dtype}")
    if tensor.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor of block ids, got shape {list(tensor.shape)}")
    if tensor.dtype != torch.int64:
        tensor = tensor.to(torch.int64)
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor


def _readable(ids: torch.Tensor) -> bool:
    """Whether the values can be read here: on the host, and not while torch.compile traces."""
    return ids.device.type == "cpu" and not torch.compiler.is_compiling()


def _compiled_input(ids: BlockIds, name: str, num_blocks: int) -> torch.Tensor:
    """``ids`` as the compiled checks read them (a contiguous 1-D int64 tensor): as they are when they already
    are one (:func:`as_ids`'s output, the one cheap test on the hot path), else through :func:`as_ids`, so
    that no other dtype or stride ever reaches the compiled code, whoever calls."""
    if (
        isinstance(ids, torch.Tensor)
        and type(ids) is torch.Tensor
        and ids.dtype is torch.int64
        and ids.layout is torch.strided
        and ids.dim() == 1
        and ids.is_contiguous()
    ):
        return ids
    return as_ids(ids, name, num_blocks)


def check_side(ids: torch.Tensor, name: str, num_blocks: int, *, unique: bool) -> None:
    """IndexError for an id outside ``[0, num_blocks)``; with ``unique`` (a destination) ValueError for a repeat.
    Host ids only (``ids`` from :func:`as_ids`, or anything it takes); device ids and traced ones are left alone."""
    ids = _compiled_input(ids, name, num_blocks)
    if not _readable(ids) or ids.numel() == 0:
        return
    compiled = _ext.extension()
    if compiled is not None:
        compiled.check_block_id_side(ids.data_ptr(), ids.numel(), num_blocks, unique, name)
    elif ids.numel() <= _SMALL_ID_COUNT:
        _check_values(ids.tolist(), name, num_blocks, unique=unique)
    else:
        _check_array(ids.numpy(), name, num_blocks, unique=unique)


def check_host_pair(
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    src_blocks: int,
    dst_blocks: int,
    *,
    same_cache: bool,
    names: tuple[str, str] = ("src_ids", "dst_ids"),
) -> None:
    """Both sides (as :func:`check_side`), then one length, then with ``same_cache`` no block both read and
    written (the result would depend on copy order). Host ids from :func:`as_ids` (or anything it takes)."""
    src_ids, dst_ids = _compiled_input(src_ids, names[0], src_blocks), _compiled_input(dst_ids, names[1], dst_blocks)
    if not (_readable(src_ids) and _readable(dst_ids)):
        return
    compiled = _ext.extension()
    if compiled is not None:
        compiled.check_block_ids(
            src_ids.data_ptr(),
            src_ids.numel(),
            dst_ids.data_ptr(),
            dst_ids.numel(),
            src_blocks,
            dst_blocks,
            same_cache,
            *names,
        )
        return
    check_side(src_ids, names[0], src_blocks, unique=False)
    check_side(dst_ids, names[1], dst_blocks, unique=True)
    check_lengths(src_ids, dst_ids, names)
    if same_cache and src_ids.numel():
        src = src_ids.numpy()
        both = src[np.isin(src, dst_ids.numpy())]  # the first source id (in order) that is also written
        if both.size:
            raise ValueError(
                f"{names[1]}: block {int(both[0])} is both a source and a destination within one cache; "
                f"copy in two calls or through a spare block"
            )


def check_shared_memory(
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    overlap: MemoryOverlap | None,
    names: tuple[str, str] = ("src_ids", "dst_ids"),
) -> None:
    """ValueError naming both arguments when a block ``src_ids`` reads shares a byte with one ``dst_ids`` writes
    (the caches share memory as ``overlap`` says, kvcopy.layout.memory_overlap): the result would depend on the
    order of the copies. Host ids from :func:`as_ids`, already checked for range and length."""
    if overlap is None or not (_readable(src_ids) and _readable(dst_ids)):
        return
    found = overlap.first_overlap(src_ids.numpy(), dst_ids.numpy())
    if found is None:
        return
    src_block, dst_block = found
    raise ValueError(
        f"{names[0]}/{names[1]}: {names[0]} reads block {src_block} and {names[1]} writes block {dst_block}, which "
        f"share memory (src and dst overlap in memory), so the result would depend on copy order; copy in two "
        f"calls or through a spare block"
    )


def check_lengths(src_ids: torch.Tensor, dst_ids: torch.Tensor, names: tuple[str, str]) -> None:
    if src_ids.numel() != dst_ids.numel():
        raise ValueError(f"{names[1]}: expected as many ids as {names[0]} ({src_ids.numel()}), got {dst_ids.numel()}")


def prepare_ids(ids: BlockIds, name: str, num_blocks: int, *, unique: bool) -> torch.Tensor:
    """:func:`as_ids`, then :func:`check_side`: the ids of one side, validated."""
    tensor = as_ids(ids, name, num_blocks)
    check_side(tensor, name, num_blocks, unique=unique)
    return tensor


def require_host(ids: torch.Tensor, name: str) -> None:
    """ValueError unless ``ids`` (from :func:`as_ids`) are on the host, for code that reads their values there
    (a range planner, a disk store, NIXL's descriptors): a CUDA or meta tensor's data pointer is no host
    address, and reading it would crash the process."""
    if ids.device.type != "cpu":
        raise ValueError(f"{name}: expected ids on the host (cpu), got ids on {ids.device}")


def prepare_host_ids(ids: BlockIds, name: str, num_blocks: int, *, unique: bool) -> torch.Tensor:
    """:func:`as_ids`, :func:`require_host`, then :func:`check_side`: one side's ids as a contiguous 1-D int64
    tensor on the host, every value checked, for code that reads them there."""
    tensor = as_ids(ids, name, num_blocks)
    require_host(tensor, name)
    check_side(tensor, name, num_blocks, unique=unique)
    return tensor


# ----------------------------------------------------------------------------- the fallback (no extension)


def _range_error(name: str, num_blocks: int, bad: int) -> IndexError:
    return IndexError(f"{name}: expected ids in [0, {num_blocks}), got {bad}")


def _repeat_error(name: str, value: int) -> ValueError:
    return ValueError(f"{name}: expected distinct destination ids (repeats would race), got {value} more than once")


def _check_values(values: Sequence[int], name: str, num_blocks: int, *, unique: bool) -> None:
    """Checks a short Python sequence of ints."""
    if not values:
        return
    low, high = min(values), max(values)
    if low < 0 or high >= num_blocks:
        raise _range_error(name, num_blocks, int(low if low < 0 else high))
    if unique and len(set(values)) != len(values):
        seen: set[int] = set()
        for value in values:
            if value in seen:
                raise _repeat_error(name, int(value))
            seen.add(value)


def _check_array(values: np.ndarray, name: str, num_blocks: int, *, unique: bool) -> None:
    """Checks a long int64 array with numpy."""
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= num_blocks:
        raise _range_error(name, num_blocks, low if low < 0 else high)
    if unique:
        _, first_seen = np.unique(values, return_index=True)
        if first_seen.size != values.size:  # the first id (in order) seen before, as the compiled check reports
            again = np.ones(values.size, dtype=bool)
            again[first_seen] = False
            raise _repeat_error(name, int(values[np.argmax(again)]))
