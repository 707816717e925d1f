"""One contiguous host region for a HostKVPool: exact size, optionally NUMA-bound, pinned in chunks.

Why not ``torch.empty(..., pin_memory=True)``: torch's caching host allocator
rounds requests up to a power of two (a 65 GiB pool would take 128 GiB) and
pins in one call, and one ``cudaHostRegister`` of 512 GiB or more fails
(docs/decisions.md). Here the region is an anonymous mapping of exactly the
bytes asked for (rounded to a page), backed by transparent huge pages where the
kernel offers them, bound to a NUMA node before any page is touched, and
registered with CUDA in chunks of at most MAX_REGISTER_BYTES.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import time
import weakref
from typing import Any

import numpy as np
import torch

__all__ = [
    "HOST_RESERVE_BYTES",
    "MAX_REGISTER_BYTES",
    "HostRegion",
    "available_host_bytes",
    "gpu_numa_node",
    "registration_chunks",
]

# No single cudaHostRegister above this: registrations of 512 GiB and more fail.
# Chunks end at addresses that are multiples of it, so the copy-engine path
# (which must not submit one copy across two registrations) can split its ranges
# by address alone: kRegistrationChunkBytes in csrc/include/kvcopy/copy_ranges.h.
MAX_REGISTER_BYTES = 64 << 30
# Host memory left to the OS and the process: a pool that would eat into it is
# refused before anything is allocated (pinned pages cannot be swapped out).
HOST_RESERVE_BYTES = 2 << 30

_CUDA_HOST_REGISTER_PORTABLE = 1  # usable from every CUDA context
_CUDA_HOST_REGISTER_MAPPED = 2  # mapped into the device address space (read by the SM kernels)
_MPOL_BIND = 2
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}


def registration_chunks(address: int, nbytes: int) -> list[tuple[int, int]]:
    """(address, length) of each cudaHostRegister for a region: split at every address that is a
    multiple of MAX_REGISTER_BYTES, so no chunk crosses one (and none is larger)."""
    chunks = []
    start, end = address, address + nbytes
    while start < end:
        boundary = (start // MAX_REGISTER_BYTES + 1) * MAX_REGISTER_BYTES
        chunks.append((start, min(boundary, end) - start))
        start = min(boundary, end)
    return chunks


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def gpu_numa_node(device: torch.device) -> int | None:
    """The NUMA node of a GPU's PCI slot where sysfs tells it, else None."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    # Any: torch's stubs lack the PCI ids (pci_domain_id, pci_bus_id, pci_device_id) that its builds have;
    # a build without them is the AttributeError below.
    props: Any = torch.cuda.get_device_properties(device)
    try:
        address = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        with open(f"/sys/bus/pci/devices/{address}/numa_node") as f:
            node = int(f.read().strip())
    except (AttributeError, OSError, ValueError):
        return None
    return node if node >= 0 else None


def _numa_nodes() -> list[int]:
    try:
        names = os.listdir("/sys/devices/system/node")
    except OSError:
        return []
    return sorted(int(n[4:]) for n in names if n.startswith("node") and n[4:].isdigit())


def _ask_for_huge_pages(mapping: mmap.mmap) -> None:
    """Asks the kernel to back the mapping's 2 MiB-aligned stretches with transparent huge pages, where it
    offers them (THP "madvise" or "always"). A DMA into host memory (an O_DIRECT disk read, a copy engine's)
    then meets physically contiguous 2 MiB runs instead of scattered 4 KiB pages: on the CPU VM's virtio disk
    one O_DIRECT read of 2-64 MiB into 4 KiB pages took 1.4-2.4x as long (benchmarks/bench_disk.py, "contiguous,
    4 KiB pages"). Pinning also walks 512x fewer pages. A kernel without THP refuses: nothing changes then."""
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            mapping.madvise(mmap.MADV_HUGEPAGE)


def _bind_to_node(address: int, length: int, node: int) -> None:
    """mbind(MPOL_BIND) the (untouched) pages of [address, address + length) to ``node``."""
    nodes = _numa_nodes()
    if node not in nodes:
        raise ValueError(f"numa_node: expected one of this machine's NUMA nodes {nodes}, got {node}")
    syscall = _SYS_MBIND.get(platform.machine())
    if syscall is None:
        raise ValueError(f"numa_node: binding memory is not supported on {platform.machine()}")
    mask_bits = 64 * (node // 64 + 1)
    mask = (ctypes.c_ulong * (mask_bits // 64))()
    mask[node // 64] = 1 << (node % 64)
    libc = ctypes.CDLL(None, use_errno=True)
    result = libc.syscall(
        syscall, ctypes.c_void_p(address), ctypes.c_ulong(length), _MPOL_BIND, mask, ctypes.c_ulong(mask_bits + 1), 0
    )
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mbind to NUMA node {node} failed: {os.strerror(err)}")


def _unregister(registered: list[int]) -> None:
    """cudaHostUnregister every chunk start in ``registered`` and forget them."""
    if registered:
        cudart = torch.cuda.cudart()
        for address in registered:
            cudart.cudaHostUnregister(address)
        registered.clear()


class _RegionBytes(np.ndarray):
    """The region's bytes as a numpy array that holds the region: torch.from_numpy keeps it, and so the
    region, alive as long as any tensor over the bytes is."""

    region: HostRegion | None = None

    @classmethod
    def over(cls, mapping: Any, nbytes: int, region: HostRegion) -> _RegionBytes:
        array = np.frombuffer(mapping, dtype=np.uint8, count=nbytes).view(cls)
        array.region = region
        return array


class HostRegion:
    """``nbytes`` of host memory, as uint8 tensors from :meth:`new_tensor`.

    ``pin``: register with CUDA in chunks (RuntimeError without CUDA).
    ``numa_node``: bind the pages to that node first (None: leave to the OS).
    Raises MemoryError before allocating when ``nbytes`` would leave less than
    HOST_RESERVE_BYTES of the machine's available memory.
    """

    def __init__(self, nbytes: int, *, pin: bool, numa_node: int | None) -> None:
        available = available_host_bytes()
        if available is not None and nbytes > available - HOST_RESERVE_BYTES:
            raise MemoryError(
                f"host pool: {nbytes / 2**30:.2f} GiB asked for, {available / 2**30:.2f} GiB available and "
                f"{HOST_RESERVE_BYTES / 2**30:.0f} GiB kept in reserve; use fewer blocks"
            )
        if pin and not torch.cuda.is_available():
            raise RuntimeError("pin_memory=True: pinning host memory needs a CUDA device, and none is available")
        started = time.perf_counter()
        self.nbytes = nbytes
        self.numa_node = numa_node
        self._registered: list[int] = []
        # Unpins when the region is collected without close(): a registration must not outlive its pages.
        self._finalizer = weakref.finalize(self, _unregister, self._registered)
        mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._mapping: mmap.mmap | memoryview = mapping  # (a memoryview: memory another owner allocated)
        _ask_for_huge_pages(mapping)
        view = ctypes.c_char.from_buffer(mapping)
        self.address = ctypes.addressof(view)
        del view  # a live ctypes view would keep the mapping from ever being released
        if numa_node is not None:
            _bind_to_node(self.address, len(mapping), numa_node)
        if pin:
            self._register()
        self.pinned = pin
        self.alloc_seconds = time.perf_counter() - started

    @classmethod
    def over(cls, memory: Any, nbytes: int, *, pin: bool) -> HostRegion:
        """A region over the first ``nbytes`` of ``memory``, which another owner allocated (a writable,
        C-contiguous buffer: a memoryview, an mmap, a numpy array): the same tensors, pinning and
        :meth:`close`, but the memory stays the owner's (no NUMA binding, no reserve check), and the region and
        its tensors hold it while they live.

        TypeError for an object without the buffer protocol; ValueError for a read-only or non-contiguous one,
        or one of fewer than ``nbytes`` bytes.
        """
        try:
            view = memoryview(memory)
        except TypeError:
            raise TypeError(
                f"memory: expected a writable buffer (a memoryview, mmap or numpy array), got {type(memory).__name__}"
            ) from None
        if view.readonly:
            raise ValueError("memory: expected a writable buffer, got a read-only one")
        if not view.c_contiguous:
            raise ValueError(f"memory: expected a C-contiguous buffer, got one of strides {view.strides}")
        if view.nbytes < nbytes:
            raise ValueError(f"memory: expected at least {nbytes} bytes, got {view.nbytes}")
        if pin and not torch.cuda.is_available():
            raise RuntimeError("pin_memory=True: pinning host memory needs a CUDA device, and none is available")
        started = time.perf_counter()
        region = cls.__new__(cls)
        region._mapping = view.cast("B")[:nbytes]
        region.nbytes = nbytes
        region.numa_node = None
        region._registered = []
        region._finalizer = weakref.finalize(region, _unregister, region._registered)
        region.address = np.frombuffer(region._mapping, dtype=np.uint8).ctypes.data if nbytes else 0
        if pin:
            region._register()
        region.pinned = pin
        region.alloc_seconds = time.perf_counter() - started
        return region

    def new_tensor(self) -> torch.Tensor:
        """The region as one uint8 tensor, which keeps the region (and its registration) alive: a GPU copy
        may still read through a view of it after every other holder is gone."""
        owner = _RegionBytes.over(self._mapping, self.nbytes, self)
        return torch.from_numpy(owner)

    def _register(self) -> None:
        cudart = torch.cuda.cudart()
        flags = _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED
        for start, length in registration_chunks(self.address, self.nbytes):
            start -= self.address
            code = int(cudart.cudaHostRegister(self.address + start, length, flags))
            if code != 0:
                _unregister(self._registered)
                raise RuntimeError(
                    f"host pool: cudaHostRegister of {length / 2**30:.2f} GiB at offset {start} failed with CUDA "
                    f"error {code} (a memlock limit, or not enough memory that can be pinned)"
                )
            self._registered.append(self.address + start)

    def close(self) -> None:
        """Unpins now; the mapping itself is released once no tensor over it is left (memory another owner
        allocated: the region's own view of it is released now if no tensor over it is left)."""
        _unregister(self._registered)
        self.pinned = False
        if isinstance(self._mapping, memoryview):
            with contextlib.suppress(BufferError):  # a tensor over it still lives: released with the last one
                self._mapping.release()
