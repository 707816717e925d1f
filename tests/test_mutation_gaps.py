"""Four behaviours that seeded bugs got past the suite with (issue [netns], part 3): each is asserted here.

- The engine's per-block ordering keeps a later writer of a host block when an earlier one finishes.
- ``OffloadSession.reserve`` over two allocators is all or none.
- A peer descriptor of a newer format is refused by name.
- ``threshold_tokens(from_peer=True)`` equals a brute-force scan above 4096 tokens, where it bisects.
"""

from __future__ import annotations

import time

import pytest
import torch
from test_planner_fetch import brute_fetch_threshold, planner

import kvcopy
from kvcopy.integrations.common.live_planner import LivePlanner
from kvcopy.integrations.common.offload_session import OffloadSession

from helpers.copies import assert_same_bytes, dst_bytes, fill_random_, make_layout, reference_copy

# How long the test gives an unordered reload to run (and so read the wrong bytes) while B is held: it
# only needs to be long enough to catch the bug most of the time; the right ordering passes whatever it is.
UNORDERED_GRACE_S = 0.3


def test_a_later_writer_of_a_host_block_is_waited_for_after_an_earlier_one_finishes(engines, monkeypatch):
    """Offload A into host 3, then B into host 3 (held); once A is done, a reload of host 3 still waits for
    B, and reads B's bytes."""
    gen = torch.Generator().manual_seed(3)
    kv = make_layout("vllm", 12, torch.bfloat16, gen, num_layers=2)
    pool = kvcopy.HostKVPool(kv, 8, pin_memory=False)
    fill_random_(pool, gen)
    eng = engines(kv, pool)
    gate = engines.gate(monkeypatch, hold=lambda src, dst: src is eng.kv)  # offloads wait at the gate
    expected = reference_copy(kv, [5], kv, [9])  # device 5 reaches device 9 through host 3
    a = eng.offload([4], [3])
    b = eng.offload([5], [3])  # write after write: runs after A
    gate.release(1)  # A only
    a.wait()
    gate.wait_held(1)  # B is at the gate: A finished, B still writes host 3 (the case under test)
    back = eng.reload([3], [9])
    deadline = time.monotonic() + UNORDERED_GRACE_S
    while not back.done() and time.monotonic() < deadline:  # a reload that forgot B would finish now
        time.sleep(0.01)
    assert not b.done()
    gate.open()
    back.wait()
    assert b.done()
    assert_same_bytes(dst_bytes(kv), expected)


def test_reserve_over_two_allocators_is_all_or_none():
    gen = torch.Generator().manual_seed(4)
    caches = {
        "full_attention": make_layout("vllm", 8, torch.bfloat16, gen, num_layers=2),
        "sliding_attention": make_layout("vllm", 8, torch.bfloat16, gen, num_layers=1),
    }
    session = OffloadSession(
        host_bytes=sum(16 * kv.nbytes_per_block for kv in caches.values()),
        policy="offload",
        live=LivePlanner(None, None, learn=False),
        method="auto",
        profile=None,
    )
    try:
        pools = session.pools_for(caches)
        first, second = pools["full_attention"], pools["sliding_attention"]
        assert session.reserve({"sliding_attention": second.num_free}) is not None  # the second pool is full
        free_before = first.num_free
        assert session.reserve({"full_attention": 1, "sliding_attention": 1}) is None
        assert first.num_free == free_before  # nothing taken from the first pool either
    finally:
        session.close()


def test_a_descriptor_of_a_newer_format_is_refused_by_name():
    from kvcopy.remote import descriptor

    layout = descriptor.PoolLayout("peer-a", "page_first", 4, ((4096, 512, 512, "bfloat16"),), None)
    data = bytearray(descriptor.encode(layout, b"metadata"))
    data[4:8] = (descriptor.DESCRIPTOR_FORMAT + 1).to_bytes(4, "little")
    with pytest.raises(ValueError, match=rf"remote_descriptor: format {descriptor.DESCRIPTOR_FORMAT + 1}, this"):
        descriptor.decode(bytes(data))
    assert descriptor.decode(descriptor.encode(layout, b"metadata")) == (layout, b"metadata")  # the format it reads


@pytest.mark.parametrize(("fetch_alpha_s", "limit"), [(0.2, 8192), (0.5, 16384)])
def test_the_fetch_threshold_above_4096_tokens_matches_a_brute_force_scan(fetch_alpha_s, limit):
    p = planner(fa=fetch_alpha_s)  # a link so slow per read that fetching pays only beyond 4096 tokens
    threshold = p.threshold_tokens(max_tokens=limit, from_peer=True)
    assert threshold is not None and threshold > 4096  # in the geometric grid, where the bisection runs
    assert threshold == brute_fetch_threshold(p, limit)
