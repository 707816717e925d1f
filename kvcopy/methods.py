"""Which copy methods can run for a (source, destination) pair, and what "auto" picks."""

from __future__ import annotations

import os
from typing import Literal

from . import _ext
from .layout import PagedKV
from .profile import Profile, direction_of

__all__ = ["CAPTURABLE_METHODS", "DMA_MIN_BLOCK_BYTES", "METHODS", "Method", "available_methods", "choose_method"]

Method = Literal["torch", "cpu", "triton", "cuda", "copy_engine"]
METHODS: tuple[Method, ...] = ("torch", "cpu", "triton", "cuda", "copy_engine")
# Methods whose submission can be captured in a CUDA graph: one kernel launch
# each. Not "copy_engine" (cudaMemcpyBatchAsync is not capturable) nor "torch"
# (its cross-device copies synchronise the host).
CAPTURABLE_METHODS: tuple[Method, ...] = ("cuda", "triton")
# Methods that read block ids on the host.
HOST_ID_METHODS: tuple[Method, ...] = ("cpu", "copy_engine")

# Without a calibrated profile, "auto" sends plane-blocks of at least this many
# bytes to the copy engines: per-copy DMA cost is 2-7 us, so below the
# half-peak size (100-350 KB, shared/REFERENCE.md) the SM kernel wins.
DMA_MIN_BLOCK_BYTES = 256 * 1024

# Read once, like triton itself, which decides at import whether kernels are interpreted.
_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _pair_problem(src: PagedKV, dst: PagedKV) -> str | None:
    """Why no compiled GPU method can run for this pair, or None when they can."""
    cuda_sides = [kv.device for kv in (src, dst) if kv.device.type == "cuda"]
    if not cuda_sides:
        return "no CUDA tensor on either side"
    for name, kv in (("src", src), ("dst", dst)):
        if kv.device.type == "cpu" and not kv.is_pinned:
            return f"{name} is pageable host memory (pin it, e.g. HostKVPool(pin_memory=True))"
        if kv.device.type not in ("cpu", "cuda"):
            return f"{name} is on {kv.device}"
    return None


def available_methods(src: PagedKV, dst: PagedKV) -> list[Method]:
    """The methods that can copy from ``src`` to ``dst`` in this process, "torch" first."""
    methods: list[Method] = ["torch"]
    both_cpu = src.device.type == "cpu" and dst.device.type == "cpu"
    interpret = _TRITON_INTERPRET
    if both_cpu:
        if _ext.has_cpu_kernels():
            methods.append("cpu")
        if interpret and _ext.triton_available():
            methods.append("triton")
        return methods
    if _pair_problem(src, dst) is not None:
        return methods
    kernels_reach_host = _kernels_reach_host(src, dst)
    if not interpret and _ext.triton_available() and kernels_reach_host:
        methods.append("triton")
    if _ext.has_cuda_kernels():
        methods += ["cuda", "copy_engine"] if kernels_reach_host else ["copy_engine"]
    return methods


def _kernels_reach_host(src: PagedKV, dst: PagedKV) -> bool:
    """Whether an SM kernel on the pair's GPU can read a host side through its host address."""
    if src.device.type == dst.device.type:
        return True
    return _ext.kernels_read_host_pointers(src.device if src.device.type == "cuda" else dst.device)


# Why the SM kernels cannot reach pinned host memory on some platforms.
HOST_POINTER_PROBLEM = ("this GPU cannot read registered host memory through its host address "
                        "(cudaDevAttrCanUseHostPointerForRegisteredMem is 0); use 'copy_engine', "
                        "which 'auto' picks here")


def _measured_choice(
    src: PagedKV, dst: PagedKV, available: list[Method], host_ids: bool, capturing: bool, num_blocks: int,
    profile: Profile,
) -> Method | None:
    direction = direction_of(src.device.type, dst.device.type)
    if direction not in profile.links:
        return None
    candidates = [
        m for m in available
        if (host_ids or m not in HOST_ID_METHODS) and (not capturing or m in CAPTURABLE_METHODS)
    ]
    nbytes = src.nbytes_per_block * max(num_blocks, 1)
    return profile.fastest_method(direction, nbytes, src.nbytes_per_block / src.num_planes, candidates)  # type: ignore[return-value]


def unavailable_reason(method: str, src: PagedKV, dst: PagedKV) -> str:
    """A sentence on why ``method`` cannot run for this pair."""
    if method == "cpu":
        if src.device.type != "cpu" or dst.device.type != "cpu":
            return "'cpu' copies host to host only"
        return f"the compiled extension is not loaded ({_ext.build_info()['extension_error']})"
    if method == "triton":
        if not _ext.triton_available():
            return "triton is not installed"
        if src.device.type == "cpu" and dst.device.type == "cpu":
            return "'triton' on CPU tensors needs TRITON_INTERPRET=1 set before kvcopy and triton are imported"
        problem = _pair_problem(src, dst)
        if problem is None and not _kernels_reach_host(src, dst):
            return HOST_POINTER_PROBLEM
        return problem or "TRITON_INTERPRET=1 is set, and the interpreter cannot reach GPU memory"
    problem = _pair_problem(src, dst)
    if problem:
        return problem
    if method == "cuda" and _ext.has_cuda_kernels() and not _kernels_reach_host(src, dst):
        return HOST_POINTER_PROBLEM
    return "kvcopy was built without CUDA kernels"


def choose_method(
    src: PagedKV,
    dst: PagedKV,
    available: list[Method],
    *,
    host_ids: bool,
    capturing: bool = False,
    num_blocks: int = 1,
    profile: Profile | None = None,
) -> Method:
    """What ``method="auto"`` runs.

    With a calibrated ``profile`` that measured this direction: the measured
    method predicted fastest for ``num_blocks`` blocks at this cache's
    plane-block size (among those that can run here, and are capturable while
    capturing). Without one, the documented defaults: host to host "cpu" when
    compiled, else "torch"; with a GPU "copy_engine" for plane-blocks of at
    least DMA_MIN_BLOCK_BYTES (host ids only), else the SM kernel "cuda", else
    "triton", else "copy_engine" (host ids; where the SM kernels cannot read
    host memory), else "torch". While the current stream is being captured into a
    CUDA graph: "cuda", else "triton" (ValueError if neither can run).
    """
    if profile is not None:
        measured = _measured_choice(src, dst, available, host_ids, capturing, num_blocks, profile)
        if measured is not None:
            return measured
    if capturing:
        for method in CAPTURABLE_METHODS:
            if method in available:
                return method
        raise ValueError(f"method: 'auto' found no method that can be captured in a CUDA graph among {available}")
    if "cpu" in available and host_ids:
        return "cpu"
    if "copy_engine" in available and host_ids and min(src.block_nbytes) >= DMA_MIN_BLOCK_BYTES:
        return "copy_engine"
    for method in ("cuda", "triton"):
        if method in available and (src.device.type == "cuda" or dst.device.type == "cuda"):
            return method
    if "copy_engine" in available and host_ids:  # the SM kernels cannot reach the host side here
        return "copy_engine"
    return "torch"
