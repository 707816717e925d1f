"""Which vLLM kvcopy's offloading spec runs on, checked when the spec is built.

The spec subclasses vLLM's ``OffloadingSpec`` and ``CPUOffloadingManager``
and reads two of their internals (a request's key positions, the manager's
eviction policy); they change between minor releases. vLLM outside :data:`SUPPORTED_RANGE` is a RuntimeError naming
the range; no vLLM at all an ImportError saying how to install it.
"""

from __future__ import annotations

import importlib
import re

__all__ = ["INSTALL", "SUPPORTED_RANGE", "check_vllm", "vllm_version"]

# The versions the spec was written against and tested with (scripts/setup.sh installs the same).
SUPPORTED_MIN = "0.33"
SUPPORTED_BELOW = "0.34"
SUPPORTED_RANGE = f">={SUPPORTED_MIN},<{SUPPORTED_BELOW}"
# vLLM pins an exact torch; kvcopy's own is kept by installing vLLM without its dependencies and then the
# pure-Python ones it needs (pyproject's "vllm" extra).
INSTALL = "pip install --no-deps 'vllm>=0.33,<0.34' && pip install 'kvcopy[vllm]'"


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


def vllm_version() -> str:
    """The installed vLLM's version; ImportError (with how to install it) without one."""
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as err:
        raise ImportError(f"kvcopy.integrations.vllm needs vLLM {SUPPORTED_RANGE}: {INSTALL}") from err
    return str(getattr(vllm, "__version__", "0"))


def check_vllm(version: str | None = None) -> None:
    """RuntimeError unless ``version`` (default: the installed vLLM's) is in SUPPORTED_RANGE and has the internals
    the spec reads."""
    version = vllm_version() if version is None else version
    if not _release(SUPPORTED_MIN) <= _release(version)[:2] < _release(SUPPORTED_BELOW):
        raise RuntimeError(
            f"kvcopy.integrations.vllm was tested with vLLM {SUPPORTED_RANGE}; this is vLLM {version} ({INSTALL})"
        )
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    if "_offload_key_positions" not in getattr(ReqContext, "__dataclass_fields__", {}) or not hasattr(
        CPUOffloadingManager, "lookup"
    ):
        raise RuntimeError(
            f"vLLM {version}: ReqContext no longer records key positions; kvcopy needs {SUPPORTED_RANGE}"
        )
