"""Getting block ids to where a GPU method reads them, without synchronising the host."""

from __future__ import annotations

import torch

__all__ = ["ids_on", "record_on_current_stream", "staged"]


def staged(ids: torch.Tensor) -> torch.Tensor:
    """Host ids in a pinned buffer of kvcopy's own, ready for an asynchronous copy to a GPU.

    Always a new buffer: ``pin_memory()`` of a tensor already pinned returns the tensor itself,
    which the caller may change before the asynchronous copy reads it. While torch.compile
    traces (fake tensors cannot be pinned) the ids are copied as they are.
    """
    if torch.compiler.is_compiling():
        return ids
    if ids.is_pinned():
        ids = ids.clone()  # a pageable copy: pin_memory() below copies it again into pinned memory
    return ids.pin_memory()


def record_on_current_stream(ids: torch.Tensor) -> None:
    """The caller's GPU ids, made on another stream, stay allocated until the current stream (which
    reads them) is past the copy, even if the caller drops them as soon as copy_blocks returns."""
    if ids.is_cuda and not torch.compiler.is_compiling():
        ids.record_stream(torch.cuda.current_stream(ids.device))


def ids_on(src_ids: torch.Tensor, dst_ids: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Both id tensors on ``device``; host ids travel together in one asynchronous copy from a pinned
    buffer of kvcopy's own. Ids already on the GPU are recorded on the current stream, which reads them."""
    if src_ids.device == device and dst_ids.device == device:
        for ids in (src_ids, dst_ids):
            record_on_current_stream(ids)
        return src_ids, dst_ids
    if src_ids.device.type == "cpu" and dst_ids.device.type == "cpu":
        both = staged(torch.cat((src_ids, dst_ids))).to(device, non_blocking=True)
        return both[: src_ids.numel()], both[src_ids.numel() :]

    def moved(ids: torch.Tensor) -> torch.Tensor:
        if ids.device == device:
            record_on_current_stream(ids)
            return ids
        return staged(ids).to(device, non_blocking=True)

    return moved(src_ids), moved(dst_ids)
