"""The Triton kernel compiles for real GPU targets, checked without a GPU.

Under TRITON_INTERPRET=1 the tests run the kernel's Python semantics; this
compiles the same source through Triton's CUDA backend (PTX and cubin via the
bundled ptxas) for Ampere and Hopper, so a typo in GPU-only lowering (such as
the int64-to-pointer casts) fails here and not on a lent GPU.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

SIGNATURE = {
    "src_table_ptr": "*i64",
    "dst_table_ptr": "*i64",
    "src_ids_ptr": "*i64",
    "dst_ids_ptr": "*i64",
    "num_ids": "i64",
    "num_planes": "i32",
    "src_num_blocks": "i64",
    "dst_num_blocks": "i64",
    "WORD": "constexpr",
    "WORD_BYTES": "constexpr",
    "ALIGN": "constexpr",
    "STEP": "constexpr",
    "PLANE_COLUMNS": "constexpr",
    "ADDRESS": "constexpr",
    "BLOCK_STRIDE": "constexpr",
    "BLOCK_BYTES": "constexpr",
}


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("word", [(tl.int64, 8, 16), (tl.int64, 8, 8), (tl.int16, 2, 2)])
def test_copy_blocks_kernel_compiles_to_cubin(arch: int, word: tuple) -> None:
    if not hasattr(triton, "compile"):
        pytest.skip("this triton has no ahead-of-time compile entry point")
    from kvcopy import layout
    from kvcopy.methods.triton_kernel import _STEP_ELEMENTS, _copy_blocks_kernel

    kernel = _copy_blocks_kernel
    if not isinstance(kernel, triton.runtime.JITFunction):  # under TRITON_INTERPRET=1: wrap the Python source
        kernel = triton.runtime.JITFunction(kernel.fn)
    source = ASTSource(
        fn=kernel,
        signature=SIGNATURE,
        constexprs={
            "WORD": word[0],
            "WORD_BYTES": word[1],
            "ALIGN": word[2],
            "STEP": _STEP_ELEMENTS,
            "PLANE_COLUMNS": len(layout.PLANE_TABLE_COLUMNS),
            "ADDRESS": layout.PLANE_ADDRESS,
            "BLOCK_STRIDE": layout.PLANE_BLOCK_STRIDE,
            "BLOCK_BYTES": layout.PLANE_BLOCK_BYTES,
        },
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 8})
    assert "ld.global" in compiled.asm["ptx"] and "st.global" in compiled.asm["ptx"]
    assert len(compiled.asm["cubin"]) > 0
    if word[2] == 16:  # the alignment hints must turn into 16-byte vector accesses
        assert "ld.global.v2.b64" in compiled.asm["ptx"] or "ld.global.v4.b32" in compiled.asm["ptx"]


def test_runtime_sizes_are_not_specialised() -> None:
    """Every runtime integer of the kernel (not a pointer, not a constexpr) is left unspecialised, so new
    id counts, plane counts or pool sizes never compile the kernel again on the hot path."""
    import inspect

    from kvcopy.methods.triton_kernel import UNSPECIALIZED_ARGS, _copy_blocks_kernel

    parameters = inspect.signature(_copy_blocks_kernel.fn).parameters
    runtime_ints = [name for name in parameters if not name.endswith("_ptr") and SIGNATURE[name] != "constexpr"]
    assert sorted(UNSPECIALIZED_ARGS) == sorted(runtime_ints)
    if isinstance(_copy_blocks_kernel, triton.runtime.JITFunction):  # compiled mode: the decorator took them
        assert sorted(p.name for p in _copy_blocks_kernel.params if p.do_not_specialize) == sorted(runtime_ints)


@pytest.mark.parametrize(("plane_block", "programs"), [(2048, 128), (8192, 128), (32768, 32), (1 << 20, 16)])
def test_small_plane_blocks_get_more_programs_over_the_host_link(plane_block: int, programs: int) -> None:
    import torch

    import kvcopy
    from kvcopy.methods.triton_kernel import DEVICE_PROGRAMS, programs_for

    kv = kvcopy.PagedKV.from_planes([torch.empty(4, plane_block, dtype=torch.uint8)])
    host = kvcopy.PagedKV.from_planes([torch.empty(4, plane_block, dtype=torch.uint8, device="meta")])
    assert programs_for(kv, host) == programs  # one side host, the other not: the host-link budget
    assert programs_for(kv, kv) == DEVICE_PROGRAMS
