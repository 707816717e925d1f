"""kvcopy's own copy methods, registered in the order ``available_methods`` lists them.

- "torch": per plane ``index_select`` + ``index_copy_`` in plain torch; runs anywhere.
- "cpu": the compiled host-to-host copy (coalesced runs, memcpy, OpenMP threads).
- "triton": the Triton kernel (GPU; on CPU tensors only under TRITON_INTERPRET=1, for tests).
- "cuda": the compiled SM kernel.
- "copy_engine": the DMA copy engines (cudaMemcpyBatchAsync of coalesced ranges); ids on the host.

Eager calls enter the compiled code through csrc/python/module.cpp with each PagedKV's cached plane
table; traced calls (torch.compile) go through the registered torch.ops.kvcopy ops instead.
"""

from __future__ import annotations

import torch

from kvcopy import _ext
from kvcopy.layout import PagedKV, block_for_block
from kvcopy.methods.cta_budget import TRITON_PROGRAMS_PER_CTA, cta_budget
from kvcopy.methods.pairs import (
    HOST_POINTER_PROBLEM,
    both_on_host,
    cuda_device,
    gpu_kernel_problem,
    kernels_reach_host,
    pair_problem,
    uses_cuda,
)
from kvcopy.methods.registry import CopyMethod, register
from kvcopy.methods.staging import ids_on
from kvcopy.methods.torch_method import copy_blocks_torch

__all__ = ["CAPTURABLE_METHODS", "DMA_MIN_BLOCK_BYTES", "METHODS"]

# Without a calibrated profile, "auto" sends plane-blocks of at least this many bytes to the copy engines:
# per-copy DMA cost is 2-7 us, so below the half-peak size (100-350 KB, docs/measurements.md) the SM kernel wins.
DMA_MIN_BLOCK_BYTES = 256 * 1024

# "auto"'s documented defaults, as ranks (lower first): the compiled host copy; the copy engines for large
# plane-blocks; the SM kernels; the copy engines where the SM kernels cannot reach the host; torch.
_RANK_FIRST, _RANK_SM_KERNEL, _RANK_TRITON, _RANK_DMA_FALLBACK, _RANK_LAST = 0, 10, 20, 30, 100


def _raw_stream(device: torch.device) -> int:
    return torch._C._cuda_getCurrentRawStream(device.index)


def _tables(src: PagedKV, dst: PagedKV) -> tuple[int, int, int]:
    return src.plane_table.data_ptr(), dst.plane_table.data_ptr(), src.num_planes


# ----------------------------------------------------------------------------- torch


def _torch_run(src: PagedKV, src_ids: torch.Tensor, dst: PagedKV, dst_ids: torch.Tensor, num_ctas: int | None) -> None:
    copy_blocks_torch(src, src_ids, dst, dst_ids)


TORCH = CopyMethod("torch", run=_torch_run, unavailable=lambda src, dst: None, auto_rank=lambda src, dst: _RANK_LAST)

# ----------------------------------------------------------------------------- cpu


def _cpu_unavailable(src: PagedKV, dst: PagedKV) -> str | None:
    if not both_on_host(src, dst):
        return "'cpu' copies host to host only"
    if not _ext.has_cpu_kernels():
        return f"the compiled extension is not loaded ({_ext.build_info()['extension_error']})"
    return None


def _cpu_run(src: PagedKV, src_ids: torch.Tensor, dst: PagedKV, dst_ids: torch.Tensor, num_ctas: int | None) -> None:
    n = src_ids.numel()
    _ext.loaded_extension().copy_blocks_cpu(
        *_tables(src, dst),
        src_ids.data_ptr(),
        n,
        dst_ids.data_ptr(),
        n,
        src.num_blocks,
        dst.num_blocks,
        block_for_block(src, dst),
        torch.get_num_threads(),
    )


def _cpu_run_traced(
    src: PagedKV, src_ids: torch.Tensor, dst: PagedKV, dst_ids: torch.Tensor, num_ctas: int | None
) -> None:
    torch.ops.kvcopy.copy_blocks(src.planes, src_ids, dst.planes, dst_ids, 0)


CPU = CopyMethod(
    "cpu",
    run=_cpu_run,
    run_traced=_cpu_run_traced,
    unavailable=_cpu_unavailable,
    auto_rank=lambda src, dst: _RANK_FIRST,
    host_ids_only=True,
)

# ----------------------------------------------------------------------------- triton


def _triton_unavailable(src: PagedKV, dst: PagedKV) -> str | None:
    if not _ext.triton_available():
        return "triton is not installed"
    if both_on_host(src, dst):
        if not _ext.TRITON_INTERPRET:
            return "'triton' on CPU tensors needs TRITON_INTERPRET=1 set before kvcopy and triton are imported"
        return None
    if _ext.TRITON_INTERPRET:
        return pair_problem(src, dst) or "TRITON_INTERPRET=1 is set, and the interpreter cannot reach GPU memory"
    return gpu_kernel_problem(src, dst)


def _triton_run(src: PagedKV, src_ids: torch.Tensor, dst: PagedKV, dst_ids: torch.Tensor, num_ctas: int | None) -> None:
    from kvcopy.methods.triton_kernel import copy_blocks_triton  # importing triton takes seconds: only when first used

    device = cuda_device(src, dst) if uses_cuda(src, dst) else src.device
    src_ids, dst_ids = ids_on(src_ids, dst_ids, device)
    programs = None if num_ctas is None else num_ctas * TRITON_PROGRAMS_PER_CTA
    copy_blocks_triton(src, src_ids, dst, dst_ids, num_programs=programs)


TRITON = CopyMethod(
    "triton",
    run=_triton_run,
    unavailable=_triton_unavailable,
    auto_rank=lambda src, dst: _RANK_TRITON if uses_cuda(src, dst) else None,
    stages_ids=True,
    capturable=True,
    uses_sms=True,
)

# ----------------------------------------------------------------------------- cuda


def _cuda_kernels_problem(src: PagedKV, dst: PagedKV) -> str | None:
    """Why the pair cannot run through kvcopy's own CUDA code (the SM kernel and the copy engines alike): the
    pair's problem, or a build without CUDA kernels; None when it can."""
    problem = pair_problem(src, dst)
    if problem is not None:
        return problem
    return None if _ext.has_cuda_kernels() else "kvcopy was built without CUDA kernels"


def _cuda_unavailable(src: PagedKV, dst: PagedKV) -> str | None:
    problem = _cuda_kernels_problem(src, dst)
    if problem is not None:
        return problem
    return None if kernels_reach_host(src, dst) else HOST_POINTER_PROBLEM


def _cuda_run(src: PagedKV, src_ids: torch.Tensor, dst: PagedKV, dst_ids: torch.Tensor, num_ctas: int | None) -> None:
    device = cuda_device(src, dst)
    src_ids, dst_ids = ids_on(src_ids, dst_ids, device)
    _ext.loaded_extension().copy_blocks_cuda(
        *_tables(src, dst),
        src_ids.data_ptr(),
        dst_ids.data_ptr(),
        src_ids.numel(),
        src.num_blocks,
        dst.num_blocks,
        cta_budget(src, dst, num_ctas),
        _raw_stream(device),
        device.index,
    )


def _cuda_run_traced(
    src: PagedKV, src_ids: torch.Tensor, dst: PagedKV, dst_ids: torch.Tensor, num_ctas: int | None
) -> None:
    src_ids, dst_ids = ids_on(src_ids, dst_ids, cuda_device(src, dst))
    torch.ops.kvcopy.copy_blocks(src.planes, src_ids, dst.planes, dst_ids, cta_budget(src, dst, num_ctas))


CUDA = CopyMethod(
    "cuda",
    run=_cuda_run,
    run_traced=_cuda_run_traced,
    unavailable=_cuda_unavailable,
    auto_rank=lambda src, dst: _RANK_SM_KERNEL,
    stages_ids=True,
    capturable=True,
    uses_sms=True,
)

# ----------------------------------------------------------------------------- copy_engine


def _dma_run(src: PagedKV, src_ids: torch.Tensor, dst: PagedKV, dst_ids: torch.Tensor, num_ctas: int | None) -> None:
    device = cuda_device(src, dst)
    _ext.loaded_extension().copy_blocks_dma(
        *_tables(src, dst), src_ids.data_ptr(), dst_ids.data_ptr(), src_ids.numel(), _raw_stream(device), device.index
    )


def _dma_run_traced(
    src: PagedKV, src_ids: torch.Tensor, dst: PagedKV, dst_ids: torch.Tensor, num_ctas: int | None
) -> None:
    torch.ops.kvcopy.copy_blocks_dma(src.planes, src_ids, dst.planes, dst_ids)


def _dma_rank(src: PagedKV, dst: PagedKV) -> int:
    if min(src.plane_block_nbytes) >= DMA_MIN_BLOCK_BYTES:
        return _RANK_FIRST
    return _RANK_DMA_FALLBACK


COPY_ENGINE = CopyMethod(
    "copy_engine",
    run=_dma_run,
    run_traced=_dma_run_traced,
    unavailable=_cuda_kernels_problem,
    auto_rank=_dma_rank,
    host_ids_only=True,
)

BUILTIN_METHODS = (TORCH, CPU, TRITON, CUDA, COPY_ENGINE)
for _method in BUILTIN_METHODS:
    register(_method)

METHODS = tuple(m.name for m in BUILTIN_METHODS)
CAPTURABLE_METHODS = (CUDA.name, TRITON.name)  # in auto's order of preference
