"""Block-id normalisation and validation, done before any byte moves.

Host-resident ids (CPU tensors, Python sequences, numpy arrays) are checked in
full: dtype, shape, range and, for destinations, repeats. Device-resident ids
(CUDA tensors) are checked for dtype and shape only, because reading their
values would synchronise the device; the compiled kernels skip any device id
out of range instead of touching memory outside the cache, and repeated
destination ids among device ids leave which source wins unspecified.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["BlockIds", "prepare_ids"]

BlockIds = torch.Tensor | Sequence[int] | np.ndarray
_ID_DTYPES = (torch.int32, torch.int64)
# Up to this many ids a Python set finds repeats faster than a numpy sort.
_SMALL_ID_COUNT = 64


def _as_tensor(ids: BlockIds, name: str) -> torch.Tensor:
    if isinstance(ids, torch.Tensor):
        return ids
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise TypeError(f"{name}: expected int32 or int64 ids, got a numpy array of {ids.dtype}")
        return torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"{name}: expected a 1-D int32/int64 tensor or a sequence of ints, got {type(ids).__name__}")
    values = list(ids)
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name}: expected integer ids, got {type(value).__name__} {value!r}")
    try:
        return torch.tensor(values, dtype=torch.int64)
    except (OverflowError, RuntimeError) as err:
        raise IndexError(f"{name}: an id does not fit in int64 ({err})") from None


def prepare_ids(ids: BlockIds, name: str, num_blocks: int, *, unique: bool) -> torch.Tensor:
    """Returns ``ids`` as a contiguous 1-D int64 tensor on the device they came on.

    Raises TypeError for a non-integer dtype, ValueError for a shape other than
    1-D or (with ``unique``) a repeated id, IndexError for an id outside
    ``[0, num_blocks)``. Value checks apply to host-resident ids only.
    """
    tensor = _as_tensor(ids, name)
    if tensor.dtype not in _ID_DTYPES:
        raise TypeError(f"{name}: expected dtype int32 or int64, got {tensor.dtype}")
    if tensor.dim() != 1:
        raise ValueError(f"{name}: expected a 1-D tensor of block ids, got shape {list(tensor.shape)}")
    tensor = tensor.to(torch.int64).contiguous()
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return tensor
    values = tensor.numpy()
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= num_blocks:
        bad = low if low < 0 else high
        raise IndexError(f"{name}: expected ids in [0, {num_blocks}), got {bad}")
    if unique and values.size > 1:
        _check_no_repeats(values, name)
    return tensor


def _check_no_repeats(values: np.ndarray, name: str) -> None:
    if values.size <= _SMALL_ID_COUNT:
        seen: set[int] = set()
        for value in values.tolist():
            if value in seen:
                raise ValueError(f"{name}: expected distinct destination ids (repeats would race), got {value} twice")
            seen.add(value)
        return
    ordered = np.sort(values)
    repeats = ordered[1:][ordered[1:] == ordered[:-1]]
    if repeats.size:
        raise ValueError(
            f"{name}: expected distinct destination ids (repeats would race), got {int(repeats[0])} more than once"
        )
