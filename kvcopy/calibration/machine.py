"""Who measured a number: the machine identity written beside every profile and benchmark."""

from __future__ import annotations

import datetime
import os
import platform
from typing import Any

import torch

from kvcopy import _ext
from kvcopy._version import __version__

__all__ = ["cpu_name", "machine_identity"]


def cpu_name() -> str:
    """The host CPU's model name from /proc/cpuinfo, else what :mod:`platform` knows."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        return name


def _driver_version() -> str | None:
    """The CUDA driver's version as "major.minor", from the extension (None without it)."""
    fast = _ext.extension()
    if fast is None or not hasattr(fast, "cuda_driver_version"):
        return None
    version = fast.cuda_driver_version()
    return f"{version // 1000}.{version % 1000 // 10}"


def machine_identity(device: torch.device | str) -> dict[str, Any]:
    """Device, host CPU, core and thread counts, versions (torch, CUDA, driver, kvcopy) and the UTC time."""
    device = torch.device(device)
    cpu = cpu_name()
    info: dict[str, Any] = {
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
        "host_cpu": cpu,
        "host_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "kvcopy": __version__,
        "extension": _ext.build_info()["extension_loaded"],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["capability"] = f"{props.major}.{props.minor}"
        info["driver"] = _driver_version()
    return info
