"""The "torch" method: block copies in plain torch, the always-available fallback."""

from __future__ import annotations

import torch

from .layout import PagedKV

__all__ = ["copy_blocks_torch", "word_view"]


# Integer words tried for the bitwise view, widest first: index kernels move
# wide words several times faster than single bytes.
_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def word_view(plane: torch.Tensor) -> torch.Tensor:
    """``plane`` as ``[num_blocks, words]`` of the widest integer type that fits (a view).

    Integer words copy every dtype bitwise (fp8, NaN payloads included).
    """
    block_numel = plane[0].numel() if plane.shape[0] else 0
    rows = plane.unsqueeze(1) if plane.dim() == 1 else plane.view(plane.shape[0], block_numel)
    rows = rows.view(torch.uint8)
    for word in _WORDS:
        try:
            return rows.view(word)
        except RuntimeError:  # block size, stride or offset not a multiple of this word
            continue
    return rows


def copy_blocks_torch(src: PagedKV, src_ids: torch.Tensor, dst: PagedKV, dst_ids: torch.Tensor) -> None:
    """Per plane: ``index_select`` on the source device, move, ``index_copy_`` on the destination.

    Synchronous across devices (the host waits for each cross-device copy).
    """
    src_ids = src_ids.to(src.device)
    dst_ids = dst_ids.to(dst.device)
    for src_plane, dst_plane in zip(src.planes, dst.planes):
        picked = word_view(src_plane).index_select(0, src_ids).to(dst.device)
        word_view(dst_plane).index_copy_(0, dst_ids, picked)
