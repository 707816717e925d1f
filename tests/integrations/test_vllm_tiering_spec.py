"""kvcopy's vLLM spec with ``secondary_tiers``: vLLM's tiered offloading with kvcopy's worker (copying GPU
blocks into and out of vLLM's shared region, in vLLM's layout) and kvcopy's judgment across tiers. vLLM's real
Scheduler and OffloadingConnector on the CPU (tests/helpers/vllm_tiers.py).

What is checked:

* a prompt stored, cascaded to KVCopyDiskTier (and to vLLM's own fs tier), evicted from the primary tier and
  requested again loads bitwise what was stored (1 and 2 blocks per chunk, two layers), and kvcopy's worker
  writes and reads the region rows in vLLM's layout (what one of it and the stand-in worker, a copy of vLLM's
  own descriptors, stores, the other loads back bitwise in another engine);
* the judgment, both ways: with a profile whose disk read is far slower than recomputing, a hit only on
  disk is never promoted (no submit_load, the primary tier's chunks left alone) and its tokens are computed,
  while a hit in host RAM still loads; a hit of host-RAM chunks then disk chunks, judged worth only its host
  part, loads that part and promotes nothing; with the opposite profile the disk hit is promoted and loads
  bitwise; ``kvcopy_policy: "offload"`` promotes every hit; the judgment's counters are labelled by tier;
* vLLM's per-request controls: ``max_load_tokens`` caps what is loaded (from the hit's start, after vLLM's
  prefix cache), ``kv_load_tiers`` keeps a request off the tiers it does not name (vLLM 0.33.0 has no
  ``kv_store_tiers``: no code of it reads one);
* bad configuration of the tiered keys, at build, in both roles.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs it)")
pytest.importorskip("nixl_cu13", reason="NIXL is part of the test install (pip install 'kvcopy[nixl]')")

from vllm.v1.kv_offload.base import LookupResult, ReqContext

from kvcopy.integrations.vllm import KVCopyDiskTier
from kvcopy.integrations.vllm.primary_region import RegionHost
from kvcopy.integrations.vllm.tiering import (
    HITS_LOADED,
    HITS_RECOMPUTED,
    PREDICTION_ERROR,
    TOKENS_RECOMPUTED,
    KVCopyTieringManager,
    KVCopyTieringSpec,
)

from helpers.vllm import (
    BLOCK_TOKENS,
    HEAD_DIM,
    PROMPT,
    SPEC_PATH,
    assert_blocks_hold,
    info_labels,
    metric_totals,
    prometheus_logger,
    write_profile,
)
from helpers.vllm_tiers import make_tiering_rig, record_calls

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

ROW_BYTES = 2 * 2 * BLOCK_TOKENS * 2 * 16 * 4  # a primary row: two layers of K and V, 16 tokens x 2 heads x 16 x fp32
OTHER = [(3 * i + 7) % 250 for i in range(9 * BLOCK_TOKENS)]  # a prompt of its own (no shared prefix)


def disk_tier(tmp_path) -> dict:
    return {
        "type": "KVCopyDiskTier",
        "module_path": "kvcopy.integrations.vllm",
        "path": str(tmp_path / "tier"),
        "bytes_to_use": 1 << 22,
    }


def kvcopy_rig(tmp_path, *, tiers=None, blocks_per_chunk: int = 1, head_dim: int = HEAD_DIM, **extra):
    """A CPU engine on kvcopy's spec with ``tiers`` (a KVCopyDiskTier by default) and ``extra`` keys."""
    tiers = tiers if tiers is not None else [disk_tier(tmp_path)]
    return make_tiering_rig(
        tmp_path,
        secondary_tiers=tiers,
        spec=SPEC_PATH,
        blocks_per_chunk=blocks_per_chunk,
        head_dim=head_dim,
        extra=extra,
    )


def profile(tmp_path, *, disk_s: float) -> str:
    """Host loads free, prefill at a kFLOP/s (recomputing is slow), and a disk read of ``disk_s`` a call."""
    return write_profile(
        tmp_path / f"disk_{disk_s:g}.json",
        "model",
        load_alpha_s=0.0,
        load_bytes_per_s=1e15,
        prefill_flops_per_s=1e3,
        disk=(disk_s, 1e15),
    )


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
@pytest.mark.parametrize("tier", ["kvcopy", "fs"])
def test_kvcopys_spec_with_tiers_round_trips_bitwise(tmp_path, blocks_per_chunk, tier):
    tiers = [disk_tier(tmp_path)] if tier == "kvcopy" else [{"type": "fs", "root_dir": str(tmp_path / "fs")}]
    rig = kvcopy_rig(tmp_path, tiers=tiers, blocks_per_chunk=blocks_per_chunk, kvcopy_policy="offload")
    try:
        assert isinstance(rig.worker_spec, KVCopyTieringSpec) and isinstance(rig.manager, KVCopyTieringManager)
        assert isinstance(rig.kv_worker.region, RegionHost)  # kvcopy's worker, over vLLM's region
        assert len(rig.kv_worker.region.engines) == blocks_per_chunk
        loads = record_calls(rig.tiers[0], "submit_load")
        tokens, hit = rig.reload_from_tiers(PROMPT)
        assert assert_blocks_hold(rig, "again", tokens, range(hit // BLOCK_TOKENS)) == 2 * hit // BLOCK_TOKENS
        assert len(loads) == 1  # the chunks came back from the tier
    finally:
        rig.close()
    assert not rig.region_left_behind


@pytest.mark.parametrize("writer", ["kvcopy", "vllm"])
def test_rows_one_worker_writes_are_the_rows_the_others_reads(tmp_path, writer):
    """An engine on one spec stores and cascades to vLLM's fs tier; an engine on the other loads from it:
    kvcopy's worker and vLLM's (the stand-in: vLLM's own descriptors) write and read vLLM's layout, bitwise."""
    fs = [{"type": "fs", "root_dir": str(tmp_path / "fs")}]

    def rig_of(spec: str):
        if spec == "kvcopy":
            return kvcopy_rig(tmp_path, tiers=fs, blocks_per_chunk=2, kvcopy_policy="offload")
        return make_tiering_rig(tmp_path, secondary_tiers=fs, blocks_per_chunk=2)

    rig = rig_of(writer)
    try:
        rig.add("first", PROMPT)
        rig.run()
        rig.drain()
    finally:
        rig.close()
    rig = rig_of("vllm" if writer == "kvcopy" else "kvcopy")
    try:
        tokens = [*PROMPT, 5, 6, 7]
        hit = len(PROMPT) // (2 * BLOCK_TOKENS) * 2 * BLOCK_TOKENS
        assert len(tokens) - hit in rig.rerun(tokens, keep_blocks=True)
        assert assert_blocks_hold(rig, "again", tokens, range(hit // BLOCK_TOKENS)) == 2 * hit // BLOCK_TOKENS
    finally:
        rig.close()


def stored_on_disk_and_in_host(rig) -> None:
    """PROMPT only on disk (cascaded, then the primary tier emptied); OTHER in the primary tier (and on disk)."""
    rig.store_cascade_evict(PROMPT)
    rig.add("other", OTHER)
    rig.run()
    rig.drain()
    rig.reset_prefix_cache(zero=True)


def in_primary(rig, tokens) -> list[bool]:
    context = ReqContext("probe")
    return [rig.manager.primary_tier.lookup(k, context) is LookupResult.HIT for k in rig.offload_keys(tokens)]


def judged_counts(rig) -> dict[str, dict]:
    """The judgment's counters (summed) and prediction errors (every sample) vLLM's stats collected, by label."""
    seen: dict[str, dict] = {}
    get_stats = rig.manager.get_stats

    def collecting():
        stats = get_stats()
        if stats is not None:
            for name, by_label in stats.metric_sections()[1].items():
                if name in (HITS_LOADED, HITS_RECOMPUTED, TOKENS_RECOMPUTED):
                    for labels, value in by_label.items():
                        seen.setdefault(name, {})[labels] = seen.get(name, {}).get(labels, 0) + value
                elif name == PREDICTION_ERROR:
                    for labels, values in by_label.items():
                        seen.setdefault(name, {}).setdefault(labels, []).extend(values)
        return stats

    rig.manager.get_stats = collecting
    return seen


def test_a_hit_only_on_a_slow_disk_is_never_promoted_while_a_host_hit_loads(tmp_path):
    rig = kvcopy_rig(tmp_path, kvcopy_profile=profile(tmp_path, disk_s=1e9), kvcopy_learn=False)
    try:
        counted = judged_counts(rig)
        stored_on_disk_and_in_host(rig)
        loads = record_calls(rig.tiers[0], "submit_load")
        assert all(in_primary(rig, OTHER)) and not any(in_primary(rig, PROMPT))
        tokens = [*PROMPT, 5, 6, 7]
        assert rig.rerun(tokens) == [len(tokens)]  # every token computed
        assert loads == []  # never promoted
        assert all(in_primary(rig, OTHER))  # no primary slot given up for it
        decision = rig.session.stats.decisions[-1]
        assert decision.action == "recompute" and decision.reason.startswith("none:")
        other = [*OTHER, 4, 5]
        rig.add("other again", other, max_tokens=4)
        rig.run_until_prefilled("other again")
        hit = len(OTHER) // BLOCK_TOKENS * BLOCK_TOKENS
        assert sum(f.get("other again", 0) for f in rig.forwards) == len(other) - hit  # the host hit loaded
        assert assert_blocks_hold(rig, "other again", other, range(hit // BLOCK_TOKENS)) == 2 * hit // BLOCK_TOKENS
        assert loads == []
        tier_label = next(iter(counted[HITS_RECOMPUTED]))
        assert "KVCopyDiskTier" in tier_label[0]
        assert counted[TOKENS_RECOMPUTED][tier_label] == len(PROMPT) // BLOCK_TOKENS * BLOCK_TOKENS
        assert sum(counted[HITS_LOADED].values()) >= 1
    finally:
        rig.close()


def test_a_hit_judged_worth_only_its_host_part_loads_that_and_promotes_nothing(tmp_path):
    """A hit whose first 3 chunks are in host RAM and the rest only on a slow disk: the Planner loads the host
    part and computes the rest; no promotion job reaches the disk tier, and the host part loads bitwise."""
    rig = kvcopy_rig(tmp_path, kvcopy_profile=profile(tmp_path, disk_s=1e9), kvcopy_learn=False)
    try:
        rig.store_cascade_evict(PROMPT)
        host_chunks = 3
        rig.add("warm", PROMPT[: host_chunks * BLOCK_TOKENS + 5])  # computed (the disk is slow), stored to host
        rig.run()
        rig.drain()
        rig.reset_prefix_cache(zero=True)
        assert in_primary(rig, PROMPT) == [True] * host_chunks + [False] * (len(PROMPT) // BLOCK_TOKENS - host_chunks)
        loads = record_calls(rig.tiers[0], "submit_load")
        tokens = [*PROMPT, 5, 6, 7]
        host = host_chunks * BLOCK_TOKENS
        assert len(tokens) - host in rig.rerun(tokens, keep_blocks=True)
        assert sum(f.get("again", 0) for f in rig.forwards) == len(tokens) - host  # the rest computed
        decision = rig.session.stats.decisions[-1]
        assert decision.request_id == "again" and decision.reason.startswith("host:")
        assert decision.prefix_tokens == host
        assert loads == []  # never promoted
        assert assert_blocks_hold(rig, "again", tokens, range(host_chunks)) == 2 * host_chunks
    finally:
        rig.close()


@pytest.mark.parametrize(
    ("keys", "why"),
    [({"disk_s": 0.0}, "a free disk read"), ({"disk_s": 1e9, "kvcopy_policy": "offload"}, "policy 'offload'")],
    ids=["fast_disk", "offload_policy"],
)
def test_a_disk_hit_worth_its_promotion_is_promoted_and_loads_bitwise(tmp_path, keys, why):
    policy = keys.get("kvcopy_policy", "auto")
    rig = kvcopy_rig(tmp_path, kvcopy_profile=profile(tmp_path, disk_s=keys["disk_s"]), kvcopy_policy=policy)
    try:
        counted = judged_counts(rig)
        stored_on_disk_and_in_host(rig)
        loads = record_calls(rig.tiers[0], "submit_load")
        tokens = [*PROMPT, 5, 6, 7]
        hit = len(PROMPT) // BLOCK_TOKENS * BLOCK_TOKENS
        assert len(tokens) - hit in rig.rerun(tokens, keep_blocks=True), why
        assert len(loads) == 1
        assert assert_blocks_hold(rig, "again", tokens, range(hit // BLOCK_TOKENS)) == 2 * hit // BLOCK_TOKENS
        assert rig.session.stats.decisions[-1].reason.startswith("all:")
        # judged at each step of its promotion (three at least), recorded and counted once
        assert len([d for d in rig.session.stats.decisions if d.request_id == "again"]) == 1
        assert sum(counted[HITS_LOADED].values()) == 1
        # the promotion's read was learned (the disk's line), and its prediction scored against it
        assert rig.session.live.online.num_observations["f2h nixl_posix"] == 1
        (errors,) = counted[PREDICTION_ERROR].values()
        assert len(errors) == 1 and errors[0] >= 0
    finally:
        rig.close()


def test_max_load_tokens_caps_what_is_promoted(tmp_path):
    rig = kvcopy_rig(tmp_path, kvcopy_policy="offload")
    try:
        rig.store_cascade_evict(PROMPT)
        tokens = [*PROMPT, 5, 6, 7]
        cap = 4 * BLOCK_TOKENS
        rig.add("again", tokens, max_tokens=4, kv_transfer_params={"max_load_tokens": cap})
        rig.run_until_prefilled("again")
        assert sum(f.get("again", 0) for f in rig.forwards) == len(tokens) - cap
        assert assert_blocks_hold(rig, "again", tokens, range(len(PROMPT) // BLOCK_TOKENS))
    finally:
        rig.close()


def test_max_load_tokens_counts_from_the_start_of_a_tier_hit_after_vllms_prefix_cache(tmp_path):
    """vLLM's prefix cache holds the first 2 blocks, so the tier hit starts at the third: ``max_load_tokens``
    caps the tokens loaded from there on (vLLM's own reading of it), not the tokens from the prompt's start."""
    rig = kvcopy_rig(tmp_path, kvcopy_policy="offload")
    try:
        rig.store_cascade_evict(PROMPT)
        cached = 2 * BLOCK_TOKENS
        rig.add("warm", PROMPT[: cached + 5])  # puts the first 2 blocks in vLLM's prefix cache
        rig.run()
        rig.drain()
        loads = record_calls(rig.tiers[0], "submit_load")
        tokens = [*PROMPT, 5, 6, 7]
        cap = 4 * BLOCK_TOKENS
        rig.add("again", tokens, max_tokens=4, kv_transfer_params={"max_load_tokens": cap})
        rig.run_until_prefilled("again")
        assert sum(f.get("again", 0) for f in rig.forwards) == len(tokens) - cached - cap
        keys = rig.offload_keys(PROMPT)
        assert [k for (job,) in loads for k in job.keys] == keys[2:6]  # the hit's 4 chunks, from the disk
        assert assert_blocks_hold(rig, "again", tokens, range((cached + cap) // BLOCK_TOKENS)) == 2 * 6
    finally:
        rig.close()


def test_kv_load_tiers_keeps_a_request_off_the_tiers_it_does_not_name(tmp_path):
    rig = kvcopy_rig(tmp_path, kvcopy_policy="offload")
    try:
        rig.store_cascade_evict(PROMPT)
        loads = record_calls(rig.tiers[0], "submit_load")
        tokens = [*PROMPT, 5, 6, 7]
        rig.add("again", tokens, max_tokens=4, kv_transfer_params={"kv_load_tiers": [{"medium": "cpu"}]})
        rig.run_until_prefilled("again")
        assert sum(f.get("again", 0) for f in rig.forwards) == len(tokens)  # the disk was not theirs to load from
        assert loads == []
    finally:
        rig.close()


@pytest.mark.parametrize(
    ("keys", "error", "message"),
    [
        ({"secondary_tiers": {"type": "fs"}}, TypeError, "secondary_tiers: expected a list"),
        ({"store_threshold": 2}, ValueError, "store_threshold: 2 is not supported"),
        ({"canonical_layout": True}, ValueError, "canonical_layout"),
        ({"secondary_tiers": [{"type": "nope"}]}, ValueError, "Unknown secondary tier type"),
        ({"kvcopy_polcy": "auto"}, ValueError, "kvcopy_polcy"),
        ({"cpu_bytes_to_use": None}, ValueError, "cpu_bytes_to_use"),
    ],
)
def test_bad_tiered_keys_are_named_at_build(tmp_path, keys, error, message):
    extra = {"secondary_tiers": [disk_tier(tmp_path)], **keys}
    with pytest.raises(error, match=message):
        make_tiering_rig(tmp_path, secondary_tiers=extra.pop("secondary_tiers"), spec=SPEC_PATH, extra=extra)


def test_the_disk_tier_is_a_kvcopy_disk_tier_under_kvcopys_spec(tmp_path):
    rig = kvcopy_rig(tmp_path)
    try:
        (tier,) = rig.tiers
        assert isinstance(tier, KVCopyDiskTier)
    finally:
        rig.close()


def primary_events(rig) -> list[tuple[str, int]]:
    """The primary tier's KV cache events vLLM's scheduler takes, as (kind, how many keys), in order."""
    seen: list[tuple[str, int]] = []
    take = rig.manager.primary_tier.take_events

    def taking():
        for event in take():
            seen.append(("removed" if event.removed else "stored", len(event.keys)))
            yield event

    rig.manager.primary_tier.take_events = taking
    return seen


def test_the_primary_tier_publishes_kv_cache_events_as_vllms_does(tmp_path):
    """The same stores, one evicting the other's chunks, under vLLM's spec and under kvcopy's: the same events
    from the primary tier, the eviction among them."""
    events = []
    for spec in (None, SPEC_PATH):
        rig = make_tiering_rig(
            tmp_path / str(bool(spec)), secondary_tiers=[], spec=spec, kv_events=True, cpu_bytes_to_use=12 * ROW_BYTES
        )
        try:
            seen = primary_events(rig)
            for name, prompt in (("first", PROMPT), ("other", OTHER)):  # 9 chunks each, in a primary tier of 12
                rig.add(name, prompt)
                rig.run()
                rig.drain()
            events.append(seen)
        finally:
            rig.close()
    vllms, kvcopys = events
    assert kvcopys == vllms
    assert ("removed", 6) in kvcopys  # the eviction is seen


@pytest.mark.parametrize(
    ("tier_keys", "error", "message"),
    [
        ({"bytes_to_use": 0}, ValueError, "bytes_to_use"),
        ({"bytes_to_use": "1G"}, TypeError, "bytes_to_use"),
        ({"backend": "nvme"}, ValueError, "backend"),
        ({"path": None}, ValueError, "path: required"),
        ({"byte_to_use": 1}, ValueError, "byte_to_use: not a key"),
    ],
)
def test_a_bad_disk_tier_key_is_refused_in_either_role_before_anything_is_made(tmp_path, tier_keys, error, message):
    """The worker's spec is built without the tiers (the scheduler's manager builds them): kvcopy's spec checks
    KVCopyDiskTier's keys itself, so a worker refuses them too, and nothing is made under the tier's path."""
    import dataclasses

    from kvcopy.integrations.vllm import KVCopyOffloadingSpec

    from helpers.disk_tier import offloading_spec

    tier = {k: v for k, v in {**disk_tier(tmp_path), **tier_keys}.items() if v is not None}
    config = dataclasses.replace(
        offloading_spec().config, extra_config={"cpu_bytes_to_use": 1 << 22, "secondary_tiers": [tier]}
    )
    with pytest.raises(error, match=message):
        KVCopyOffloadingSpec(config)
    assert not (tmp_path / "tier").exists()


def test_the_tiered_specs_metrics_reach_vllms_logger(tmp_path):
    """vLLM's frontend declares the metrics from ``KVCopyOffloadingSpec`` (the class the config names), which it
    never builds: a tiered config must declare the tiered spec's, the tiers' and the judgment's."""
    rig = kvcopy_rig(tmp_path, kvcopy_profile=profile(tmp_path, disk_s=0.0))
    try:
        registry = prometheus_logger(rig)
        stored_on_disk_and_in_host(rig)
        rig.rerun([*PROMPT, 5, 6, 7])
        totals = metric_totals(registry)
        chunks = len(PROMPT) // BLOCK_TOKENS  # one block a chunk
        assert totals["vllm:kv_offload_kvcopy_tier_hits_loaded_total"] == 1  # the judgment's, by tier
        assert totals["vllm:kv_offload_kvcopy_tier_prediction_error_count"] == 1
        assert totals["vllm:kv_offload_kvcopy_disk_loaded_blocks_total"] == chunks  # the tier's own
        assert totals["vllm:kv_offload_kvcopy_disk_stored_blocks_total"] >= chunks
        assert totals["vllm:kv_offload_tiering_chunk_hits_total"] >= chunks  # vLLM's tiering manager's
        assert any(labels.get("tier") for labels in info_labels(registry)), info_labels(registry)
        # the tier's own series, the judgment's and vLLM's tiering manager's carry one label for the tier
        tiers = {
            s.name: s.labels.get("tier")
            for family in registry.collect()
            for s in family.samples
            if s.name.endswith("_total") and any(part in s.name for part in ("kvcopy_disk", "tier_hits", "read_bytes"))
        }
        assert set(tiers.values()) == {"1:KVCopyDiskTier"}, tiers
    finally:
        rig.close()


def test_a_lookup_from_outside_the_scheduler_is_answered_and_not_judged(tmp_path):
    """vLLM's p2p tier serves a peer's lookups through the manager with a context of its own, whose keys the
    scheduler never placed: they are answered as vLLM's manager answers them, and no hit is judged."""
    rig = kvcopy_rig(tmp_path, kvcopy_profile=profile(tmp_path, disk_s=1e9), kvcopy_learn=False)
    try:
        stored_on_disk_and_in_host(rig)
        decisions = len(rig.session.stats.decisions)
        peer = ReqContext("p2p:peer")
        assert [rig.manager.lookup(k, peer) for k in rig.offload_keys(OTHER)] == [LookupResult.HIT] * (
            len(OTHER) // BLOCK_TOKENS
        )
        assert rig.manager.lookup(rig.offload_keys([*OTHER, *OTHER])[-1], peer) is LookupResult.MISS  # never stored
        assert len(rig.session.stats.decisions) == decisions
    finally:
        rig.close()


def test_a_tiers_read_is_costed_at_the_rows_it_reads(tmp_path):
    """A secondary tier reads whole rows of vLLM's region (every worker's slot, padded to 4 KiB), not the bytes
    one worker loads of a chunk: at 12 dims a head, a chunk is 6 KiB and its row 8 KiB."""
    disk_bytes_per_s = 1e6  # the read is all the prediction holds: loads and prefill are free
    free_but_the_disk = write_profile(
        tmp_path / "read.json",
        "model",
        load_alpha_s=0.0,
        load_bytes_per_s=1e18,
        prefill_flops_per_s=1e30,
        disk=(0.0, disk_bytes_per_s),
    )
    rig = kvcopy_rig(tmp_path, kvcopy_profile=free_but_the_disk, kvcopy_policy="offload", head_dim=12)
    try:
        stored_on_disk_and_in_host(rig)
        rig.rerun([*PROMPT, 5, 6, 7])
        decision = rig.session.stats.decisions[-1]
        chunks = len(PROMPT) // BLOCK_TOKENS
        assert decision.action == "reload" and decision.prefix_tokens == chunks * BLOCK_TOKENS
        assert decision.predicted_reload_s == pytest.approx(chunks * 8192 / disk_bytes_per_s, rel=1e-3)
    finally:
        rig.close()


@pytest.mark.parametrize(("medium", "learned"), [("STORAGE", 1), ("CPU", 0)])
def test_only_a_storage_tiers_promotions_teach_the_disks_line(tmp_path, medium, learned):
    """The Planner's one line for secondary tiers is the disk's: a tier in another medium (a peer's memory)
    would teach it another link's speed."""
    tier = {"type": "MemoryRowTier", "module_path": "helpers.vllm_tiers", "medium": medium}
    rig = kvcopy_rig(tmp_path, tiers=[tier], kvcopy_profile=profile(tmp_path, disk_s=0.0))
    try:
        stored_on_disk_and_in_host(rig)
        promotions = record_calls(rig.tiers[0], "submit_load")
        rig.rerun([*PROMPT, 5, 6, 7])
        assert len(promotions) == 1
        assert rig.session.live.online.num_observations.get("f2h nixl_posix", 0) == learned
    finally:
        rig.close()


def test_a_key_between_chunk_ends_is_not_judged_and_does_not_cut_a_hit(tmp_path):
    """vLLM places each chunk's key at the chunk's end; only a partial recurrent tail's boundary key (hybrid
    models, where a hash block is shorter than a chunk) lies between: it answers MISS, judged never, and a hit
    runs past it."""
    rig = kvcopy_rig(tmp_path, kvcopy_policy="offload")
    try:
        stored_on_disk_and_in_host(rig)
        keys, tail = rig.offload_keys(OTHER), rig.offload_keys(PROMPT)[0]
        decisions = len(rig.session.stats.decisions)
        boundary = ReqContext("tail")
        boundary.set_offload_key_position(keys[0], BLOCK_TOKENS // 2)
        assert rig.manager.lookup(keys[0], boundary) is LookupResult.MISS
        assert len(rig.session.stats.decisions) == decisions
        hit = ReqContext("hit")
        for i in range(3):
            hit.set_offload_key_position(keys[i], (i + 1) * BLOCK_TOKENS)
        hit.set_offload_key_position(tail, 2 * BLOCK_TOKENS + BLOCK_TOKENS // 2)  # between the 2nd and 3rd ends
        assert rig.manager.lookup(keys[0], hit) is LookupResult.HIT
        assert rig.session.stats.decisions[-1].prefix_tokens == 3 * BLOCK_TOKENS
    finally:
        rig.close()
