"""kvcopy's vLLM spec with CUDA caches: the store, the reset and the load of
tests/integrations/test_vllm_offload.py on a GPU, where the copies run on the TransferEngine's copy streams and
the host pool is pinned; and tiered offloading with KVCopyDiskTier on a GPU, under vLLM's own spec (vLLM's own
worker) and under kvcopy's (its worker over vLLM's pinned shared region).

It needs vLLM and a GPU together; the lent GPU machine cannot receive vLLM's wheel, so there it skips
(docs/engines.md, "vLLM": what ran where)."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm", reason="vLLM is not installed (scripts/setup.sh installs it; it cannot travel to the lent GPU)"
)

import torch

from helpers import gpu, requires_gpu
from helpers.vllm import BLOCK_TOKENS, PROMPT, assert_blocks_hold, make_rig, reload_prefix

pytestmark = [pytest.mark.engine, pytest.mark.vllm]


@gpu
@requires_gpu
@pytest.mark.parametrize("blocks_per_chunk", [1, 4])
def test_cuda_caches_load_back_bitwise(tmp_path, blocks_per_chunk):
    rig = make_rig(tmp_path, device="cuda", extra={"kvcopy_policy": "offload", "blocks_per_chunk": blocks_per_chunk})
    try:
        assert rig.kv_worker.kv.device.type == "cuda" and rig.kv_worker.host.pinned
        tokens, hit = reload_prefix(rig, PROMPT, BLOCK_TOKENS * blocks_per_chunk)
        torch.cuda.synchronize()
        assert assert_blocks_hold(rig, "again", tokens, range(hit // BLOCK_TOKENS)) == 2 * hit // BLOCK_TOKENS
        assert {c.profile_direction for c in rig.kv_worker.copies} <= {"d2h", "h2d"}
    finally:
        rig.close()


def _disk_tier(tmp_path) -> dict:
    return {"type": "KVCopyDiskTier", "module_path": "kvcopy.integrations.vllm", "path": str(tmp_path / "tier"),
            "bytes_to_use": 1 << 22}  # fmt: skip


@gpu
@requires_gpu
@pytest.mark.parametrize("spec", ["vllm", "kvcopy"])
def test_cuda_caches_cascade_to_the_disk_tier_and_load_back_bitwise(tmp_path, spec):
    pytest.importorskip("nixl_cu13", reason="KVCopyDiskTier needs NIXL (pip install 'kvcopy[nixl]')")
    from helpers.vllm import SPEC_PATH
    from helpers.vllm_tiers import make_tiering_rig

    stock = {"spec_name": "TieringOffloadingSpec"}  # vLLM's own, with vLLM's own worker on the GPU
    rig = make_tiering_rig(
        tmp_path,
        secondary_tiers=[_disk_tier(tmp_path)],
        spec=stock if spec == "vllm" else SPEC_PATH,
        extra={"kvcopy_policy": "offload"} if spec == "kvcopy" else None,
        device="cuda",
    )
    try:
        if spec == "kvcopy":
            assert rig.kv_worker.kv.device.type == "cuda" and rig.kv_worker.host.pinned
        tokens, hit = rig.reload_from_tiers(PROMPT)
        torch.cuda.synchronize()
        assert assert_blocks_hold(rig, "again", tokens, range(hit // BLOCK_TOKENS)) == 2 * hit // BLOCK_TOKENS
    finally:
        rig.close()
