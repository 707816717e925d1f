"""The "triton" method: the block-copy kernel written in Triton.

Planes are passed as a table of raw addresses, cast to pointers inside the
kernel, so the same kernel reads device pages and (on CUDA) pinned host memory
through unified addressing. On CPU tensors it runs under ``TRITON_INTERPRET=1``
(set before triton is first imported), which is how it is tested without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcopy.layout import PLANE_ADDRESS, PLANE_BLOCK_BYTES, PLANE_BLOCK_STRIDE, PLANE_TABLE_COLUMNS, PagedKV
from kvcopy.methods.cta_budget import HOST_MEMORY_CTA_BUDGET, TRITON_PROGRAMS_PER_CTA, TRITON_WARPS

__all__ = ["copy_blocks_triton"]

# Elements each program moves per step: 1024 x 8 B = 8 KiB, a 16-token block
# of one head in bf16, so one step covers a typical small plane-block.
_STEP_ELEMENTS = 1024
# Programs when a host buffer is on one side: the CUDA kernel's CTA budget in
# Triton programs (the same threads), which keeps PCIe busy and leaves the SMs to decode...
HOST_MEMORY_PROGRAMS = HOST_MEMORY_CTA_BUDGET * TRITON_PROGRAMS_PER_CTA
# ...as long as enough bytes are in flight: a host-link copy reaches 80-90% of the
# link from 1-2 MB outstanding (the half-peak sizes of docs/measurements.md). Each program
# has one plane-block in flight, so small plane-blocks get more programs, up to:
HOST_MEMORY_BYTES_IN_FLIGHT = 1 << 20
HOST_MEMORY_MAX_PROGRAMS = 128
# Programs for device-to-device copies: enough to fill a large GPU.
DEVICE_PROGRAMS = 1024
_WORD_DTYPES = {8: tl.int64, 4: tl.int32, 2: tl.int16, 1: tl.int8}
# Runtime sizes that change from call to call: specialising on them (Triton does for
# values of 1 and multiples of 16) would compile the kernel again (about a second)
# for new combinations on the hot path.
UNSPECIALIZED_ARGS = ("num_ids", "num_planes", "src_num_blocks", "dst_num_blocks")


@triton.jit(do_not_specialize=UNSPECIALIZED_ARGS)
def _copy_blocks_kernel(
    src_table_ptr,  # int64 [num_planes, PLANE_COLUMNS]: kvcopy.layout.PLANE_TABLE_COLUMNS of each source plane
    dst_table_ptr,  # int64 [num_planes, PLANE_COLUMNS]: the same for the destination
    src_ids_ptr,  # int64 [num_ids]
    dst_ids_ptr,  # int64 [num_ids]
    num_ids,
    num_planes,
    src_num_blocks,
    dst_num_blocks,
    WORD: tl.constexpr,  # element type: the widest of int64/32/16/8 dividing every address, stride and size
    WORD_BYTES: tl.constexpr,
    ALIGN: tl.constexpr,  # bytes (<= 16) dividing every address, stride and size: lets loads vectorise
    STEP: tl.constexpr,
    PLANE_COLUMNS: tl.constexpr,
    ADDRESS: tl.constexpr,  # the plane table's columns (kvcopy.layout)
    BLOCK_STRIDE: tl.constexpr,
    BLOCK_BYTES: tl.constexpr,
):
    # Grid: (num_programs,). Item = i * num_planes + p copies block src_ids[i] -> dst_ids[i] of
    # plane p; programs stride over items.
    num_items = num_ids * num_planes
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        i = item // num_planes
        src_row = src_table_ptr + (item % num_planes) * PLANE_COLUMNS
        dst_row = dst_table_ptr + (item % num_planes) * PLANE_COLUMNS
        src_id = tl.load(src_ids_ptr + i)
        dst_id = tl.load(dst_ids_ptr + i)
        if (src_id >= 0) & (src_id < src_num_blocks) & (dst_id >= 0) & (dst_id < dst_num_blocks):
            src_addr = tl.load(src_row + ADDRESS) + src_id * tl.load(src_row + BLOCK_STRIDE)
            dst_addr = tl.load(dst_row + ADDRESS) + dst_id * tl.load(dst_row + BLOCK_STRIDE)
            # Pointers made from integers carry no alignment: state it, or every access is scalar.
            src = tl.multiple_of(src_addr.to(tl.pointer_type(WORD), bitcast=True), ALIGN)
            dst = tl.multiple_of(dst_addr.to(tl.pointer_type(WORD), bitcast=True), ALIGN)
            num_words = tl.multiple_of(tl.load(src_row + BLOCK_BYTES) // WORD_BYTES, ALIGN // WORD_BYTES)
            for start in range(0, num_words, STEP):
                offsets = start + tl.arange(0, STEP)
                mask = offsets < num_words
                tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)


def programs_for(src: PagedKV, dst: PagedKV) -> int:
    """Programs for a copy between these caches (see the constants above)."""
    if src.device.type == dst.device.type:
        return DEVICE_PROGRAMS
    smallest = max(1, min(src.plane_block_nbytes))
    return max(HOST_MEMORY_PROGRAMS, min(HOST_MEMORY_MAX_PROGRAMS, HOST_MEMORY_BYTES_IN_FLIGHT // smallest))


def copy_blocks_triton(
    src: PagedKV, src_ids: torch.Tensor, dst: PagedKV, dst_ids: torch.Tensor, *, num_programs: int | None = None
) -> None:
    """Copies with the Triton kernel; ids must be int64 on the kernel's device."""
    device = src.device if src.device.type == "cuda" else dst.device
    alignment = min(src.alignment, dst.alignment)
    word_bytes = min(alignment, 8)
    num_items = src_ids.numel() * src.num_planes
    if num_programs is None:
        num_programs = programs_for(src, dst)
    grid = (max(1, min(num_items, num_programs)),)
    _copy_blocks_kernel[grid](
        src.plane_table_on(device),
        dst.plane_table_on(device),
        src_ids,
        dst_ids,
        src_ids.numel(),
        src.num_planes,
        src.num_blocks,
        dst.num_blocks,
        WORD=_WORD_DTYPES[word_bytes],
        WORD_BYTES=word_bytes,
        ALIGN=alignment,
        STEP=_STEP_ELEMENTS,
        PLANE_COLUMNS=len(PLANE_TABLE_COLUMNS),
        ADDRESS=PLANE_ADDRESS,
        BLOCK_STRIDE=PLANE_BLOCK_STRIDE,
        BLOCK_BYTES=PLANE_BLOCK_BYTES,
        num_warps=TRITON_WARPS,
    )
