"""kvcopy's vLLM spec reads ``cpu_bytes_to_use`` as vLLM's own CPU spec does: the total of every worker of the
engine, each worker pinning its share. Pinning it in every worker made TP=8 pin 8x what was asked."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs it)")

import torch
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvcopy.integrations.vllm import KVCopyOffloadingSpec

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

# One worker's canonical KV tensors: two planes of PAGE_BYTES per block. Their sum (4096) is a page multiple, so
# vLLM's CPU spec (which pads a chunk to the OS page) sizes its tier with no padding: an exact reference.
PAGE_BYTES = 2048
NUM_PLANES = 2
WORKER_BYTES_PER_BLOCK = NUM_PLANES * PAGE_BYTES
DEVICE_BLOCKS = 8
BLOCKS_PER_CHUNK = 2
CPU_BYTES_TO_USE = 64 * 2**20  # the engine's total: 64 MiB


def offloading_config(tp: int, pp: int = 1, rank: int = 0) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layers.0",), group_id=0),),
        worker_kv_bytes_per_block=WORKER_BYTES_PER_BLOCK,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": CPU_BYTES_TO_USE, "kvcopy_policy": "offload"},
        engine_id="engine-0",
        model=OffloadingModelConfig(name="no-such-model-dir", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=BLOCKS_PER_CHUNK),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=tp * pp,
            tp_size=tp,
            pp_size=pp,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def worker_caches() -> CanonicalKVCaches:
    tensors = [
        CanonicalKVCacheTensor(torch.zeros(DEVICE_BLOCKS, PAGE_BYTES, dtype=torch.int8), PAGE_BYTES)
        for _ in range(NUM_PLANES)
    ]
    refs = [[CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE_BYTES) for i in range(NUM_PLANES)]]
    return CanonicalKVCaches(tensors=tensors, group_data_refs=refs)


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (8, 1), (4, 2)])
def test_the_scheduler_sizes_the_tier_as_vllms_cpu_spec_does(tp, pp):
    config = offloading_config(tp, pp)
    reference = CPUOffloadingSpec(config)  # vLLM's own reading of the same key
    spec = KVCopyOffloadingSpec(config)
    assert reference.num_chunks == CPU_BYTES_TO_USE // (WORKER_BYTES_PER_BLOCK * BLOCKS_PER_CHUNK * tp * pp)
    assert spec.num_chunks == reference.num_chunks
    # the tier's reported size (chunks, bytes over all workers) is vLLM's too
    assert list(spec.get_manager().config_info()) == [reference.cpu_info.as_config_info()]


@pytest.mark.parametrize("tp", [2, 8])
def test_every_worker_pins_its_share_and_all_together_pin_what_was_asked(tp):
    pinned = []
    for rank in range(tp):
        spec = KVCopyOffloadingSpec(offloading_config(tp, rank=rank))
        worker = spec.get_worker(worker_caches())
        try:
            host = worker.host
            pinned.append(host.num_blocks * host.paged.nbytes_per_block)
            # the scheduler's chunks all fit this worker's pool: a chunk id the manager hands out is a valid slot
            assert host.num_blocks >= spec.num_chunks * BLOCKS_PER_CHUNK
        finally:
            worker.shutdown()
    per_worker = CPU_BYTES_TO_USE // tp
    assert all(nbytes == per_worker for nbytes in pinned), (pinned, per_worker)  # 64 MiB divides by 2 and 8
    assert sum(pinned) == CPU_BYTES_TO_USE


def test_a_total_too_small_for_one_chunk_on_every_worker_is_refused():
    too_small = WORKER_BYTES_PER_BLOCK * BLOCKS_PER_CHUNK * 8 - 1  # a chunk on each of 8 workers, less a byte
    config = offloading_config(8)
    config = OffloadingConfig(**{**config.__dict__, "extra_config": {"cpu_bytes_to_use": too_small}})
    with pytest.raises(ValueError, match=r"cpu_bytes_to_use: .*the total of 8 workers.*hold no chunk"):
        KVCopyOffloadingSpec(config)
