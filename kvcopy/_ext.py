"""Loads the compiled extension (kvcopy._C) and says what was built.

Importing ``kvcopy._C`` registers the ``torch.ops.kvcopy`` ops. When it is
missing (KVCOPY_NO_EXT=1, no compiler, a torch mismatch) kvcopy still works
through its "torch" method; :func:`build_info` says why the extension is absent.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import os
import platform
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from kvcopy._version import __version__

__all__ = [
    "TRITON_INTERPRET",
    "build_info",
    "extension",
    "has_cpu_kernels",
    "has_cuda_kernels",
    "loaded_extension",
    "triton_available",
]

# Whether Triton kernels are interpreted on the CPU (tests): read once, as triton itself decides it when first
# imported. Set TRITON_INTERPRET=1 before importing kvcopy.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _load() -> tuple[ModuleType | None, str | None]:
    try:
        module = importlib.import_module("kvcopy._C")
    except ImportError as err:
        return None, str(err)
    _register_fakes()
    return module, None


def extension() -> ModuleType | None:
    """The compiled module, or None when it is not built or failed to load."""
    return _MODULE


def loaded_extension() -> ModuleType:
    """The compiled module, for a caller that only runs when it is loaded (a method whose problem() said so, a
    CUDA stream kvcopy made): RuntimeError, naming why it is absent, otherwise."""
    module = extension()
    if module is None:
        raise RuntimeError(f"kvcopy's compiled extension is not loaded ({_LOAD_ERROR})")
    return module


def _register_fakes() -> None:
    """Fake implementations: the ops only mutate ``dst``, so tracing needs no output."""

    @torch.library.register_fake("kvcopy::copy_blocks")
    def _copy_blocks_fake(
        src: list[torch.Tensor], src_ids: torch.Tensor, dst: list[torch.Tensor], dst_ids: torch.Tensor, num_ctas: int
    ) -> None:
        return None

    @torch.library.register_fake("kvcopy::copy_blocks_dma")
    def _copy_blocks_dma_fake(
        src: list[torch.Tensor], src_ids: torch.Tensor, dst: list[torch.Tensor], dst_ids: torch.Tensor
    ) -> None:
        return None

    @torch.library.register_fake("kvcopy::check_block_ids")
    def _check_block_ids_fake(
        src_ids: torch.Tensor, dst_ids: torch.Tensor, src_num_blocks: int, dst_num_blocks: int, same_cache: bool = False
    ) -> None:
        return None

    # It returns nothing and mutates nothing: without this, graphs would drop it as dead code.
    torch.fx.node.has_side_effect(torch.ops.kvcopy.check_block_ids.default)


def has_cpu_kernels() -> bool:
    return _MODULE is not None


def has_cuda_kernels() -> bool:
    return _MODULE is not None and bool(_MODULE.WITH_CUDA)


_host_pointer_ok: dict[int, bool] = {}


def kernels_read_host_pointers(device: torch.device) -> bool:
    """Whether kernels on ``device`` may read registered host memory through its host address
    (cudaDevAttrCanUseHostPointerForRegisteredMem), which the "cuda" and "triton" methods do to reach a
    HostKVPool. Asked once per device; True where the extension cannot ask (no CUDA kernels built)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _host_pointer_ok:
        module = extension()
        ask = getattr(module, "can_use_host_pointer", None) if module is not None else None
        _host_pointer_ok[index] = True if ask is None else bool(ask(index))
    return _host_pointer_ok[index]


@functools.cache
def _triton_version() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        import triton
    except Exception:  # a broken triton install is the same as none
        return None
    return str(triton.__version__)


def triton_available() -> bool:
    """Whether triton is installed (found without importing it: importing takes seconds)."""
    return _TRITON_FOUND


def _recorded_build_config() -> dict[str, Any]:
    try:
        return json.loads((Path(__file__).parent / "_build_config.json").read_text())
    except FileNotFoundError:
        return {"extension": False, "reason": "not built (no kvcopy/_build_config.json from setup.py)"}


def build_info() -> dict[str, Any]:
    """What this kvcopy has: compiled CPU/CUDA kernels and CUDA archs, Triton, versions."""
    module, load_error = _MODULE, _LOAD_ERROR
    recorded = _recorded_build_config()
    archs = recorded.get("cuda_archs", "")
    return {
        "kvcopy": __version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "extension_loaded": module is not None,
        "extension_error": load_error,
        "cpu_kernels": module is not None,
        "cuda_kernels": module is not None and bool(module.WITH_CUDA),
        "cuda_archs": [a for a in archs.split(";") if a] if module is not None else [],
        "built_with_torch": recorded.get("torch_version"),
        "build_note": recorded.get("reason"),
        "compiler": getattr(module, "COMPILER", None),
        "triton": _triton_version(),
        "triton_interpret": TRITON_INTERPRET,
        "cuda_available": torch.cuda.is_available(),
    }


# Loaded once at import, so hot paths and torch.compile read plain globals.
_MODULE, _LOAD_ERROR = _load()
_TRITON_FOUND = importlib.util.find_spec("triton") is not None
