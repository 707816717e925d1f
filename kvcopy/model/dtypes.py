"""KV-cache dtypes by name: the one place a dtype given as a torch.dtype or a string ("bf16", "fp8",
"torch.float16") becomes the torch name kvcopy records ("bfloat16", "float8_e4m3fn")."""

from __future__ import annotations

import torch

__all__ = ["dtype_itemsize", "kv_dtype_name", "torch_name"]

_DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float": "float32",
    "fp8": "float8_e4m3fn",  # what vLLM and SGLang mean by a "fp8" KV cache
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
_INTEGER_KV_DTYPES = (torch.int8, torch.uint8)


def torch_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def kv_dtype_name(dtype: torch.dtype | str, what: str = "dtype") -> str:
    """The torch name (``"bfloat16"``) of a KV dtype given as a torch.dtype or a string."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        key = _DTYPE_ALIASES.get(key, key)
        found = getattr(torch, key, None)
        if not isinstance(found, torch.dtype):
            raise ValueError(f"{what}: unknown dtype {dtype!r}; expected a torch dtype name like 'bfloat16' or 'fp8'")
        resolved = found
    else:
        raise TypeError(f"{what}: expected a torch.dtype or a string, got {type(dtype).__name__}")
    name = torch_name(resolved)
    if name.endswith("_x2") or not (resolved.is_floating_point or resolved in _INTEGER_KV_DTYPES):
        raise ValueError(
            f"{what}: {name} is not a KV-cache dtype (expected a float type of 1 byte or more, int8 or uint8)"
        )
    return name


def dtype_itemsize(name: str) -> int:
    return getattr(torch, name).itemsize
