"""What a user would write instead of kvcopy, and the contiguous-copy limit, as callables to time.

Every baseline copies the same blocks as kvcopy (``dst.planes[p][dst_ids[i]] =
src.planes[p][src_ids[i]]``) bitwise, through integer-word views, so fp8 and
NaN payloads move exactly; the benchmark checks each one's output.

The DMA baselines are compiled into a module of their own, kvcopy.tools.bench._baselines
(csrc/bench/), which setup.py builds beside kvcopy._C only with the CUDA kernels.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

import torch

from kvcopy.layout import PagedKV
from kvcopy.methods.torch_method import word_views

__all__ = [
    "DMA_BASELINES",
    "contiguous_copy",
    "dma_baseline",
    "has_dma_baselines",
    "per_block_copy_loop",
    "per_layer_index_loop",
]

# The baselines of _baselines.copy_blocks_dma_baseline (csrc/bench/dma_baselines.h, DmaBaseline).
DMA_BASELINES = {
    "per-block cudaMemcpyAsync": 0,  # one call per (block, plane): vLLM's old swap_blocks
    "batched DMA, unmerged": 1,  # one cudaMemcpyBatchAsync of every (block, plane), no coalescing
}


def per_layer_index_loop(src: PagedKV, src_ids: torch.Tensor, dst: PagedKV, dst_ids: torch.Tensor) -> None:
    """Per plane: ``index_select`` on the source's device, move, ``index_copy_`` on the destination's.

    ``src_ids`` on src's device, ``dst_ids`` on dst's. kvcopy's "torch" method is this loop.
    """
    for s, d in zip(src.planes, dst.planes, strict=True):
        s_words, d_words = word_views(s, d)
        d_words.index_copy_(0, dst_ids, s_words.index_select(0, src_ids).to(d_words.device))


def per_block_copy_loop(src: PagedKV, src_ids: list[int], dst: PagedKV, dst_ids: list[int]) -> None:
    """One ``copy_`` per block per plane (asynchronous between a GPU and pinned memory)."""
    pairs = [word_views(s, d) for s, d in zip(src.planes, dst.planes, strict=True)]
    for i, j in zip(src_ids, dst_ids, strict=True):
        for s, d in pairs:
            d[j].copy_(s[i], non_blocking=True)


def _load_dma_baselines() -> ModuleType | None:
    try:
        return importlib.import_module("kvcopy.tools.bench._baselines")
    except ImportError:  # not built (no CUDA kernels), or built against another torch
        return None


def has_dma_baselines() -> bool:
    """Whether the compiled DMA baselines are here (they are wherever kvcopy's CUDA kernels were built)."""
    return _DMA_BASELINES is not None


def dma_baseline(
    name: str, src: PagedKV, src_ids: torch.Tensor, dst: PagedKV, dst_ids: torch.Tensor, device: torch.device
) -> Callable[[], None]:
    """A call of the compiled DMA baseline ``name`` (a key of DMA_BASELINES) on the current stream.

    Ids are CPU int64 tensors, already validated (the benchmark makes them).
    """
    fast = _DMA_BASELINES
    if fast is None:
        raise RuntimeError("kvcopy: the DMA baselines were not built (kvcopy.tools.bench._baselines needs CUDA)")
    baseline = DMA_BASELINES[name]
    src_ids, dst_ids = src_ids.to(torch.int64).contiguous(), dst_ids.to(torch.int64).contiguous()
    tables = (src.plane_table.data_ptr(), dst.plane_table.data_ptr(), src.num_planes)

    def run() -> None:
        stream = torch._C._cuda_getCurrentRawStream(device.index)
        fast.copy_blocks_dma_baseline(
            *tables, src_ids.data_ptr(), dst_ids.data_ptr(), src_ids.numel(), stream, device.index, baseline
        )

    return run


def contiguous_copy(src: torch.Tensor, dst: torch.Tensor) -> Callable[[], object]:
    """One ``copy_`` of equal-sized flat buffers: the link's limit for the same bytes."""
    return lambda: dst.copy_(src, non_blocking=True)


# Loaded once at import, as kvcopy._ext loads kvcopy._C.
_DMA_BASELINES = _load_dma_baselines()
