"""kvcopy as vLLM's offloading data path, on the CPU: vLLM's real Scheduler and OffloadingConnector in both
roles, kvcopy's spec, CPU tensors in the GPU's place (tests/helpers/vllm.py).

The loaded blocks are compared bitwise with what the forwards wrote (kv_value), after the cache was zeroed."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs it)")


import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingConnectorMetadata
from vllm.v1.kv_offload.base import GPULoadStoreSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvcopy.integrations.vllm.worker import KVCopyOffloadingWorker

from helpers.vllm import BLOCK_TOKENS, PROMPT, assert_blocks_hold, before_copies, make_rig, reload_prefix

pytestmark = [pytest.mark.engine, pytest.mark.vllm]


@pytest.mark.parametrize("blocks_per_chunk", [1, 2, 4])
@pytest.mark.parametrize("num_layers", [2, 3])
def test_load_returns_the_stored_blocks_bitwise(tmp_path, blocks_per_chunk, num_layers):
    rig = make_rig(
        tmp_path, num_layers=num_layers, extra={"kvcopy_policy": "offload", "blocks_per_chunk": blocks_per_chunk}
    )
    try:
        tokens, hit = reload_prefix(rig, PROMPT, BLOCK_TOKENS * blocks_per_chunk)
        assert assert_blocks_hold(rig, "again", tokens, range(hit // BLOCK_TOKENS)) == num_layers * hit // BLOCK_TOKENS
        decision = rig.session.stats.decisions[-1]
        assert (decision.request_id, decision.action, decision.prefix_tokens) == ("again", "reload", hit)
    finally:
        rig.close()


@pytest.mark.parametrize(("blocks_per_chunk", "local_blocks"), [(2, 1), (4, 1), (4, 3)])
def test_a_partial_first_chunk_loads_from_the_right_sub_block(tmp_path, blocks_per_chunk, local_blocks):
    """vLLM's prefix cache holds ``local_blocks`` blocks, so the load starts inside the first chunk."""
    rig = make_rig(tmp_path, extra={"kvcopy_policy": "offload", "blocks_per_chunk": blocks_per_chunk})
    try:
        rig.store_and_reset(PROMPT, zero=True)
        head = PROMPT[: local_blocks * BLOCK_TOKENS + 3]  # too short for a chunk: computed, and cached on the device
        rig.add("head", head)
        rig.run()
        rig.drain()
        tokens = [*PROMPT, 5, 6, 7]
        chunk_tokens = BLOCK_TOKENS * blocks_per_chunk
        hit = len(PROMPT) // chunk_tokens * chunk_tokens
        assert len(tokens) - hit in rig.rerun(tokens, keep_blocks=True)
        loaded = range(local_blocks, hit // BLOCK_TOKENS)
        assert assert_blocks_hold(rig, "again", tokens, loaded) == 2 * len(loaded)
    finally:
        rig.close()


@pytest.mark.parametrize(
    ("layout", "mla"), [("LBNHC", False), ("BLHNC", False), ("BLNHC", False), ("LBHNC", True), ("BLHNC", True)]
)
def test_every_kv_cache_layout_loads_bitwise(tmp_path, layout, mla):
    """vLLM's page layouts (LBHNC, the connector's own, is above): FlashAttention's token-major pages (LBNHC),
    the cross-layer block-first ones (BL..., one page per block for all layers), and MLA's latent pages."""
    rig = make_rig(tmp_path, num_layers=3, layout=layout, mla=mla, extra={"kvcopy_policy": "offload"})
    try:
        tokens, hit = reload_prefix(rig, PROMPT)
        assert assert_blocks_hold(rig, "again", tokens, range(hit // BLOCK_TOKENS)) == 3 * hit // BLOCK_TOKENS
        # block-first layouts reach kvcopy as one plane whose block is every layer's page; the others, a plane
        # per layer
        assert len(rig.kv_worker.kv.planes) == (1 if layout.startswith("BL") else 3)
    finally:
        rig.close()


def test_two_kv_cache_groups_full_and_sliding_window(tmp_path):
    rig = make_rig(tmp_path, num_layers=4, sliding_window=32, extra={"kvcopy_policy": "offload"})
    try:
        assert len(rig.kv_cache_config.kv_cache_groups) == 2  # vLLM built a full and a sliding-window group
        tokens, hit = reload_prefix(rig, PROMPT)
        full = assert_blocks_hold(rig, "again", tokens, range(hit // BLOCK_TOKENS), groups={0})
        window = assert_blocks_hold(rig, "again", tokens, range(hit // BLOCK_TOKENS), groups={1})
        assert full == 2 * hit // BLOCK_TOKENS
        assert window >= 2 * 2  # the window's blocks (2 x 16 tokens) in both sliding layers
    finally:
        rig.close()


def slow_copies(worker: KVCopyOffloadingWorker, direction: str, seconds: float, started: threading.Event):
    """Makes the worker's engine sleep before each copy of ``direction`` ("offload" or "reload")."""

    def sleep() -> None:
        started.set()
        time.sleep(seconds)

    before_copies(worker, direction, sleep)


def test_a_load_of_chunks_a_slow_store_still_writes_reads_what_it_stored(tmp_path):
    """Submitted back to back, with the store held up: the engine's order, not timing, decides."""
    rig = make_rig(tmp_path, extra={"kvcopy_policy": "offload", "blocks_per_chunk": 2})
    try:
        worker = rig.kv_worker
        started = threading.Event()
        slow_copies(worker, "offload", 0.3, started)
        device = list(range(1, 5))  # any four device blocks, written with known bytes
        for cache in rig.caches.values():
            for b in device:
                cache[b] = float(b)
        worker.submit_store(100, GPULoadStoreSpec(device, [4], [0]), CPULoadStoreSpec([0, 1]))
        target = list(range(20, 24))
        worker.submit_load(101, CPULoadStoreSpec([0, 1]), GPULoadStoreSpec(target, [4], [0]))
        assert started.wait(5)
        worker.wait({100, 101})
        results = {r.job_id: r for r in worker.get_finished()}
        assert results[100].success and results[101].success
        assert results[101].transfer_size == 4 * worker.kv.nbytes_per_block
        for cache in rig.caches.values():
            for b, t in zip(device, target, strict=True):
                assert torch.equal(cache[t], cache[b])
        assert results[101].transfer_time >= 0.3 - 0.05  # its turnaround includes the wait behind the store
    finally:
        rig.close()


def test_preemption_in_the_middle_of_a_store_waits_for_it(tmp_path):
    """vLLM flushes a preempted request's stores (handle_preemptions) before its blocks are reused."""
    rig = make_rig(tmp_path, extra={"kvcopy_policy": "offload"})
    try:
        worker = rig.kv_worker
        started = threading.Event()
        slow_copies(worker, "offload", 0.3, started)
        device = [3, 4]
        for cache in rig.caches.values():
            cache[3], cache[4] = 30.0, 40.0
        worker.submit_store(7, GPULoadStoreSpec(device, [2], [0]), CPULoadStoreSpec([5, 6]))
        assert started.wait(5) and 7 in worker.job_ids_in_flight
        rig.worker.handle_preemptions(OffloadingConnectorMetadata(load_jobs={}, store_jobs={}, jobs_to_flush={7}))
        assert worker.engine.num_in_flight == 0  # the store is done: the blocks may be reused
        for cache in rig.caches.values():
            cache[3], cache[4] = -1.0, -1.0  # the preempted request's blocks, reused
        worker.submit_load(8, CPULoadStoreSpec([5, 6]), GPULoadStoreSpec([9, 10], [2], [0]))
        worker.wait({8})
        assert all(r.success for r in worker.get_finished())
        for cache in rig.caches.values():
            assert bool((cache[9] == 30.0).all()) and bool((cache[10] == 40.0).all())
    finally:
        rig.close()


def test_a_failed_copy_is_reported_failed_and_logged(tmp_path, caplog):
    rig = make_rig(tmp_path, extra={"kvcopy_policy": "offload"})
    try:
        worker = rig.kv_worker
        copy = worker.engine._copy

        def broken(method, src, src_ids, dst, dst_ids, layer):
            raise RuntimeError("injected copy failure")

        worker.engine._copy = broken
        worker.submit_store(1, GPULoadStoreSpec([1, 2], [2], [0]), CPULoadStoreSpec([0, 1]))
        worker.wait({1})
        worker.engine._copy = copy
        worker.submit_store(2, GPULoadStoreSpec([1, 2], [2], [0]), CPULoadStoreSpec([2, 3]))
        worker.wait({2})
        results = {r.job_id: r for r in worker.get_finished()}
        assert results[1].success is False and results[1].transfer_size is None
        assert results[2].success is True
        assert "injected copy failure" in caplog.text and "job 1 failed" in caplog.text
        assert worker.get_finished() == []  # each job reported once
    finally:
        rig.close()


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize("hold_failures", [False, True])
def test_a_job_the_engine_refuses_at_submission_is_reported_failed_once(tmp_path, caplog, direction, hold_failures):
    """The engine raises inside submit_*: vLLM hears of the job once, as failed (or, for
    KVCopyOffloadingConnector, it is held in ``failures`` once), never as done and never lost."""
    rig = make_rig(tmp_path, extra={"kvcopy_policy": "offload"})
    try:
        worker = rig.kv_worker
        worker.hold_failures = hold_failures

        def refuse(*args, **kwargs):
            raise RuntimeError("injected submission failure")

        engine_call = "offload" if direction == "store" else "reload"
        setattr(worker.engine, engine_call, refuse)
        device, host = GPULoadStoreSpec([1, 2], [2], [0]), CPULoadStoreSpec([0, 1])
        if direction == "store":
            assert worker.submit_store(7, device, host) is True  # vLLM's contract: accepted, then reported
        else:
            assert worker.submit_load(7, host, device) is True
        assert 7 in worker.job_ids_in_flight
        first, second = worker.get_finished(), worker.get_finished()
        if hold_failures:
            assert first == [] and worker.failures == [(7, [1, 2])]
        else:
            assert [(r.job_id, r.success, r.transfer_size) for r in first] == [(7, False, None)]
        assert second == [] and worker.job_ids_in_flight == set()
        assert f"{direction} job 7 failed to start" in caplog.text and "injected submission failure" in caplog.text
    finally:
        rig.close()


def test_shutdown_waits_for_the_copies_in_flight_and_frees_the_pool(tmp_path):
    rig = make_rig(tmp_path, extra={"kvcopy_policy": "offload"})
    worker = rig.kv_worker
    started = threading.Event()
    slow_copies(worker, "offload", 0.2, started)
    for cache in rig.caches.values():
        cache[1] = 11.0
    worker.submit_store(1, GPULoadStoreSpec([1], [1], [0]), CPULoadStoreSpec([0]))
    assert started.wait(5)
    host = worker.host
    rig.close()  # the worker's shutdown, with the store still sleeping
    assert worker.engine.num_in_flight == 0
    assert worker.session.closed and host.buffer.numel() == host.nbytes
    with pytest.raises(RuntimeError, match="shut down"):
        worker.submit_store(2, GPULoadStoreSpec([1], [1], [0]), CPULoadStoreSpec([1]))
