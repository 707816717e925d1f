"""What to do with a cached prefix: reload, layer-wise reload, split or recompute (:class:`Planner`, its
:class:`Decision`), decided from measured costs, and the small-prefix threshold below which recomputing wins."""

from __future__ import annotations

from kvcopy.planner.decision import ACTIONS, Decision
from kvcopy.planner.planner import DEFAULT_BLOCK_TOKENS, DEFAULT_CONTEXT_TOKENS, Planner

__all__ = ["ACTIONS", "DEFAULT_BLOCK_TOKENS", "DEFAULT_CONTEXT_TOKENS", "Decision", "Planner"]
