"""NIXL itself, imported only when an agent is made: importing kvcopy never needs it."""

from __future__ import annotations

from typing import Any

__all__ = ["nixl_module"]


def nixl_module() -> tuple[Any, Any]:
    """NIXL's agent and config classes (nixl_agent, nixl_agent_config); ImportError saying how to install NIXL
    without it."""
    try:
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    except ImportError as err:
        raise ImportError("kvcopy.remote and kvcopy.storage need NIXL: pip install 'kvcopy[nixl]' (nixl-cu13)") from err
    return nixl_agent, nixl_agent_config
