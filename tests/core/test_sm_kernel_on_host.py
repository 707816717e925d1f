"""The SM kernel's own source, run on the CPU and checked byte for byte.

``csrc/kernels/copy_blocks_sm.cu`` is compiled as host C++ with g++ through the stand-in
``csrc/kernels/host_shim/cuda_runtime_api.h`` (CUDA keywords, index variables, vector types, a launch that
runs every thread of every CTA in turn) and loaded with ctypes. The kernel has no shared memory and no
barrier, so that order is a faithful execution: its index math, its 32 KiB work-item split, its per-item
vector width, its bounds checks and the launcher's plane-table split all run as on a GPU. The build has
``-fsanitize=alignment``, so a vector access the kernel's width choice misaligns (a fault on a GPU) is
reported, and a test with a report fails.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcopy
import kvcopy.layout

from helpers import DTYPES, SUBPROCESS_TIMEOUT_S
from helpers.copies import LAYOUTS, assert_same_bytes, dst_bytes, fill_random_, make_layout, reference_copy, snapshot

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
SHIM = CSRC / "kernels" / "host_shim"
GXX = shutil.which("g++")

# The kernel's constants (copy_blocks_sm.cu / .h), restated to build the cases around them.
ITEM_BYTES = 32 * 1024  # kMaxItemBytes: a larger block is split into work items of this size
WARPS_PER_CTA = 32  # kThreadsPerCta / kWarpSize
MAX_PLANES_PER_LAUNCH = 256  # kMaxPlanesPerLaunch
# The shim's simulated GPU (cuda_runtime_api.h): kSmCount SMs x kCtasPerSm resident CTAs = one wave.
ONE_WAVE_CTAS = 3
CUDA_ERRORS = {700: "the kernel faulted: an illegal or misaligned address"}
PLANE_COLUMNS = len(kvcopy.layout.PLANE_TABLE_COLUMNS)

DEVICE_BLOCKS = 8
HOST_BLOCKS = 6
GATHER_IDS = ([5, 1, 2, 3, 5, 0], [4, 0, 1, 2, 5, 3])  # a repeated source, a run of adjacent ids
SCATTER_IDS = ([2, 2, 3, 4, 0], [7, 0, 1, 2, 5])


@dataclass
class HostKernel:
    lib: ctypes.CDLL

    def copy(self, src_table, dst_table, src_ids, dst_ids, src_num_blocks, dst_num_blocks, *, ctas=0, forced=0):
        """Runs kvcopy::copy_blocks_sm over int64 plane tables; returns the grids the launcher computed."""
        src_table = np.ascontiguousarray(src_table, dtype=np.int64)
        dst_table = np.ascontiguousarray(dst_table, dtype=np.int64)
        assert src_table.shape == dst_table.shape and src_table.shape[1] == PLANE_COLUMNS
        src_ids = np.ascontiguousarray(src_ids, dtype=np.int64)
        dst_ids = np.ascontiguousarray(dst_ids, dtype=np.int64)
        err, reports = _with_stderr_caught(
            lambda: self.lib.kvcopy_host_copy_blocks_sm(
                _ptr(src_table),
                _ptr(dst_table),
                len(src_table),
                _ptr(src_ids),
                _ptr(dst_ids),
                len(src_ids),
                src_num_blocks,
                dst_num_blocks,
                ctas,
                forced,
            )
        )
        assert "runtime error" not in reports, f"misaligned access (a fault on a GPU):\n{reports}"
        assert err == 0, f"copy_blocks_sm returned cudaError {err} ({CUDA_ERRORS.get(err, 'unknown')})"
        count = self.lib.kvcopy_host_launched_grids(None, 0)
        grids = (ctypes.c_int * max(count, 1))()
        self.lib.kvcopy_host_launched_grids(grids, count)
        return list(grids)[:count]


def _with_stderr_caught(call: Callable[[], int]) -> tuple[int, str]:
    """call() and what it wrote to file descriptor 2 (where the sanitizer reports)."""
    with tempfile.TemporaryFile(mode="w+") as caught:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        try:
            result = call()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        caught.seek(0)
        return result, caught.read()


def _ptr(array: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(array.ctypes.data)


def _compile(out: Path) -> subprocess.CompletedProcess:
    command = [GXX, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall", "-fsanitize=alignment"]
    command += [f"-I{SHIM}", f"-I{CSRC / 'include'}", f"-I{CSRC}", str(SHIM / "copy_blocks_sm_host.cpp")]
    return subprocess.run(
        [*command, "-o", str(out)], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, check=False
    )


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> HostKernel:
    """The kernel source built by g++ (about a second) into a shared library, with alignment checks."""
    if GXX is None:
        pytest.skip("needs g++ to build the SM kernel's source for the CPU")
    build = tmp_path_factory.mktemp("sm_kernel_on_host")
    out = build / "copy_blocks_sm_host.so"
    done = _compile(out)
    assert done.returncode == 0, f"the SM kernel does not build for the host:\n{done.stderr}"
    lib = ctypes.CDLL(str(out))
    lib.kvcopy_host_copy_blocks_sm.restype = ctypes.c_int
    lib.kvcopy_host_copy_blocks_sm.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] + [ctypes.c_void_p] * 2
    lib.kvcopy_host_copy_blocks_sm.argtypes += [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    lib.kvcopy_host_launched_grids.restype = ctypes.c_int64
    lib.kvcopy_host_launched_grids.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.kvcopy_host_plane_table_capacity.restype = ctypes.c_int64
    lib.kvcopy_host_plane_table_capacity.argtypes = [ctypes.c_int64]
    return HostKernel(lib)


# --------------------------------------------------------------------------- the engine layouts


def _layout_cases():
    return [
        pytest.param(layout, dtype, host_layout, id=f"{layout}-{str(dtype)[6:]}-{host_layout}")
        for layout in LAYOUTS
        for dtype in DTYPES
        for host_layout in ("page_first", "layer_first")
    ]


@pytest.mark.parametrize(("layout", "dtype", "host_layout"), _layout_cases())
def test_gather_and_scatter_of_every_layout_and_dtype(kernel, layout, dtype, host_layout, gen):
    """The layouts and dtypes the Triton kernel is tested on (test_copy_methods.py), through the plane tables
    kvcopy hands the compiled kernels."""
    kv = make_layout(layout, DEVICE_BLOCKS, dtype, gen)
    pool = kvcopy.HostKVPool(kv, HOST_BLOCKS, layout=host_layout, pin_memory=False)
    fill_random_(pool, gen)
    directions = ((kv, GATHER_IDS[0], pool, GATHER_IDS[1]), (pool, SCATTER_IDS[0], kv, SCATTER_IDS[1]))
    for src, src_ids, dst, dst_ids in directions:
        expected = reference_copy(src, src_ids, dst, dst_ids)
        src_before = snapshot(src)
        src_paged, dst_paged = (x.paged if isinstance(x, kvcopy.HostKVPool) else x for x in (src, dst))
        kernel.copy(
            src_paged.plane_table.numpy(),
            dst_paged.plane_table.numpy(),
            src_ids,
            dst_ids,
            src_paged.num_blocks,
            dst_paged.num_blocks,
        )
        assert_same_bytes(dst_bytes(dst), expected)
        assert_same_bytes(snapshot(src), src_before)


# --------------------------------------------------------------------------- planes built byte by byte


@dataclass
class Plane:
    """One plane of a test: block 0 at `offset` bytes into the buffer, `stride` bytes between blocks."""

    src_offset: int
    dst_offset: int
    src_stride: int
    dst_stride: int
    nbytes: int


class Buffers:
    """Source and destination byte buffers holding planes with guard bytes between and around them: a
    write to an out-of-range id (one block before or a few after a plane) lands in a guard and shows."""

    GUARD_BLOCKS = 4  # of the plane's own stride, before and after each plane

    def __init__(self, specs: list[tuple[int, int, int, int, int]], num_blocks: tuple[int, int], seed: int):
        self.num_blocks = num_blocks
        self.planes: list[Plane] = []
        ends = [0, 0]
        for src_misalign, dst_misalign, src_gap, dst_gap, nbytes in specs:
            strides = (nbytes + src_gap, nbytes + dst_gap)
            offsets = []
            for side, misalign in enumerate((src_misalign, dst_misalign)):
                start = _round_up(ends[side] + self.GUARD_BLOCKS * strides[side], 16) + misalign
                offsets.append(start)
                ends[side] = start + (num_blocks[side] + self.GUARD_BLOCKS) * strides[side]
            self.planes.append(Plane(offsets[0], offsets[1], strides[0], strides[1], nbytes))
        rng = np.random.default_rng(seed)
        # 16-byte aligned allocations, so a plane's misalignment is exactly the one asked for.
        self.src = _aligned_bytes(ends[0] + 16, rng)
        self.dst = _aligned_bytes(ends[1] + 16, rng)

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        src_base, dst_base = self.src.ctypes.data, self.dst.ctypes.data
        src = [(src_base + p.src_offset, p.src_stride, p.nbytes) for p in self.planes]
        dst = [(dst_base + p.dst_offset, p.dst_stride, p.nbytes) for p in self.planes]
        return np.array(src, dtype=np.int64).reshape(-1, 3), np.array(dst, dtype=np.int64).reshape(-1, 3)

    def expected(self, src_ids, dst_ids) -> np.ndarray:
        """The destination buffer after the copy, by plain slicing; pairs with an id out of range are skipped."""
        out = self.dst.copy()
        for s, d in zip(src_ids, dst_ids, strict=True):
            if not (0 <= s < self.num_blocks[0] and 0 <= d < self.num_blocks[1]):
                continue
            for p in self.planes:
                read = p.src_offset + s * p.src_stride
                write = p.dst_offset + d * p.dst_stride
                out[write : write + p.nbytes] = self.src[read : read + p.nbytes]
        return out


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _aligned_bytes(nbytes: int, rng: np.random.Generator) -> np.ndarray:
    raw = np.empty(nbytes + 16, dtype=np.uint8)
    start = (-raw.ctypes.data) % 16
    out = raw[start : start + nbytes]
    out[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
    return out


def _check(kernel: HostKernel, buffers: Buffers, src_ids, dst_ids, **launch) -> list[int]:
    src_before = buffers.src.copy()
    expected = buffers.expected(src_ids, dst_ids)
    grids = kernel.copy(*buffers.tables(), src_ids, dst_ids, *buffers.num_blocks, **launch)
    differ = np.flatnonzero(buffers.dst != expected)
    assert differ.size == 0, f"{differ.size} destination bytes differ, first at byte {differ[0]}"
    assert np.array_equal(buffers.src, src_before), "the source was written"
    return grids


# Every vector width (16, 8, 4, 2, 1 B) the per-item choice can make: planes misaligned on either side, or
# with a stride or size that only a narrower word divides.
WIDTH_SPECS = [
    (0, 0, 0, 0, 256),  # 16 B words
    (8, 0, 0, 8, 264),  # 8 B
    (0, 4, 12, 4, 100),  # 4 B
    (2, 6, 2, 6, 94),  # 2 B
    (1, 0, 0, 3, 80),  # 1 B: the source misaligned by one
    (0, 0, 5, 1, 7),  # 1 B: an odd size and odd strides (block b is misaligned for odd b)
    (3, 5, 1, 1, 1),  # one byte a block
]


def test_every_vector_width_on_misaligned_planes(kernel):
    buffers = Buffers(WIDTH_SPECS, (8, 9), seed=1)
    _check(kernel, buffers, [7, 0, 3, 3, 5, 1], [8, 2, 0, 4, 7, 1])


# Blocks at and over the 32 KiB work item, beside small planes of the same launch (which skip the chunks
# past their end), aligned and not.
LARGE_SPECS = [
    (0, 0, 0, 0, ITEM_BYTES),  # exactly one item
    (0, 0, 0, 16, ITEM_BYTES + 16),  # a 16-byte second item
    (1, 0, 0, 0, ITEM_BYTES + 1),  # one byte over, misaligned
    (0, 8, 8, 0, 3 * ITEM_BYTES + 8),  # four items, 8-byte words
    (2, 2, 3, 5, 2 * ITEM_BYTES - 3),  # two items, the second shorter
    (0, 0, 0, 0, 48),  # a small plane in the same launch
]


def test_blocks_over_one_work_item(kernel):
    buffers = Buffers(LARGE_SPECS, (4, 5), seed=2)
    _check(kernel, buffers, [3, 0, 2], [1, 4, 0])


@pytest.mark.parametrize("num_planes", [1, 8, 9, 64, 65, 256, 257, 300, 513])
def test_more_planes_than_one_launch_table(kernel, num_planes):
    specs = [(p % 3, p % 5, p % 7, p % 2, 16 + 8 * (p % 11) + p % 3) for p in range(num_planes)]
    buffers = Buffers(specs, (3, 4), seed=num_planes)
    grids = _check(kernel, buffers, [2, 0, 1], [3, 1, 0])
    assert len(grids) == -(-num_planes // MAX_PLANES_PER_LAUNCH)  # one launch per 256 planes, in order
    last = num_planes - MAX_PLANES_PER_LAUNCH * (len(grids) - 1)
    expected_capacity = 8 if last <= 8 else 64 if last <= 64 else 256
    assert kernel.lib.kvcopy_host_plane_table_capacity(last) == expected_capacity


def test_ids_out_of_range_are_skipped(kernel):
    """Ids outside [0, num_blocks) on either side are skipped, and nothing around a plane is written."""
    buffers = Buffers(WIDTH_SPECS + LARGE_SPECS[2:4], (5, 6), seed=3)
    src_ids = [-1, 0, 5, 4, 2, 1, 3, -(2**62), 2**62]
    dst_ids = [0, -1, 1, 6, 9, 2, 5, 3, 4]
    _check(kernel, buffers, src_ids, dst_ids)


def test_no_ids_and_no_planes_launch_nothing(kernel):
    buffers = Buffers(WIDTH_SPECS, (3, 3), seed=4)
    assert _check(kernel, buffers, [], []) == []
    empty = np.zeros((0, PLANE_COLUMNS), dtype=np.int64)
    assert kernel.copy(empty, empty, [0], [1], 3, 3) == []


def _items(buffers: Buffers, num_ids: int) -> int:
    largest = max(p.nbytes for p in buffers.planes)
    return num_ids * len(buffers.planes) * -(-largest // ITEM_BYTES)


@pytest.mark.parametrize("budget", [0, 1, 2, 5, 1000])
def test_grid_from_a_cta_budget(kernel, budget):
    """The launcher's grid: the budget (or one wave when 0), never more CTAs than the work has warps for."""
    buffers = Buffers(LARGE_SPECS + WIDTH_SPECS, (6, 6), seed=5)
    src_ids, dst_ids = [5, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5]
    grids = _check(kernel, buffers, src_ids, dst_ids, ctas=budget)
    needed = -(-_items(buffers, len(src_ids)) // WARPS_PER_CTA)
    assert grids == [min(budget or ONE_WAVE_CTAS, needed)]


@pytest.mark.parametrize("ctas", [1, 2, 7, 64])
def test_grids_smaller_and_larger_than_the_work(kernel, ctas):
    """The kernel run under a grid it did not choose: one CTA whose warps loop over many items, up to
    far more warps than items (the idle ones must do nothing)."""
    buffers = Buffers(LARGE_SPECS + WIDTH_SPECS, (6, 7), seed=6)
    src_ids, dst_ids = [5, 4, 3, 2, 1, 0, 5], [0, 1, 2, 3, 4, 5, 6]
    if ctas == 64:
        assert ctas * WARPS_PER_CTA > _items(buffers, len(src_ids))
    _check(kernel, buffers, src_ids, dst_ids, forced=ctas)


PLANE_SPEC = st.tuples(
    st.integers(0, 15),  # source misalignment
    st.integers(0, 15),  # destination misalignment
    st.integers(0, 33),  # source stride - block bytes
    st.integers(0, 33),  # destination stride - block bytes
    st.one_of(st.integers(1, 300), st.integers(ITEM_BYTES - 40, 2 * ITEM_BYTES + 40)),  # block bytes
)


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(PLANE_SPEC, min_size=1, max_size=6),
    pairs=st.lists(st.tuples(st.integers(-2, 7), st.integers(-2, 7)), max_size=8, unique_by=lambda pair: pair[1]),
    ctas=st.sampled_from([0, 1, 2, 3, 9]),
    forced=st.booleans(),
)
def test_random_planes_ids_and_grids(kernel, specs, pairs, ctas, forced):
    """Random plane shapes and alignments, ids (some out of range; destinations distinct, as kvcopy
    requires) and grids, against the reference."""
    buffers = Buffers(specs, (6, 6), seed=len(specs))
    src_ids = [s for s, _ in pairs]
    dst_ids = [d for _, d in pairs]
    _check(kernel, buffers, src_ids, dst_ids, **({"forced": ctas} if forced and ctas else {"ctas": ctas}))
