"""DiskKVStore's index calls for a tier that answers lookups itself: ``contains`` (held or not, never a use),
``touch`` (what is evicted next), ``discard`` (a block forgotten durably, across a reopen), and ``close``
letting go of the pools it moved (their owner may unmap them)."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

pytest.importorskip("nixl_cu13", reason="NIXL is part of the test install (pip install 'kvcopy[nixl]')")

from kvcopy.storage.store import DiskKVStore

from helpers.storage import filled_pool, hashes, key, layout

NUM_BLOCKS = 4


def test_contains_answers_for_committed_blocks_only_and_is_not_a_use(tmp_path):
    pool = filled_pool(layout(), 1)
    with DiskKVStore.create(tmp_path / "store", pool, NUM_BLOCKS, cache_key=key()) as store:
        h = hashes(NUM_BLOCKS + 1)
        store.put(h[:NUM_BLOCKS], pool, list(range(NUM_BLOCKS))).wait()
        assert [store.contains(x) for x in h] == [True] * NUM_BLOCKS + [False]
        assert store.contains(h[0].upper())  # as put takes it
        for _ in range(3):
            assert store.contains(h[0])  # asked about, not used: still the least recent
        store.put([h[NUM_BLOCKS]], pool, [NUM_BLOCKS]).wait()
        assert not store.contains(h[0])
        with pytest.raises(TypeError, match="block_hash"):
            store.contains(b"\x00" * 32)  # type: ignore[arg-type]


def test_touch_decides_what_is_evicted_next(tmp_path):
    pool = filled_pool(layout(), 1)
    with DiskKVStore.create(tmp_path / "store", pool, NUM_BLOCKS, cache_key=key()) as store:
        h = hashes(NUM_BLOCKS + 1)
        store.put(h[:NUM_BLOCKS], pool, list(range(NUM_BLOCKS))).wait()
        store.touch([h[0], hashes(1, start=99)[0]])  # one held, one not (ignored)
        store.put([h[NUM_BLOCKS]], pool, [NUM_BLOCKS]).wait()
        assert [store.contains(x) for x in h] == [True, False, True, True, True]  # h[1] was the least recent


def test_discard_forgets_blocks_durably_and_frees_their_slots(tmp_path):
    pool = filled_pool(layout(), 1)
    path = tmp_path / "store"
    h = hashes(NUM_BLOCKS)
    with DiskKVStore.create(path, pool, NUM_BLOCKS, cache_key=key()) as store:
        store.put(h, pool, list(range(NUM_BLOCKS))).wait()
        assert store.discard([h[2], hashes(1, start=99)[0]]) == 1
        assert store.match(h) == store.match(h[:2])  # the prefix stops at the discarded block
        assert not store.contains(h[2])
    with DiskKVStore.open(path, pool, cache_key=key()) as store:
        assert [store.contains(x) for x in h] == [True, True, False, True]
        store.put(hashes(1, start=50), pool, [9]).wait()  # into the freed slot: nothing else evicted
        assert [store.contains(x) for x in h] == [True, True, False, True]


def test_contains_from_another_thread_while_the_store_puts(tmp_path):
    pool = filled_pool(layout(), 1)
    with DiskKVStore.create(tmp_path / "store", pool, NUM_BLOCKS, cache_key=key()) as store:
        h = hashes(64)
        stop = threading.Event()
        answers: list[bool] = []
        errors: list[BaseException] = []

        def ask() -> None:
            try:
                while not stop.is_set():
                    answers.extend(store.contains(x) for x in h)
            except BaseException as err:  # reported below
                errors.append(err)

        asker = threading.Thread(target=ask)
        asker.start()
        try:
            for i in range(0, 64, 2):
                store.put(h[i : i + 2], pool, [0, 1]).wait()
        finally:
            stop.set()
            asker.join()
        assert not errors
        assert answers  # it did ask while the puts ran
        assert [store.contains(x) for x in h] == [False] * 60 + [True] * 4


def test_close_lets_go_of_the_pools_it_moved(tmp_path):
    pool = filled_pool(layout(), 1)
    store = DiskKVStore.create(tmp_path / "store", pool, NUM_BLOCKS, cache_key=key())
    store.put(hashes(1), pool, [0]).wait()
    gone = weakref.ref(pool)
    store.close()
    del pool
    gc.collect()
    assert gone() is None
