"""The model a cache belongs to: :class:`ModelSpec` (KV bytes per token and block, prefill FLOPs, the bytes
a forward reads, tensor-parallel sharding) from a Hugging Face ``config.json`` or a named preset, read by one
table of model-family rules (``families.py``)."""

from __future__ import annotations

from kvcopy.model.spec import SUPPORTED_FAMILIES, ModelSpec, forward_costs

__all__ = ["SUPPORTED_FAMILIES", "ModelSpec", "forward_costs"]
