"""KVCopyOffloadingConnector: the engine's own transfers and step timings reach the Planner's OnlineProfile,
and a failed copy becomes recomputation instead of vLLM's assertion. vLLM's real Scheduler on the CPU."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs it)")

from kvcopy.integrations.vllm import KVCopyOffloadingConnector

from helpers.vllm import BLOCK_TOKENS, before_copies, make_rig, write_profile

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

PROMPT = [(3 * i + 2) % 250 for i in range(120)]
TOKENS = [*PROMPT, 4, 5, 6]
HIT = len(PROMPT) // BLOCK_TOKENS * BLOCK_TOKENS


def connector_rig(tmp_path, load_failure_policy="fail", **extra):
    profile = write_profile(
        tmp_path / "fast_load.json", "model", load_alpha_s=0.0, load_bytes_per_s=1e15, prefill_flops_per_s=1e3
    )
    rig = make_rig(
        tmp_path,
        connector="KVCopyOffloadingConnector",
        extra={"kvcopy_profile": profile, **extra},
        load_failure_policy=load_failure_policy,
    )
    assert isinstance(rig.scheduler.connector, KVCopyOffloadingConnector)
    return rig


def store_reset_and_rerun(rig) -> list[int]:
    rig.store_and_reset(PROMPT)
    return rig.rerun(TOKENS)


def fail_copies(rig, direction: str) -> None:
    def fail() -> None:
        raise RuntimeError(f"injected {direction} failure")

    before_copies(rig.kv_worker, direction, fail)


def test_the_engines_transfers_and_steps_feed_the_planners_profile(tmp_path):
    rig = connector_rig(tmp_path)
    try:
        assert store_reset_and_rerun(rig) == [len(TOKENS) - HIT]
        counts = rig.session.live.online.num_observations
        method = next(k for k in counts if k.startswith("h2h "))  # "h2h <method>": host to host on the CPU
        assert counts[method] == 2  # the store and the load, by the worker's own measurement
        assert counts["prefill"] == 2  # the two forwards that computed tokens
        learned = rig.session.stats.profile
        assert learned.hardware["online"]["learned_online"] and learned.hardware["online"]["observations"] == counts
    finally:
        rig.close()


def test_learning_off_feeds_nothing(tmp_path):
    rig = connector_rig(tmp_path, kvcopy_learn=False)
    try:
        store_reset_and_rerun(rig)
        assert rig.session.live.online is None
    finally:
        rig.close()


def run_with_failed_load(rig):
    rig.store_and_reset(PROMPT)
    fail_copies(rig, "reload")
    return rig.rerun(TOKENS)


def test_a_failed_load_is_recomputed_under_vllms_recompute_policy(tmp_path, caplog):
    rig = connector_rig(tmp_path, load_failure_policy="recompute")
    try:
        assert run_with_failed_load(rig) == [len(TOKENS)]  # vLLM recomputed every token of the request
        assert "injected reload failure" in caplog.text
        assert rig.requests["again"].status.name == "FINISHED_LENGTH_CAPPED"
    finally:
        rig.close()


def test_a_failed_load_fails_the_request_under_vllms_default_policy(tmp_path):
    rig = connector_rig(tmp_path)
    try:
        assert run_with_failed_load(rig) == []  # never computed on invalid KV
        assert rig.requests["again"].status.name == "FINISHED_ERROR"
        rig.add("later", list(range(200, 240)))  # no stored prefix: nothing to load
        rig.run()  # the engine goes on serving
        assert rig.requests["later"].status.name == "FINISHED_LENGTH_CAPPED"
    finally:
        rig.close()


SYNC = {"sync_load_budget_bytes": 1 << 30}  # vLLM loads these hits inside the step, expedited


def test_an_expedited_load_is_loaded_within_the_step(tmp_path):
    rig = connector_rig(tmp_path, **SYNC)
    try:
        assert store_reset_and_rerun(rig) == [len(TOKENS) - HIT]
        # the forward that waited for the load is not learned as a forward: only the first request's is
        assert rig.session.live.online.num_observations["prefill"] == 1
    finally:
        rig.close()


def test_a_failed_expedited_load_is_recomputed(tmp_path, caplog):
    rig = connector_rig(tmp_path, load_failure_policy="recompute", **SYNC)
    try:
        computed = run_with_failed_load(rig)
        assert computed == [len(TOKENS) - HIT, len(TOKENS)]  # the step on invalid blocks is discarded, all recomputed
        assert "injected reload failure" in caplog.text
        assert rig.requests["again"].status.name == "FINISHED_LENGTH_CAPPED"
    finally:
        rig.close()


def test_a_failed_store_never_reads_as_stored(tmp_path):
    rig = connector_rig(tmp_path)
    try:
        fail_copies(rig, "offload")
        assert store_reset_and_rerun(rig) == [len(TOKENS)]  # no hit: the chunks were dropped
        assert rig.session.stats.decisions == []
    finally:
        rig.close()


def test_a_prompt_whose_store_failed_once_is_loadable_after_a_later_store_succeeds(tmp_path):
    """The failed store's keys are dropped once, not for ever: the same prompt stored again is a hit."""
    rig = connector_rig(tmp_path)
    try:
        engine = rig.kv_worker.engine
        copy = engine._copy
        fail_copies(rig, "offload")
        rig.add("failing", PROMPT)
        rig.run()
        rig.drain()
        assert rig.scheduler.reset_prefix_cache()
        engine._copy = copy  # stores work again
        rig.store_and_reset(PROMPT)  # the same prompt, stored again: its keys are the failed store's
        assert rig.rerun(TOKENS) == [len(TOKENS) - HIT]  # loaded: the hit was there
        (decision,) = [d for d in rig.session.stats.decisions if d.request_id == "again"]
        assert decision.action == "reload" and decision.prefix_tokens == HIT
        assert rig.session.stats.decisions[0].request_id == "again"  # the failed store never read as stored
    finally:
        rig.close()


def test_another_spec_is_refused(tmp_path):
    with pytest.raises(ValueError, match="spec_name: KVCopyOffloadingConnector runs KVCopyOffloadingSpec"):
        make_rig(tmp_path, connector="KVCopyOffloadingConnector", extra={"spec_name": "CPUOffloadingSpec"})


def test_copies_reported_without_a_completed_job_are_sent_once(tmp_path):
    from kvcopy.integrations.vllm.worker import CopyObservation

    rig = connector_rig(tmp_path)
    try:
        copy = CopyObservation("h2h", "cpu", 4096, 1, 1e-3)
        rig.kv_worker.copies.append(copy)  # finished (observed) before any job was reported complete
        sent = rig.worker.build_connector_worker_meta()
        assert sent.copies == [copy] and not sent.completed_jobs
        assert rig.worker.build_connector_worker_meta() is None  # not again
    finally:
        rig.close()
