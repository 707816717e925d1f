"""The extra-config keys of kvcopy's vLLM offloading spec, read and checked before anything is built.

vLLM builds the spec in both roles (scheduler and worker), so a bad key fails
in both, at start-up, before any transfer.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from kvcopy.methods import METHODS  # the copy methods a TransferEngine accepts, besides "auto"

__all__ = ["KEYS", "POLICIES", "ProfileNotFoundError", "SpecConfig", "read_config"]

Policy = Literal["auto", "offload"]
POLICIES: tuple[Policy, ...] = ("auto", "offload")
# kvcopy's own keys in kv_connector_extra_config; vLLM's (spec_name, blocks_per_chunk, eviction_policy, ...) pass
# through to vLLM.
KEYS = ("cpu_bytes_to_use", "kvcopy_policy", "kvcopy_profile", "kvcopy_method", "kvcopy_learn", "kvcopy_decode_share")


class ProfileNotFoundError(FileNotFoundError, ValueError):
    """``kvcopy_profile`` names no file: a missing file, and a bad configuration value."""


@dataclass(frozen=True)
class SpecConfig:
    """What the keys say. ``profile_path`` None: kvcopy's default profile. ``learn``: refine the profile from
    the engine's own transfers and steps (kvcopy.integrations.vllm.KVCopyOffloadingConnector)."""

    cpu_bytes_to_use: int
    policy: Policy = "auto"
    profile_path: str | None = None
    method: str = "auto"
    learn: bool = True
    decode_share: float = 0.0


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise TypeError(f"{name}: expected true or false, got {value!r}")


def read_config(extra: Mapping[str, Any]) -> SpecConfig:
    """The spec's configuration from vLLM's ``kv_connector_extra_config``.

    ``cpu_bytes_to_use`` missing or not above 0, an unknown ``kvcopy_policy`` or ``kvcopy_method``, or a
    ``kvcopy_decode_share`` outside [0, 1) is a ValueError; a value of the wrong type a TypeError; a
    ``kvcopy_profile`` that names no file a :class:`ProfileNotFoundError` (a FileNotFoundError and a
    ValueError).
    """
    size = extra.get("cpu_bytes_to_use")
    if size is None:
        raise ValueError("cpu_bytes_to_use: required in kv_connector_extra_config (the host bytes to offload to)")
    if isinstance(size, bool) or not isinstance(size, (int, float)):
        raise TypeError(f"cpu_bytes_to_use: expected a number of bytes, got {type(size).__name__} {size!r}")
    if not math.isfinite(size) or size <= 0:
        raise ValueError(f"cpu_bytes_to_use: expected a positive number of bytes, got {size!r}")
    policy = extra.get("kvcopy_policy", "auto")
    if policy not in POLICIES:
        raise ValueError(f"kvcopy_policy: expected one of {POLICIES}, got {policy!r}")
    method = extra.get("kvcopy_method", "auto")
    if method != "auto" and method not in METHODS:
        raise ValueError(f"kvcopy_method: expected 'auto' or one of {sorted(METHODS)}, got {method!r}")
    path = extra.get("kvcopy_profile")
    if path is not None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"kvcopy_profile: expected a path, got {type(path).__name__}")
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ProfileNotFoundError(f"kvcopy_profile: no profile at {path!r} (write one with `kvcopy calibrate`)")
    share = extra.get("kvcopy_decode_share", 0.0)
    if isinstance(share, bool) or not isinstance(share, (int, float)):
        raise TypeError(f"kvcopy_decode_share: expected a fraction, got {type(share).__name__}")
    if not 0 <= share < 1:
        raise ValueError(f"kvcopy_decode_share: expected a fraction in [0, 1), got {share}")
    return SpecConfig(
        cpu_bytes_to_use=int(size),
        policy=policy,
        profile_path=path,
        method=method,
        learn=_bool("kvcopy_learn", extra.get("kvcopy_learn", True)),
        decode_share=float(share),
    )
