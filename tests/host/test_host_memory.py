"""HostKVPool memory: one exact-size anonymous mapping, NUMA binding, the memory check, pinning, close."""

from __future__ import annotations

import gc
import mmap
import os

import pytest
import torch

import kvcopy
from kvcopy.host import memory as _host_memory

from helpers import HAS_CUDA
from helpers.copies import byte_rows, make_vllm

PAGE = mmap.PAGESIZE


def _like(block_nbytes: int = 70) -> kvcopy.PagedKV:
    """Planes whose blocks add up to ``block_nbytes`` (70 by default: far from a power of two)."""
    if block_nbytes == 70:
        planes = [
            torch.zeros(2, 3, 5, dtype=torch.float16),  # 30 B
            torch.zeros(2, 7, dtype=torch.float16),  # 14 B
            torch.zeros(2, dtype=torch.float16),  # 2 B
            torch.zeros(2, 2, 3, 2, dtype=torch.float16),  # 24 B
        ]
        return kvcopy.PagedKV.from_planes(planes, planes_per_layer=2)
    return kvcopy.PagedKV.from_planes([torch.zeros(2, block_nbytes, dtype=torch.uint8)])


def _vm_size() -> int:
    """Bytes of this process's virtual address space (VmSize)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize in /proc/self/status")


def _mapping_of(address: int) -> tuple[int, int]:
    """(start, end) of the mapping in /proc/self/maps that holds ``address``."""
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return start, end
    raise AssertionError(f"no mapping holds {address:#x}")


def _numa_policy_of(address: int) -> str:
    """The /proc/self/numa_maps line of the mapping that holds ``address``."""
    best = None
    with open("/proc/self/numa_maps") as f:
        for line in f:
            start = int(line.split()[0], 16)
            if start <= address and (best is None or start > best[0]):
                best = (start, line)
    assert best is not None
    return best[1]


_numa_nodes = _host_memory._numa_nodes


def _available() -> int:
    return _host_memory.available_host_bytes() or 0


needs_node0 = pytest.mark.skipif(0 not in _numa_nodes(), reason="this machine reports no NUMA node 0")


# --------------------------------------------------------------------------- exact size


@pytest.mark.parametrize("num_blocks", [1, 3, 1000, 12_345, 99_991])
@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_buffer_is_exactly_the_pool_size(num_blocks, layout):
    like = _like()
    pool = kvcopy.HostKVPool(like, num_blocks, layout=layout, pin_memory=False)
    assert pool.buffer.numel() == num_blocks * like.nbytes_per_block
    assert pool.nbytes == num_blocks * like.nbytes_per_block
    assert pool.buffer.dtype == torch.uint8
    assert pool.buffer.is_contiguous()


def test_buffer_is_its_own_page_aligned_mapping_of_fresh_zero_pages():
    like = _like()
    num_blocks = 3 * PAGE // 70 + 5  # a few pages, not a whole number of them
    pool = kvcopy.HostKVPool(like, num_blocks, pin_memory=False, numa_node=0 if 0 in _numa_nodes() else None)
    start = pool.buffer.data_ptr()
    assert start % PAGE == 0, "the buffer does not start a mapping of its own"
    lo, hi = _mapping_of(start)
    assert lo <= start and start + pool.nbytes <= hi
    assert torch.count_nonzero(pool.buffer) == 0  # fresh anonymous pages read as zero
    # Every plane lies inside that buffer.
    for plane in pool.paged.planes:
        assert start <= plane.data_ptr() < start + pool.nbytes


def _vm_flags_of(address: int) -> list[str]:
    """The VmFlags of the /proc/self/smaps mapping that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no smaps entry with VmFlags holds {address:#x}")


@pytest.mark.skipif(
    not os.path.isdir("/sys/kernel/mm/transparent_hugepage"), reason="this kernel has no transparent huge pages"
)
def test_buffer_asks_for_transparent_huge_pages():
    """A DMA into the pool (an O_DIRECT read of the disk store, a copy engine's) meets 2 MiB physically
    contiguous runs: the mapping carries MADV_HUGEPAGE ("hg"); a plain anonymous mapping does not."""
    pool = kvcopy.HostKVPool(_like(1 << 20), 8, pin_memory=False)
    assert "hg" in _vm_flags_of(pool.buffer.data_ptr())
    plain = mmap.mmap(-1, 8 << 20)
    address = torch.frombuffer(plain, dtype=torch.uint8).data_ptr()
    assert "hg" not in _vm_flags_of(address)


@pytest.mark.skipif(_available() < (4 << 30), reason="needs ~4 GiB of available memory for the size check")
def test_large_pool_is_not_rounded_up_and_is_released():
    """~1.06 GiB, far from a power of two: the address space grows by that much, not by 2 GiB.

    The mapping is never touched, so this costs no physical memory.
    """
    block_nbytes = 123_457  # odd, not a power of two
    num_blocks = 9_001
    nbytes = block_nbytes * num_blocks
    like = _like(block_nbytes)
    gc.collect()
    before = _vm_size()
    pool = kvcopy.HostKVPool(like, num_blocks, pin_memory=False)
    grown = _vm_size() - before
    assert pool.buffer.numel() == nbytes
    rounded = -(-nbytes // PAGE) * PAGE
    slack = 256 << 20  # other allocations; a power-of-two rounding would add ~1 GiB
    assert grown >= rounded - slack
    assert grown <= rounded + slack, f"address space grew by {grown} bytes for a {nbytes}-byte pool"
    pool.close()
    del pool
    gc.collect()
    assert _vm_size() - before < slack, "the mapping outlived the pool"


# --------------------------------------------------------------------------- NUMA


@needs_node0
def test_numa_node_0_binds_the_pages():
    like = _like()
    pool = kvcopy.HostKVPool(like, 4 * PAGE // 70, pin_memory=False, numa_node=0)
    assert pool.numa_node == 0
    pool.buffer.fill_(1)  # touch the pages: they are placed under the bound policy
    line = _numa_policy_of(pool.buffer.data_ptr())
    assert "bind:0" in line, line
    assert torch.all(pool.buffer == 1)


def test_numa_node_none_on_cpu_is_unbound():
    pool = kvcopy.HostKVPool(_like(), 4, pin_memory=False)
    if not HAS_CUDA:
        assert pool.numa_node is None


@pytest.mark.parametrize("node", [max(_numa_nodes(), default=0) + 1, 1000, -1])
def test_missing_numa_node_is_a_value_error(node):
    with pytest.raises(ValueError, match="numa_node"):
        kvcopy.HostKVPool(_like(), 4, pin_memory=False, numa_node=node)


@pytest.mark.parametrize("node", [True, 0.0, "0"])
def test_numa_node_must_be_an_int(node):
    with pytest.raises(TypeError, match="numa_node"):
        kvcopy.HostKVPool(_like(), 4, pin_memory=False, numa_node=node)


# --------------------------------------------------------------------------- memory check


def test_more_than_available_is_a_memory_error_before_allocating(monkeypatch):
    calls = []
    real_mmap = mmap.mmap

    def spy(*args, **kwargs):
        calls.append(args)
        return real_mmap(*args, **kwargs)

    monkeypatch.setattr(mmap, "mmap", spy)
    like = _like()
    num_blocks = 10**15 // like.nbytes_per_block + 1  # ~1 PB
    with pytest.raises(MemoryError):
        kvcopy.HostKVPool(like, num_blocks, pin_memory=False)
    assert calls == [], "memory was mapped before the size check"
    kvcopy.HostKVPool(like, 4, pin_memory=False)
    assert len(calls) == 1  # the spy does see the pool's mapping


def test_memory_check_keeps_a_reserve(monkeypatch):
    """A pool that fits in available memory but would eat into the reserve is refused too."""
    like = _like(4096)
    monkeypatch.setattr(_host_memory, "available_host_bytes", lambda: _host_memory.HOST_RESERVE_BYTES + 8192)
    kvcopy.HostKVPool(like, 2, pin_memory=False)  # exactly what is left above the reserve
    with pytest.raises(MemoryError):
        kvcopy.HostKVPool(like, 3, pin_memory=False)


# --------------------------------------------------------------------------- attributes, close


def test_alloc_seconds_and_pinned():
    pool = kvcopy.HostKVPool(_like(), 100, pin_memory=False)
    assert isinstance(pool.alloc_seconds, float)
    assert pool.alloc_seconds >= 0
    assert pool.pinned is False


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-CUDA default")
def test_default_is_unpinned_without_cuda():
    pool = kvcopy.HostKVPool(_like(), 10)
    assert pool.pinned is False
    assert pool.paged.is_pinned is False


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-CUDA error")
def test_pin_memory_true_without_cuda_is_a_runtime_error_before_allocating(monkeypatch):
    calls = []
    real_mmap = mmap.mmap
    monkeypatch.setattr(mmap, "mmap", lambda *a, **k: calls.append(a) or real_mmap(*a, **k))
    with pytest.raises(RuntimeError):
        kvcopy.HostKVPool(_like(), 10, pin_memory=True)
    assert calls == []


def test_close_and_context_manager(gen):
    like, _ = make_vllm(2, 4, 3, 1, 5, torch.bfloat16, gen)
    with kvcopy.HostKVPool(like, 6, pin_memory=False) as pool:
        assert isinstance(pool, kvcopy.HostKVPool)
        pool.buffer.fill_(7)
    assert pool.pinned is False
    # The memory stays valid while tensors over it are alive.
    assert torch.all(pool.buffer == 7)
    assert torch.all(byte_rows(pool.paged.planes[0]) == 7)
    pool.close()  # closing twice is fine
    assert pool.pinned is False


def test_close_then_reuse_as_copy_target(gen):
    like, _ = make_vllm(1, 4, 3, 1, 5, torch.float16, gen)
    pool = kvcopy.HostKVPool(like, 4, pin_memory=False)
    pool.close()
    kvcopy.gather(like, [0, 1], pool, [2, 3])
    for lp, hp in zip(like.planes, pool.paged.planes, strict=True):
        assert torch.equal(byte_rows(hp)[2:4], byte_rows(lp)[0:2])


def test_pools_do_not_share_memory():
    a = kvcopy.HostKVPool(_like(), 50, pin_memory=False)
    b = kvcopy.HostKVPool(_like(), 50, pin_memory=False)
    a_lo, a_hi = a.buffer.data_ptr(), a.buffer.data_ptr() + a.nbytes
    b_lo, b_hi = b.buffer.data_ptr(), b.buffer.data_ptr() + b.nbytes
    assert a_hi <= b_lo or b_hi <= a_lo
    a.buffer.fill_(1)
    assert torch.count_nonzero(b.buffer) == 0
