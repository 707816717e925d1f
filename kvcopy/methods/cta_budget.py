"""How many SMs a kvcopy kernel takes from whatever runs beside it: one budget, in CTAs of the CUDA kernel,
from which the Triton kernel's program count is derived."""

from __future__ import annotations

import numbers

from kvcopy.layout import PagedKV

__all__ = [
    "HOST_MEMORY_CTA_BUDGET",
    "MAX_NUM_CTAS",
    "SM_KERNEL_THREADS_PER_CTA",
    "TRITON_PROGRAMS_PER_CTA",
    "TRITON_WARPS",
    "check_num_ctas",
    "cta_budget",
]

# CTAs the "cuda" SM kernel uses by default when host memory is on one side: a few CTAs saturate PCIe
# (each has 32 warps of 16-byte loads in flight), and every other SM stays with decode. `num_ctas` overrides it.
HOST_MEMORY_CTA_BUDGET = 4
# The most CTAs a caller may ask for: the compiled launch takes a C int (a grid never needs more; the kernel
# caps it at what the copy can use).
MAX_NUM_CTAS = 2**31 - 1
# Threads in one CTA of the "cuda" kernel (kThreadsPerCta in csrc/kernels/copy_blocks_sm.cu).
SM_KERNEL_THREADS_PER_CTA = 1024
# Warps of one Triton program (its num_warps): 256 threads.
TRITON_WARPS = 8
# A CTA budget buys Triton the same number of threads: 1024 / (8 x 32) = 4 programs per CTA.
TRITON_PROGRAMS_PER_CTA = SM_KERNEL_THREADS_PER_CTA // (TRITON_WARPS * 32)


def cta_budget(src: PagedKV, dst: PagedKV, num_ctas: int | None) -> int:
    """CTAs for the SM kernel: the caller's budget, else the host-memory default, else 0 (one full wave)."""
    if num_ctas is not None:
        return num_ctas
    return HOST_MEMORY_CTA_BUDGET if src.device.type != dst.device.type else 0


def check_num_ctas(num_ctas: object, name: str = "num_ctas") -> int | None:
    """``num_ctas`` as an int (numpy's integers too), or None; TypeError / ValueError naming it."""
    if num_ctas is None:
        return None
    if isinstance(num_ctas, bool) or not isinstance(num_ctas, numbers.Integral):
        raise TypeError(
            f"{name}: expected a number of CTAs (int) or None, got {type(num_ctas).__name__} {num_ctas!r:.40}"
        )
    number = int(num_ctas)
    if not 1 <= number <= MAX_NUM_CTAS:
        raise ValueError(f"{name}: expected 1 to {MAX_NUM_CTAS} CTAs, or None for the default, got {num_ctas!r:.40}")
    return number
