"""kvcopy's copy methods: a registry of records (kvcopy.methods.registry), the built-in methods
(kvcopy.methods.builtin) and what ``method="auto"`` picks (kvcopy.methods.choice).

Adding a method is one module that builds a :class:`CopyMethod` and calls :func:`register`.
"""

from __future__ import annotations

from kvcopy.methods.builtin import CAPTURABLE_METHODS, DMA_MIN_BLOCK_BYTES, METHODS
from kvcopy.methods.choice import available_methods, choose_method, unavailable_reason
from kvcopy.methods.cta_budget import HOST_MEMORY_CTA_BUDGET, TRITON_PROGRAMS_PER_CTA
from kvcopy.methods.registry import CopyMethod, get, method_names, register, unregister

__all__ = [
    "CAPTURABLE_METHODS",
    "DMA_MIN_BLOCK_BYTES",
    "HOST_MEMORY_CTA_BUDGET",
    "METHODS",
    "TRITON_PROGRAMS_PER_CTA",
    "CopyMethod",
    "available_methods",
    "choose_method",
    "get",
    "method_names",
    "register",
    "unavailable_reason",
    "unregister",
]


def __getattr__(name: str) -> object:
    if name == "HOST_LINK_CTA_BUDGET":  # renamed in 0.2.0: "link" names a network link only
        from kvcopy._version import warn_renamed

        warn_renamed("kvcopy.methods.HOST_LINK_CTA_BUDGET", "kvcopy.methods.HOST_MEMORY_CTA_BUDGET")
        return HOST_MEMORY_CTA_BUDGET
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
