"""OffloadSession, what every engine adapter's offload stands on (kvcopy/integrations/common): its host pools,
one per cache group, reserved from all or from none."""

from __future__ import annotations

import torch

from kvcopy.integrations.common.offload_session import OffloadSession
from kvcopy.integrations.common.online_planner import OnlinePlanner

from helpers.copies import make_layout


def test_reserve_over_two_allocators_is_all_or_none():
    gen = torch.Generator().manual_seed(4)
    caches = {
        "full_attention": make_layout("vllm", 8, torch.bfloat16, gen, num_layers=2),
        "sliding_attention": make_layout("vllm", 8, torch.bfloat16, gen, num_layers=1),
    }
    session = OffloadSession(
        host_bytes=sum(16 * kv.nbytes_per_block for kv in caches.values()),
        policy="offload",
        live=OnlinePlanner(None, None, learn=False),
        method="auto",
        profile=None,
    )
    try:
        pools = session.pools_for(caches)
        first, second = pools["full_attention"], pools["sliding_attention"]
        assert session.reserve({"sliding_attention": second.num_free}) is not None  # the second pool is full
        free_before = first.num_free
        assert session.reserve({"full_attention": 1, "sliding_attention": 1}) is None
        assert first.num_free == free_before  # nothing taken from the first pool either
    finally:
        session.close()
