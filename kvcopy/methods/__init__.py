"""kvcopy's copy methods: a registry of records (kvcopy.methods.registry), the built-in methods
(kvcopy.methods.builtin) and what ``method="auto"`` picks (kvcopy.methods.choice).

Adding a method is one module that builds a :class:`CopyMethod` and calls :func:`register`.
"""

from __future__ import annotations

from kvcopy.methods.builtin import CAPTURABLE_METHODS, DMA_MIN_BLOCK_BYTES, METHODS
from kvcopy.methods.choice import available_methods, choose_method, unavailable_reason
from kvcopy.methods.registry import CopyMethod, get, method_names, register, unregister
from kvcopy.methods.sm_budget import HOST_LINK_CTA_BUDGET, TRITON_PROGRAMS_PER_CTA

__all__ = [
    "CAPTURABLE_METHODS",
    "DMA_MIN_BLOCK_BYTES",
    "HOST_LINK_CTA_BUDGET",
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
