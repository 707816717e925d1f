"""The rig of tests/helpers/vllm_tiers.py is faithful: vLLM's real Scheduler, OffloadingConnector (both roles)
and stock TieringOffloadingSpec, with the CPU stand-in worker, store a prompt, cascade it to a secondary tier,
and after the primary tier, vLLM's prefix cache and the KV cache are emptied, promote and load it back bitwise.

References are independent of the rig: the KV the forwards wrote (kv_value), the row layout vLLM documents
(``SharedOffloadRegion.create_next_worker_view``: a slot holds the tensors one after another, each tensor's
pages of the chunk's blocks in order), and the files vLLM's fs tier writes."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs it)")

import torch
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from helpers.vllm import BLOCK_TOKENS, PROMPT, assert_blocks_hold, expected_block, kv_value
from helpers.vllm_tiers import TIERING_SPEC_PATH, TieringRig, make_tiering_rig, record_calls

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

MEMORY_TIER = {"type": "MemoryRowTier", "module_path": "helpers.vllm_tiers"}
OTHER_PROMPT = [(11 * i + 5) % 250 for i in range(150)]  # shares no block with PROMPT


@pytest.fixture
def rigs(tmp_path):
    """make_tiering_rig(tmp_path, ...), every rig closed at the end, none leaving its region in /dev/shm."""
    made: list[TieringRig] = []

    def make(**kwargs) -> TieringRig:
        made.append(make_tiering_rig(tmp_path, **kwargs))
        return made[-1]

    yield make
    for rig in made:
        rig.close()
        assert not rig.region_left_behind, rig.region_path
        assert not os.path.exists(rig.region_path)


def fs_tier(tmp_path) -> dict:
    return {"type": "fs", "root_dir": str(tmp_path / "fs")}


def primary_holds(rig: TieringRig, keys) -> list[bool]:
    context = ReqContext(req_id="probe")
    with rig.manager.lock:
        return [rig.manager.primary_tier.lookup(key, context) is LookupResult.HIT for key in keys]


def chunk_row(tokens, chunk: int, blocks_per_chunk: int, num_layers: int, page_bytes: int) -> torch.Tensor:
    """The documented bytes of one worker's slot for chunk ``chunk``: tensor-major, each layer's pages of the
    chunk's blocks in order (every page of the rig's forwards holds one value)."""
    pages = [
        torch.full((page_bytes // 4,), kv_value(tokens, (chunk * blocks_per_chunk + j + 1) * BLOCK_TOKENS - 1, layer))
        for layer in range(num_layers)
        for j in range(blocks_per_chunk)
    ]
    return torch.cat(pages).view(torch.int8)


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_a_prefix_evicted_from_the_primary_comes_back_from_vllms_fs_tier_bitwise(rigs, tmp_path, blocks_per_chunk):
    rig = rigs(secondary_tiers=[fs_tier(tmp_path)], blocks_per_chunk=blocks_per_chunk)
    (tier,) = rig.tiers
    cascades, promotions = record_calls(tier, "submit_store"), record_calls(tier, "submit_load")
    keys = rig.offload_keys(PROMPT)
    chunk_tokens = BLOCK_TOKENS * blocks_per_chunk
    assert len(keys) == len(PROMPT) // chunk_tokens

    rig.store_cascade_evict(PROMPT)
    assert sorted(k for (job,) in cascades for k in job.keys) == sorted(keys)  # every chunk cascaded
    assert all(os.path.isfile(tier.file_mapper.get_file_name(key)) for key in keys)
    assert primary_holds(rig, keys) == [False] * len(keys)

    tokens = [*PROMPT, 5, 6, 7]
    rig.add("again", tokens, max_tokens=4)
    rig.step()
    assert not promotions  # the fs tier's first answer is RETRY: its lookup thread checks the files
    rig.run_until_prefilled("again")
    hit = len(keys) * chunk_tokens

    (job,) = [call[0] for call in promotions]  # one batched promotion of the whole prefix
    assert job.is_promotion and list(job.keys) == keys and len(job.chunk_ids) == len(keys)
    (load,) = [j for j in rig.kv_worker.jobs if not j.store]  # then one primary -> KV cache load
    assert sorted(load.chunk_ids) == sorted(job.chunk_ids.tolist())
    assert [f["again"] for f in rig.forwards if "again" in f] == [len(tokens) - hit]  # the rest was computed
    assert assert_blocks_hold(rig, "again", tokens, range(hit // BLOCK_TOKENS)) == 2 * hit // BLOCK_TOKENS


def test_rows_and_fs_files_hold_vllms_tensor_major_layout(rigs, tmp_path):
    """At blocks_per_chunk=2 a slot is [layer 0: block 0, block 1 | layer 1: block 0, block 1], not page-first;
    vLLM's fs tier writes the row as it is."""
    blocks_per_chunk, num_layers = 2, 2
    rig = rigs(secondary_tiers=[fs_tier(tmp_path)], blocks_per_chunk=blocks_per_chunk, num_layers=num_layers)
    (tier,) = rig.tiers
    rig.add("first", PROMPT)
    rig.run()
    rig.drain()
    keys = rig.offload_keys(PROMPT)
    page_bytes = rig.caches["layers.0"][0].numel() * rig.caches["layers.0"].element_size()
    slot = blocks_per_chunk * num_layers * page_bytes
    row_stride = rig.region.shape[1]
    assert slot <= row_stride and row_stride % 4096 == 0  # one worker's slot, then padding to the page
    for chunk, (key, row) in enumerate(zip(keys, rig.primary_chunk_ids(keys), strict=True)):
        expected = chunk_row(PROMPT, chunk, blocks_per_chunk, num_layers, page_bytes)
        assert torch.equal(rig.region[row, :slot], expected), chunk
        with open(tier.file_mapper.get_file_name(key), "rb") as f:
            stored = torch.frombuffer(bytearray(f.read()), dtype=torch.int8)
        assert stored.numel() == row_stride and torch.equal(stored[:slot], expected), chunk
    page_first = torch.cat([expected_block(rig, PROMPT, f"layers.{n}", j).flatten() for j in (0, 1) for n in (0, 1)])
    assert not torch.equal(rig.region[rig.primary_chunk_ids(keys[:1])[0], :slot], page_first.view(torch.int8))


def test_a_synchronous_tier_promotes_in_the_first_step_and_loads_in_the_second(rigs):
    """A tier whose lookup answers at once (here MemoryRowTier, which copies rows): HIT_PENDING and one batched
    submit_load in the request's first step, the primary -> KV cache load in the second, the forward of the
    rest in the third; the bytes are the stored ones."""
    rig = rigs(secondary_tiers=[MEMORY_TIER], blocks_per_chunk=2)
    (tier,) = rig.tiers
    promotions = record_calls(tier, "submit_load")
    rig.store_cascade_evict(PROMPT)
    tokens = [*PROMPT, 5, 6, 7]
    rig.add("again", tokens, max_tokens=4)
    loads_before = len([j for j in rig.kv_worker.jobs if not j.store])

    assert rig.step() == {} and len(promotions) == 1
    assert rig.step() == {} and len([j for j in rig.kv_worker.jobs if not j.store]) == loads_before + 1
    hit = len(PROMPT) // 32 * 32
    assert rig.step() == {"again": len(tokens) - hit}
    assert assert_blocks_hold(rig, "again", tokens, range(hit // BLOCK_TOKENS)) == 2 * hit // BLOCK_TOKENS


def test_vllms_example_tier_copies_nothing_so_the_rig_sees_zeros(rigs):
    """The negative control: vLLM's ``example`` tier records keys and reports promotions done without writing
    the primary; the rig zeroed the primary at the eviction, so the loaded blocks are zeros, not the KV."""
    rig = rigs(secondary_tiers=[{"type": "example"}])
    tokens, hit = rig.reload_from_tiers(PROMPT)
    table = rig.blocks_of("again")[0]
    assert all(not rig.caches[name][table[i]].any() for name in rig.caches for i in range(hit // BLOCK_TOKENS))
    with pytest.raises(AssertionError):
        assert_blocks_hold(rig, "again", tokens, range(hit // BLOCK_TOKENS))


def test_a_failed_promotion_keeps_its_successful_prefix_and_the_rest_is_computed(rigs):
    """A promotion reported success=False with successful_keys = the chunks before a bad one: those load
    bitwise, the bad chunk (dropped by the tier, so it then misses) and every chunk after it are computed, and
    nothing is promoted again."""
    rig = rigs(secondary_tiers=[MEMORY_TIER])
    (tier,) = rig.tiers
    promotions = record_calls(tier, "submit_load")
    rig.store_cascade_evict(PROMPT)
    keys = rig.offload_keys(PROMPT)
    bad = 3
    tier.corrupt(keys[bad])
    tokens = [*PROMPT, 5, 6, 7]
    results = []  # what the manager was told
    report = tier.get_finished_jobs

    def reported():
        done = report()
        results.extend(done)
        return done

    tier.get_finished_jobs = reported

    assert rig.rerun(tokens, keep_blocks=True) == [len(tokens) - bad * BLOCK_TOKENS]
    assert len(promotions) == 1
    (failed,) = [r for r in results if r.job_id == promotions[0][0].job_id]
    assert not failed.success and list(failed.successful_keys) == keys[:bad]
    assert assert_blocks_hold(rig, "again", tokens, range(bad)) == 2 * bad
    assert keys[bad] not in tier.rows


def test_a_tier_still_answering_hit_for_a_failed_key_is_asked_to_promote_it_every_step(rigs):
    """vLLM's side of the contract (the fs tier marks failed keys missing): a tier that keeps answering HIT for
    a key whose promotion failed gets that key and the ones after it promoted again at every step, and the
    request waits, computing nothing. A tier must answer MISS for a key it failed to promote."""
    rig = rigs(secondary_tiers=[{**MEMORY_TIER, "drop_failed": False}])
    (tier,) = rig.tiers
    promotions = record_calls(tier, "submit_load")
    rig.store_cascade_evict(PROMPT)
    keys = rig.offload_keys(PROMPT)
    bad = 3
    tier.corrupt(keys[bad])
    rig.add("again", [*PROMPT, 5, 6, 7], max_tokens=4)
    steps = 6
    assert all(rig.step() == {} for _ in range(steps))
    assert [list(job.keys) for (job,) in promotions] == [keys] + [keys[bad:]] * (steps - 1)
    assert rig.requests["again"].num_computed_tokens == 0


def test_a_prefix_evicted_by_other_prompts_is_promoted_from_the_fs_tier(rigs, tmp_path):
    """No reset: a primary of 12 chunks, so storing OTHER_PROMPT's 9 chunks evicts most of PROMPT's; PROMPT
    again promotes what the primary lost (evicting OTHER_PROMPT's chunks for the room) and loads it bitwise."""
    chunk_bytes = 2 * 2 * BLOCK_TOKENS * 2 * 16 * 4  # 2 layers x (K, V) x 16 tokens x 2 heads x 16 dims, fp32
    rig = rigs(secondary_tiers=[fs_tier(tmp_path)], cpu_bytes_to_use=12 * chunk_bytes)
    (tier,) = rig.tiers
    promotions = record_calls(tier, "submit_load")
    keys = rig.offload_keys(PROMPT)
    for request_id, prompt in (("first", PROMPT), ("other", OTHER_PROMPT)):
        rig.add(request_id, prompt)
        rig.run()
        rig.drain()
    evicted = [not held for held in primary_holds(rig, keys)]
    assert any(evicted)
    rig.reset_prefix_cache(zero=True)

    tokens = [*PROMPT, 5, 6, 7]
    hit = len(keys) * BLOCK_TOKENS
    assert rig.rerun(tokens, keep_blocks=True)[-1] == len(tokens) - hit
    # what the primary had lost, and what the promotions' own room evicted of PROMPT (its least recently used)
    promoted = {key for (job,) in promotions for key in job.keys}
    assert {key for key, gone in zip(keys, evicted, strict=True) if gone} <= promoted <= set(keys)
    assert assert_blocks_hold(rig, "again", tokens, range(hit // BLOCK_TOKENS)) == 2 * hit // BLOCK_TOKENS


def test_the_spec_is_vllms_own_but_the_worker(rigs, tmp_path):
    from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    from helpers.vllm_tiers import CPUStandInWorker, CPUTieringSpec

    rig = rigs(secondary_tiers=[fs_tier(tmp_path)])
    spec = rig.scheduler.connector.connector_scheduler
    assert type(rig.manager) is TieringOffloadingManager
    assert type(rig.manager.primary_tier) is CPUPrimaryTierOffloadingManager
    assert isinstance(rig.worker_spec, TieringOffloadingSpec) and type(rig.worker_spec) is CPUTieringSpec
    assert [name for name, value in vars(CPUTieringSpec).items() if callable(value)] == ["get_worker"]
    assert isinstance(rig.kv_worker, CPUStandInWorker)
    assert rig.vllm_config.kv_transfer_config.kv_connector_extra_config["spec_name"] == TIERING_SPEC_PATH["spec_name"]
    assert os.path.exists(rig.region_path) and spec is not None
