"""The load-or-recompute judgment inside vLLM's scheduler: a hit the Planner predicts slower to load than to
recompute is refused (vLLM computes its tokens); the opposite is loaded; ``kvcopy_policy: "offload"`` loads
every hit. vLLM's real Scheduler and OffloadingConnector on the CPU (tests/helpers/vllm.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs it)")


from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext, make_offload_key

from kvcopy.integrations.common.online_planner import predict_paths
from kvcopy.integrations.vllm.manager import (
    COUNTERS,
    HITS_LOADED,
    HITS_RECOMPUTED,
    TOKENS_RECOMPUTED,
    request_hit,
)

from helpers.vllm import BLOCK_TOKENS, make_rig, write_profile

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

PROMPT = [(5 * i + 1) % 250 for i in range(160)]
TOKENS = [*PROMPT, 9, 8, 7]
HIT = len(PROMPT) // BLOCK_TOKENS * BLOCK_TOKENS
MAX_FORWARD_TOKENS = 512  # make_rig's max_batch_tokens: vLLM's forwards of at most this many tokens


def slow_load_profile(tmp_path) -> str:
    """Loading costs 10 s a call; prefill runs at a PFLOP/s: recomputing always wins."""
    return write_profile(
        tmp_path / "slow_load.json", "model", load_alpha_s=10.0, load_bytes_per_s=1e6, prefill_flops_per_s=1e15
    )


def fast_load_profile(tmp_path) -> str:
    """Loading is free; prefill runs at a kFLOP/s: loading always wins."""
    return write_profile(
        tmp_path / "fast_load.json", "model", load_alpha_s=0.0, load_bytes_per_s=1e15, prefill_flops_per_s=1e3
    )


def run_hit(tmp_path, extra) -> tuple[object, dict[str, int]]:
    """Stores PROMPT, drops vLLM's prefix cache, runs PROMPT + 3 tokens: the rig and the second run's forward."""
    rig = make_rig(tmp_path, extra=extra)
    rig.counted = count_reported(rig.manager)
    rig.store_and_reset(PROMPT)
    return rig, rig.rerun(TOKENS)


def count_reported(manager) -> dict[str, int]:
    """The judgment's counters summed over every stats report vLLM's scheduler collects (once a step)."""
    counted = dict.fromkeys(COUNTERS, 0)
    get_stats = manager.get_stats

    def reporting():
        stats = get_stats()
        _, values = stats.metric_sections()  # per metric: {label values: value}; these have no labels
        for name in COUNTERS:
            counted[name] += values.get(name, {}).get((), 0)
        return stats

    manager.get_stats = reporting
    return counted


def assert_counted(rig, *, loaded: int, recomputed: int, tokens: int) -> None:
    """vLLM's connector stats carried the judgment's counters (declared as metrics by the spec)."""
    assert rig.counted == {HITS_LOADED: loaded, HITS_RECOMPUTED: recomputed, TOKENS_RECOMPUTED: tokens}
    assert set(COUNTERS) <= set(type(rig.worker_spec).build_metric_definitions({}))


def test_a_hit_slower_to_load_than_to_recompute_is_computed(tmp_path):
    rig, computed = run_hit(tmp_path, {"kvcopy_profile": slow_load_profile(tmp_path), "kvcopy_learn": False})
    try:
        assert computed == [len(TOKENS)]  # no load: every token computed
        (decision,) = [d for d in rig.session.stats.decisions if d.request_id == "again"]
        assert decision.action == "recompute" and decision.prefix_tokens == HIT
        assert decision.predicted_reload_s > decision.predicted_recompute_s
        assert rig.session.stats.recomputed_requests == 1 and rig.session.stats.reloaded_requests == 0
        assert rig.kv_worker.engine.num_in_flight == 0
        assert_counted(rig, loaded=0, recomputed=1, tokens=HIT)
    finally:
        rig.close()


def test_the_same_hit_is_loaded_when_loading_is_faster(tmp_path):
    rig, computed = run_hit(tmp_path, {"kvcopy_profile": fast_load_profile(tmp_path), "kvcopy_learn": False})
    try:
        assert computed == [len(TOKENS) - HIT]
        (decision,) = [d for d in rig.session.stats.decisions if d.request_id == "again"]
        assert decision.action == "reload" and decision.predicted_reload_s < decision.predicted_recompute_s
        assert "planner (calibrated)" in decision.reason
        assert rig.session.stats.reloaded_requests == 1
        assert_counted(rig, loaded=1, recomputed=0, tokens=0)
    finally:
        rig.close()


def test_policy_offload_loads_every_hit(tmp_path):
    rig, computed = run_hit(tmp_path, {"kvcopy_profile": slow_load_profile(tmp_path), "kvcopy_policy": "offload"})
    try:
        assert computed == [len(TOKENS) - HIT]
        (decision,) = [d for d in rig.session.stats.decisions if d.request_id == "again"]
        assert decision.action == "reload" and decision.reason == "policy 'offload'"
        assert decision.predicted_reload_s > decision.predicted_recompute_s  # predicted all the same
    finally:
        rig.close()


def test_the_tokens_in_vllms_prefix_cache_before_the_hit_reach_the_planner(tmp_path, monkeypatch):
    """A request whose first 2 blocks vLLM's own prefix cache holds: the hit starts at its third block, and the
    judgment prices the hit after those 32 tokens (attention over them is paid on both paths)."""
    rig = make_rig(tmp_path, extra={"kvcopy_profile": fast_load_profile(tmp_path), "kvcopy_learn": False})
    try:
        session = rig.session
        asked: dict[str, dict] = {}
        decide = session.decide

        def recording(request_id, **kwargs):
            asked[request_id] = kwargs
            return decide(request_id, **kwargs)

        monkeypatch.setattr(session, "decide", recording)
        rig.store_and_reset(PROMPT)
        cached_blocks = 2
        rig.add("warm", PROMPT[: cached_blocks * BLOCK_TOKENS + 5])  # puts the first 2 blocks in vLLM's prefix cache
        rig.run()
        assert rig.rerun(TOKENS) == [len(TOKENS) - HIT]  # the rest of the hit was loaded
        cached = cached_blocks * BLOCK_TOKENS
        assert asked["again"]["cached_tokens"] == cached == 32
        assert asked["again"]["prefix_tokens"] == HIT - cached
        (decision,) = [d for d in session.stats.decisions if d.request_id == "again"]
        planner, _ = session.live.current()
        expected = predict_paths(
            planner, HIT - cached, decision.new_tokens, decision.reload_nbytes, MAX_FORWARD_TOKENS, cached_tokens=cached
        )
        assert (decision.predicted_reload_s, decision.predicted_recompute_s) == expected
    finally:
        rig.close()


def test_the_judgment_is_made_once_a_step_and_again_the_next(tmp_path):
    """A refused request answers MISS for every key in that step; the next step judges it afresh."""
    rig = make_rig(tmp_path, extra={"kvcopy_profile": slow_load_profile(tmp_path), "kvcopy_learn": False})
    try:
        manager = rig.manager
        context = ReqContext(req_id="r")
        keys = [make_offload_key(bytes([i]) * 8, 0) for i in range(3)]
        for i, key in enumerate(keys):
            context.set_offload_key_position(key, (i + 1) * BLOCK_TOKENS)
        assert [manager.lookup(k, context).name for k in keys] == ["MISS"] * 3  # nothing stored: nothing judged
        assert rig.session.stats.decisions == []
        stored = manager.prepare_store(keys, context)
        manager.complete_store(stored.keys_to_store, context)
        assert [manager.lookup(k, context).name for k in keys] == ["MISS"] * 3  # refused, judged once
        assert len(rig.session.stats.decisions) == 1
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        assert manager.lookup(keys[0], context).name == "MISS"
        assert [d.prefix_tokens for d in rig.session.stats.decisions] == [3 * BLOCK_TOKENS] * 2
    finally:
        rig.close()


@pytest.mark.parametrize(
    ("stored", "expected"),
    [((0, 1, 2, 3), (0, 64, 64)), ((1, 2), (16, 48, 64)), ((1, 3), (16, 32, 64)), ((3,), (48, 64, 64))],
)
def test_request_hit_reads_the_run_of_stored_chunks_from_the_first_key(stored, expected):
    context = ReqContext(req_id="r")
    keys = [make_offload_key(bytes([i]) * 8, 0) for i in range(4)]
    for i, key in enumerate(keys):
        context.set_offload_key_position(key, (i + 1) * BLOCK_TOKENS)
    other_group = make_offload_key(b"x" * 8, 1)
    context.set_offload_key_position(other_group, 999)
    first = keys[stored[0]]
    assert request_hit(first, context, lambda k: keys.index(k) in stored, BLOCK_TOKENS) == expected
