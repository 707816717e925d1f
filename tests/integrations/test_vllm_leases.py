"""Leases on vLLM's host tier (kvcopy.integrations.vllm.agents.leases) over vLLM's own LRU and ARC policies."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs it)")

from vllm.v1.kv_offload.base import OffloadKey, ReqContext
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy
from vllm.v1.kv_offload.cpu.policies.base import CachePolicy, ChunkStatus
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

from kvcopy.integrations.vllm.agents.leases import STORE_WINDOW_S, LeasedPolicy

POLICIES = {"lru": LRUCachePolicy, "arc": ARCCachePolicy}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def key(i: int) -> OffloadKey:
    return OffloadKey(i.to_bytes(8, "little"))


def filled(name: str, capacity: int, **bounds: float) -> tuple[LeasedPolicy, Clock]:
    """A policy of ``capacity`` chunks, every one stored and idle, key(0) the least recently used."""
    clock = Clock()
    inner: CachePolicy = POLICIES[name](cache_capacity=capacity)
    policy = LeasedPolicy(inner, clock=clock, **{"max_leased_fraction": 1.0, "max_session_fraction": 1.0, **bounds})
    for i in range(capacity):
        chunk = ChunkStatus(i)
        chunk.ref_cnt = 0
        policy.insert(key(i), chunk, ReqContext(req_id=f"r{i}"))
        policy.touch([key(i)], ReqContext(req_id=f"r{i}"))
    return policy, clock


def evicted(policy: LeasedPolicy, n: int, protected: set[OffloadKey] | None = None) -> list[int] | None:
    out = policy.evict(n, protected or set())
    return None if out is None else sorted(int.from_bytes(k, "little") for k, _ in out)


@pytest.fixture(params=sorted(POLICIES))
def name(request: pytest.FixtureRequest) -> str:
    return request.param


def test_leased_chunks_are_skipped_while_others_can_go(name: str) -> None:
    policy, _ = filled(name, 10)
    assert evicted(policy, 0) == []
    assert policy.lease("s", [key(0), key(1), key(2)], until=100.0) == 3
    assert evicted(policy, 3) == [3, 4, 5]  # the least recently used after the leased ones
    assert policy.leased("s") == 3 and policy.displaced == 0


def test_a_lease_never_keeps_a_request_from_room(name: str) -> None:
    policy, _ = filled(name, 10)
    policy.lease("near", [key(0), key(1)], until=50.0)
    policy.lease("far", [key(2), key(3)], until=100.0)
    # 6 chunks are not leased; 8 are needed: the lease nearest its end gives way, the other holds
    assert evicted(policy, 8) == [0, 1, 4, 5, 6, 7, 8, 9]
    assert policy.leased("near") == 0 and policy.leased("far") == 2 and policy.displaced == 1
    assert evicted(policy, 2) == [2, 3]  # and then the other, rather than refuse
    assert policy.displaced == 2


def test_an_eviction_that_cannot_be_met_changes_nothing(name: str) -> None:
    policy, _ = filled(name, 4)
    policy.lease("s", [key(0)], until=100.0)
    assert evicted(policy, 4, protected={key(3)}) is None
    assert policy.leased("s") == 1 and policy.displaced == 0
    assert all(policy.get(key(i)) is not None for i in range(4))


def test_an_expired_lease_protects_nothing(name: str) -> None:
    policy, clock = filled(name, 6)
    policy.lease("s", [key(0), key(1)], until=10.0)
    clock.now = 10.0
    assert evicted(policy, 2) == [0, 1]
    assert policy.expired == 1 and policy.displaced == 0 and policy.lease_end("s") is None


def test_leases_are_bounded_in_all_and_per_session(name: str) -> None:
    policy, _ = filled(name, 100, max_leased_fraction=0.5, max_session_fraction=0.1)
    assert policy.lease("big", [key(i) for i in range(20)], until=1.0) == 10  # the leading chunks, to its share
    assert policy.keys_of("big") == tuple(key(i) for i in range(10))
    for s in range(4):
        assert policy.lease(f"s{s}", [key(20 + 10 * s + i) for i in range(10)], until=1.0) == 10
    assert policy.room("late") == 0 and policy.lease("late", [key(99)], until=1.0) == 0
    assert policy.leased() == 50
    policy.release("big")
    assert policy.room("late") == 10


def test_a_session_lease_replaces_its_earlier_one(name: str) -> None:
    policy, _ = filled(name, 10)
    policy.lease("s", [key(0), key(1)], until=5.0)
    policy.lease("s", [key(2)], until=9.0)
    assert policy.keys_of("s") == (key(2),) and policy.lease_end("s") == 9.0
    assert evicted(policy, 2) == [0, 1]


def test_demoted_chunks_go_first(name: str) -> None:
    policy, _ = filled(name, 10)
    policy.lease("other", [key(9)], until=100.0)
    policy.demote([key(7), key(8), key(9)])  # key(9) is another session's lease: it stays leased
    assert evicted(policy, 3) == [0, 7, 8]
    assert policy.get(key(7)) is None and policy.get(key(9)) is not None


def test_a_chunk_being_read_is_not_demoted_out(name: str) -> None:
    policy, _ = filled(name, 6)
    policy.demote([key(5)])
    chunk = policy.get(key(5))
    assert chunk is not None
    policy.mark_non_evictable(key(5))
    chunk.ref_cnt = 1  # a load in flight reads it
    assert evicted(policy, 1) == [0]


def test_bad_bounds_are_named() -> None:
    with pytest.raises(ValueError, match="max_leased_fraction"):
        LeasedPolicy(LRUCachePolicy(cache_capacity=4), max_leased_fraction=1.5)
    with pytest.raises(TypeError, match="max_session_fraction"):
        LeasedPolicy(LRUCachePolicy(cache_capacity=4), max_session_fraction="0.1")  # type: ignore[arg-type]


def test_a_chunk_evicted_lately_and_stored_again_is_told_as_reused(name: str) -> None:
    """What prices a lease: a key among the last ``cache_capacity`` evicted that comes back is told once; a new
    key, or one evicted more than a capacity's worth of evictions ago, is not."""
    policy, _ = filled(name, 4)
    reused: list[int] = []
    policy.on_reuse = lambda k: reused.append(int.from_bytes(k, "little"))

    def store(i: int) -> None:
        evicted(policy, 1)  # (room for it, as the CPU manager makes before it stores)
        chunk = ChunkStatus(i)
        chunk.ref_cnt = 0
        policy.insert(key(i), chunk, ReqContext(req_id=f"r{i}"))

    gone = evicted(policy, 2)
    assert gone is not None and len(gone) == 2
    store(gone[0])  # back after two later evictions' room: reused
    store(100)  # never held: not
    assert reused == [gone[0]]
    for i in range(101, 106):  # five more evictions: more than the capacity's worth since gone[1] went
        store(i)
    store(gone[1])
    assert reused == [gone[0]]


def test_lru_keeps_a_chunk_for_as_long_as_the_tier_takes_to_store_what_it_holds_outside_the_leases(name: str) -> None:
    clock = Clock()
    policy = LeasedPolicy(POLICIES[name](cache_capacity=10), clock=clock)
    assert policy.lru_s() == math.inf  # a tier that stored nothing evicts nothing: no lease is needed
    policy, clock = filled(name, 10)  # 10 chunks stored at t=0
    clock.now = 5.0
    assert policy.lru_s() == pytest.approx(10 / (10 / 5.0))  # 2 chunks a second, 10 held: 5 s
    policy.lease("s", [key(0), key(1)], until=100.0)
    assert policy.lru_s() == pytest.approx(8 / 2.0)  # what the leases hold is not LRU's
    clock.now = 5.0 + STORE_WINDOW_S + 1.0
    assert policy.lru_s() == math.inf  # the window has passed: nothing stored lately
