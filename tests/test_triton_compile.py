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
}


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("word", [(tl.int64, 8, 16), (tl.int64, 8, 8), (tl.int16, 2, 2)])
def test_block_copy_kernel_compiles_to_cubin(arch: int, word: tuple) -> None:
    if not hasattr(triton, "compile"):
        pytest.skip("this triton has no ahead-of-time compile entry point")
    from kvcopy.triton_copy import _STEP_ELEMENTS, _block_copy_kernel

    kernel = _block_copy_kernel
    if not isinstance(kernel, triton.runtime.JITFunction):  # under TRITON_INTERPRET=1: wrap the Python source
        kernel = triton.runtime.JITFunction(kernel.fn)
    source = ASTSource(
        fn=kernel,
        signature=SIGNATURE,
        constexprs={"WORD": word[0], "WORD_BYTES": word[1], "ALIGN": word[2], "STEP": _STEP_ELEMENTS},
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 8})
    assert "ld.global" in compiled.asm["ptx"] and "st.global" in compiled.asm["ptx"]
    assert len(compiled.asm["cubin"]) > 0
    if word[2] == 16:  # the alignment hints must turn into 16-byte vector accesses
        assert "ld.global.v2.b64" in compiled.asm["ptx"] or "ld.global.v4.b32" in compiled.asm["ptx"]
