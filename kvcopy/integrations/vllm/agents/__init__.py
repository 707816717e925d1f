"""Agents' pauses acted on in kvcopy's tiered vLLM spec: leases on the host tier's eviction policy
(:class:`LeasedPolicy`) and the plans that make them, demote and read back (:class:`AgentPauses`)."""

from __future__ import annotations

from kvcopy.integrations.vllm.agents.leases import LeasedPolicy
from kvcopy.integrations.vllm.agents.pauses import AGENT_METRICS, AgentPauses, agent_metric_definitions

__all__ = ["AGENT_METRICS", "AgentPauses", "LeasedPolicy", "agent_metric_definitions"]
