"""Block-id normalisation and validation, done before any byte moves.

Host-resident ids (CPU tensors, Python sequences, numpy arrays) are checked in
full: dtype, shape, range and, for destinations, repeats. The compiled check
(csrc/include/kvcopy/block_ids.h, used by the ops and the eager fast path)
reports the same problem first with the same message; tests/test_validation.py
holds the two to that. Device-resident ids
(CUDA tensors) are checked for dtype and shape only, because reading their
values would synchronise the device; the compiled kernels skip any device id
out of range instead of touching memory outside the cache, and repeated
destination ids among device ids leave which source wins unspecified.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["BlockIds", "check_disjoint", "prepare_ids"]

BlockIds = torch.Tensor | Sequence[int] | np.ndarray
_ID_DTYPES = (torch.int32, torch.int64)
# Up to this many ids, plain Python checks beat numpy's per-call overhead.
_SMALL_ID_COUNT = 64


def _validate_ints(values: Sequence[int], name: str) -> None:
    if all(type(v) is int for v in values):
        return
    for value in values:
        if isinstance(value, (Sequence, np.ndarray, torch.Tensor)) and not isinstance(value, (str, bytes)):
            raise ValueError(f"{name}: expected a 1-D sequence of block ids, got a nested {type(value).__name__}")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name}: expected integer ids, got {type(value).__name__} {value!r}")


def _as_tensor(ids: BlockIds, name: str) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        return ids
    if isinstance(ids, np.ndarray):
        if ids.dtype not in (np.int32, np.int64):
            raise TypeError(f"{name}: expected dtype int32 or int64, got a numpy array of {ids.dtype}")
        return torch.from_numpy(np.ascontiguousarray(ids))
    raise TypeError(f"{name}: expected a 1-D int32/int64 tensor or a sequence of ints, got {type(ids).__name__}")


def prepare_ids(ids: BlockIds, name: str, num_blocks: int, *, unique: bool) -> torch.Tensor:
    """Returns ``ids`` as a contiguous 1-D int64 tensor on the device they came on.

    Raises TypeError for a non-integer dtype, ValueError for a shape other than
    1-D or (with ``unique``) a repeated id, IndexError for an id outside
    ``[0, num_blocks)``. Value checks apply to host-resident ids only.
    """
    if isinstance(ids, (list, tuple, range)):
        _validate_ints(ids, name)
        _check_values(ids, name, num_blocks, unique=unique)
        if not ids:
            return torch.empty(0, dtype=torch.int64)
        return torch.frombuffer(array.array("q", ids), dtype=torch.int64)  # ~3x faster than torch.tensor
    tensor = _as_tensor(ids, name)
    if tensor.dtype not in _ID_DTYPES:
        raise TypeError(f"{name}: expected dtype int32 or int64, got {tensor.dtype}")
    if tensor.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor of block ids, got shape {list(tensor.shape)}")
    if tensor.dtype != torch.int64:
        tensor = tensor.to(torch.int64)
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.device.type != "cpu" or tensor.numel() == 0 or torch.compiler.is_compiling():
        return tensor  # values unread: that would sync the device or break the traced graph
    if tensor.numel() <= _SMALL_ID_COUNT:
        _check_values(tensor.tolist(), name, num_blocks, unique=unique)
    else:
        _check_array(tensor.numpy(), name, num_blocks, unique=unique)
    return tensor


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


def check_disjoint(src_ids: torch.Tensor, dst_ids: torch.Tensor, name: str = "dst_ids") -> None:
    """Within one cache, no block may be both read and written: the result would depend on copy order.
    Reports the first source id (in order) that is also a destination, as the compiled check does."""
    if torch.compiler.is_compiling() or src_ids.numel() == 0:
        return
    src = src_ids.numpy()
    both = src[np.isin(src, dst_ids.numpy())]
    if both.size:
        raise ValueError(
            f"{name}: block {int(both[0])} is both a source and a destination within one cache; "
            f"copy in two calls or through a spare block"
        )
