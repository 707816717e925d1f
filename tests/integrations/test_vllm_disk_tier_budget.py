"""KVCopyDiskTier's stores of several identities under one ``path`` sharing ``bytes_to_use`` by use: a new
identity's store takes only the room that is free and grows as it fills; other identities' stores that no
engine holds give back their least recently used chunks when room is needed, the least recently used store
first, and go once empty; a store another engine holds is never changed by another engine, and two live
engines end up with their fair shares.

Identities differ here by ``cache_key_extra`` alone (another model, rope scaling or KV dtype make another
identity the same way: test_vllm_disk_tier.py). Which chunks a store that no engine holds keeps is read from
its commit log directly, never by opening it (that would make it held)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs it)")
pytest.importorskip("nixl_cu13", reason="NIXL is part of the test install (pip install 'kvcopy[nixl]')")
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from kvcopy.integrations.vllm.tiers.disk import store_hash
from kvcopy.integrations.vllm.tiers.stores import STORE_DIR
from kvcopy.storage.commit_log import CommitLog
from kvcopy.storage.files import DATA, INDEX, read_header

from helpers.disk_tier import NUM_ROWS, ROW_BYTES, engine_config, job, key, model_dir, primary, run, tier_of

REQUEST = ReqContext("r")
BUDGET = NUM_ROWS * ROW_BYTES  # eight chunks, every identity's together
# ext4 counts an extent-tree block in a file's allocated bytes once it has more than four extents
METADATA_SLACK = 4096


def identity_tier(path, rows, model: str, name: str):
    """A tier of identity ``name`` (its cache_key_extra) under ``path``, within BUDGET."""
    return tier_of(path, rows, engine_config(model), bytes_to_use=BUDGET, cache_key_extra=name)


def cascade(tier, rows, first: int, count: int = 1, seed: int = 0) -> dict[int, bytes]:
    """Stores chunks ``first`` .. ``first + count - 1``, one job each (through row 0), with distinct bytes;
    returns them by chunk, asserting each job succeeded."""
    data = {}
    for i in range(first, first + count):
        data[i] = rows.fill(0, seed=seed + i)
        assert run(tier, job([key(i)], [0], promotion=False)).success, i
    return data


def served(tier, rows, chunks) -> dict[int, bytes]:
    """The chunks of ``chunks`` the tier serves, promoted one by one through row 7 in the order given (each a
    use), with the bytes it loaded."""
    out = {}
    for i in chunks:
        if tier.lookup(key(i), REQUEST) is LookupResult.HIT:
            assert run(tier, job([key(i)], [7], promotion=True)).success, i
            out[i] = rows.rows[7].tobytes()
    return out


def held_chunks(folder: str) -> list[int] | None:
    """The chunks (of 0..99) the store in ``folder`` holds, least recently used first, from its log; None when
    the folder is gone."""
    path = os.path.join(folder, STORE_DIR)
    if not os.path.isdir(folder):
        return None
    log = CommitLog(os.path.join(path, INDEX), read_header(path)["num_blocks"], create=False)
    try:
        by_hash = {store_hash(key(i)): i for i in range(100)}
        return [by_hash[log.entry_at(slot).block_hash] for slot in log.least_recent(len(log))]
    finally:
        log.close()


def room_of(folder: str) -> int:
    """The store's room, in chunks, as its header counts it."""
    return read_header(os.path.join(folder, STORE_DIR))["room"]


def disk_bytes(folder: str) -> int:
    """Bytes the store's data file takes on the disk."""
    return os.stat(os.path.join(folder, STORE_DIR, DATA)).st_blocks * 512


def test_a_to_b_to_a_within_a_budget_that_holds_both_serves_a_bitwise(tmp_path):
    """An operator serves A, switches to B, and back to A: B takes only the room A left free, so A's chunks are
    all there, bitwise."""
    model, rows = model_dir(tmp_path), primary()
    with identity_tier(tmp_path / "tier", rows, model, "A") as tier:
        a = cascade(tier, rows, 0, 4, seed=100)
        a_folder = tier._tier_store.folder
    with identity_tier(tmp_path / "tier", rows, model, "B") as tier:
        assert held_chunks(a_folder) == [0, 1, 2, 3]  # a new identity takes nothing when it opens...
        assert room_of(a_folder) == 4 and tier.store.room == 0  # (A grew as it filled)
        b = cascade(tier, rows, 10, 4, seed=200)
        assert held_chunks(a_folder) == [0, 1, 2, 3]
        assert tier.store.room == 4  # ... and the free room as it fills
        b_folder = tier._tier_store.folder
    with identity_tier(tmp_path / "tier", rows, model, "A") as tier:
        assert served(tier, rows, range(4)) == a
    with identity_tier(tmp_path / "tier", rows, model, "B") as tier:
        assert served(tier, rows, range(10, 14)) == b
    assert room_of(a_folder) + room_of(b_folder) == NUM_ROWS
    rows.close()


def test_a_budget_of_one_store_gives_bs_cascades_as_least_recently_used_chunks_first_and_a_goes_once_empty(tmp_path):
    model, rows = model_dir(tmp_path), primary()
    with identity_tier(tmp_path / "tier", rows, model, "A") as tier:
        a = cascade(tier, rows, 0, NUM_ROWS, seed=100)  # A fills the budget
        served(tier, rows, [0])  # chunk 0 used again: the most recently used now
        a_folder = tier._tier_store.folder
    full = disk_bytes(a_folder)
    assert held_chunks(a_folder) == [1, 2, 3, 4, 5, 6, 7, 0]  # the order of use, written when A closed
    with identity_tier(tmp_path / "tier", rows, model, "B") as tier:
        b = cascade(tier, rows, 10, 3, seed=200)
        assert held_chunks(a_folder) == [4, 5, 6, 7, 0]  # A's three least recently used gave B their room
        assert room_of(a_folder) == 5 and tier.store.room == 3
        assert disk_bytes(a_folder) <= full - 3 * ROW_BYTES + METADATA_SLACK  # their disk space freed
        assert tier._tier_store.removed == []
    with identity_tier(tmp_path / "tier", rows, model, "A") as tier:  # what A kept is served, bitwise
        assert served(tier, rows, [1, 2, 3]) == {}
        assert served(tier, rows, [4, 5, 6, 7, 0]) == {i: a[i] for i in [4, 5, 6, 7, 0]}
    with identity_tier(tmp_path / "tier", rows, model, "B") as tier:
        for n, i in enumerate(range(13, 18)):
            b |= cascade(tier, rows, i, seed=200)
            left = [4, 5, 6, 7, 0][n + 1 :]
            assert held_chunks(a_folder) == (left or None), n  # the store goes only once empty
        assert tier._tier_store.removed == [a_folder]
        assert tier.store.room == NUM_ROWS
        assert served(tier, rows, range(10, 18)) == b
    rows.close()


def test_of_three_identities_the_store_used_least_recently_gives_room_first(tmp_path):
    """A is opened before B but used after it: C's room comes from B, the store used least recently (removing
    the least, or the most, recently opened first would take A's)."""
    model, rows = model_dir(tmp_path), primary()
    other = primary()
    with identity_tier(tmp_path / "tier", rows, model, "A") as first:
        a = cascade(first, rows, 0, 4, seed=100)
        with identity_tier(tmp_path / "tier", other, model, "B") as second:  # opened after A, while A runs
            cascade(second, other, 10, 4, seed=200)
            b_folder = second._tier_store.folder
        assert served(first, rows, range(4)) == a  # A used after B closed
        a_folder = first._tier_store.folder
    with identity_tier(tmp_path / "tier", rows, model, "C") as tier:
        c = cascade(tier, rows, 20, 3, seed=300)
        assert held_chunks(b_folder) == [13] and held_chunks(a_folder) == [0, 1, 2, 3]
        c |= cascade(tier, rows, 23, seed=300)
        assert held_chunks(b_folder) is None and tier._tier_store.removed == [b_folder]
        assert held_chunks(a_folder) == [0, 1, 2, 3]
        assert served(tier, rows, range(20, 24)) == c
    with identity_tier(tmp_path / "tier", rows, model, "A") as tier:
        assert served(tier, rows, range(4)) == a
    rows.close()
    other.close()


def test_two_live_engines_of_different_identities_share_the_budget_without_either_starving(tmp_path):
    """T fills the budget alone; S starts beside it. S's first cascade finds no room and asks for its fair share
    (half the budget); T gives back its least recently used chunks at its next cascade, and from then on every
    cascade of S's succeeds. Each ends with its share, its most recent chunks served bitwise."""
    model, rows, other = model_dir(tmp_path), primary(), primary()
    with identity_tier(tmp_path / "tier", rows, model, "T") as t:
        t_data = cascade(t, rows, 0, NUM_ROWS, seed=100)
        assert t.store.room == NUM_ROWS
        with identity_tier(tmp_path / "tier", other, model, "S") as s:
            other.fill(0, seed=1)
            assert not run(s, job([key(50)], [0], promotion=False)).success  # no room yet: it asks
            assert s.store.room == 0 and os.path.exists(os.path.join(s._tier_store.folder, "wanting"))
            t_data |= cascade(t, rows, NUM_ROWS, seed=100)  # T gives back what S asks for
            assert t.store.room == NUM_ROWS // 2
            s_data = cascade(s, other, 50, NUM_ROWS, seed=300)  # every one succeeds
            t_data |= cascade(t, rows, NUM_ROWS + 1, 2, seed=100)  # T goes on within its share
            assert s.store.room == t.store.room == NUM_ROWS // 2
            assert not os.path.exists(os.path.join(s._tier_store.folder, "wanting"))
            recent_s = range(50 + NUM_ROWS // 2, 50 + NUM_ROWS)
            assert served(s, other, range(50, 50 + NUM_ROWS)) == {i: s_data[i] for i in recent_s}
            recent_t = range(NUM_ROWS + 3 - NUM_ROWS // 2, NUM_ROWS + 3)
            assert served(t, rows, range(NUM_ROWS + 3)) == {i: t_data[i] for i in recent_t}
    rows.close()
    other.close()


def test_a_store_another_engine_holds_is_never_shrunk_by_another_engine(tmp_path):
    """H holds a store of three chunks; S, of another identity, fills the rest of the budget and then evicts
    its own chunks: H's store keeps its room and every chunk, bitwise."""
    model, rows, other = model_dir(tmp_path), primary(), primary()
    with identity_tier(tmp_path / "tier", rows, model, "H") as h:
        h_data = cascade(h, rows, 0, 3, seed=100)
        with identity_tier(tmp_path / "tier", other, model, "S") as s:
            s_data = cascade(s, other, 50, NUM_ROWS, seed=300)
            assert served(s, other, range(50, 50 + NUM_ROWS)) == {i: s_data[i] for i in range(53, 50 + NUM_ROWS)}
            assert served(h, rows, range(3)) == h_data
            assert s.store.room == NUM_ROWS - 3 and h.store.room == 3
    rows.close()
    other.close()


def test_the_taker_frees_the_next_extent_ahead_of_the_cascades(tmp_path):
    """With a budget of 64 chunks a store grows 4 at a time (1/16 of it). Taking from another identity's store
    runs on the tier's taker thread: the first cascade waits for it; once the spare falls below half an extent,
    it takes the next extent's room while the cascades go on, so the other store has given back one extent more
    than the cascades used, its least recently used chunks, and no more."""
    model, rows = model_dir(tmp_path), primary()
    budget, extent = 64 * ROW_BYTES, 4
    with tier_of(tmp_path / "tier", rows, engine_config(model), bytes_to_use=budget, cache_key_extra="A") as tier:
        cascade(tier, rows, 0, 64, seed=100)
        a_folder = tier._tier_store.folder
    with tier_of(tmp_path / "tier", rows, engine_config(model), bytes_to_use=budget, cache_key_extra="B") as tier:
        assert tier._tier_store.extent == extent
        b = {}
        for i in range(100, 108):
            b |= cascade(tier, rows, i, seed=200)
        tier._tier_store.taker.wait()
        assert tier.store.room == 8
        assert held_chunks(a_folder) == list(range(8 + extent, 64))
        assert room_of(a_folder) == 64 - 8 - extent
        assert served(tier, rows, range(100, 108)) == b
    rows.close()
