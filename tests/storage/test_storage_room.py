"""A DiskKVStore's room (kvcopy.storage.room): the blocks of its data file backed on the disk. A store made with
less room takes that much of the disk; it grows by backing holes and gives room back by punching them (its
spare blocks first, then its least recently used blocks, forgotten before their bytes go); a store no process
has open gives back room from its files alone; the order of use survives a clean close; the states a crash
leaves between the steps of a growth or a give-back are brought back within the room when the store opens,
and every block that matches then reads back bitwise. Every bad argument is refused with nothing changed.

How much of the disk a data file takes is read from its allocated blocks (``st_blocks``)."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("nixl_cu13", reason="NIXL is part of the test install (pip install 'kvcopy[nixl]')")

from kvcopy._checks import FileFormatError
from kvcopy.storage.files import DATA
from kvcopy.storage.room import extend_store, give_back_room
from kvcopy.storage.store import DiskKVStore

from helpers.storage import filled_pool, hashes, key, layout, store_files

NUM_BLOCKS = 8
# ext4 counts an extent-tree block in a file's allocated bytes once it has more than four extents
METADATA_SLACK = 4096


def disk_bytes(path) -> int:
    """Bytes the store's data file takes on the disk."""
    return os.stat(os.path.join(path, DATA)).st_blocks * 512


def read_back(store: DiskKVStore, pool, block_hashes: list[str], ids: list[int]) -> None:
    """Asserts each of ``block_hashes`` matches and reads back bitwise as pool block ``ids[i]`` (read into the
    pool's last blocks)."""
    slots = store.match(block_hashes)
    assert len(slots) == len(block_hashes)
    into = list(range(pool.num_blocks - len(slots), pool.num_blocks))
    store.get(slots, pool, into).wait()
    for i, j in zip(ids, into, strict=True):
        assert torch.equal(pool.block_bytes(i), pool.block_bytes(j)), i


def put(store: DiskKVStore, pool, first: int, count: int) -> None:
    """Puts pool blocks ``first..`` as the blocks of hashes ``first..`` (and waits)."""
    store.put(hashes(count, start=first), pool, list(range(first, first + count))).wait()


def test_a_store_made_with_no_room_takes_no_disk_and_grows_as_asked(tmp_path):
    pool = filled_pool(layout(), 1)
    path = tmp_path / "store"
    size = pool.nbytes_per_block
    with DiskKVStore.create(path, pool, NUM_BLOCKS, cache_key=key(), room=0) as store:
        assert (store.room, store.spare, disk_bytes(path)) == (0, 0, 0)
        assert os.path.getsize(path / DATA) == NUM_BLOCKS * size  # every block there, as holes
        with pytest.raises(ValueError, match="room of 0 blocks"):
            put(store, pool, 0, 1)
        assert store.match(hashes(1)) == []
        store.grow(3)
        assert (store.room, store.spare) == (3, 3)
        assert 3 * size <= disk_bytes(path) <= 3 * size + METADATA_SLACK
        put(store, pool, 0, 3)
        assert store.spare == 0
        store.match(hashes(1))  # block 0 used again: block 1 is the least recent
        put(store, pool, 3, 1)  # no spare block: it evicts within its room
        assert store.match(hashes(1, start=1)) == []
        read_back(store, pool, [hashes(1)[0], hashes(1, start=2)[0], hashes(1, start=3)[0]], [0, 2, 3])
        assert store.room == 3 and disk_bytes(path) <= 3 * size + METADATA_SLACK
    with DiskKVStore.open(path, pool, cache_key=key()) as store:
        assert (store.room, store.spare) == (3, 0)


def test_give_back_frees_the_spare_blocks_then_the_least_recently_used(tmp_path):
    pool = filled_pool(layout(), 1)
    path = tmp_path / "store"
    size = pool.nbytes_per_block
    with DiskKVStore.create(path, pool, NUM_BLOCKS, cache_key=key(), room=5) as store:
        put(store, pool, 0, 3)
        store.match(hashes(1))  # order of use: 1, 2, 0
        assert store.give_back(2) == 0  # the two spare blocks
        assert (store.room, store.spare) == (3, 0)
        assert store.give_back(1) == 1  # then block 1, the least recently used
        assert store.match(hashes(1, start=1)) == []
        read_back(store, pool, [hashes(1, start=2)[0], hashes(1)[0]], [2, 0])
        assert store.room == 2 and disk_bytes(path) <= 2 * size + METADATA_SLACK
    with DiskKVStore.open(path, pool, cache_key=key()) as store:  # as it was left
        assert (store.room, store.spare) == (2, 0)
        read_back(store, pool, [hashes(1)[0], hashes(1, start=2)[0]], [0, 2])


def test_the_order_of_use_survives_a_clean_close(tmp_path):
    pool = filled_pool(layout(), 1)
    path = tmp_path / "store"
    with DiskKVStore.create(path, pool, 3, cache_key=key()) as store:
        put(store, pool, 0, 3)
        store.touch(hashes(1))  # order of use: 1, 2, 0
    with DiskKVStore.open(path, pool, cache_key=key()) as store:
        put(store, pool, 3, 1)  # evicts the least recently used: block 1, not block 0
        assert store.match(hashes(1, start=1)) == []
        read_back(store, pool, [hashes(1)[0]], [0])


def test_a_closed_store_gives_back_room_from_its_files(tmp_path):
    """No layout, no CacheKey, no NIXL agent: what kvcopy's disk tier does to another identity's store."""
    pool = filled_pool(layout(), 1)
    path = tmp_path / "store"
    size = pool.nbytes_per_block
    with DiskKVStore.create(path, pool, NUM_BLOCKS, cache_key=key(), room=4) as store:
        put(store, pool, 0, 3)
        store.touch(hashes(1))  # order of use: 1, 2, 0
    assert give_back_room(str(path), size + 1) == (2 * size, 2)  # the spare block and block 1
    assert json.loads((path / "header.json").read_text())["room"] == 2
    assert disk_bytes(path) <= 2 * size + METADATA_SLACK
    with DiskKVStore.open(path, pool, cache_key=key()) as store:
        assert store.match(hashes(1, start=1)) == []
        read_back(store, pool, [hashes(1, start=2)[0], hashes(1)[0]], [2, 0])
    assert give_back_room(str(path), 10 * size) == (2 * size, 0)  # everything: it holds nothing now


def test_a_store_with_more_blocks_keeps_its_blocks(tmp_path):
    pool = filled_pool(layout(num_blocks=64), 1)
    path = tmp_path / "store"
    with DiskKVStore.create(path, pool, 4, cache_key=key(), room=2) as store:
        put(store, pool, 0, 2)
    extend_store(str(path), 12)
    with DiskKVStore.open(path, pool, cache_key=key()) as store:
        assert (store.num_blocks, store.room) == (12, 2)
        store.grow(10)
        put(store, pool, 2, 10)
        read_back(store, pool, hashes(12), list(range(12)))
    # a data file longer than its header says (a crash between the two steps of extend_store) opens as before
    os.truncate(path / DATA, 16 * pool.nbytes_per_block)
    with DiskKVStore.open(path, pool, cache_key=key()) as store:
        assert store.num_blocks == 12
        read_back(store, pool, hashes(12), list(range(12)))


class Crash(BaseException):
    """A process killed at this point: nothing after it runs (the store is dropped as it is, then reopened)."""


def crashing_at(monkeypatch, name: str, target: object = None) -> None:
    """Makes ``<target>.<name>`` (kvcopy.storage.room's by default) raise Crash when called."""
    import kvcopy.storage.room as room

    def crash(*args: object, **kwargs: object) -> None:
        raise Crash(name)

    monkeypatch.setattr(room if target is None else target, name, crash)


def reopened_within_its_room(path, pool, held: list[int]) -> DiskKVStore:
    """The store reopened: it holds exactly the blocks of hashes ``held`` (each bitwise), and its data file
    takes no more than its room."""
    store = DiskKVStore.open(path, pool, cache_key=key())
    for i in range(NUM_BLOCKS):
        assert (store.match(hashes(1, start=i)) != []) == (i in held), i
    read_back(store, pool, [hashes(1, start=i)[0] for i in held], held)
    assert disk_bytes(path) <= store.room * pool.nbytes_per_block + METADATA_SLACK
    return store


def test_a_store_killed_after_it_grew_opens_within_what_it_holds(tmp_path, monkeypatch):
    """A growth writes no header (the data file's allocated blocks are the room others count until the store
    closes): killed before it closed, the store opens with its room raised to the blocks it committed in the
    grown room, and the grown blocks that hold nothing punched."""
    pool = filled_pool(layout(), 1)
    path = tmp_path / "store"
    store = DiskKVStore.create(path, pool, NUM_BLOCKS, cache_key=key(), room=2)
    put(store, pool, 0, 2)
    store.grow(4)
    put(store, pool, 2, 2)  # two of the grown blocks committed, two spare
    crashing_at(monkeypatch, "write_header")  # killed before its close wrote the room
    with pytest.raises(Crash):
        store.close()
    monkeypatch.undo()
    assert json.loads((path / "header.json").read_text())["room"] == 2
    with reopened_within_its_room(path, pool, [0, 1, 2, 3]) as store:
        assert (store.room, store.spare) == (4, 0)


def test_a_growth_the_filesystem_refuses_changes_nothing(tmp_path, monkeypatch):
    pool = filled_pool(layout(), 1)
    path = tmp_path / "store"
    with DiskKVStore.create(path, pool, NUM_BLOCKS, cache_key=key(), room=2) as store:
        put(store, pool, 0, 1)

        def full(*args: object) -> None:
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", full)
        with pytest.raises(OSError, match=r"3 blocks .* more do not fit on"):
            store.grow(3)
        monkeypatch.undo()
        assert (store.room, store.spare) == (2, 1)
        assert disk_bytes(path) <= 2 * pool.nbytes_per_block + METADATA_SLACK
    with reopened_within_its_room(path, pool, [0]) as store:
        assert store.room == 2


@pytest.mark.parametrize(("point", "held"), [("free", [0, 1, 2, 3]), ("punch_hole", [2, 3]), ("write_header", [2, 3])])
def test_a_give_back_cut_short_never_leaves_a_block_matching_that_is_not_there(tmp_path, monkeypatch, point, held):
    """Cut before the evicted blocks are forgotten, after (before their holes are punched), or after that
    (before the header counts less): a block matches only while its bytes are there, and the next open punches
    what its room does not count."""
    pool = filled_pool(layout(), 1)
    path = tmp_path / "store"
    store = DiskKVStore.create(path, pool, NUM_BLOCKS, cache_key=key(), room=4)
    put(store, pool, 0, 4)
    crashing_at(monkeypatch, point, store._index if point == "free" else None)
    with pytest.raises(Crash):
        store.give_back(2)  # blocks 0 and 1, the least recently used
    monkeypatch.undo()
    store.close()
    with reopened_within_its_room(path, pool, held) as store:
        assert store.room == 4 and store.spare == 4 - len(held)  # the header still counts them


def test_bad_room_arguments_change_nothing(tmp_path):
    pool = filled_pool(layout(), 1)
    path = tmp_path / "store"
    for room, error, message in [
        (9, ValueError, r"room: expected at most num_blocks \(8\) blocks, got 9"),
        (-1, ValueError, "room: expected a non-negative int"),
        (1.0, TypeError, "room: expected a non-negative int, got float"),
        (True, TypeError, "room: expected a non-negative int, got bool"),
    ]:
        with pytest.raises(error, match=message):
            DiskKVStore.create(path, pool, NUM_BLOCKS, cache_key=key(), room=room)
        assert not path.exists()
    with DiskKVStore.create(path, pool, NUM_BLOCKS, cache_key=key(), room=2) as store:
        put(store, pool, 0, 2)
        before = store_files(path)
        for call, error, message in [
            (lambda: store.grow(7), ValueError, r"blocks: expected at most 6 \(num_blocks 8 - room 2\), got 7"),
            (lambda: store.grow(-1), ValueError, "blocks: expected a non-negative int"),
            (lambda: store.grow(1.5), TypeError, "blocks: expected a non-negative int, got float"),
            (lambda: store.give_back(3), ValueError, r"blocks: expected at most the store's room \(2\), got 3"),
            (lambda: store.give_back("1"), TypeError, "blocks: expected a non-negative int, got str"),
        ]:
            with pytest.raises(error, match=message):
                call()
            assert store_files(path) == before and store.room == 2
    store.close()


def test_a_header_without_room_is_a_whole_store_a_bad_room_is_named_and_a_low_one_raised(tmp_path):
    pool = filled_pool(layout(), 1)
    path = tmp_path / "store"
    with DiskKVStore.create(path, pool, 4, cache_key=key()) as store:  # room: every block, by default
        assert store.room == 4
        put(store, pool, 0, 3)
    header = json.loads((path / "header.json").read_text())
    (path / "header.json").write_text(json.dumps({k: v for k, v in header.items() if k != "room"}))
    with DiskKVStore.open(path, pool, cache_key=key()) as store:  # as kvcopy made stores before they grew
        assert (store.room, store.spare) == (4, 1)
    for room, message in [(5, r"room: expected the blocks backed on disk, an int in \[0, 4\], found 5"),
                          ("2", "room: expected the blocks backed on disk")]:  # fmt: skip
        (path / "header.json").write_text(json.dumps({**header, "room": room}))
        before = store_files(path)
        with pytest.raises(FileFormatError, match=message):
            DiskKVStore.open(path, pool, cache_key=key())
        assert store_files(path) == before
    # a room below the blocks the index holds (a growth's header a power loss turned back): raised to them
    (path / "header.json").write_text(json.dumps({**header, "room": 2}))
    with DiskKVStore.open(path, pool, cache_key=key()) as store:
        assert (store.room, store.spare) == (3, 0)
        read_back(store, pool, hashes(3), [0, 1, 2])
    assert json.loads((path / "header.json").read_text())["room"] == 3


def test_opening_punches_the_free_blocks_its_room_does_not_count(tmp_path, monkeypatch):
    """The backed blocks a cut give-back leaves are not always the lowest free ones, which the open keeps as
    spare: the others are punched, so the data file takes no more than the room."""
    pool = filled_pool(layout(), 1)
    path = tmp_path / "store"
    store = DiskKVStore.create(path, pool, NUM_BLOCKS, cache_key=key(), room=4)
    put(store, pool, 0, 4)  # slots 0-3
    store.touch(hashes(2, start=2))  # blocks 0 and 1 least recently used
    store.give_back(2)  # slots 0 and 1 punched: holes below the blocks held
    crashing_at(monkeypatch, "punch_hole")
    with pytest.raises(Crash):
        store.give_back(1)  # block 2 forgotten, its slot still backed
    monkeypatch.undo()
    store.close()
    with reopened_within_its_room(path, pool, [3]) as store:
        assert (store.room, store.spare) == (2, 1)
