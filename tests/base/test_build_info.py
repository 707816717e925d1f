"""build_info(), __version__ and the ``python -m kvcopy info`` command."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvcopy
from kvcopy import _ext
from kvcopy.tools.bench.baselines import has_dma_baselines

from helpers import SUBPROCESS_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
KEYS = {
    "kvcopy",
    "torch",
    "torch_cuda",
    "python",
    "extension_loaded",
    "extension_error",
    "cpu_kernels",
    "cuda_kernels",
    "cuda_archs",
    "triton",
    "triton_interpret",
    "cuda_available",
}


def test_build_info_keys_and_types():
    info = kvcopy.build_info()
    assert isinstance(info, dict)
    missing = KEYS - set(info)
    assert not missing, missing
    assert info["kvcopy"] == kvcopy.__version__
    assert info["torch"] == torch.__version__
    assert info["torch_cuda"] == torch.version.cuda
    for key in ("extension_loaded", "cpu_kernels", "cuda_kernels", "triton_interpret", "cuda_available"):
        assert isinstance(info[key], bool), key
    assert isinstance(info["cuda_archs"], list)
    assert info["cuda_available"] == torch.cuda.is_available()
    assert info["triton_interpret"] == (os.environ.get("TRITON_INTERPRET") == "1")


def test_build_info_consistency():
    info = kvcopy.build_info()
    if info["cuda_kernels"]:
        assert info["extension_loaded"]
        assert info["cuda_archs"], "CUDA kernels built for no arch"
    if info["cpu_kernels"]:
        assert info["extension_loaded"]
    if info["extension_loaded"]:
        assert info["extension_error"] is None
        assert info["cpu_kernels"]
    else:
        assert info["extension_error"]
        assert not info["cuda_kernels"] and not info["cpu_kernels"]
    # The methods advertised follow from what was built.
    kv = kvcopy.PagedKV.from_planes([torch.zeros(2, 4)])
    methods = kvcopy.available_methods(kv, kv)
    assert ("cpu" in methods) == info["cpu_kernels"]
    assert ("triton" in methods) == (info["triton"] is not None and info["triton_interpret"])


def test_dma_baselines_are_a_module_of_their_own_built_with_the_cuda_kernels():
    # The benchmark's copy-engine baselines are no part of the copy core: kvcopy._C does not hold them,
    # kvcopy.tools.bench._baselines does, built wherever the CUDA kernels are.
    module = _ext.extension()
    if module is not None:
        assert not hasattr(module, "copy_blocks_dma_baseline")
    if kvcopy.build_info()["cuda_kernels"]:
        assert has_dma_baselines(), "the CUDA kernels were built without kvcopy.tools.bench._baselines"
        assert hasattr(importlib.import_module("kvcopy.tools.bench._baselines"), "copy_blocks_dma_baseline")


def test_build_info_returns_a_fresh_dict():
    info = kvcopy.build_info()
    info["kvcopy"] = "tampered"
    assert kvcopy.build_info()["kvcopy"] == kvcopy.__version__


def test_version_is_the_pyproject_dynamic_version():
    assert isinstance(kvcopy.__version__, str)
    assert re.fullmatch(r"\d+\.\d+\.\d+([.+-]?[0-9A-Za-z.]+)?", kvcopy.__version__)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'dynamic\s*=\s*\[[^\]]*"version"', pyproject)
    attr = re.search(r'version\s*=\s*\{\s*attr\s*=\s*"([\w.]+)"\s*\}', pyproject)
    assert attr, "pyproject.toml has no [tool.setuptools.dynamic] version attr"
    module_name, _, name = attr.group(1).rpartition(".")
    module = __import__(module_name, fromlist=[name])
    assert getattr(module, name) == kvcopy.__version__


def _run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "kvcopy", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=SUBPROCESS_TIMEOUT_S,
    )


@pytest.mark.slow
def test_cli_info_runs():
    done = _run_cli("info")
    assert done.returncode == 0, done.stderr
    assert "kvcopy" in done.stdout
    assert kvcopy.__version__ in done.stdout
    assert "cuda_kernels" in done.stdout


@pytest.mark.slow
def test_cli_info_json():
    done = _run_cli("info", "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["kvcopy"] == kvcopy.__version__
    assert info["extension_loaded"] == kvcopy.build_info()["extension_loaded"]
    assert info["cuda_kernels"] == kvcopy.build_info()["cuda_kernels"]
    assert "device" in info


@pytest.mark.slow
def test_cli_without_command_fails():
    done = _run_cli()
    assert done.returncode != 0
