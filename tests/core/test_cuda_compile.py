"""The SM kernel as nvcc builds it for Hopper, checked without a GPU.

Each launch passes the plane table in the kernel's parameters, so the
parameter space a launch moves must follow the planes it copies: a layer of
a layer-wise reload (2 planes) must not pay for a 256-plane table.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import SUBPROCESS_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
NVCC = shutil.which("nvcc")
PLANE_BYTES = 40  # a PlaneCopy: two addresses, two strides, the block bytes


@pytest.fixture(scope="module")
def ptx(tmp_path_factory) -> str:
    if NVCC is None:
        pytest.skip("needs nvcc (the CUDA toolkit), not a GPU")
    out = tmp_path_factory.mktemp("ptx") / "copy_blocks_sm.ptx"
    subprocess.run(
        [
            NVCC,
            "-ptx",
            "-arch=sm_90",
            "-std=c++17",
            f"-I{ROOT / 'csrc' / 'include'}",
            f"-I{ROOT / 'csrc'}",
            str(ROOT / "csrc" / "kernels" / "copy_blocks_sm.cu"),
            "-o",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    return out.read_text()


def test_one_kernel_per_plane_table_capacity_with_parameters_to_match(ptx: str) -> None:
    params = {
        int(capacity): int(size)
        for capacity, size in re.findall(
            r"copy_blocks_sm_kernelILl(\d+)EEEvNS0_16CopyBlocksSmArgsIXT_EEE_param_0\[(\d+)\]", ptx
        )
    }
    assert sorted(params) == [8, 64, 256]
    for capacity, size in params.items():
        assert capacity * PLANE_BYTES <= size < capacity * PLANE_BYTES + 128, (capacity, size)
    assert params[8] < 512  # a 2-plane layer launch: under 0.5 KiB, not 10 KiB
