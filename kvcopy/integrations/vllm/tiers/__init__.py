"""kvcopy's secondary tier for vLLM's tiered offloading: :class:`KVCopyDiskTier` (a DiskKVStore below vLLM's
primary tier, kvcopy.integrations.vllm.tiers.disk), the identity of what it stores (``identity``) and its
stores under its path (``stores``). vLLM names it ``{"type": "KVCopyDiskTier", "module_path":
"kvcopy.integrations.vllm"}``."""

from __future__ import annotations

from kvcopy.integrations.vllm.tiers.disk import METRICS, KVCopyDiskTier, TierKeys, check_tier_config

__all__ = ["METRICS", "KVCopyDiskTier", "TierKeys", "check_tier_config"]
