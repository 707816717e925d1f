"""Agents' pauses in kvcopy's vLLM specs (kvcopy.integrations.vllm.agents), under vLLM's real Scheduler and
tiering manager on the CPU (tests/helpers/vllm_tiers.py).

What is checked (the tiered spec unless said): a hinted session whose chunks LRU would evict while other
requests run comes back to a host hit, loaded bitwise, where agents "off" recomputes it; ``done`` frees the
session's chunks at once; malformed hints in both carriers are served, ignored and counted by kind; without
hints, a resume is found by prefix continuation and its gap learned; agents "off" builds no pauses and leaves
the host tier's policy vLLM's own; a demoted session's prefetch lands before its resume, a resume during it
waits on it without a second read, one never used is let go; leases hold no more than their share and a burst
still gets room; the untiered spec leases too.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs it)")
pytest.importorskip("nixl_cu13", reason="NIXL is part of the test install (pip install 'kvcopy[nixl]')")

from vllm.v1.kv_hints.protocol import KvHintAction, KvHintsEnvelope
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from kvcopy.agents import PausePlan
from kvcopy.integrations.vllm.agents.leases import LeasedPolicy
from kvcopy.integrations.vllm.agents.pauses import HINT_FAULTS, PAUSES, PREFETCHES, RESUMES
from kvcopy.integrations.vllm.manager import KVCopyOffloadingManager

from helpers.vllm import (
    BLOCK_TOKENS,
    PROMPT,
    SPEC_PATH,
    assert_blocks_hold,
    make_rig,
    metric_totals,
    prometheus_logger,
    write_profile,
)
from helpers.vllm_tiers import make_tiering_rig, record_calls

pytestmark = [pytest.mark.engine, pytest.mark.vllm]

ROW_BYTES = 2 * 2 * BLOCK_TOKENS * 2 * 16 * 4  # a primary row: two layers of K and V, 16 tokens x 2 heads x 16 x fp32
CHUNKS = len(PROMPT) // BLOCK_TOKENS  # PROMPT's complete chunks (one block each)
OTHER = [(3 * i + 7) % 250 for i in range(len(PROMPT))]
THIRD = [(5 * i + 11) % 250 for i in range(len(PROMPT))]
HINT = {"kvcopy": {"session": "s-17", "tool": "run_tests", "resume_in_s": 30.0}}


def agents_rig(
    tmp_path,
    *,
    agents: str = "auto",
    primary_chunks: int = 2 * CHUNKS + 2,
    disk_s: float = 1e9,
    measured: bool = True,
    plan_delay_s: float = 0.0,
    **extra,
):
    """kvcopy's tiered spec over a KVCopyDiskTier whose reads take ``disk_s`` a call (by default far slower than
    recomputing: a chunk not in host RAM is computed), with a host tier of ``primary_chunks`` chunks that one
    session may lease whole; ``measured``: its reuse taken as measured (:func:`reuse_measured`);
    ``plan_delay_s``: how long a pause waits for its plan (0: planned as it begins, which is what most tests
    here look at; the delay has tests of its own)."""
    profile = write_profile(
        tmp_path / f"disk_{disk_s:g}.json",
        "model",
        load_alpha_s=0.0,
        load_bytes_per_s=1e15,
        prefill_flops_per_s=1e3,
        disk=(disk_s, 1e15),
    )
    tier = {"type": "KVCopyDiskTier", "module_path": "kvcopy.integrations.vllm", "path": str(tmp_path / "tier")}
    rig = make_tiering_rig(
        tmp_path,
        secondary_tiers=[{**tier, "bytes_to_use": 1 << 22}],
        spec=SPEC_PATH,
        cpu_bytes_to_use=primary_chunks * ROW_BYTES,
        extra={
            "kvcopy_profile": profile,
            "kvcopy_learn": False,
            "kvcopy_agents": agents,
            "kvcopy_agent_max_leased_fraction": 1.0,
            "kvcopy_agent_max_session_fraction": 1.0,
            **extra,
        },
    )
    if rig.manager.pauses is not None:
        rig.manager.pauses.plan_delay_s = plan_delay_s
        if measured:
            reuse_measured(rig)
    return rig


def reuse_measured(rig) -> None:
    """The host tier's reuse taken as measured, and none: as after a capacity's worth of evictions that nothing
    asked for again. Holding is then free, and a hinted pause leases to its cap. (A fresh tier prices holding at
    its store rate until then: the test of that is test_holding_is_priced_at_the_store_rate_until_...)"""
    policy = rig.manager.pauses.policy
    policy.evicted = policy.cache_capacity


def counted(rig) -> dict[str, dict]:
    """The agents' counters vLLM's stats collected from now on, summed by label."""
    seen: dict[str, dict] = {}
    get_stats = rig.manager.get_stats

    def collecting():
        stats = get_stats()
        if stats is not None:
            for name, by_label in stats.metric_sections()[1].items():
                if name in (PAUSES, RESUMES, HINT_FAULTS, PREFETCHES):
                    for labels, value in by_label.items():
                        seen.setdefault(name, {})[labels] = seen.get(name, {}).get(labels, 0) + value
        return stats

    rig.manager.get_stats = collecting
    return seen


def in_primary(rig, tokens) -> list[bool]:
    context = ReqContext("probe")
    return [rig.manager.primary_tier.lookup(k, context) is LookupResult.HIT for k in rig.offload_keys(tokens)]


def run_one(rig, request_id: str, tokens, params=None) -> None:
    rig.add(request_id, list(tokens), kv_transfer_params=params)
    rig.run()
    rig.drain()


def pause_then_crowd(rig, params) -> None:
    """Session s-17's turn over PROMPT pauses; two other prompts then need more host room than is free."""
    run_one(rig, "turn-1", PROMPT, params)
    for name, tokens in (("other", OTHER), ("third", THIRD)):
        run_one(rig, name, tokens)
    rig.reset_prefix_cache(zero=True)


@pytest.mark.parametrize("agents", ["auto", "off"])
def test_a_hinted_session_comes_back_to_a_host_hit_that_lru_would_have_evicted(tmp_path, agents):
    rig = agents_rig(tmp_path, agents=agents)
    try:
        seen = counted(rig)
        pause_then_crowd(rig, HINT)
        loads = record_calls(rig.tiers[0], "submit_load")
        tokens = [*PROMPT, 5, 6, 7]
        hit = CHUNKS * BLOCK_TOKENS
        rig.add("turn-2", tokens, max_tokens=4, kv_transfer_params=HINT)
        rig.run_until_prefilled("turn-2")
        computed = sum(f.get("turn-2", 0) for f in rig.forwards)
        assert loads == []  # never from the (slow) disk
        if agents == "off":
            assert rig.manager.pauses is None
            # LRU evicted the session's chunks, tails first (vLLM's order): only its first two loaded
            assert computed == len(tokens) - 2 * BLOCK_TOKENS
            return
        assert computed == len(tokens) - hit  # the leased chunks loaded from host RAM
        assert rig.manager.pauses.policy.leased("s-17") == 0  # the session is live: its lease ended at its resume
        assert assert_blocks_hold(rig, "turn-2", tokens, range(CHUNKS)) == 2 * CHUNKS
        assert sum(in_primary(rig, OTHER)) == 2  # the crowd's own chunks gave way
        rig.run()
        assert seen[PAUSES][("keep",)] >= 1
        assert seen[RESUMES][("host",)] == 1
    finally:
        rig.close()


def test_a_pause_shorter_than_lrus_keeping_leases_nothing_and_comes_back_to_a_host_hit(tmp_path):
    """A turn back at once (a forecast well inside what LRU keeps the chunks for) is left to LRU: no lease
    holds room from the others, and the resume is a host hit, counted as one."""
    rig = agents_rig(tmp_path)
    try:
        seen = counted(rig)
        quick = {"kvcopy": {"session": "s-17", "tool": "read_file", "resume_in_s": 0.001}}
        run_one(rig, "turn-1", PROMPT, quick)
        policy = rig.manager.pauses.policy
        assert policy.lru_s() > 1.0  # (a tier that stored a few chunks this second keeps them for seconds)
        assert policy.leased() == 0
        rig.reset_prefix_cache(zero=True)
        tokens = [*PROMPT, 5, 6, 7]
        rig.add("turn-2", tokens, max_tokens=4, kv_transfer_params=quick)
        rig.run_until_prefilled("turn-2")
        assert sum(f.get("turn-2", 0) for f in rig.forwards) == len(tokens) - CHUNKS * BLOCK_TOKENS
        rig.run()  # (turn-2 pauses in its turn, left to LRU too)
        assert seen[PAUSES] == {("keep",): 2} and seen[RESUMES] == {("host",): 1} and policy.leased() == 0
    finally:
        rig.close()


def test_a_session_back_within_the_plan_delay_is_never_planned(tmp_path, monkeypatch):
    """An agent's back-to-back turn ends its pause before the pause has waited PLAN_DELAY_S for its plan: no plan
    is computed (a few milliseconds of the scheduler's thread each), LRU keeps the chunks meanwhile, and the
    resume is a host hit, counted as one; no pause decision is counted."""
    from kvcopy.integrations.vllm.agents.pauses import PLAN_DELAY_S

    rig = agents_rig(tmp_path, plan_delay_s=PLAN_DELAY_S)
    try:
        pauses = rig.manager.pauses
        clock = Clock(1000.0)
        pauses.clock = pauses.policy.clock = pauses.tracker.clock = clock

        def planned(*args, **kwargs):
            raise AssertionError("a pause was planned")

        monkeypatch.setattr(pauses, "_plan", planned)
        seen = counted(rig)
        run_one(rig, "turn-1", PROMPT, HINT)
        assert "s-17" in pauses._waiting and pauses.policy.leased() == 0 and not pauses.due_now()
        clock.now += PLAN_DELAY_S / 2  # back before its plan is due
        tokens = [*PROMPT, 5, 6, 7]
        rig.add("turn-2", tokens, max_tokens=4, kv_transfer_params=HINT)
        rig.run_until_prefilled("turn-2")
        assert not pauses._waiting
        assert sum(f.get("turn-2", 0) for f in rig.forwards) == len(tokens) - CHUNKS * BLOCK_TOKENS
        rig.run()
        rig.drain()  # (turn-2 pauses in its turn, and waits for its plan)
        assert PAUSES not in seen and seen[RESUMES] == {("host",): 1}
    finally:
        rig.close()


def test_a_pause_that_outlasts_the_plan_delay_is_planned_by_the_step_that_reaches_it(tmp_path, monkeypatch):
    """The engine is asked to step once the plan is due (has_pending_work); that step plans the pause, and the
    lease's end counts from the pause's beginning, not from the plan."""
    from kvcopy.integrations.vllm.agents.pauses import PLAN_DELAY_S

    rig = agents_rig(tmp_path, plan_delay_s=PLAN_DELAY_S)
    try:
        pauses = rig.manager.pauses
        clock = Clock(1000.0)
        pauses.clock = pauses.policy.clock = pauses.tracker.clock = clock
        plans = []
        real = pauses._plan
        monkeypatch.setattr(pauses, "_plan", lambda *args, **kwargs: plans.append(real(*args, **kwargs)) or plans[-1])
        seen = counted(rig)
        run_one(rig, "turn-1", PROMPT, HINT)
        assert pauses.policy.leased() == 0 and not rig.manager.has_pending_work()
        clock.now += PLAN_DELAY_S
        assert rig.manager.has_pending_work()  # (the engine steps for it, with nothing to schedule)
        rig.step()
        (plan,) = plans
        assert plan.choice == "keep" and plan.leased and not pauses._waiting
        assert pauses.policy.leased("s-17") == CHUNKS
        assert pauses.policy.lease_end("s-17") == pytest.approx(1000.0 + plan.lease_end_s)
        rig.run()
        assert seen[PAUSES] == {("keep",): 1}
    finally:
        rig.close()


def test_an_idle_engines_pause_is_planned_by_the_timer(tmp_path):
    """Nothing steps an idle engine: the agents' timer plans a pause that has waited its delay, under the
    manager's lock."""
    import time

    from kvcopy.integrations.vllm.agents.pauses import PLAN_DELAY_S

    rig = agents_rig(tmp_path, plan_delay_s=PLAN_DELAY_S)
    try:
        pauses = rig.manager.pauses
        clock = Clock(1000.0)
        pauses.clock = pauses.policy.clock = pauses.tracker.clock = clock
        run_one(rig, "turn-1", PROMPT, HINT)
        assert pauses.policy.leased() == 0
        clock.now += PLAN_DELAY_S
        pauses._notify()  # (the timer sleeps at most a moment; woken, it reads the test's clock)
        waited = time.monotonic()  # (60 s bounds a hung timer, it is not a speed: the timer wakes within 0.5 s)
        while not pauses.policy.leased("s-17") and time.monotonic() - waited < 60.0:  # (the plan's outcome)
            time.sleep(0.01)
        assert not pauses._waiting and pauses.policy.leased("s-17") == CHUNKS
    finally:
        rig.close()


def test_done_frees_the_sessions_chunks_first(tmp_path):
    rig = agents_rig(tmp_path)
    try:
        seen = counted(rig)
        done = {"kvcopy": {"session": "s-17", "done": True}}
        run_one(rig, "turn-1", PROMPT, done)
        run_one(rig, "other", OTHER)
        assert all(in_primary(rig, PROMPT)) and rig.manager.pauses.policy.leased() == 0
        run_one(rig, "third", THIRD)
        # the crowd needed CHUNKS - 2 slots: the done session's chunks went, the other request's stayed
        assert not any(in_primary(rig, PROMPT)[: CHUNKS - 2]) and all(in_primary(rig, OTHER))
        assert seen[PAUSES][("done",)] == 1
    finally:
        rig.close()


def test_two_sessions_in_one_batch_keep_their_own_hints(tmp_path):
    rig = agents_rig(tmp_path)
    try:
        pauses = rig.manager.pauses
        seen = counted(rig)
        sessions = {"s-a": (PROMPT, 30.0), "s-b": (OTHER, 5.0)}
        for turn in (1, 2):  # each turn's two requests in one batch: both arrive before either finishes
            for session, (tokens, gap) in sessions.items():
                hint = {"kvcopy": {"session": session, "resume_in_s": gap}}
                rig.add(f"{session}-{turn}", [*tokens, *range(turn)], kv_transfer_params=hint)
            rig.run()
            rig.drain()
            for session, (tokens, gap) in sessions.items():
                pause = pauses.tracker.pause_of(session)
                assert pause is not None and (pause.request_id, pause.resume_in_s) == (f"{session}-{turn}", gap)
                held = pauses.policy.keys_of(session)
                assert held and set(held) <= set(rig.offload_keys(tokens))  # each session leases its own chunks
        assert seen[RESUMES][("host",)] == 2  # each second turn resumed its own session
    finally:
        rig.close()


def _frontend_request(request_id: str, sampling_params, kv_hints=None):
    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=list(PROMPT),
        mm_features=None,
        sampling_params=sampling_params,
        pooling_params=None,
        arrival_time=0.0,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
        kv_hints=kv_hints,
    )


def test_both_carriers_reach_the_spec_through_vllms_front_end_and_ipc(tmp_path):
    """The README's HTTP body, parsed by `vllm serve`'s own request model and made sampling parameters as its
    chat endpoint does, and a `kvcopy.pause` action in vLLM's hint envelope (AsyncLLM.generate's kv_hints):
    each sent through vLLM's engine-core IPC codec, each planned under its own session."""
    from vllm import SamplingParams
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    body = {
        "model": "model",
        "messages": [{"role": "user", "content": "run the tests"}],
        "kv_transfer_params": {"kvcopy": {"session": "s-17", "tool": "run_tests", "resume_in_s": 12.0}},
    }
    http = ChatCompletionRequest.model_validate(body).to_sampling_params(1, {})
    envelope = KvHintsEnvelope(
        protocol_version="1",
        message_id="m1",
        actions=[KvHintAction("a1", "kvcopy.pause", "1", {"session": "s-18", "tool": "grep", "resume_in_s": 2.0})],
    )
    rig = agents_rig(tmp_path)
    try:
        seen = counted(rig)
        rig.add_from_frontend(_frontend_request("http-1", http))
        rig.add_from_frontend(_frontend_request("hints-1", SamplingParams(max_tokens=1), envelope))
        rig.run()
        rig.drain()
        tracker = rig.manager.pauses.tracker
        for session, request_id, tool, gap in (("s-17", "http-1", "run_tests", 12.0), ("s-18", "hints-1", "grep", 2.0)):
            pause = tracker.pause_of(session)
            assert pause is not None and (pause.request_id, pause.tool, pause.resume_in_s) == (request_id, tool, gap)
        assert HINT_FAULTS not in seen and sum(seen[PAUSES].values()) == 2
    finally:
        rig.close()


@pytest.mark.parametrize(
    ("params", "hints", "kind"),
    [
        ({"kvcopy": {"session": "s", "resume_in_s": -1.0}}, None, "value"),
        ({"kvcopy": {"session": "s", "resume_in": 3.0}}, None, "unknown_key"),
        ({"kvcopy": {"session": ""}}, None, "empty_session"),
        ({"kvcopy": "s-17"}, None, "type"),
        (None, [KvHintAction("a1", "kvcopy.pause", "2", {"session": "s"})], "version"),
        (None, [KvHintAction("a1", "kvcopy.pause", "1", {"session": 17})], "type"),
    ],
    ids=["negative_gap", "unknown_key", "empty_session", "not_a_mapping", "action_version", "hint_session_type"],
)
def test_a_malformed_hint_is_served_ignored_and_counted(tmp_path, params, hints, kind):
    rig = agents_rig(tmp_path)
    try:
        seen = counted(rig)
        envelope = None if hints is None else KvHintsEnvelope(protocol_version="1", message_id="m1", actions=hints)
        rig.add("turn-1", list(PROMPT), kv_transfer_params=params, kv_hints=envelope)
        rig.run()
        rig.drain()
        assert rig.requests["turn-1"].is_finished()  # served
        assert rig.manager.pauses.policy.leased() == 0  # the hint ignored
        assert seen[HINT_FAULTS] == {(kind,): 1}
    finally:
        rig.close()


def test_without_hints_a_resume_is_learned_by_prefix_continuation(tmp_path):
    rig = agents_rig(tmp_path)
    try:
        pauses = rig.manager.pauses
        learned = record_calls(pauses.forecaster, "observe")
        run_one(rig, "turn-1", PROMPT)
        assert pauses.policy.leased() == 0  # a session not learned yet is LRU's
        run_one(rig, "unrelated", OTHER)
        turn2 = [*PROMPT, *range(1, 2 * BLOCK_TOKENS + 1)]
        run_one(rig, "turn-2", turn2)
        # turn-2 continued turn-1 (its prompt holds turn-1's last chunk): a resume, its gap learned
        assert len(learned) == 1 and learned[0][0] > 0
        assert pauses.policy.leased("~turn-1") > 0  # and the learned session's next pause is planned
        run_one(rig, "turn-3", [*turn2, 9, 9, 9])
        assert len(learned) == 2
    finally:
        rig.close()


def test_agents_off_leaves_vllms_policy_as_it_is(tmp_path):
    rig = agents_rig(tmp_path, agents="off")
    try:
        assert rig.manager.pauses is None
        assert not isinstance(rig.manager.primary_tier._policy, LeasedPolicy)
    finally:
        rig.close()


class Clock:
    """The pauses' clock, moved by the test (the leases', the tracker's and the prefetches' alike)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_reuse_that_prices_a_lease_is_kept_to_its_window_with_no_pause_planned(tmp_path):
    """An engine whose requests carry no hints plans no pause; the reuses it counts still stay within the last
    minute (they priced every lease over the run before: a list that only a plan trimmed)."""
    from kvcopy.integrations.vllm.agents.pauses import REUSE_WINDOW_S

    rig = agents_rig(tmp_path)
    try:
        pauses = rig.manager.pauses
        clock = Clock(1000.0)
        pauses.clock = clock
        pauses.policy.evicted = pauses.policy.cache_capacity  # (the reuses are measured: see the next test)
        keys = rig.offload_keys(PROMPT)
        for second in range(10 * int(REUSE_WINDOW_S)):
            clock.now = 1000.0 + second
            pauses.reused(keys[second % len(keys)])
        assert len(pauses._reuses) == int(REUSE_WINDOW_S) + 1  # the last minute's, ends included
        per_s = len(pauses._reuses) / REUSE_WINDOW_S
        assert pauses._reuse_rate() == pytest.approx(per_s / pauses.policy.cache_capacity)
    finally:
        rig.close()


def test_holding_is_priced_at_the_store_rate_until_the_tier_has_evicted_a_capacitys_worth(tmp_path):
    """Before the reuses are measured (a chunk counts as reused only while among the last capacity's worth
    evicted), every chunk the tier stores is taken to evict one that comes back: holding is priced at the store
    rate, the most the reuse rate can be. After, at the reuses seen: here none, so holding is free."""
    rig = agents_rig(tmp_path, measured=False)
    try:
        pauses = rig.manager.pauses
        policy = pauses.policy
        clock = Clock(1000.0)
        pauses.clock = policy.clock = pauses.tracker.clock = clock
        assert pauses._reuse_rate() == 0.0  # nothing stored yet
        priced = []
        for k in range(1, 8):  # distinct prompts, each its own chunks: nothing evicted comes back
            clock.now += 1.0
            run_one(rig, f"r{k}", [(k * i + 3 * k) % 250 for i in range(len(PROMPT))])
            if policy.evicted < policy.cache_capacity:
                priced.append(pauses._reuse_rate())
                assert priced[-1] == pytest.approx(policy.stored_per_s() / policy.cache_capacity)
        assert len(priced) >= 2 and min(priced) > 0.0
        assert policy.evicted >= policy.cache_capacity
        assert pauses._reuse_rate() == 0.0
    finally:
        rig.close()


def demoted_with_prefetch(rig, monkeypatch, *, at_s: float) -> Clock:
    """The pauses' clock made the test's, and every plan a demotion read back ``at_s`` after the pause (the plan
    itself is tests/agents/test_pause_plan.py's: here, what the engine does with one)."""
    pauses = rig.manager.pauses
    clock = Clock(1000.0)
    pauses.clock = pauses.policy.clock = pauses.tracker.clock = clock
    plan = PausePlan("demote", 600.0, at_s, 0.1, 1.0, 0.9, "demote, read back (the test's plan)")
    monkeypatch.setattr(pauses, "_plan", lambda *args, **kwargs: plan)
    return clock


def crowded_out(rig) -> None:
    """Session s-17's turn over PROMPT pauses (demoted: its chunks go first); two other prompts take its room."""
    pause_then_crowd(rig, HINT)
    assert not any(in_primary(rig, PROMPT))  # the demoted chunks went first
    assert all(in_primary(rig, OTHER)) and all(in_primary(rig, THIRD))


def test_a_demoted_sessions_prefetch_lands_before_its_resume(tmp_path, monkeypatch):
    rig = agents_rig(tmp_path, disk_s=0.0, primary_chunks=2 * CHUNKS)
    try:
        seen = counted(rig)
        clock = demoted_with_prefetch(rig, monkeypatch, at_s=5.0)
        crowded_out(rig)
        loads = record_calls(rig.tiers[0], "submit_load")
        rig.step()
        assert loads == []  # not due yet
        clock.now += 5.0
        assert rig.manager.has_pending_work()  # a prefetch due: the engine steps with no request
        rig.drain()
        assert len(loads) == 1 and all(in_primary(rig, PROMPT))  # read back into host RAM, and leased
        assert rig.manager.pauses.policy.leased("s-17") == CHUNKS
        tokens = [*PROMPT, 5, 6, 7]
        rig.add("turn-2", tokens, max_tokens=4, kv_transfer_params=HINT)
        rig.run_until_prefilled("turn-2")
        assert len(loads) == 1  # the resume's hit was in host RAM: no promotion of its own
        assert sum(f.get("turn-2", 0) for f in rig.forwards) == len(tokens) - CHUNKS * BLOCK_TOKENS
        assert assert_blocks_hold(rig, "turn-2", tokens, range(CHUNKS)) == 2 * CHUNKS
        rig.run()
        assert seen[RESUMES] == {("prefetch",): 1}
        assert seen[PREFETCHES] == {("started",): 1, ("in_time",): 1}
    finally:
        rig.close()


def test_a_resume_during_its_prefetch_waits_on_it_without_a_second_read(tmp_path, monkeypatch):
    rig = agents_rig(tmp_path, disk_s=0.0, primary_chunks=2 * CHUNKS)
    try:
        seen = counted(rig)
        clock = demoted_with_prefetch(rig, monkeypatch, at_s=5.0)
        crowded_out(rig)
        tier = rig.tiers[0]
        loads = record_calls(tier, "submit_load")
        finished, held = tier.get_finished_jobs, []
        release = False

        def withheld():  # the tier's read lands only when the test says so
            held.extend(finished())
            if not release:
                return []
            out = list(held)
            held.clear()
            return out

        monkeypatch.setattr(tier, "get_finished_jobs", withheld)
        clock.now += 5.0
        rig.step()
        assert len(loads) == 1  # the prefetch is in flight
        tokens = [*PROMPT, 5, 6, 7]
        rig.add("turn-2", tokens, max_tokens=4, kv_transfer_params=HINT)
        for _ in range(5):
            rig.step()
        assert sum(f.get("turn-2", 0) for f in rig.forwards) == 0  # waiting on the prefetch (HIT_PENDING)
        assert len(loads) == 1  # and no second read
        release = True
        rig.run_until_prefilled("turn-2")
        assert len(loads) == 1
        assert sum(f.get("turn-2", 0) for f in rig.forwards) == len(tokens) - CHUNKS * BLOCK_TOKENS
        assert assert_blocks_hold(rig, "turn-2", tokens, range(CHUNKS)) == 2 * CHUNKS
        rig.run()
        assert seen[PREFETCHES] == {("started",): 1, ("late",): 1}
    finally:
        rig.close()


def test_a_lease_holds_no_more_than_its_share(tmp_path):
    rig = agents_rig(tmp_path, kvcopy_agent_max_leased_fraction=0.5, kvcopy_agent_max_session_fraction=0.1)
    try:
        run_one(rig, "turn-1", PROMPT, HINT)
        policy = rig.manager.pauses.policy
        share = int(policy.cache_capacity * 0.1)
        assert 0 < policy.leased("s-17") == share < CHUNKS  # the leading chunks, to its share
        assert policy.keys_of("s-17") == tuple(rig.offload_keys(PROMPT)[:share])
    finally:
        rig.close()


def test_the_chunks_past_a_sessions_share_stay_lrus(tmp_path):
    """A session larger than its share leases its leading chunks; the rest are as recent as they are, not the
    first to go: a request that needs room takes it from older requests' chunks."""
    rig = agents_rig(tmp_path, kvcopy_agent_max_session_fraction=0.1)
    try:
        run_one(rig, "older", OTHER)
        run_one(rig, "turn-1", PROMPT, HINT)
        assert 0 < rig.manager.pauses.policy.leased("s-17") < CHUNKS
        run_one(rig, "small", THIRD[: 4 * BLOCK_TOKENS])  # 4 chunks: 2 slots free, 2 evicted
        assert all(in_primary(rig, PROMPT))  # the session's unleased tail stayed
        assert sum(in_primary(rig, OTHER)) == CHUNKS - 2  # LRU took the older request's
    finally:
        rig.close()


def test_a_burst_of_new_requests_still_gets_host_room(tmp_path):
    rig = agents_rig(tmp_path, primary_chunks=2 * CHUNKS)
    try:
        run_one(rig, "turn-1", PROMPT, HINT)
        policy = rig.manager.pauses.policy
        assert policy.leased("s-17") == CHUNKS
        burst = [*OTHER, *THIRD]  # as many chunks as the host tier holds: half of them only the lease can give
        run_one(rig, "burst", burst)
        # the host tier is the burst's: the lease gave way rather than keep a store from room
        assert all(in_primary(rig, burst))
        assert policy.displaced == 1 and policy.leased("s-17") == 0
    finally:
        rig.close()


def test_a_prefetch_whose_session_never_comes_back_is_counted_unused_and_let_go(tmp_path, monkeypatch):
    rig = agents_rig(tmp_path, disk_s=0.0, primary_chunks=2 * CHUNKS)
    try:
        seen = counted(rig)
        clock = demoted_with_prefetch(rig, monkeypatch, at_s=5.0)
        crowded_out(rig)
        clock.now += 5.0
        rig.drain()
        policy = rig.manager.pauses.policy
        assert policy.leased("s-17") == CHUNKS  # landed, and leased until the plan's end (600 s after the pause)
        clock.now += 600.0
        rig.step()
        assert policy.leased("s-17") == 0 and not rig.manager.pauses._prefetches
        assert seen[PREFETCHES] == {("started",): 1, ("unused",): 1}
    finally:
        rig.close()


@pytest.mark.parametrize("agents", ["auto", "off"])
def test_the_untiered_spec_leases_a_hinted_session_that_lru_would_have_evicted(tmp_path, agents):
    profile = write_profile(
        tmp_path / "profile.json", "model", load_alpha_s=0.0, load_bytes_per_s=1e15, prefill_flops_per_s=1e3
    )
    rig = make_rig(
        tmp_path,
        extra={
            "cpu_bytes_to_use": (2 * CHUNKS + 2) * ROW_BYTES,
            "kvcopy_profile": profile,
            "kvcopy_learn": False,
            "kvcopy_agents": agents,
            "kvcopy_agent_max_leased_fraction": 1.0,
            "kvcopy_agent_max_session_fraction": 1.0,
        },
    )
    try:
        assert isinstance(rig.manager, KVCopyOffloadingManager)
        assert (rig.manager.pauses is None) == (agents == "off")
        if agents == "auto":
            reuse_measured(rig)
            rig.manager.pauses.plan_delay_s = 0.0
        for name, tokens, params in (("turn-1", PROMPT, HINT), ("other", OTHER, None), ("third", THIRD, None)):
            rig.add(name, list(tokens), kv_transfer_params=params)
            rig.run()
        rig.drain()
        assert rig.scheduler.reset_prefix_cache()
        tokens = [*PROMPT, 5, 6, 7]
        rig.add("turn-2", tokens, max_tokens=4, kv_transfer_params=HINT)
        rig.run_until_prefilled("turn-2")
        computed = sum(f.get("turn-2", 0) for f in rig.forwards)
        # leased, the whole prompt loads from host RAM; without, LRU kept only its first two chunks
        assert computed == len(tokens) - (CHUNKS if agents == "auto" else 2) * BLOCK_TOKENS
        assert assert_blocks_hold(rig, "turn-2", tokens, range(CHUNKS if agents == "auto" else 2))
    finally:
        rig.close()


@pytest.mark.parametrize("tiered", [True, False], ids=["tiered", "untiered"])
def test_the_agents_metrics_reach_vllms_logger(tmp_path, tiered):
    """vLLM's frontend declares the metrics from the class the config names: both specs declare the agents'."""
    if tiered:
        rig = agents_rig(tmp_path)
    else:
        profile = write_profile(
            tmp_path / "profile.json", "model", load_alpha_s=0.0, load_bytes_per_s=1e15, prefill_flops_per_s=1e3
        )
        whole = {"kvcopy_agent_max_leased_fraction": 1.0, "kvcopy_agent_max_session_fraction": 1.0}
        rig = make_rig(tmp_path, extra={"cpu_bytes_to_use": 4 * CHUNKS * ROW_BYTES, "kvcopy_profile": profile, **whole})
        reuse_measured(rig)
        rig.manager.pauses.plan_delay_s = 0.0
    try:
        registry = prometheus_logger(rig)
        run_one(rig, "turn-1", PROMPT, HINT)
        run_one(rig, "bad", OTHER, {"kvcopy": {"session": "s", "resume_in": 1.0}})
        assert rig.scheduler.reset_prefix_cache()
        run_one(rig, "turn-2", [*PROMPT, 5, 6, 7], HINT)
        totals = metric_totals(registry)
        assert totals["vllm:kv_offload_kvcopy_agent_pauses_total"] == 2  # turn-1 and turn-2, each kept
        assert totals["vllm:kv_offload_kvcopy_agent_resumes_total"] == 1
        assert totals["vllm:kv_offload_kvcopy_agent_hint_faults_total"] == 1
        assert totals["vllm:kv_offload_kvcopy_agent_forecast_error_count"] == 1
        assert totals["vllm:kv_offload_kvcopy_agent_resumes_in_band_total"] == 1
        assert totals["vllm:kv_offload_kvcopy_agent_leased_bytes_total"] == 2 * CHUNKS * ROW_BYTES
        labels = {
            s.labels.get("decision")
            for family in registry.collect()
            for s in family.samples
            if "agent_pauses" in s.name
        }
        assert labels == {"keep"}
    finally:
        rig.close()


def test_a_pause_is_priced_from_the_profile_and_a_prefetch_timed_with_the_reads_margin(tmp_path, monkeypatch):
    from kvcopy.integrations.vllm.agents import pauses as module

    planned = []
    real = module.plan_pause
    monkeypatch.setattr(
        module, "plan_pause", lambda gaps, costs, **kw: planned.append(costs) or real(gaps, costs, **kw)
    )
    rig = agents_rig(tmp_path, disk_s=0.5)
    try:
        run_one(rig, "turn-1", PROMPT, HINT)
        (costs,) = planned
        assert costs.nbytes == CHUNKS * ROW_BYTES
        assert costs.tier_s == pytest.approx(0.5 + costs.host_s)  # the disk line's read, then the host load
        assert costs.read_s == pytest.approx(0.5 * (1 + module.PREFETCH_READ_MARGIN))  # a prefetch lands early
        assert costs.recompute_s > costs.tier_s  # prefill at a kFLOP/s: recomputing is dear
    finally:
        rig.close()
