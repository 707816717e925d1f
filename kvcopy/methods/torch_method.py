"""The "torch" method: block copies in plain torch, the always-available fallback."""

from __future__ import annotations

import torch

from kvcopy.layout import PagedKV

__all__ = ["copy_blocks_torch", "word_views"]


# Integer words tried for the bitwise view, widest first: index kernels move
# wide words several times faster than single bytes.
_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _byte_rows(plane: torch.Tensor) -> torch.Tensor:
    """``plane`` as ``[num_blocks, block_nbytes]`` uint8, a view (each block is contiguous)."""
    block_numel = plane[0].numel() if plane.shape[0] else 0
    return plane.as_strided((plane.shape[0], block_numel), (plane.stride(0), 1)).view(torch.uint8)


def word_views(src_plane: torch.Tensor, dst_plane: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both planes as ``[num_blocks, words]`` of the widest integer type that fits both (views).

    Integer words copy every dtype bitwise (fp8, NaN payloads included).
    """
    src_rows, dst_rows = _byte_rows(src_plane), _byte_rows(dst_plane)
    for word in _WORDS[:-1]:
        try:
            return src_rows.view(word), dst_rows.view(word)
        except RuntimeError:  # block size, stride or offset not a multiple of this word
            continue
    return src_rows, dst_rows


def copy_blocks_torch(src: PagedKV, src_ids: torch.Tensor, dst: PagedKV, dst_ids: torch.Tensor) -> None:
    """Per plane: ``index_select`` on the source device, move, ``index_copy_`` on the destination.

    Synchronous across devices (the host waits for each cross-device copy).
    """
    src_ids = src_ids.to(src.device)
    dst_ids = dst_ids.to(dst.device)
    for src_plane, dst_plane in zip(src.planes, dst.planes, strict=True):
        src_words, dst_words = word_views(src_plane, dst_plane)
        dst_words.index_copy_(0, dst_ids, src_words.index_select(0, src_ids).to(dst.device))
