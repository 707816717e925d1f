"""What both of kvcopy's vLLM specs (untiered and tiered) build alike: the model the Planner plans for, the
offload session that decides, and the geometry that maps vLLM's keys to tokens and bytes."""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.v1.kv_offload.config import OffloadingConfig

from kvcopy.integrations.common.offload_session import OffloadSession
from kvcopy.integrations.common.online_planner import OnlinePlanner
from kvcopy.integrations.vllm._config import SpecConfig
from kvcopy.integrations.vllm.manager import HitGeometry
from kvcopy.model.spec import ModelSpec
from kvcopy.planner.planner import DEFAULT_BLOCK_TOKENS
from kvcopy.profile import Profile

__all__ = ["hit_geometry", "model_spec_of", "new_session"]

logger = logging.getLogger("kvcopy.integrations.vllm")


def _vllm_config() -> Any | None:
    from vllm.config import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


def model_spec_of(config: OffloadingConfig) -> ModelSpec | None:
    """The ModelSpec of the model vLLM serves: its hf_config (the current vLLM config's), else the config.json of
    the model directory; None (with a warning) when kvcopy cannot read it."""
    vllm_config = _vllm_config()
    source: Any = None
    if vllm_config is not None and getattr(vllm_config, "model_config", None) is not None:
        source = vllm_config.model_config.hf_config.to_dict()
    elif os.path.isfile(os.path.join(config.model.name, "config.json")):
        source = config.model.name
    if source is None:
        logger.warning("kvcopy: no config.json for %r; every hit is loaded (policy 'offload')", config.model.name)
        return None
    name = os.path.basename(config.model.name.rstrip("/")) or config.model.name
    try:
        try:
            return ModelSpec.from_hf_config(source, name=name, kv_dtype=config.model.dtype)
        except ValueError:  # a KV dtype name kvcopy does not know (e.g. "auto"): the config's own dtype
            return ModelSpec.from_hf_config(source, name=name)
    except ValueError as err:
        logger.warning(
            "kvcopy: cannot plan for %r (%s); every hit is loaded (policy 'offload')", config.model.name, err
        )
        return None


def block_tokens_of(tokens_per_block: tuple[int, ...]) -> int:
    """Tokens per device block (the first group's; vLLM's groups share a block size on this path)."""
    return tokens_per_block[0] if tokens_per_block else DEFAULT_BLOCK_TOKENS


def new_session(
    settings: SpecConfig,
    profile: Profile | None,
    spec: ModelSpec | None,
    host_bytes: int,
    tokens_per_block: tuple[int, ...],
) -> OffloadSession:
    """The session of one role: the policy, the online Planner (learning as the keys say) and the host bytes."""
    live = OnlinePlanner(
        spec,
        profile,
        learn=settings.learn,
        decode_share=settings.decode_share,
        block_tokens=block_tokens_of(tokens_per_block),
    )
    return OffloadSession(
        host_bytes=host_bytes, policy=settings.policy, live=live, method=settings.method, profile=profile
    )


def _max_forward_tokens() -> int | None:
    vllm_config = _vllm_config()
    scheduler = getattr(vllm_config, "scheduler_config", None)
    return getattr(scheduler, "max_num_batched_tokens", None)


def hit_geometry(spec: Any) -> HitGeometry:
    """What the judgment needs of the cache ``spec`` (an OffloadingSpec) offloads."""
    config = spec.config
    return HitGeometry(
        tokens_per_chunk={g.group_id: g.tokens_per_block * spec.blocks_per_chunk for g in config.groups},
        full_groups=frozenset(g.group_id for g in config.groups if g.sliding_window_size_in_chunks is None),
        tokens_per_block=block_tokens_of(spec.tokens_per_block),
        bytes_per_block=config.worker_kv_bytes_per_block,
        max_forward_tokens=_max_forward_tokens(),
    )
