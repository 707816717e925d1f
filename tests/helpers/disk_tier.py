"""kvcopy's disk tier on its own, as vLLM's tiering manager drives it: a primary tier's rows (an int8 memoryview
over an mmap, as vLLM's shared region gives one), the tier built as vLLM's SecondaryTierFactory builds it, and
its jobs made as the manager makes them."""

from __future__ import annotations

import itertools
import mmap
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs it)")
pytest.importorskip("nixl_cu13", reason="NIXL is part of the test install (pip install 'kvcopy[nixl]')")

from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
from vllm.v1.kv_offload.base import ReqContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from helpers.vllm import write_model_dir

ROW_BYTES = 8192  # one chunk of every worker, padded to 4 KiB as vLLM's region is
NUM_ROWS = 8
TIER_TYPE = "KVCopyDiskTier"
_job_ids = itertools.count(1)


def offloading_spec(*, dtype: str = "float32", blocks_per_chunk: int = 1, data_parallel: tuple[int, int] = (0, 1)):
    """What a tier reads of vLLM's spec: its OffloadingConfig and the region's sizes; ``data_parallel``: the
    engine's replica index and the replicas."""
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layers.0", "layers.1"), 0),),
        worker_kv_bytes_per_block=ROW_BYTES // blocks_per_chunk,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="test",
        model=OffloadingModelConfig("tiny", dtype, 1024),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, *data_parallel, None, False),
    )
    return SimpleNamespace(config=config, kv_bytes_per_chunk=ROW_BYTES, cpu_page_size_per_worker=ROW_BYTES)


def engine_config(model_dir: str, *, hf_overrides: dict | None = None, cache_dtype: str = "auto") -> VllmConfig:
    """The engine's VllmConfig, as the tier finds it: the model's config (with ``hf_overrides``) and the KV
    cache's dtype."""
    model = ModelConfig(
        model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=1024, hf_overrides=hf_overrides or {}
    )
    return VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=16, cache_dtype=cache_dtype),
        device_config=DeviceConfig(device="cpu"),
    )


@dataclass
class Primary:
    """The primary tier's rows: an mmap, and the int8 (rows, row bytes) view of it vLLM gives a tier."""

    memory: mmap.mmap
    view: memoryview

    @property
    def rows(self) -> np.ndarray:
        return np.frombuffer(self.memory, dtype=np.uint8).reshape(NUM_ROWS, ROW_BYTES)

    def fill(self, row: int, seed: int) -> bytes:
        data = np.random.default_rng(seed).integers(0, 256, ROW_BYTES, dtype=np.uint8)
        self.rows[row] = data
        return data.tobytes()

    def close(self) -> None:
        self.view.release()
        self.memory.close()  # BufferError if anything still views it


def primary() -> Primary:
    memory = mmap.mmap(-1, NUM_ROWS * ROW_BYTES)
    return Primary(memory, memoryview(memory).cast("b", (NUM_ROWS, ROW_BYTES)))


def make_tier(primary_rows: Primary, spec=None, **keys):
    """The tier, built as vLLM's factory builds an out-of-tree one from its configuration."""
    config = {"type": TIER_TYPE, "module_path": "kvcopy.integrations.vllm", **keys}
    return SecondaryTierFactory.create_secondary_tier(config, primary_rows.view, spec or offloading_spec())


@contextmanager
def tier_of(path, primary_rows: Primary, vllm_config: VllmConfig | None = None, **keys) -> Iterator:
    """A tier over ``primary_rows`` keeping its stores in ``path`` (``bytes_to_use``: every row, unless given),
    built under ``vllm_config``; shut down after."""
    keys = {"path": str(path), "bytes_to_use": NUM_ROWS * ROW_BYTES, **keys}
    if vllm_config is None:
        tier = make_tier(primary_rows, **keys)
    else:
        with set_current_vllm_config(vllm_config):
            tier = make_tier(primary_rows, **keys)
    try:
        yield tier
    finally:
        tier.shutdown()


def key(i: int):
    """The offload key of the i-th chunk of a prefix (a block hash and group 0, as vLLM packs them)."""
    return make_offload_key(i.to_bytes(32, "big"), 0)


def job(keys: list, rows: list[int], *, promotion: bool) -> TransferJob:
    return TransferJob(
        next(_job_ids), keys, np.array(rows, dtype=np.int64), is_promotion=promotion, req_context=ReqContext("r")
    )


def run(tier, transfer_job: TransferJob):
    """Submits the job, waits for the tier to end it (drain_jobs, as vLLM's reset does), returns its result."""
    (tier.submit_load if transfer_job.is_promotion else tier.submit_store)(transfer_job)
    tier.drain_jobs()
    results = [r for r in tier.get_finished_jobs() if r.job_id == transfer_job.job_id]
    assert len(results) == 1, results
    return results[0]


def chunk_bytes(i: int) -> np.ndarray:
    """The bytes of chunk i, as a test's writer fills its row (a function of i alone)."""
    return np.random.default_rng(10_000 + i).integers(0, 256, ROW_BYTES, dtype=np.uint8)


def model_dir(tmp_path) -> str:
    return write_model_dir(str(tmp_path / "model"), 2)
