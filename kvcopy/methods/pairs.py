"""Facts about a (source, destination) pair that decide which methods can run."""

from __future__ import annotations

import torch

from kvcopy import _ext
from kvcopy.layout import PagedKV

__all__ = ["HOST_POINTER_PROBLEM", "cuda_device", "kernels_reach_host", "pair_problem", "uses_cuda"]

# Why the SM kernels cannot reach pinned host memory on some platforms.
HOST_POINTER_PROBLEM = (
    "this GPU cannot read registered host memory through its host address "
    "(cudaDevAttrCanUseHostPointerForRegisteredMem is 0); use 'copy_engine', "
    "which 'auto' picks here"
)


def uses_cuda(src: PagedKV, dst: PagedKV) -> bool:
    return src.device.type == "cuda" or dst.device.type == "cuda"


def cuda_device(src: PagedKV, dst: PagedKV) -> torch.device:
    """The pair's GPU (the caller knows one side is on a GPU)."""
    return src.device if src.device.type == "cuda" else dst.device


def both_on_host(src: PagedKV, dst: PagedKV) -> bool:
    return src.device.type == "cpu" and dst.device.type == "cpu"


def pair_problem(src: PagedKV, dst: PagedKV) -> str | None:
    """Why no compiled GPU method can run for this pair, or None when they can."""
    if not uses_cuda(src, dst):
        return "no CUDA tensor on either side"
    for name, kv in (("src", src), ("dst", dst)):
        if kv.device.type == "cpu" and not kv.is_pinned:
            return f"{name} is pageable host memory (pin it, e.g. HostKVPool(pin_memory=True))"
        if kv.device.type not in ("cpu", "cuda"):
            return f"{name} is on {kv.device}"
    return None


def kernels_reach_host(src: PagedKV, dst: PagedKV) -> bool:
    """Whether an SM kernel on the pair's GPU can read a host side through its host address."""
    if src.device.type == dst.device.type:
        return True
    return _ext.kernels_read_host_pointers(cuda_device(src, dst))


def gpu_kernel_problem(src: PagedKV, dst: PagedKV) -> str | None:
    """Why an SM kernel (CUDA or Triton) on the pair's GPU cannot copy it, or None."""
    problem = pair_problem(src, dst)
    if problem is None and not kernels_reach_host(src, dst):
        return HOST_POINTER_PROBLEM
    return problem
