"""The disk store's commit log (kvcopy/storage/commit_log.py): replayed as committed, a torn tail cut off at
every byte, compaction invisible, and a writer killed with SIGKILL at many points never leaves a log that
fails to open or forgets a commit it reported."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import time

import pytest

from kvcopy._checks import FileFormatError
from kvcopy.storage.commit_log import COMPACT_FACTOR, EXTEND_BYTES, MAGIC, RECORD_BYTES, CommitLog, Entry

from helpers.forked import Child


def h(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def state(log: CommitLog) -> dict[int, tuple[str, int]]:
    return {slot: (log.get(e.block_hash).block_hash, e.checksum) for slot, e in log._by_slot.items()}


def test_commits_and_frees_survive_a_reopen(tmp_path):
    path = tmp_path / "index.log"
    log = CommitLog(path, 8)
    log.commit([Entry(0, h(0), 11), Entry(3, h(3), 33)])
    log.free([0])
    log.commit([Entry(5, h(5), 55)])
    before = state(log)
    log.close()
    again = CommitLog(path, 8)
    assert state(again) == before == {3: (h(3), 33), 5: (h(5), 55)}
    assert again.get(h(0)) is None and again.get(h(3)).slot == 3
    again.close()


def test_a_torn_last_record_is_cut_off_at_every_byte(tmp_path):
    path = tmp_path / "index.log"
    log = CommitLog(path, 4)
    log.commit([Entry(0, h(0), 1)])
    log.commit([Entry(1, h(1), 2)])
    log.close()
    data = path.read_bytes()
    whole = data[: len(MAGIC) + 2 * RECORD_BYTES]
    assert data[len(whole) :] == bytes(len(data) - len(whole))  # after the records: the zeros written ahead
    for cut in range(len(whole) - RECORD_BYTES, len(whole)):
        path.write_bytes(whole[:cut] + bytes(len(data) - cut) * (cut % 2))  # the zeros ahead kept, or not
        log = CommitLog(path, 4)
        assert state(log) == {0: (h(0), 1)}
        assert path.stat().st_size == len(MAGIC) + RECORD_BYTES  # truncated to the record boundary
        log.commit([Entry(2, h(2), 3)])  # appends start on a boundary
        log.close()
        assert state(CommitLog(path, 4)) == {0: (h(0), 1), 2: (h(2), 3)}


def test_a_corrupt_record_ends_the_replay_there(tmp_path):
    path = tmp_path / "index.log"
    log = CommitLog(path, 4)
    for i in range(3):
        log.commit([Entry(i, h(i), i)])
    log.close()
    data = bytearray(path.read_bytes())
    data[len(MAGIC) + RECORD_BYTES + 10] ^= 0xFF  # the second record
    path.write_bytes(bytes(data))
    log = CommitLog(path, 4)
    assert state(log) == {0: (h(0), 0)}  # never a record that does not check
    log.commit([Entry(3, h(3), 3)])  # written where the replay stopped
    log.close()
    assert state(CommitLog(path, 4)) == {0: (h(0), 0), 3: (h(3), 3)}  # the third record never comes back


def test_appends_overwrite_zeros_written_ahead(tmp_path):
    path = tmp_path / "index.log"
    log = CommitLog(path, 4)
    log.commit([Entry(0, h(0), 0)])
    assert path.stat().st_size == EXTEND_BYTES  # grown once, with zeros after the record
    for i in range(1, 4):
        log.commit([Entry(i, h(i), i)])
    assert path.stat().st_size == EXTEND_BYTES
    data = path.read_bytes()
    assert data[len(MAGIC) + 4 * RECORD_BYTES :] == bytes(EXTEND_BYTES - len(MAGIC) - 4 * RECORD_BYTES)
    log.close()
    assert state(CommitLog(path, 4)) == {i: (h(i), i) for i in range(4)}


def test_compaction_keeps_the_state_and_bounds_the_file(tmp_path):
    path = tmp_path / "index.log"
    log = CommitLog(path, 4)
    for i in range(COMPACT_FACTOR * 4 * 3):
        log.commit([Entry(i % 4, h(i), i)])
    before = state(log)
    records = path.read_bytes().rstrip(b"\0")  # the zeros written ahead of the appends are not records
    assert len(records) <= len(MAGIC) + (COMPACT_FACTOR * 4 + 1) * RECORD_BYTES
    log.close()
    assert state(CommitLog(path, 4)) == before
    assert not (tmp_path / "index.log.compact").exists()


def test_the_same_hash_committed_again_moves_to_its_new_slot(tmp_path):
    log = CommitLog(tmp_path / "index.log", 4)
    log.commit([Entry(0, h(7), 1)])
    log.commit([Entry(2, h(7), 2)])
    assert state(log) == {2: (h(7), 2)}
    log.close()
    assert state(CommitLog(tmp_path / "index.log", 4)) == {2: (h(7), 2)}


def test_least_recent_follows_use(tmp_path):
    log = CommitLog(tmp_path / "index.log", 4)
    log.commit([Entry(s, h(s), 0) for s in range(4)])
    log.touch([0, 2])
    assert log.least_recent(2) == [1, 3]
    assert log.least_recent(3, keep={1}) == [3, 0, 2]


def test_unused_slots_come_lowest_first_through_commits_moves_and_frees(tmp_path):
    path = tmp_path / "index.log"
    log = CommitLog(path, 6)
    assert log.unused(3, skip=set()) == [0, 1, 2]
    assert log.unused(3, skip={1}) == [0, 2, 3]  # a slot an unfinished put writes is skipped
    log.commit([Entry(0, h(0), 0), Entry(2, h(2), 0)])
    assert log.unused(10, skip=set()) == [1, 3, 4, 5]
    log.free([2])
    assert log.unused(2, skip=set()) == [1, 2]
    log.commit([Entry(4, h(0), 1)])  # the same hash again: it moves from slot 0 to slot 4
    assert log.unused(10, skip=set()) == [0, 1, 2, 3, 5]
    log.close()
    assert CommitLog(path, 6).unused(10, skip=set()) == [0, 1, 2, 3, 5]


def test_unused_matches_the_slots_that_hold_nothing_over_random_use(tmp_path):
    log = CommitLog(tmp_path / "index.log", 16)
    rng = random.Random(7)
    for i in range(300):
        empty = sorted(set(range(16)) - {e.slot for e in log._by_slot.values()})
        skip = set(rng.sample(range(16), rng.randint(0, 4)))
        count = rng.randint(0, 16)
        assert log.unused(count, skip=skip) == [s for s in empty if s not in skip][:count]
        if rng.random() < 0.6:  # a put: new hashes (some again, which moves them) into slots of its choice
            slots = rng.sample(range(16), rng.randint(1, 3))
            log.commit([Entry(s, h(rng.randint(0, 40)), i) for s in slots])
        else:
            log.free(rng.sample(range(16), rng.randint(1, 3)))


def test_another_file_is_refused(tmp_path):
    path = tmp_path / "index.log"
    path.write_bytes(b"not a log at all, longer than the magic")
    with pytest.raises(FileFormatError, match=r"index\.log: magic: expected a kvcopy disk-store log"):
        CommitLog(path, 4)


def test_bad_hashes_are_value_errors(tmp_path):
    log = CommitLog(tmp_path / "index.log", 4)
    with pytest.raises(ValueError, match="block_hashes: expected a SHA-256 hex digest"):
        log.commit([Entry(0, "abcd", 0)])


WRITER = """
import hashlib, sys
from kvcopy.storage.commit_log import CommitLog, Entry
log = CommitLog(sys.argv[1], 64)
for i in range(100000):
    slot = i % 64
    log.free([slot])
    log.commit([Entry(slot, hashlib.sha256(str(i).encode()).hexdigest(), i)])
    print(i, flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.05, 0.1, 0.2, 0.3, 0.5, 0.8])
def test_a_writer_killed_mid_append_leaves_every_reported_commit(tmp_path, delay_s):
    path = tmp_path / "index.log"
    with Child(WRITER, [str(path)]) as child:
        first = child.readline()  # it has started appending
        time.sleep(delay_s)
        child.kill()
        reported = [int(first), *(int(line) for line in child.communicate())]
    assert child.returncode == -signal.SIGKILL
    assert len(reported) > 1  # killed in the middle of its appends, not before them
    log = CommitLog(path, 64)  # never raises
    last = reported[-1] if reported else -1
    # the latest reported commit of every slot but the one the child was reusing (its FREE may be durable)
    for i in range(max(0, last - 62), last + 1):
        entry = log.get(h(i))
        assert entry is not None and entry.slot == i % 64 and entry.checksum == i
    for entry in log._by_slot.values():  # nothing it had not at least begun: one commit past the last reported
        assert entry.checksum <= last + 1


def test_commit_and_free_each_sync_the_log_before_they_return(tmp_path, monkeypatch):
    """A record is durable when commit or free returns: each calls fdatasync on the log's own file."""
    log = CommitLog(tmp_path / "index.log", 4)
    synced: list[int] = []
    real = os.fdatasync

    def spy(fd: int) -> None:
        real(fd)
        synced.append(fd)

    monkeypatch.setattr(os, "fdatasync", spy)
    log.commit([Entry(0, h(0), 1)])
    assert synced == [log._fd]
    log.free([0])
    assert synced == [log._fd, log._fd]
    log.free([0])  # holds nothing now: no record, nothing to sync
    assert len(synced) == 2
    log.close()
